"""OTLP/HTTP receiver: POST ``/v1/traces``, ``/v1/metrics``, ``/v1/logs`` with protobuf or JSON, optionally gzip.

Errors answer with a ``google.rpc.Status`` body in the request's encoding: 400 for bodies that do not decode,
413 over the size limit, 415 for other content types, 401 without the bearer token, 503 + ``Retry-After`` when the
pipeline refuses (queue full, memory limit). Served by a ``ThreadingHTTPServer`` with a cap on concurrent requests.
"""

from __future__ import annotations

import logging
import math
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc.status_pb2 import Status

from collector_processor.config.model import MIB
from collector_processor.config.types import split_host_port
from collector_processor.receiver.auth import BearerAuth
from collector_processor.receiver.common import Config, Dispatcher, HttpProtocol, export_response
from collector_processor.receiver.decode import (
    CT_JSON,
    CT_PROTOBUF,
    HTTP_PATHS,
    DecodeFailure,
    TooLarge,
    decode,
    gunzip_bounded,
)
from collector_processor.telemetry import Telemetry

log = logging.getLogger(__name__)
_SIGNALS = {path: signal for signal, path in HTTP_PATHS.items()}
MAX_CONCURRENT = 64
READ_TIMEOUT_S = 30.0
# gRPC code numbers for the Status body
_INVALID_ARGUMENT, _RESOURCE_EXHAUSTED, _UNAUTHENTICATED, _UNAVAILABLE, _UNIMPLEMENTED = 3, 8, 16, 14, 12


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # listen backlog; socketserver's 5 stalls connection bursts for 1 s (SYN retry)
    receiver: OtlpHttpReceiver
    ssl_context: ssl.SSLContext | None = None

    def finish_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        """TLS handshake here, on the connection's own thread and under the read timeout: done in ``accept`` (a
        wrapped listening socket) one client that connects and never handshakes would block every other."""
        if self.ssl_context is not None:
            try:
                request.settimeout(READ_TIMEOUT_S)
                request = self.ssl_context.wrap_socket(request, server_side=True)
            except (OSError, ValueError):  # ssl.SSLError is an OSError; a failed handshake just ends here
                return
        super().finish_request(request, client_address)


def _encode(msg: Message, ctype: str) -> bytes:
    """A reply body in the request's encoding (``ctype`` is CT_JSON or CT_PROTOBUF)."""
    return json_format.MessageToJson(msg, indent=None).encode() if ctype == CT_JSON else msg.SerializeToString()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S
    server_version = "otel-straggler-collector"
    sys_version = ""

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _status(self, http: int, grpc_code: int, message: str, ctype: str, outcome: str,
                headers: dict[str, str] | None = None, close: bool = False) -> None:
        rcv = self.server.receiver
        rcv.d.outcome(outcome)
        if ctype != CT_JSON:
            ctype = CT_PROTOBUF
        body = _encode(Status(code=grpc_code, message=message[:300]), ctype)
        if close:
            self.close_connection = True
            headers = {**(headers or {}), "Connection": "close"}
        self._send(http, body, ctype, headers)

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        else:
            self._send(404, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        rcv = self.server.receiver
        if not rcv.slots.acquire(blocking=False):
            self.close_connection = True
            self._send(503, b"busy\n", "text/plain", {"Retry-After": rcv.retry_after, "Connection": "close"})
            rcv.d.outcome("throttled")
            return
        try:
            self._post(rcv)
        finally:
            rcv.slots.release()

    def _post(self, rcv: OtlpHttpReceiver) -> None:
        path = self.path.split("?", 1)[0]
        ctype_full = self.headers.get("Content-Type", "")
        ctype = ctype_full.split(";", 1)[0].strip().lower()
        reply_ct = CT_JSON if ctype == CT_JSON else CT_PROTOBUF
        length_h = self.headers.get("Content-Length")
        if path not in _SIGNALS:
            self._drain_or_close(length_h, rcv.limit)
            self._status(404, _UNIMPLEMENTED, f"unknown path {path}", reply_ct, "invalid")
            return
        signal = _SIGNALS[path]
        if rcv.auth.enabled and not rcv.auth.check(self.headers.get("Authorization")):
            rcv.t.unauthenticated.labels(rcv.d.label).inc()
            self._drain_or_close(length_h, rcv.limit)
            self._status(401, _UNAUTHENTICATED, "missing or bad bearer token", reply_ct, "unauthenticated",
                         {"WWW-Authenticate": "Bearer"})
            return
        if length_h is None:
            self._status(411, _INVALID_ARGUMENT, "Content-Length required", reply_ct, "invalid", close=True)
            return
        try:
            length = int(length_h)
            if length < 0:
                raise ValueError
        except ValueError:
            self._status(400, _INVALID_ARGUMENT, "bad Content-Length", reply_ct, "invalid", close=True)
            return
        if length > rcv.limit:
            self._status(413, _RESOURCE_EXHAUSTED, f"body of {length} bytes exceeds {rcv.limit}", reply_ct,
                         "too_large", close=True)
            return
        body = self.rfile.read(length)
        if len(body) < length:
            self._status(400, _INVALID_ARGUMENT, "truncated body", reply_ct, "invalid", close=True)
            return
        if not rcv.d.has(signal):  # before any decoding work, like the gRPC receiver
            self._status(404, _UNIMPLEMENTED, f"no {signal} pipeline", reply_ct, "invalid")
            return
        if ctype not in (CT_JSON, CT_PROTOBUF):
            self._status(415, _INVALID_ARGUMENT, f"unsupported content type {ctype_full!r}", reply_ct, "invalid")
            return
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        try:
            if encoding == "gzip":
                body = gunzip_bounded(body, rcv.limit)
            elif encoding not in ("identity", ""):
                raise DecodeFailure(f"unsupported Content-Encoding {encoding!r}")
            msg = decode(signal, body, ctype)
        except TooLarge as e:
            self._status(413, _RESOURCE_EXHAUSTED, str(e), reply_ct, "too_large")
            return
        except DecodeFailure as e:
            self._status(400, _INVALID_ARGUMENT, str(e), reply_ct, "invalid")
            return
        r = rcv.d.dispatch(signal, msg, len(body))
        if r.status != "ok":
            st = Status(code=_UNAVAILABLE, message=r.message or "throttled")
            self._send(503, _encode(st, reply_ct), reply_ct, {"Retry-After": rcv.retry_after})
            return
        self._send(200, _encode(export_response(signal, r), reply_ct), reply_ct)

    def _drain_or_close(self, length_h: str | None, limit: int) -> None:
        """Read a small refused body so the connection can be reused; close it otherwise."""
        try:
            n = int(length_h or "0")
        except ValueError:
            n = -1
        if 0 <= n <= min(limit, 1 * MIB):
            self.rfile.read(n)
        else:
            self.close_connection = True


class OtlpHttpReceiver:
    what = "OTLP/HTTP"

    def __init__(self, rid: str, cfg: Config, proto: HttpProtocol, dispatcher: Dispatcher, telemetry: Telemetry,
                 auth: BearerAuth) -> None:
        self.id = rid
        self.cfg = cfg
        self.d = dispatcher
        self.t = telemetry
        self.auth = auth
        self.limit = int(proto.max_request_body_size_mib * MIB)
        self.retry_after = str(max(1, math.ceil(cfg.retry_delay)))
        self.slots = threading.BoundedSemaphore(MAX_CONCURRENT)
        self.host, self.port = split_host_port(proto.endpoint, 4318)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        server = _Server((self.host, self.port), _Handler)
        server.receiver = self
        tls = self.cfg.tls
        if tls.enabled():
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
            if tls.client_ca_file:
                ctx.load_verify_locations(tls.client_ca_file)
                ctx.verify_mode = ssl.CERT_REQUIRED
            server.ssl_context = ctx
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"http-{self.id}", daemon=True)
        self._thread.start()
        log.info("OTLP/HTTP receiver %s listening on http%s://%s:%d", self.id, "s" if tls.enabled() else "",
                 self.host, self.port)

    def stop_accepting(self, grace_s: float) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(grace_s)
            self._server = None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.stop_accepting(min(timeout_s, 2.0))

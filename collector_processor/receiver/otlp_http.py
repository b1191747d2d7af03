"""OTLP/HTTP receiver: POST ``/v1/traces``, ``/v1/metrics``, ``/v1/logs`` with protobuf or JSON, optionally gzip;
``GET /healthz`` (200 while the collector is healthy, 503 otherwise, as the gRPC health check answers).

An HTTP/1.1 server on an asyncio event loop: a connection that is waiting for its client costs a coroutine, not a
thread, so thousands of stalled connections take no worker from anyone. Connections are admitted within caps shared
fairly between peer addresses (``_admit``), before TLS starts. Each request is checked in this order,
and refused as soon as something is wrong, without reading a body it will not use:

1. request line and headers (within ``HEAD_TIMEOUT_S``; a kept-alive connection may idle ``IDLE_TIMEOUT_S``);
2. the body's framing: ``Content-Length`` (400 invalid or conflicting) or ``Transfer-Encoding: chunked`` (400
   beside a ``Content-Length`` or in HTTP/1.0, 501 for any other transfer coding); then path (404), bearer token
   (401), a length (411 with neither), 413 over the limit, content type (415) and encoding, all on the headers;
3. a free processing slot (see 4) and the memory the body takes, reserved at the pipelines' admission gates
   before it is read (503 + ``Retry-After``); ``Expect: 100-continue`` is answered only now. A chunked body's
   length is known only as it comes: each chunk is checked against the size limit when its size line arrives
   (413 before its bytes are read) and its memory reserved before it is read (503 + ``Retry-After``), twice the
   bytes buffered so far (the growing buffer and its copy when it moves), in steps of at least
   ``INFLATE_RESERVE``, none while that is under 1 MiB; its framing (size lines, extensions, trailers) may take
   ``max(FRAMING_FLOOR, limit / FRAMING_SHARE)`` bytes (400 beyond); each read waits at most ``READ_TIMEOUT_S``, as
   for a body with a ``Content-Length``;
4. one of ``MAX_CONCURRENT`` processing slots (503 + ``Retry-After``): gzip inflated with a bound on the total of
   all members (413), the decoder's memory estimate reserved (503, or 413 when it could never fit), decoded
   (400) and handed to the pipelines (503 + ``Retry-After`` when they refuse) on a worker thread.

A refusal on the headers drops the body as it comes (it holds no memory) and keeps the connection; for a client
without the token, a body over the limit or of unknown length, and any chunked body not read to its end, the
connection is closed after draining what the client still sends for at most ``LINGER_S``. Either way the client
reads the answer, not a reset. Errors carry a ``google.rpc.Status`` body in the request's encoding. A request
whose client goes away or stalls past a timeout is counted as ``aborted``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate

from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc.status_pb2 import Status

from collector_processor.component import Refusal
from collector_processor.config.model import MIB
from collector_processor.config.types import split_host_port
from collector_processor.receiver.aio import LoopThread, Workers, stop_runtime
from collector_processor.receiver.auth import EVERYONE, BearerAuth, Tenant
from collector_processor.receiver.common import (
    SERVER,
    UNRESERVED_BYTES,
    Config,
    Dispatcher,
    HttpProtocol,
    Reservation,
    export_response,
    refusal_code,
)
from collector_processor.receiver.decode import (
    CT_JSON,
    CT_PROTOBUF,
    HTTP_PATHS,
    DecodeFailure,
    TooLarge,
    gunzip_bounded,
)
from collector_processor.receiver.tenants import Forbidden
from collector_processor.telemetry import Telemetry

log = logging.getLogger(__name__)
_SIGNALS = {path: signal for signal, path in HTTP_PATHS.items()}
MAX_CONCURRENT = 64  # requests being decoded or waiting for their pipelines at once
WORKERS = 8  # threads that decode and dispatch (the GIL makes more pointless; waits for the pipeline are bounded)
HEAD_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 30.0  # for each chunk of a body (a TLS handshake has handshake_timeout)
WRITE_TIMEOUT_S = 30.0
LINGER_S = 2.0
MAX_HEAD = 16 * 1024  # request line and headers; also what a connection buffers while its request is processed
MAX_HEADERS = 100
CHUNK = 256 * 1024
INFLATE_RESERVE = 4 * MIB  # a gzip body's inflated bytes (and a chunked body) are reserved in steps of at least this
CHUNKED = -1  # the body length of a chunked request, until it is read
MAX_CHUNK_LINE = 1024  # a chunk-size line with its extensions
FRAMING_FLOOR = 64 * 1024  # a chunked body's framing may take max(this, limit / FRAMING_SHARE) bytes
FRAMING_SHARE = 16
# gRPC code numbers for the Status body
_INVALID_ARGUMENT, _RESOURCE_EXHAUSTED, _UNAUTHENTICATED, _UNIMPLEMENTED, _PERMISSION_DENIED = 3, 8, 16, 12, 7
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 501: "Not Implemented",
            411: "Length Required", 413: "Content Too Large", 415: "Unsupported Media Type",
            431: "Request Header Fields Too Large", 503: "Service Unavailable"}


@dataclass
class _Peer:
    """The connections of one peer address: how many, and those before auth (task -> when admitted, oldest first)."""

    n: int = 0
    preauth: dict[asyncio.Task[None], float] = field(default_factory=dict)


class _Aborted(Exception):
    """The client went away or stalled; the connection ends without an answer."""


class _Refused(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class _BadChunk(Exception):
    """The chunked framing is broken (400; the connection is closed)."""


class _TooLong(Exception):
    """A chunked body passed the size limit (413; the connection is closed)."""


@dataclass
class _Head:
    method: str
    path: str
    version: str
    headers: dict[str, list[str]] = field(default_factory=dict)

    def get(self, name: str) -> str | None:
        values = self.headers.get(name)
        return values[0] if values else None

    def keep_alive(self) -> bool:
        conn = (self.get("connection") or "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in conn
        return "close" not in conn


@dataclass
class _Answer:
    code: int
    body: bytes
    ctype: str
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False


def _encode(msg: Message, ctype: str) -> bytes:
    """A reply body in the request's encoding (``ctype`` is CT_JSON or CT_PROTOBUF)."""
    return json_format.MessageToJson(msg, indent=None).encode() if ctype == CT_JSON else msg.SerializeToString()


def _error(http: int, grpc_code: int, message: str, ctype: str, headers: dict[str, str] | None = None,
           close: bool = False) -> _Answer:
    return _Answer(http, _encode(Status(code=grpc_code, message=message[:300]), ctype), ctype, headers or {}, close)


def _parse_head(data: bytes) -> _Head:
    lines = data.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("bad request line")
    head = _Head(parts[0], parts[1].split("?", 1)[0], parts[2])
    n = 0
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or line[0] in " \t":
            raise ValueError("bad header line")
        n += 1
        if n > MAX_HEADERS:
            raise ValueError("too many headers")
        head.headers.setdefault(name.lower(), []).append(value.strip())
    return head


def _content_length(head: _Head) -> int | None:
    """The body length; None when absent. Several Content-Length values (repeated headers or a list) must agree."""
    values = [v.strip() for h in head.headers.get("content-length", []) for v in h.split(",")]
    if not values:
        return None
    if len(set(values)) != 1 or not values[0].isdigit():
        raise ValueError("conflicting or invalid Content-Length")
    return int(values[0])


class _Unsupported(ValueError):
    """A transfer coding other than ``chunked`` (501)."""


def _framing(head: _Head) -> int | None:
    """The body length (``CHUNKED`` for ``Transfer-Encoding: chunked``); None when neither header is there. A
    ``Transfer-Encoding`` beside a ``Content-Length``, or in an HTTP/1.0 request, is refused (ValueError): those
    are how requests are smuggled past a proxy that frames them otherwise."""
    length = _content_length(head)
    codings = [c.strip().lower() for h in head.headers.get("transfer-encoding", []) for c in h.split(",")]
    if not codings:
        return length
    if length is not None:
        raise ValueError("Transfer-Encoding and Content-Length together")
    if head.version == "HTTP/1.0":
        raise ValueError("Transfer-Encoding in an HTTP/1.0 request")
    if codings != ["chunked"]:
        raise _Unsupported(f"unsupported Transfer-Encoding {', '.join(codings)[:60]!r}; only chunked")
    return CHUNKED


class OtlpHttpReceiver:
    what = "OTLP/HTTP"

    def __init__(self, rid: str, cfg: Config, proto: HttpProtocol, dispatcher: Dispatcher, telemetry: Telemetry,
                 auth: BearerAuth, healthy: Callable[[], bool] = lambda: True) -> None:
        self.id = rid
        self.healthy = healthy
        self.cfg = cfg
        self.d = dispatcher
        self.t = telemetry
        self.auth = auth
        self.limit = int(proto.max_request_body_size_mib * MIB)
        self.retry_after = str(max(1, math.ceil(cfg.retry_delay)))
        self.host, self.port = split_host_port(proto.endpoint, 4318)
        self._busy = 0
        self._loop: LoopThread | None = None
        self._server: asyncio.Server | None = None
        self._workers: Workers | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # every connection
        self._active: set[asyncio.Task[None]] = set()  # connections inside a request
        self.proto = proto
        # connection budget: (task -> peer address, when it came or last finished a request), oldest first; per peer
        # address with a connection (so at most max_connections of them): its connections, those before auth
        self._conns: dict[asyncio.Task[None], tuple[str, float]] = {}
        self._peers: dict[str, _Peer] = {}
        self.connections_refused = 0
        self.connections_evicted = 0
        self._tls: ssl.SSLContext | None = None
        self._refused_logged = False
        self._shed_logged = False
        self._closing = False

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def _ssl(self) -> ssl.SSLContext | None:
        tls = self.cfg.tls
        if not tls.enabled():
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.client_ca_file:
            ctx.load_verify_locations(tls.client_ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def start(self) -> None:
        ctx = self._tls = self._ssl()
        self._loop = LoopThread(f"http-{self.id}")
        self._loop.start()
        self._workers = Workers(WORKERS, f"http-{self.id}-worker")

        async def listen() -> asyncio.Server:
            # TLS is started per connection once it was admitted (``_admit``): a handshake costs its buffers only
            # within the connection budget
            return await asyncio.start_server(self._connection, self.host, self.port, backlog=1024, limit=MAX_HEAD)

        try:
            self._server = self._loop.call(listen(), 10.0)
        except Exception:
            self._stop_loop()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("OTLP/HTTP receiver %s listening on http%s://%s:%d", self.id, "s" if ctx else "", self.host,
                 self.port)
        self.d.admitted(self.limit, held_per_byte=4)  # a gzip body's inflated bytes: reserved twice, resident twice

    def stop_accepting(self, grace_s: float) -> None:
        """Stop listening and let requests being handled finish within ``grace_s``; then close every connection."""
        if self._server is None or self._loop is None:
            return
        server, self._server = self._server, None

        async def stop() -> None:
            self._closing = True
            server.close()
            for t in self._tasks - self._active:  # idle connections: nothing to finish
                t.cancel()
            active = list(self._active)
            if active:
                await asyncio.wait(active, timeout=grace_s)
            rest = list(self._tasks)
            for t in rest:
                t.cancel()
            if rest:  # let them close their connections while the loop still runs
                await asyncio.wait(rest, timeout=1.0)

        try:
            self._loop.call(stop(), grace_s + 2.0)
        except Exception:
            log.warning("OTLP/HTTP receiver %s: connections still open after %.1f s", self.id, grace_s)
        self._stop_loop()

    def _stop_loop(self) -> None:
        stop_runtime(self._workers, self._loop)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.stop_accepting(min(timeout_s, 2.0))

    # ---- connections --------------------------------------------------------------------------------------
    def _admit(self, task: asyncio.Task[None], peer: str) -> str | None:
        """A place for a new connection of ``peer``; None when it has one, else why it is refused.

        Its own address first: within max_connections_per_peer connections, and max_preauth_connections_per_peer of
        them before auth, made by closing its own oldest (idle or handshaking; before auth) connection older than
        stall_timeout (``peer_limit`` when there is none). Then the listener's max_connections, made by closing, in
        this order: the oldest connection before auth of the address holding the most connections, when that is
        more than this address will (``shed``); the oldest connection not inside a request for stall_timeout of an
        address holding at least as many as this one (``stalled``); else the newcomer is refused (``refused``).
        So one address cannot hold the listener against another: a newcomer of an address with fewer connections
        always finds room while the busiest has a connection before auth."""
        p = self.proto
        now = asyncio.get_running_loop().time()
        own = self._peers.get(peer)
        if own is not None:
            if own.n >= p.max_connections_per_peer and not self._evict_stale(now, lambda addr: addr == peer):
                return "peer_limit"
            if len(own.preauth) >= p.max_preauth_connections_per_peer and not self._evict_preauth(own, now):
                return "peer_limit"
        own = self._peers.get(peer)  # an eviction above may have closed the address's last connection
        if len(self._conns) >= p.max_connections:
            n = own.n if own is not None else 0
            if not self._shed_busiest(n) and not self._evict_stale(now, lambda addr: self._peers[addr].n >= n):
                return "refused"
            own = self._peers.get(peer)
        if own is None:
            own = self._peers[peer] = _Peer()
        own.n += 1
        own.preauth[task] = now
        self._conns[task] = (peer, now)
        return None

    def _close(self, task: asyncio.Task[None], reason: str) -> None:
        self._forget(task)
        task.cancel()
        self.connections_evicted += 1
        self.t.connections_closed.labels(self.d.label, reason).inc()

    def _evict_stale(self, now: float, which: Callable[[str], bool]) -> bool:
        """Close the oldest connection not inside a request for stall_timeout of an address ``which`` accepts."""
        for other, (addr, since) in self._conns.items():
            if now - since < self.proto.stall_timeout:
                return False
            if other not in self._active and which(addr):
                self._close(other, "stalled")
                return True
        return False

    def _evict_preauth(self, peer: _Peer, now: float) -> bool:
        """Close the oldest connection of ``peer`` before auth, if older than stall_timeout."""
        oldest, since = next(iter(peer.preauth.items()))
        if now - since < self.proto.stall_timeout:
            return False
        self._close(oldest, "stalled")
        return True

    def _shed_busiest(self, n: int) -> bool:
        """Close the oldest connection before auth of the address holding the most connections, if it holds more
        than ``n`` + 1 (a newcomer's address holding ``n``: after the exchange it would hold no more than that)."""
        busiest: _Peer | None = None
        for st in self._peers.values():
            if st.preauth and st.n > n + 1 and (busiest is None or st.n > busiest.n):
                busiest = st
        if busiest is None:
            return False
        self._close(next(iter(busiest.preauth)), "shed")
        if not self._shed_logged:
            self._shed_logged = True
            log.warning("%s: connection budget full (max_connections %d): closing the oldest unauthenticated "
                        "connection of the address holding the most to admit one of another (not logged again)",
                        self.d.label, self.proto.max_connections)
        return True

    def _past_auth(self) -> None:
        """The current connection sent a request head that passed the bearer check (any, without auth)."""
        task = asyncio.current_task()
        entry = self._conns.get(task) if task is not None else None
        if entry is not None:
            self._peers[entry[0]].preauth.pop(task, None)  # type: ignore[arg-type]

    def _forget(self, task: asyncio.Task[None]) -> None:
        entry = self._conns.pop(task, None)
        if entry is None:
            return
        st = self._peers[entry[0]]
        st.n -= 1
        st.preauth.pop(task, None)
        if st.n <= 0:
            del self._peers[entry[0]]

    def _touch(self, task: asyncio.Task[None]) -> None:
        """The connection finished a request: it is young again (moved to the end of the eviction order)."""
        entry = self._conns.pop(task, None)
        if entry is not None:
            self._conns[task] = (entry[0], asyncio.get_running_loop().time())

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        refused = self._admit(task, peer)
        if refused is not None:
            self.connections_refused += 1
            self.t.connections_closed.labels(self.d.label, refused).inc()
            if not self._refused_logged:
                self._refused_logged = True
                log.warning("%s: connection budget full (max_connections %d; per peer %d, %d before auth), no "
                            "connection to close: new connections are closed at once (not logged again)",
                            self.d.label, self.proto.max_connections, self.proto.max_connections_per_peer,
                            self.proto.max_preauth_connections_per_peer)
            writer.transport.abort()
            return
        self._tasks.add(task)
        try:
            if self._tls is not None:
                try:
                    await writer.start_tls(self._tls, ssl_handshake_timeout=self.proto.handshake_timeout)
                except (ConnectionError, OSError, TimeoutError, ssl.SSLError):
                    return
            timeout = HEAD_TIMEOUT_S
            while not self._closing:
                self._active.discard(task)
                keep = await self._one(reader, writer, timeout)
                if not keep:
                    break
                self._touch(task)
                timeout = self.proto.idle_timeout
        except _Aborted:
            pass
        except asyncio.CancelledError:  # the drain's deadline passed
            pass
        except Exception:  # never let a connection's fault reach the loop's exception handler
            log.exception("OTLP/HTTP receiver %s: unexpected error on a connection", self.id)
        finally:
            self._forget(task)
            self._tasks.discard(task)
            self._active.discard(task)
            try:
                writer.close()
            except RuntimeError:  # the loop is already closed (the process is ending)
                pass

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float) -> bool:
        """Read and answer one request; True to keep the connection for the next one."""
        try:
            first = await asyncio.wait_for(reader.read(1), timeout)
        except (TimeoutError, ConnectionError, OSError):
            return False  # nothing of a request yet: an idle connection ends
        if not first:
            return False
        task = asyncio.current_task()
        assert task is not None
        self._active.add(task)
        try:
            data = first + await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        except asyncio.IncompleteReadError:
            self.d.aborted("connection closed inside a request head")
            return False
        except asyncio.LimitOverrunError:
            await self._reply(writer, _Answer(431, b"request head too large\n", "text/plain", close=True))
            self.d.outcome("invalid")
            return False
        except TimeoutError:
            self.d.aborted("request head not complete within the timeout")
            return False
        except (ConnectionError, OSError) as e:
            self.d.aborted(type(e).__name__)
            return False
        try:
            head = _parse_head(data[:-4])
        except ValueError as e:
            await self._reply(writer, _Answer(400, f"{e}\n".encode(), "text/plain", close=True))
            self.d.outcome("invalid")
            return False
        if head.method == "GET":
            if head.path == "/healthz":
                ans = _Answer(200, b"ok\n", "text/plain") if self.healthy() else \
                    _Answer(503, b"unhealthy\n", "text/plain")
            else:
                ans = _Answer(404, b"not found\n", "text/plain")
            if _declared(head):
                ans.close = True
            await self._reply(writer, ans)
            if ans.close:
                await self._linger(reader, writer, 0)
            return not ans.close and head.keep_alive()
        if head.method != "POST":
            await self._reply(writer, _Answer(405, b"method not allowed\n", "text/plain", {"Allow": "GET, POST"},
                                              close=True))
            self.d.outcome("invalid")
            await self._linger(reader, writer, 0)
            return False
        ans, length = self._check(head)
        if ans is not None:
            await self._reply(writer, ans)
            if ans.close:
                await self._linger(reader, writer, length or 0)
                return False
            if length and not await self._discard(reader, length):  # the unused body, dropped as it comes
                return False
            return head.keep_alive()
        assert length is not None
        ans, unread = await self._request(head, length, reader, writer)
        if unread == CHUNKED:  # a chunked body not read to its end: its end is not known
            ans.close = True
        await self._reply(writer, ans)
        if ans.close:
            await self._linger(reader, writer, unread)
            return False
        if unread and not await self._discard(reader, unread):  # refused before reading: dropped as it comes
            return False
        return head.keep_alive()

    def _status(self, http: int, grpc_code: int, message: str, ctype: str, outcome: str,
                headers: dict[str, str] | None = None, close: bool = False) -> _Answer:
        """Count ``outcome`` and answer with a ``google.rpc.Status`` body."""
        self.d.outcome(outcome)
        return _error(http, grpc_code, message, ctype, headers, close)

    def _refused(self, refusal: Refusal, ctype: str) -> _Answer:
        """Count a refusal before decoding and answer it."""
        self.d.refused(refusal)
        return self._refusal(refusal, ctype)

    def _refusal(self, refusal: Refusal, ctype: str) -> _Answer:
        code = refusal_code(refusal).value[0]
        if refusal.retry:
            return _error(503, code, refusal.message, ctype, {"Retry-After": self.retry_after})
        return _error(413, code, refusal.message, ctype)

    def _check(self, head: _Head) -> tuple[_Answer | None, int | None]:
        """Everything that can be decided on the headers. Returns (answer, declared length or ``CHUNKED``); a
        refusal of a chunked request closes the connection (its body is not read)."""
        ans, length = self._check_head(head)
        if ans is not None and length == CHUNKED:
            ans.close = True
        return ans, length

    def _check_head(self, head: _Head) -> tuple[_Answer | None, int | None]:
        ctype_full = head.get("content-type") or ""
        ctype = ctype_full.split(";", 1)[0].strip().lower()
        reply_ct = CT_JSON if ctype == CT_JSON else CT_PROTOBUF
        try:
            length = _framing(head)
        except _Unsupported as e:
            return self._status(501, _UNIMPLEMENTED, str(e), reply_ct, "invalid", close=True), None
        except ValueError as e:
            return self._status(400, _INVALID_ARGUMENT, str(e), reply_ct, "invalid", close=True), None
        if head.path not in _SIGNALS:
            return self._status(404, _UNIMPLEMENTED, f"unknown path {head.path}", reply_ct, "invalid",
                                close=(length or 0) > self.limit), length
        if self.auth.enabled and self.auth.identify(head.get("authorization")) is None:
            self.t.unauthenticated.labels(self.d.label).inc()
            return self._status(401, _UNAUTHENTICATED, "missing or bad bearer token", reply_ct, "unauthenticated",
                                {"WWW-Authenticate": "Bearer"}, close=True), length
        self._past_auth()
        if length is None:
            return self._status(411, _INVALID_ARGUMENT, "Content-Length or Transfer-Encoding: chunked required",
                                reply_ct, "invalid", close=True), length
        if length > self.limit:
            return self._status(413, _RESOURCE_EXHAUSTED, f"body of {length} bytes exceeds {self.limit}", reply_ct,
                                "too_large", close=True), length
        signal = _SIGNALS[head.path]
        if not self.d.has(signal):
            return self._status(404, _UNIMPLEMENTED, f"no {signal} pipeline", reply_ct, "invalid"), length
        if ctype not in (CT_JSON, CT_PROTOBUF):
            return self._status(415, _INVALID_ARGUMENT, f"unsupported content type {ctype_full[:100]!r}",
                                reply_ct, "invalid"), length
        encoding = (head.get("content-encoding") or "identity").strip().lower()
        if encoding not in ("gzip", "identity", ""):
            return self._status(400, _INVALID_ARGUMENT, f"unsupported Content-Encoding {encoding[:40]!r}", reply_ct,
                                "invalid"), length
        return None, length

    async def _request(self, head: _Head, length: int, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> tuple[_Answer, int]:
        """The answer, and how much of the body was left unread."""
        signal = _SIGNALS[head.path]
        ctype = (head.get("content-type") or "").split(";", 1)[0].strip().lower()
        encoding = (head.get("content-encoding") or "identity").strip().lower()
        tenant = self.auth.identify(head.get("authorization")) if self.auth.enabled else EVERYONE
        assert tenant is not None  # checked in _check
        if self._busy >= MAX_CONCURRENT:  # refused before its body is reserved or read (and again once it is)
            return self._refused(Refusal("busy", "too many requests in progress"), ctype), length
        if length == CHUNKED:
            return await self._request_chunked(head, signal, ctype, encoding == "gzip", tenant, reader, writer)
        reserved = 0
        try:
            refusal = self.d.reserve(signal, length, tenant)
            if refusal is not None:
                return self._refused(refusal, ctype), length
            reserved = length
            if (head.get("expect") or "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await self._body(reader, length)
            if self._busy >= MAX_CONCURRENT:
                return self._refused(Refusal("busy", "too many requests in progress"), ctype), 0
            self._busy += 1
            try:
                assert self._workers is not None
                return await self._workers.run(self._process, signal, body, ctype, encoding == "gzip", tenant), 0
            finally:
                self._busy -= 1
        finally:
            if reserved:
                self.d.release(signal, reserved, tenant)

    async def _request_chunked(self, head: _Head, signal: str, ctype: str, gzipped: bool, tenant: Tenant,
                               reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[_Answer, int]:
        """``_request`` for a chunked body: its memory reserved chunk by chunk as it comes (``_chunked_body``)."""
        held = Reservation(self.d, signal, INFLATE_RESERVE, UNRESERVED_BYTES, tenant)
        try:
            if (head.get("expect") or "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                body = await self._chunked_body(reader, held)
            except _Refused as e:
                return self._refused(e.refusal, ctype), CHUNKED
            except _TooLong:
                return self._status(413, _RESOURCE_EXHAUSTED, f"body exceeds {self.limit} bytes", ctype,
                                    "too_large"), CHUNKED
            except _BadChunk as e:
                return self._status(400, _INVALID_ARGUMENT, str(e), ctype, "invalid"), CHUNKED
            if self._busy >= MAX_CONCURRENT:
                return self._refused(Refusal("busy", "too many requests in progress"), ctype), 0
            self._busy += 1
            try:
                assert self._workers is not None
                return await self._workers.run(self._process, signal, body, ctype, gzipped, tenant), 0
            finally:
                self._busy -= 1
        finally:
            held.release()

    async def _read(self, what: Awaitable[bytes]) -> bytes:
        """One read of a body within ``READ_TIMEOUT_S``; ``_Aborted`` (counted) when it fails or does not come."""
        try:
            return await asyncio.wait_for(what, READ_TIMEOUT_S)
        except TimeoutError:
            self.d.aborted("body not received within the read timeout")
        except asyncio.IncompleteReadError:
            self.d.aborted("connection closed inside a body")
        except (ConnectionError, OSError) as e:
            self.d.aborted(type(e).__name__)
        raise _Aborted

    async def _chunked_body(self, reader: asyncio.StreamReader, held: Reservation) -> bytearray:
        """A chunked body, read chunk by chunk: each chunk's size checked against the limit (``_TooLong``) and its
        memory covered in ``held`` (``_Refused``) before its bytes are read; framing beyond its bound or broken
        raises ``_BadChunk``; a client that stalls or goes away ``_Aborted``."""
        body = bytearray()
        framing = max(FRAMING_FLOOR, self.limit // FRAMING_SHARE)
        while True:
            try:
                line = await self._read(reader.readuntil(b"\r\n"))
            except asyncio.LimitOverrunError:
                raise _BadChunk("chunk-size line too long") from None
            framing -= len(line)
            if len(line) > MAX_CHUNK_LINE or framing < 0:
                raise _BadChunk("chunk-size line too long" if len(line) > MAX_CHUNK_LINE else "too much framing")
            digits, ext, _ = line[:-2].partition(b";")
            if ext:  # whitespace may stand before an extension, nowhere else
                digits = digits.rstrip(b" \t")
            if not digits or len(digits) > 16 or digits.strip(b"0123456789abcdefABCDEF"):
                raise _BadChunk(f"bad chunk size {digits[:20]!r}")
            size = int(digits, 16)
            if size == 0:
                break
            if len(body) + size > self.limit:
                raise _TooLong
            refusal = held.cover(2 * (len(body) + size))  # the buffer and its copy when it grows
            if refusal is not None:
                raise _Refused(refusal)
            left = size
            while left > 0:
                chunk = await self._read(reader.read(min(CHUNK, left)))
                if not chunk:
                    self.d.aborted("connection closed inside a body")
                    raise _Aborted
                body += chunk
                left -= len(chunk)
            if await self._read(reader.readexactly(2)) != b"\r\n":
                raise _BadChunk("chunk data not followed by CRLF")
            framing -= 2
        for _ in range(MAX_HEADERS + 1):  # trailer fields, dropped; an empty line ends them
            try:
                line = await self._read(reader.readuntil(b"\r\n"))
            except asyncio.LimitOverrunError:
                raise _BadChunk("trailer line too long") from None
            framing -= len(line)
            if framing < 0:
                raise _BadChunk("too much framing")
            if line == b"\r\n":
                return body
        raise _BadChunk("too many trailer fields")

    async def _discard(self, reader: asyncio.StreamReader, length: int) -> bool:
        """Read and drop ``length`` bytes (the idle timeout applies to each chunk); False if they did not come."""
        left = length
        try:
            while left > 0:
                chunk = await asyncio.wait_for(reader.read(min(CHUNK, left)), READ_TIMEOUT_S)
                if not chunk:
                    return False
                left -= len(chunk)
        except (TimeoutError, ConnectionError, OSError):
            return False
        return True

    async def _body(self, reader: asyncio.StreamReader, length: int) -> bytearray:
        """The body, read into one buffer of its announced length (no copies beside it)."""
        body = bytearray(length)
        view = memoryview(body)
        pos = 0
        while pos < length:
            try:
                chunk = await asyncio.wait_for(reader.read(min(CHUNK, length - pos)), READ_TIMEOUT_S)
            except TimeoutError:
                self.d.aborted("body not received within the read timeout")
                raise _Aborted from None
            except (ConnectionError, OSError) as e:
                self.d.aborted(type(e).__name__)
                raise _Aborted from None
            if not chunk:
                self.d.aborted("connection closed inside a body")
                raise _Aborted
            view[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        view.release()
        return body

    def _process(self, signal: str, body: bytearray, ctype: str, gzipped: bool, tenant: Tenant = EVERYONE
                 ) -> _Answer:
        """On a worker thread: inflate (reserving as it grows), reserve what decoding takes, decode, hand to the
        pipelines."""
        held = Reservation(self.d, signal, INFLATE_RESERVE, tenant=tenant)  # for the inflated body

        def grow(total: int) -> None:
            refusal = held.cover(2 * total)  # the growing buffer's spare capacity and its copy when it moves
            if refusal is not None:
                raise _Refused(refusal)

        try:
            try:
                data = gunzip_bounded(body, self.limit, grow) if gzipped else body
            except _Refused as e:
                return self._refused(e.refusal, ctype)
            except TooLarge as e:
                return self._status(413, _RESOURCE_EXHAUSTED, str(e), ctype, "too_large")
            except DecodeFailure as e:
                return self._status(400, _INVALID_ARGUMENT, str(e), ctype, "invalid")
            try:
                r = self.d.decode_and_dispatch(signal, data, ctype, tenant)
            except DecodeFailure as e:  # counted by the dispatcher
                return _error(400, _INVALID_ARGUMENT, str(e), ctype)
            except Forbidden as e:  # counted by the dispatcher
                return _error(403, _PERMISSION_DENIED, str(e), ctype)
        finally:
            held.release()  # the inflated body, reserved until its decoded request is handed over
        if isinstance(r, Refusal):
            return self._refusal(r, ctype)
        return _Answer(200, _encode(export_response(signal, r), ctype), ctype)

    async def _reply(self, writer: asyncio.StreamWriter, ans: _Answer) -> None:
        if self._closing:
            ans.close = True
        lines = [f"HTTP/1.1 {ans.code} {_REASONS.get(ans.code, 'Error')}", f"Content-Type: {ans.ctype}",
                 f"Content-Length: {len(ans.body)}", f"Server: {SERVER}", f"Date: {formatdate(usegmt=True)}"]
        lines += [f"{k}: {v}" for k, v in ans.headers.items()]
        if ans.close:
            lines.append("Connection: close")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + ans.body)
        try:
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (ConnectionError, OSError, TimeoutError) as e:
            self.d.aborted(f"answer not delivered: {type(e).__name__}")
            raise _Aborted from None

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int) -> None:
        """After an answer that closes the connection: stop sending, read (and drop) what the client still sends,
        for at most ``LINGER_S``, so that closing does not reset the connection before the client read the answer."""
        try:
            if writer.can_write_eof():
                writer.write_eof()
            loop = asyncio.get_running_loop()
            end = loop.time() + LINGER_S
            left = length if length > 0 else 64 * MIB
            while left > 0 and loop.time() < end:
                chunk = await asyncio.wait_for(reader.read(CHUNK), max(0.01, end - loop.time()))
                if not chunk:
                    break
                left -= len(chunk)
        except (ConnectionError, OSError, TimeoutError, RuntimeError):
            pass


def _declared(head: _Head) -> bool:
    try:
        return bool(_content_length(head)) or "transfer-encoding" in head.headers
    except ValueError:
        return True

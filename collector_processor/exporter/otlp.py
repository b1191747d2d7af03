"""OTLP exporters (``otlp_grpc``, ``otlp_http``): pass serialized requests on to a backend.

The SDK's ``OTLPSpanExporter`` takes SDK spans, not protobuf requests, so these send the request bytes through
the raw gRPC method (``TraceService/Export``, ``LogsService/Export``) or an HTTP POST. Each exporter owns a bounded
queue and one sender thread: the pipeline worker never waits on the network. Retries are bounded (retryable codes
only, honouring a server's RetryInfo / Retry-After); what is given up is counted in ``export_failures_total`` and,
for traces, ``spans_dropped_total{reason="export_failed"}``. An empty ``endpoint`` disables the exporter.
"""

from __future__ import annotations

import collections
import gzip
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

import grpc
from google.protobuf.message import Message
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from pydantic import Field

import otel_straggler_schema as s
from collector_processor.config.types import ClientTLS, Duration, ExportEndpoint, Strict
from collector_processor.receiver.decode import CT_PROTOBUF, GRPC_SERVICES, HTTP_PATHS, RETRY_INFO_KEY, count_items
from collector_processor.registry import BuildContext, Factory
from collector_processor.telemetry import Telemetry

log = logging.getLogger(__name__)
_RETRYABLE_GRPC = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                   grpc.StatusCode.CANCELLED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.DATA_LOSS,
                   grpc.StatusCode.RESOURCE_EXHAUSTED}
_RETRYABLE_HTTP = {429, 502, 503, 504}


class RetryConfig(Strict):
    enabled: bool = True
    initial_interval: Duration = 0.5
    max_interval: Duration = 5.0
    max_elapsed_time: Duration = 30.0


class QueueConfig(Strict):
    queue_size: int = Field(512, ge=1, le=100_000)  # requests


class Config(Strict):
    endpoint: ExportEndpoint = ""
    tls: ClientTLS = Field(default_factory=ClientTLS)
    compression: Literal["gzip", "none", ""] = "gzip"
    timeout: Duration = 5.0
    headers: dict[str, str] = Field(default_factory=dict)
    retry_on_failure: RetryConfig = Field(default_factory=RetryConfig)
    sending_queue: QueueConfig = Field(default_factory=QueueConfig)

    def __repr__(self) -> str:  # headers may carry credentials
        return f"Config(endpoint={self.endpoint!r})"


class _Permanent(Exception):
    pass


class _Retryable(Exception):
    def __init__(self, msg: str, delay_s: float | None = None) -> None:
        super().__init__(msg)
        self.delay_s = delay_s


class OtlpExporter:
    protocol = "grpc"

    def __init__(self, eid: str, cfg: Config, telemetry: Telemetry) -> None:
        self.id = eid
        self.cfg = cfg
        self.t = telemetry
        self.enabled = bool(cfg.endpoint.strip())
        self._q: collections.deque[tuple[str, bytes, int]] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._deadline = float("inf")
        self._thread = threading.Thread(target=self._run, name=f"exporter-{eid}", daemon=True)
        self._depth = telemetry.queue_depth.labels(f"exporter:{eid}")
        self.sent = 0  # requests delivered (for tests and logs)
        self._queued = {sig: 0 for sig in _SIGNALS}  # items queued or being sent, per signal
        for sig in _SIGNALS:  # every series at 0 from the start: enqueued = sent + failed + queued
            telemetry.exporter_enqueued.labels(eid, sig)
            telemetry.exporter_sent.labels(eid, sig)
            telemetry.exporter_queued.labels(eid, sig)
            for reason in s.EXPORTER_FAILED_REASONS:
                telemetry.exporter_failed.labels(eid, sig, reason)

    # ---- pipeline side ------------------------------------------------------------------------------------
    def _enqueue(self, signal: str, msg: Message) -> None:
        if not self.enabled:
            return
        n = count_items(signal, msg)
        data = msg.SerializeToString()
        self.t.exporter_enqueued.labels(self.id, signal).inc(n)
        with self._cv:
            if len(self._q) >= self.cfg.sending_queue.queue_size:
                sig_old, _, n_old = self._q.popleft()  # drop the oldest: fresh data is worth more
                self._unqueued(sig_old, n_old)
                self._failed(sig_old, n_old, "sending queue full", "queue_full")
            self._q.append((signal, data, n))
            self._queued[signal] += n
            self.t.exporter_queued.labels(self.id, signal).set(self._queued[signal])
            self._depth.set(len(self._q))
            self._cv.notify()

    def _unqueued(self, signal: str, n: int) -> None:
        """``n`` items of ``signal`` left the queue (under ``_cv``)."""
        self._queued[signal] -= n
        self.t.exporter_queued.labels(self.id, signal).set(self._queued[signal])

    def export_traces(self, request: Message) -> None:
        self._enqueue("traces", request)

    def export_logs(self, request: Message) -> None:
        self._enqueue("logs", request)

    def _failed(self, signal: str, n: int, why: str, reason: str) -> None:
        self.t.export_failures.labels(self.id).inc()
        self.t.exporter_failed.labels(self.id, signal, reason).inc(n)
        if signal == "traces":
            self.t.spans_dropped.labels("export_failed").inc(n)
        log.warning("exporter %s: dropped a %s request (%d items): %s", self.id, signal, n, why)

    # ---- sender thread ------------------------------------------------------------------------------------
    def start(self) -> None:
        if not self.enabled:
            log.info("exporter %s disabled (empty endpoint)", self.id)
            return
        self._connect()
        self._thread.start()

    def _connect(self) -> None:
        raise NotImplementedError

    def _send(self, signal: str, data: bytes, timeout_s: float) -> bytes:
        """Deliver one request; the receiving end's answer (an Export*ServiceResponse)."""
        raise NotImplementedError

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._stop:
                    self._cv.wait(0.5)
                if not self._q and self._stop:
                    return
                signal, data, n = self._q.popleft()
                self._depth.set(len(self._q))
            self._deliver(signal, data, n)
            with self._cv:  # queued until delivered or failed: enqueued = sent + failed + queued once settled
                self._unqueued(signal, n)

    def _deliver(self, signal: str, data: bytes, n: int) -> None:
        rc = self.cfg.retry_on_failure
        start = time.monotonic()
        delay = rc.initial_interval
        while True:
            remaining = min(self._deadline, start + rc.max_elapsed_time) - time.monotonic()
            try:
                answer = self._send(signal, data, max(0.05, min(self.cfg.timeout, remaining)))
                self.sent += 1
                refused = min(n, _rejected(signal, answer))
                self.t.exporter_sent.labels(self.id, signal).inc(n - refused)
                if refused:
                    self._failed(signal, refused, f"{refused} refused by the receiving end (partial success)",
                                 "partial")
                return
            except _Permanent as e:
                self._failed(signal, n, str(e), "refused")
                return
            except _Retryable as e:
                wait = e.delay_s if e.delay_s is not None else delay * random.uniform(0.8, 1.2)
                if not rc.enabled or time.monotonic() + wait >= min(self._deadline, start + rc.max_elapsed_time):
                    self._failed(signal, n, f"{e} (gave up)", "gave_up")
                    return
                with self._cv:  # interruptible by shutdown
                    self._cv.wait_for(lambda: time.monotonic() >= self._deadline, wait)
                delay = min(rc.max_interval, delay * 2)
            except Exception as e:  # never let the sender die
                self._failed(signal, n, f"{type(e).__name__}: {e}", "error")
                return

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Send what is queued within ``timeout_s``; count the rest as failed."""
        with self._cv:
            self._stop = True
            self._deadline = time.monotonic() + timeout_s
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s + 0.5)
        with self._cv:
            while self._q:
                signal, _, n = self._q.popleft()
                self._unqueued(signal, n)
                self._failed(signal, n, "not sent before shutdown", "shutdown")
        self._close()

    def _close(self) -> None:
        pass


class OtlpGrpcExporter(OtlpExporter):
    protocol = "grpc"

    def _connect(self) -> None:
        ep = self.cfg.endpoint.strip()
        secure = not self.cfg.tls.insecure
        if ep.startswith("http://"):
            ep, secure = ep[len("http://"):], False
        elif ep.startswith("https://"):
            ep, secure = ep[len("https://"):], True
        if secure:
            tls = self.cfg.tls
            creds = grpc.ssl_channel_credentials(
                root_certificates=Path(tls.ca_file).read_bytes() if tls.ca_file else None,
                private_key=Path(tls.key_file).read_bytes() if tls.key_file else None,
                certificate_chain=Path(tls.cert_file).read_bytes() if tls.cert_file else None,
            )
            self._channel = grpc.secure_channel(ep, creds)
        else:
            self._channel = grpc.insecure_channel(ep)
        self._calls = {s: self._channel.unary_unary(f"/{svc}/Export") for s, svc in GRPC_SERVICES.items()}
        self._md = tuple((k.lower(), v) for k, v in self.cfg.headers.items())
        self._compression = grpc.Compression.Gzip if self.cfg.compression == "gzip" else grpc.Compression.NoCompression

    def _send(self, signal: str, data: bytes, timeout_s: float) -> bytes:
        try:
            return self._calls[signal](data, timeout=timeout_s, metadata=self._md or None,
                                       compression=self._compression) or b""
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            if code not in _RETRYABLE_GRPC:
                raise _Permanent(f"gRPC {code.name}") from e
            delay = None
            for k, v in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
                if k == RETRY_INFO_KEY:
                    ri = RetryInfo.FromString(v)
                    delay = ri.retry_delay.ToNanoseconds() / 1e9
            raise _Retryable(f"gRPC {code.name}", delay) from e

    def _close(self) -> None:
        ch = getattr(self, "_channel", None)
        if ch is not None:
            ch.close()


class OtlpHttpExporter(OtlpExporter):
    protocol = "http"

    def _connect(self) -> None:
        ep = self.cfg.endpoint.strip().rstrip("/")
        if not ep.startswith(("http://", "https://")):
            ep = ("http://" if self.cfg.tls.insecure else "https://") + ep
        self._base = ep
        self._ctx = None
        if ep.startswith("https://"):
            import ssl

            tls = self.cfg.tls
            self._ctx = ssl.create_default_context(cafile=tls.ca_file)
            if tls.cert_file:
                self._ctx.load_cert_chain(tls.cert_file, tls.key_file)

    def _send(self, signal: str, data: bytes, timeout_s: float) -> bytes:
        headers = {"Content-Type": CT_PROTOBUF, **self.cfg.headers}
        if self.cfg.compression == "gzip":
            data = gzip.compress(data, compresslevel=5)
            headers["Content-Encoding"] = "gzip"
        req = urllib.request.Request(self._base + HTTP_PATHS[signal], data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=self._ctx) as resp:
                body = resp.read()
                ctype = (resp.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
                return body if ctype in ("", CT_PROTOBUF) else b""
        except urllib.error.HTTPError as e:
            if e.code in _RETRYABLE_HTTP:
                ra = e.headers.get("Retry-After") if e.headers else None
                delay = float(ra) if ra and ra.strip().isdigit() else None
                raise _Retryable(f"HTTP {e.code}", delay) from e
            raise _Permanent(f"HTTP {e.code}") from e
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            raise _Retryable(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from e


_SIGNALS = ("traces", "logs")


def _rejected(signal: str, answer: bytes) -> int:
    """The items a receiving end refused in a partial success (0 when it says none, or nothing readable)."""
    if not answer:
        return 0
    try:
        if signal == "traces":
            return max(0, ExportTraceServiceResponse.FromString(answer).partial_success.rejected_spans)
        return max(0, ExportLogsServiceResponse.FromString(answer).partial_success.rejected_log_records)
    except Exception:  # not a response this exporter can read: nothing is known to be refused
        return 0


def _create_grpc(ctx: BuildContext, cid: str, cfg: Config) -> OtlpGrpcExporter:
    return OtlpGrpcExporter(cid, cfg, ctx.telemetry)


def _create_http(ctx: BuildContext, cid: str, cfg: Config) -> OtlpHttpExporter:
    return OtlpHttpExporter(cid, cfg, ctx.telemetry)


_TRACES_LOGS = frozenset({"traces", "logs"})
GRPC_FACTORY = Factory("exporter", "otlp_grpc", Config, _create_grpc, signals=_TRACES_LOGS, aliases=("otlp",))
HTTP_FACTORY = Factory("exporter", "otlp_http", Config, _create_http, signals=_TRACES_LOGS, aliases=("otlphttp",))

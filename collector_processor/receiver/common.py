"""What both OTLP receivers share: config, admission before decoding, and handing a decoded request to the
pipelines of its signal."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc
from google.protobuf.message import Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from pydantic import Field, model_validator

from collector_processor.component import Admission, Refusal
from collector_processor.config.model import MIB
from collector_processor.config.types import Duration, GrpcListen, HttpListen, ServerTLS, Strict
from collector_processor.pipeline import Pipeline, Result
from collector_processor.receiver.auth import AuthConfig, Tenant
from collector_processor.receiver.decode import (
    CT_PROTOBUF,
    WORST_BYTES_PER_BYTE,
    DecodeFailure,
    admitted_bytes,
    count_items,
    decode,
    decode_cost,
    decode_cost_bound,
)
from collector_processor.receiver.tenants import DuplicateIdentity, Forbidden, check_resources
from collector_processor.telemetry import Telemetry

log = logging.getLogger(__name__)
# Requests whose body or decoding takes less are not reserved: only the decoding workers' count of them (8 per
# protocol by default) is decoded at once, and a memory limiter over its soft limit still refuses them when they
# are submitted, counting their items in spans_dropped_total.
UNRESERVED_BYTES = 1 << 20
# RSS a started collector adds at rest to the memory limiter's baseline (taken before the receivers start: their
# threads, buffers and connections; ~20 MiB measured), left out of the budget a receiver says it admits
IDLE_GROWTH_BYTES = 64 << 20
MAX_MESSAGE_MIB = 256  # the largest request size limit a receiver may be given

# export response of each signal and its partial-success count field
_RESPONSES: dict[str, tuple[type[Message], str]] = {
    "traces": (ExportTraceServiceResponse, "rejected_spans"),
    "metrics": (ExportMetricsServiceResponse, "rejected_data_points"),
    "logs": (ExportLogsServiceResponse, "rejected_log_records"),
}


# What a decoded request holds while it waits in a pipeline queue, estimated from its wire size and items (spans,
# log records, metric data points): a parsed item costs up to ~200 bytes besides its bytes (an empty Span: 176),
# and the rest of a request about 3 bytes per wire byte (bench/results/hostile.md, realistic spans: 3.8).
HELD_BYTES_PER_BYTE = 3
HELD_BYTES_PER_ITEM = 200


def held_bytes(wire_bytes: int, items: int) -> int:
    return HELD_BYTES_PER_BYTE * wire_bytes + HELD_BYTES_PER_ITEM * items


class GrpcProtocol(Strict):
    endpoint: GrpcListen = "127.0.0.1:4317"
    max_recv_msg_size_mib: float = Field(16, gt=0, le=MAX_MESSAGE_MIB)
    max_workers: int = Field(8, ge=1, le=256)
    # connections, before any token is seen
    max_connections: int = Field(512, ge=1, le=65536)
    max_streams_per_connection: int = Field(100, ge=1, le=65536)
    handshake_timeout: Duration = Field(10.0, gt=0, le=300.0)
    idle_timeout: Duration = Field(60.0, gt=0, le=86400.0)
    # calls: in progress at once (per listener and per peer address); the request message must arrive within
    # message_timeout; under pressure a call still without its message after stall_timeout is ended to make room
    max_concurrent_calls: int = Field(1024, ge=1, le=65536)
    max_calls_per_peer: int = Field(1024, ge=1, le=65536)
    message_timeout: Duration = Field(30.0, gt=0, le=600.0)
    stall_timeout: Duration = Field(2.0, gt=0, le=600.0)


class HttpProtocol(Strict):
    endpoint: HttpListen = "127.0.0.1:4318"
    max_request_body_size_mib: float = Field(16, gt=0, le=MAX_MESSAGE_MIB)
    # connections, before any token is seen: at most max_connections (max_connections_per_peer from one address, of
    # them max_preauth_connections_per_peer before a request head passed auth: TLS handshake, first head); at the
    # cap the address holding the most gives up its oldest connection before auth, else the oldest connection that
    # is not inside a request (handshaking or idle) for stall_timeout is closed to make room, else the newcomer is
    # (OtlpHttpReceiver._admit). The TLS handshake must end within handshake_timeout, a kept-alive connection may
    # idle idle_timeout.
    max_connections: int = Field(512, ge=1, le=65536)
    max_connections_per_peer: int = Field(512, ge=1, le=65536)
    max_preauth_connections_per_peer: int = Field(256, ge=1, le=65536)
    handshake_timeout: Duration = Field(10.0, gt=0, le=300.0)
    idle_timeout: Duration = Field(30.0, gt=0, le=86400.0)
    stall_timeout: Duration = Field(2.0, gt=0, le=600.0)


class Protocols(Strict):
    """A protocol listed with no body (``grpc:``) is enabled with defaults; one left out is disabled."""

    grpc: GrpcProtocol | None = None
    http: HttpProtocol | None = None

    @model_validator(mode="before")
    @classmethod
    def _empty_means_defaults(cls, data: object) -> object:
        if isinstance(data, dict):
            return {k: ({} if v is None else v) for k, v in data.items()}
        return data


class Config(Strict):
    protocols: Protocols = Field(default_factory=lambda: Protocols(grpc=GrpcProtocol(), http=HttpProtocol()))
    auth: AuthConfig = Field(default_factory=AuthConfig)
    tls: ServerTLS = Field(default_factory=ServerTLS)
    # Delay a throttled client is told to wait (gRPC RetryInfo trailer, HTTP Retry-After rounded up to seconds).
    retry_delay: Duration = Field(1.0, le=3600.0)
    # How long a request waits for the pipeline worker so that rejected spans can be reported as partial
    # success. 0: answer as soon as the request is queued.
    wait_for_processing: Duration = Field(0.5, le=60.0)
    # Items (spans, log records, metric data points) one request may carry: beyond, it is refused for good after
    # decoding (413 / RESOURCE_EXHAUSTED) instead of holding a pipeline for seconds (2 million empty spans fit in
    # 4 MiB). An honest 16 MiB request of stage spans carries about 150 000.
    max_items_per_request: int = Field(262_144, ge=1, le=10_000_000)

    @model_validator(mode="after")
    def _some_protocol(self) -> Config:
        if self.protocols.grpc is None and self.protocols.http is None:
            raise ValueError("enable at least one of protocols.grpc, protocols.http")
        return self


class TenantLedger:
    """Memory a receiver's requests reserve at the admission gates, per tenant (``Tenant.share``; the all-jobs
    token's are not shared out). While another tenant holds some, or was refused by the gates in the last
    ``WAITING_S``, a tenant past half of the budget is refused (retry later) beyond the budget over those tenants
    plus one, counted for it (``tenant_evictions_total{structure="memory"}``): its large requests leave room for
    another's, and a tenant alone may use the whole budget (what an idle collector admits)."""

    WAITING_S = 5.0
    MAX_WAITING = 1024

    def __init__(self, telemetry: Telemetry) -> None:
        self.t = telemetry
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # tenant -> bytes reserved (tenants holding some only)
        self._waiting: dict[str, float] = {}  # tenant -> when the gates last refused it (monotonic)
        self._total = 0

    def _others(self, share: str, now: float) -> int:
        """Tenants besides ``share`` holding memory or refused by the gates within ``WAITING_S``."""
        for who in [w for w, at in self._waiting.items() if now - at > self.WAITING_S]:
            del self._waiting[who]
        held = len(self._held) - (share in self._held)
        return held + sum(1 for w in self._waiting if w != share and w not in self._held)

    def take(self, tenant: Tenant | None, nbytes: int, budget: int | None) -> Refusal | None:
        if tenant is None or not tenant.share or budget is None:
            return None
        with self._lock:
            held = self._held.get(tenant.share, 0)
            if held and 2 * (self._total + nbytes) > budget:
                others = self._others(tenant.share, time.monotonic())
                if others and held + nbytes > budget // (others + 1):
                    self.t.tenant_evictions.labels(tenant=tenant.label, structure="memory").inc()
                    return Refusal("memory_limit", f"{tenant.name} holds its share of the memory for requests "
                                   "being decoded")
            self._held[tenant.share] = held + nbytes
            self._total += nbytes
            self._waiting.pop(tenant.share, None)  # served: it waits no more
        return None

    def refused(self, tenant: Tenant | None) -> None:
        """The gates refused ``tenant``: it waits for memory, so others are held to their shares meanwhile."""
        if tenant is None or not tenant.share:
            return
        with self._lock:
            if len(self._waiting) >= self.MAX_WAITING:
                self._waiting.clear()
            self._waiting[tenant.share] = time.monotonic()

    def give(self, tenant: Tenant | None, nbytes: int) -> None:
        if tenant is None or not tenant.share:
            return
        with self._lock:
            held = self._held.get(tenant.share, 0) - nbytes
            if held > 0:
                self._held[tenant.share] = held
            else:
                self._held.pop(tenant.share, None)
            self._total = max(0, self._total - nbytes)


class Dispatcher:
    """Routes one signal's requests from one receiver to every pipeline that lists the receiver, and asks those
    pipelines' admission gates (``component.Admission``) for the memory a request may take before it is read or
    decoded."""

    def __init__(self, label: str, telemetry: Telemetry, pipelines: dict[str, list[Pipeline]], wait_s: float,
                 max_items: int = 262_144, ledger: TenantLedger | None = None) -> None:
        self.label = label
        self.ledger = ledger or TenantLedger(telemetry)
        self.max_items = max_items
        self.t = telemetry
        self.pipelines = pipelines
        self.wait_s = wait_s
        self._gates: dict[str, list[Admission]] = {}
        for sig, pipes in pipelines.items():
            gates: list[Admission] = []
            for p in pipes:
                gates.extend(g for g in p.admission if all(g is not x for x in gates))
            self._gates[sig] = gates
        self._aborted_logged = threading.Event()
        self._forbidden_logged = threading.Event()
        self._duplicate_logged = threading.Event()
        telemetry.receiver(label)
        # the receiver's counter children, looked up once (a labels() call takes a lock and builds a key)
        self._spans_received = telemetry.spans_received.labels(label)
        self._outcomes: dict[str, Any] = {}

    def has(self, signal: str) -> bool:
        return bool(self.pipelines.get(signal))

    def reserve(self, signal: str, nbytes: int, tenant: Tenant | None = None) -> Refusal | None:
        """Reserve ``nbytes`` for ``tenant`` within its share (``TenantLedger``) and at every gate of the signal's
        pipelines, or nothing (the refusal)."""
        if nbytes < UNRESERVED_BYTES:
            return None
        gates = self._gates.get(signal, ())
        if gates:
            refusal = self.ledger.take(tenant, nbytes, min(g.budget() for g in gates))
            if refusal is not None:
                return refusal
        taken: list[Admission] = []
        for g in gates:
            refusal = g.reserve(nbytes)
            if refusal is not None:
                for x in taken:
                    x.release(nbytes)
                self.ledger.give(tenant, nbytes)
                self.ledger.refused(tenant)
                return refusal
            taken.append(g)
        return None

    def hold(self, signal: str, nbytes: int) -> None:
        if nbytes < UNRESERVED_BYTES:
            return
        for g in self._gates.get(signal, ()):
            g.hold(nbytes)

    def budget(self) -> int | None:
        """The smallest budget of the admission gates of any signal (None: no gate, nothing bounds memory)."""
        budgets = [g.budget() for gates in self._gates.values() for g in gates]
        return min(budgets) if budgets else None

    def admitted(self, limit: int, held_per_byte: int = 1) -> int:
        """The largest body under ``limit`` admitted whatever it holds while nothing else is reserved (a body is
        counted in ``held_per_byte`` twice: reserved, and resident once read)
        (``decode.admitted_bytes`` of the smallest budget), exported as ``receiver_admitted_bytes`` and logged
        when it is less than ``limit``."""
        budget = self.budget()
        if budget is not None:  # what a started collector holds at rest beyond the limiter's baseline
            budget = max(0, budget - IDLE_GROWTH_BYTES)
        admitted = limit if budget is None else min(limit, admitted_bytes(budget, held_per_byte))
        self.t.admitted_bytes.labels(self.label).set(admitted)
        if admitted < limit and budget is not None:
            log.info("%s: admits any request up to %.1f MiB, and one up to the %.0f MiB limit when its decoding "
                     "fits the %.0f MiB the memory limiter leaves (at most %d bytes per body byte; ordinary stage "
                     "spans ~30): receiver_admitted_bytes", self.label, admitted / MIB, limit / MIB, budget / MIB,
                     held_per_byte + WORST_BYTES_PER_BYTE)
        return admitted

    def release(self, signal: str, nbytes: int, tenant: Tenant | None = None) -> None:
        if nbytes < UNRESERVED_BYTES:
            return
        gates = self._gates.get(signal, ())
        if gates:
            self.ledger.give(tenant, nbytes)
        for g in gates:
            g.release(nbytes)

    def refused(self, refusal: Refusal) -> None:
        """Count a refusal before decoding: ``throttled`` (retry later) or ``too_large`` (never)."""
        self.outcome("throttled" if refusal.retry else "too_large")

    def decode_and_dispatch(self, signal: str, data: bytes | bytearray, ctype: str = CT_PROTOBUF,
                            tenant: Tenant | None = None) -> Result | Refusal:
        """Reserve what decoding ``data`` takes at the signal's gates, decode, hand to its pipelines (on a worker
        thread). Every outcome is counted here: a refusal before decoding (returned), a decoding failure (counted
        ``invalid``, ``DecodeFailure`` raised; a resource naming an identity attribute twice also in
        ``duplicate_identity_total``), a job outside the ``tenant``'s (counted ``forbidden`` and in
        ``tenant_refused_total``, ``Forbidden`` raised), the pipelines' refusal (returned as a retryable
        ``Refusal``) and their acceptance (the ``Result``, ``rejected`` > 0 for a partial success)."""
        prepared = self.prepare(signal, data, ctype, tenant)
        if isinstance(prepared, Refusal):
            return prepared
        msg, n = prepared
        r = self.dispatch(signal, msg, len(data), n, tenant)
        if r.status != "ok":
            return Refusal(r.reason, r.message or "throttled")
        return r

    def prepare(self, signal: str, data: bytes | bytearray, ctype: str = CT_PROTOBUF, tenant: Tenant | None = None
                ) -> tuple[Message, int] | Refusal:
        """``decode_and_dispatch`` up to the hand-over: the decoded request and its items, or the refusal (counted;
        ``DecodeFailure`` and ``Forbidden`` raised, counted). The decoding estimate is computed and reserved only
        where a gate bounds memory: a small protobuf body's most (``decode_cost_bound``), scanned for the estimate
        (``decode_cost``) only when that is refused."""
        cost = 0
        bound: int | None = None
        if self._gates.get(signal):
            bound = decode_cost_bound(data, ctype)
            cost = decode_cost(data, ctype) if bound is None else bound
        refusal = self.reserve(signal, cost, tenant)
        if refusal is not None and cost and bound is not None:  # the most was refused: the estimate may fit
            cost = decode_cost(data, ctype)
            refusal = self.reserve(signal, cost, tenant)
        if refusal is not None:
            self.refused(refusal)
            return refusal
        try:
            msg = decode(signal, data, ctype)
        except DecodeFailure:
            self.outcome("invalid")
            raise
        finally:
            self.release(signal, cost, tenant)
        try:
            check_resources(signal, msg, tenant)
        except Forbidden as e:
            self.forbidden(str(e))
            raise
        except DuplicateIdentity as e:
            self.outcome("invalid")
            self.t.duplicate_identity.labels(self.label).inc()
            if not self._duplicate_logged.is_set():
                self._duplicate_logged.set()
                log.warning("%s: a request was refused: %s; such requests are counted in "
                            "otel_straggler_collector_duplicate_identity_total and not logged again", self.label, e)
            raise
        n = count_items(signal, msg)
        if n > self.max_items:
            self.outcome("too_large")
            return Refusal("too_large", f"request of {n} items exceeds max_items_per_request ({self.max_items})",
                           retry=False)
        return msg, n

    def only_pipeline(self, signal: str) -> Pipeline | None:
        """The signal's pipeline when it has exactly one (a request can then be handed over without a thread
        waiting for it: ``offer``)."""
        pipes = self.pipelines.get(signal, ())
        return pipes[0] if len(pipes) == 1 else None

    def offer(self, signal: str, pipe: Pipeline, msg: Message, nbytes: int, n: int, done: object,
              tenant: Tenant | None = None) -> Result | object:
        """Queue a prepared request on ``pipe`` without waiting: the queued item (``done.set()`` once processed;
        then ``finished``) or the refusal, counted as ``dispatch`` counts it."""
        if signal == "traces":
            self._spans_received.inc(n)
        share, label = (tenant.share, tenant.label) if tenant is not None else ("", "")
        r = pipe.offer(msg, held_bytes(nbytes, n), n, done, share, label)
        if isinstance(r, Result):
            self.outcome("throttled")
            if signal == "traces":
                self.t.spans_dropped.labels(r.reason).inc(n)
        return r

    def process_now(self, signal: str, pipe: Pipeline, msg: Message, nbytes: int, n: int) -> Result | object | None:
        """Process a prepared request on this thread if ``pipe`` is idle (``Pipeline.process_now``): the processed
        item (then ``finished``), the refusal (counted as ``offer`` counts it), or None: ``offer`` it instead."""
        r = pipe.process_now(msg, held_bytes(nbytes, n), n)
        if r is None:
            return None
        if signal == "traces":
            self._spans_received.inc(n)
        if isinstance(r, Result):
            self.outcome("throttled")
            if signal == "traces":
                self.t.spans_dropped.labels(r.reason).inc(n)
        return r

    def finished(self, item: object, processed: bool) -> Result:
        """The answer for an ``offer``ed item: its partial success once ``processed``, else a plain success."""
        r = Result("ok", rejected=item.rejected, message=item.message) if processed else Result("ok")  # type: ignore[attr-defined]
        self.outcome("partial" if r.rejected else "ok")
        return r

    def dispatch(self, signal: str, msg, nbytes: int, n: int | None = None, tenant: Tenant | None = None
                 ) -> Result:
        """Hand a decoded request (``nbytes`` on the wire, ``n`` items) of ``tenant`` to the signal's pipelines.
        Their queues count what it holds decoded (``held_bytes``), so a queue's ``max_bytes_mib`` bounds decoded
        requests waiting, whatever their wire size, and each tenant's share of it."""
        if n is None:
            n = count_items(signal, msg)
        nbytes = held_bytes(nbytes, n)
        if signal == "traces":
            self._spans_received.inc(n)
        out = Result()
        share, label = (tenant.share, tenant.label) if tenant is not None else ("", "")
        for p in self.pipelines.get(signal, ()):
            r = p.submit(msg, nbytes, n, self.wait_s, share, label)
            if r.status != "ok":
                out = r
                break
            if r.rejected > out.rejected:
                out.rejected, out.message = r.rejected, r.message
        if out.status != "ok":
            self.outcome("throttled")
            if signal == "traces":
                self.t.spans_dropped.labels(out.reason).inc(n)
        else:
            self.outcome("partial" if out.rejected else "ok")
        return out

    def outcome(self, outcome: str) -> None:
        child = self._outcomes.get(outcome)
        if child is None:
            child = self._outcomes[outcome] = self.t.requests.labels(self.label, outcome)
        child.inc()

    def forbidden(self, why: str) -> None:
        """A request naming a job its token may not write: counted, logged once per receiver."""
        self.outcome("forbidden")
        self.t.tenant_refused.labels(self.label).inc()
        if not self._forbidden_logged.is_set():
            self._forbidden_logged.set()
            log.warning("%s: a request was refused: %s; such requests are counted in "
                        "otel_straggler_collector_tenant_refused_total and not logged again", self.label, why)

    def aborted(self, why: str) -> None:
        """A request whose client went away or stalled past a timeout before it was answered: counted, and logged
        once per receiver (thousands of dropped connections must not flood the log)."""
        self.outcome("aborted")
        if not self._aborted_logged.is_set():
            self._aborted_logged.set()
            log.warning("%s: a request was aborted (%s); such requests are counted in "
                        "otel_straggler_collector_requests_total{outcome=\"aborted\"} and not logged again",
                        self.label, why)


class Reservation:
    """Memory reserved at a signal's gates for a buffer that grows while it is filled (a body inflating, a chunked
    body arriving): ``cover(n)`` before the buffer may hold ``n`` bytes reserves what is missing, in steps of at
    least ``step`` bytes; nothing below ``floor`` bytes is reserved (as for any request under
    ``UNRESERVED_BYTES``). ``release`` gives back all of it at once."""

    def __init__(self, dispatcher: Dispatcher, signal: str, step: int, floor: int = 0, tenant: Tenant | None = None
                 ) -> None:
        self.d = dispatcher
        self.signal = signal
        self.tenant = tenant
        self.step = step
        self.floor = floor
        self.held = 0

    def cover(self, nbytes: int) -> Refusal | None:
        """Reserve up to ``nbytes`` in all; the refusal when the gates cannot take it (nothing more is held)."""
        if nbytes <= self.held or nbytes < self.floor:
            return None
        add = max(nbytes - self.held, self.step)
        refusal = self.d.reserve(self.signal, add, self.tenant)
        if refusal is None:
            self.held += add
        return refusal

    def release(self) -> None:
        if self.held:
            self.d.release(self.signal, self.held, self.tenant)
            self.held = 0


def refusal_code(refusal: Refusal) -> grpc.StatusCode:
    """The gRPC status a refusal is answered with (OTLP/HTTP puts it in its ``google.rpc.Status`` body, with HTTP 503
    or 413): UNAVAILABLE with the retry delay, or RESOURCE_EXHAUSTED for a request that could never be taken."""
    return grpc.StatusCode.UNAVAILABLE if refusal.retry else grpc.StatusCode.RESOURCE_EXHAUSTED


def export_response(signal: str, r: Result) -> Message:
    """The Export response for an accepted request, with a partial success when the processors rejected items."""
    resp_cls, rejected_field = _RESPONSES[signal]
    resp = resp_cls()
    if r.rejected:
        setattr(resp.partial_success, rejected_field, r.rejected)  # type: ignore[attr-defined]
        resp.partial_success.error_message = r.message  # type: ignore[attr-defined]
    return resp


def server_name() -> str:
    """``otel-straggler-collector/<version>``: what the receivers tell a client that asks who answers
    (HTTP ``Server``; gRPC health check trailing metadata ``otel-straggler-collector``)."""
    try:
        from importlib.metadata import version

        return f"otel-straggler-collector/{version('otel-straggler')}"
    except Exception:  # not installed (a checkout on PYTHONPATH)
        return "otel-straggler-collector/unknown"


SERVER = server_name()

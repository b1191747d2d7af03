"""OTLP/gRPC receiver: ``TraceService``, ``MetricsService`` and ``LogsService`` ``Export``, and the standard
``grpc.health.v1.Health/Check``.

A ``grpc.aio`` server on its own event loop. The Export methods are registered on the generated servicers' paths
but as request-streaming handlers of raw bytes: the handler runs as soon as the call's metadata arrives, so the
bearer token is checked before the message is read (a client without it is refused at once and holds nothing), a
stream that never sends its message is ended after ``READ_TIMEOUT_S`` (as ``aborted``), and waiting costs a
coroutine, not a worker. Then the message's size is bounded and counted here, the memory its decoding takes is
reserved at the pipelines' admission gates (UNAVAILABLE with the retry delay, or RESOURCE_EXHAUSTED when it could
never fit). A message of up to ``INLINE_BYTES`` for a signal with one pipeline is decoded on the event loop and,
when that pipeline is idle, processed there too (``Pipeline.process_now``); otherwise queued on it, the call
answered when the pipeline's worker is done with it. Larger messages are decoded and handed to the pipelines on
one of ``max_workers`` daemon threads.
Throttled requests get UNAVAILABLE with the ``google.rpc.retryinfo-bin`` trailer, which is where the OTel Python
exporter reads its retry delay. gzip-compressed messages are inflated by gRPC core, which refuses one that
inflates beyond its message size limit (``max_recv_msg_size_mib`` + 64 KiB); the handler then sees no message
and counts the call as ``invalid``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo

from collector_processor.component import Refusal
from collector_processor.config.model import MIB
from collector_processor.config.types import split_host_port
from collector_processor.pipeline import Pipeline, Result
from collector_processor.receiver.aio import Completions, LoopThread, Workers, stop_runtime
from collector_processor.receiver.auth import EVERYONE, BearerAuth, Tenant
from collector_processor.receiver.call_budget import Call, CallBudget, Evicted
from collector_processor.receiver.common import (
    SERVER,
    Config,
    Dispatcher,
    GrpcProtocol,
    export_response,
    refusal_code,
)
from collector_processor.receiver.decode import GRPC_SERVICES, RETRY_INFO_KEY, DecodeFailure
from collector_processor.receiver.tenants import Forbidden
from collector_processor.telemetry import Telemetry

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
# grpc.health.v1.HealthCheckResponse{status: SERVING (1) | NOT_SERVING (2)}, encoded by hand (field 1, varint):
# the standard health protocol without a dependency on grpcio-health-checking.
_SERVING, _NOT_SERVING = b"\x08\x01", b"\x08\x02"
# Requests up to this size are decoded on the event loop and handed to their pipeline without a worker thread
# (``_inline``); larger ones are decoded on a worker so that the loop keeps serving the other calls meanwhile.
INLINE_BYTES = 256 * 1024
# gRPC core's own cap on calls in progress, above the receiver's max_concurrent_calls: calls beyond the receiver's
# cap reach the handler, which ends a stalled call to make room or refuses the newcomer (counted).
CORE_RPC_HEADROOM = 2


class _LoopWaiter:
    """``set()`` from the pipeline's worker thread resolves a future on the receiver's event loop."""

    __slots__ = ("_completions", "_fut")

    def __init__(self, completions: Completions, fut: asyncio.Future[bool]) -> None:
        self._completions = completions
        self._fut = fut

    def set(self) -> None:
        self._completions.resolve(self._fut, True)


def _resolve(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


def _expire(call: Call) -> None:
    """The call's message did not come within the read timeout: end its read."""
    call.expired = True
    task = call.task
    if task is not None and not task.done():
        task.cancel()


def _peer_address(peer: str | None) -> str:
    """The address part of gRPC's ``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678`` (the port is one connection)."""
    if not peer:
        return ""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1:].partition("]")[0]
    return rest.rpartition(":")[0] or rest


def retry_info_bytes(delay_s: float) -> bytes:
    d = Duration()
    d.FromNanoseconds(int(delay_s * 1e9))
    return RetryInfo(retry_delay=d).SerializeToString()


def server_credentials(tls) -> grpc.ServerCredentials:  # type: ignore[no-untyped-def]
    key = Path(tls.key_file).read_bytes()
    cert = Path(tls.cert_file).read_bytes()
    ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


@dataclass
class _Outcome:
    code: grpc.StatusCode
    details: str = ""
    body: bytes = b""
    retry: bool = False  # attach the RetryInfo trailer


def _refusal(refusal: Refusal) -> _Outcome:
    return _Outcome(refusal_code(refusal), refusal.message, retry=refusal.retry)


class OtlpGrpcReceiver:
    what = "OTLP/GRPC"

    def __init__(self, rid: str, cfg: Config, proto: GrpcProtocol, dispatcher: Dispatcher, telemetry: Telemetry,
                 auth: BearerAuth, healthy: Callable[[], bool] = lambda: True) -> None:
        self.id = rid
        self.healthy = healthy
        self.cfg = cfg
        self.proto = proto
        self.d = dispatcher
        self.t = telemetry
        self.auth = auth
        self.limit = int(proto.max_recv_msg_size_mib * MIB)
        budget = dispatcher.budget()
        self._per_read = 3 * (self.limit + 64 * 1024)
        self._max_reads = None if budget is None else max(1, budget // self._per_read)
        self.calls = CallBudget(proto.max_concurrent_calls, proto.max_calls_per_peer, proto.stall_timeout,
                                self._max_reads)
        self._read_timeout = proto.message_timeout
        self._retry = retry_info_bytes(cfg.retry_delay)
        self._oversize_logged = False
        self._server: grpc.aio.Server | None = None
        self._loop: LoopThread | None = None
        self._workers: Workers | None = None
        self._completions: Completions | None = None
        # the receiver's event loop, set by start (asyncio.get_running_loop() costs a getpid system call per call)
        self._aloop: asyncio.AbstractEventLoop
        self.host, self.port = split_host_port(proto.endpoint, 4317)

    # ---- the Export methods -------------------------------------------------------------------------------
    def _method(self, signal: str) -> grpc.RpcMethodHandler:
        async def export(request_iterator: object, context: grpc.aio.ServicerContext) -> bytes:
            call = self.calls.admit(_peer_address(context.peer()), self._aloop.time())
            if call is None:  # the listener (or this peer) is full of calls that are not stalled
                self.t.connections_closed.labels(self.d.label, "refused").inc()
                out = self._refused(Refusal("busy", "too many calls in progress"))
                return self._answer(context, out)
            try:
                return await self._export(signal, context, call)
            finally:
                self.calls.leave(call)

        return grpc.stream_unary_rpc_method_handler(export)

    def _answer(self, context: grpc.aio.ServicerContext, out: _Outcome) -> bytes:
        if out.retry:
            context.set_trailing_metadata(((RETRY_INFO_KEY, self._retry),))
        if out.code != grpc.StatusCode.OK:
            context.set_code(out.code)
            context.set_details(out.details[:300])
        return out.body

    async def _export(self, signal: str, context: grpc.aio.ServicerContext, call: Call) -> bytes:
        tenant: Tenant | None = EVERYONE
        if self.auth.enabled:
            md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
            tenant = self.auth.identify(md.get("authorization"))
            if tenant is None:
                self.t.unauthenticated.labels(self.d.label).inc()
                self.d.outcome("unauthenticated")
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or bad bearer token")
        assert tenant is not None
        if not self.d.has(signal):  # answered before a read slot is taken or the message read
            self.d.outcome("invalid")
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"no {signal} pipeline")
        # gRPC core takes in a message only once it is read (until then flow control holds the client to a small
        # window): at most as many messages are read at once as the memory budget has room for the largest one
        # three times (measured: core's frames, its message buffer, the bytes; bench/hostile.py), and that room
        # is counted at the admission gates until the message's real size is known
        try:
            if self.calls.has_slots:
                if not await self.calls.slot(call, self._read_timeout):
                    out = self._refused(Refusal("memory_limit", "too many requests being read"))
                else:
                    try:
                        out = await self._read_and_handle(signal, context, self._per_read, tenant, call)
                    finally:
                        self.calls.release_slot(call)
            else:
                out = await self._read_and_handle(signal, context, 0, tenant, call)
        except Evicted:
            self.t.connections_closed.labels(self.d.label, "stalled").inc()
            self.d.aborted("no request message while other calls waited (ended to make room)")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request message within {self.calls.stall_s:g} s while other calls waited")
        return self._answer(context, out)

    async def _read_and_handle(self, signal: str, context: grpc.aio.ServicerContext, held: int,
                               tenant: Tenant, call: Call) -> _Outcome:
        self.d.hold(signal, held)
        try:
            # the read is awaited in the handler's own task (no task or wait_for per call): the read timeout and
            # an eviction cancel that task
            loop = self._aloop
            task = call.task = asyncio.current_task(loop)
            timer = loop.call_later(self._read_timeout, _expire, call)
            try:
                raw = await context.read()
            except asyncio.CancelledError:
                if call.evicted:
                    raise Evicted from None
                if not call.expired:
                    raise
                if task is not None:
                    task.uncancel()
                self.d.aborted("no request message within the read timeout")
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no request message within {self._read_timeout:g} s")
            finally:
                timer.cancel()
                call.task = None
            self.calls.arrived(call)
            if raw is grpc.aio.EOF or not isinstance(raw, bytes):
                await self._no_message(context)
            assert isinstance(raw, bytes)
            if held:  # what the message really holds from now on: its bytes
                self.d.release(signal, held)
                held = len(raw)
                self.d.hold(signal, held)
            return await self._handle(signal, raw, tenant)
        finally:
            self.d.release(signal, held)

    async def _no_message(self, context: grpc.aio.ServicerContext) -> None:
        """The call ended without a message: the client sent none (INVALID_ARGUMENT, counted ``invalid``), or gRPC
        core refused one over its size limit and already answered RESOURCE_EXHAUSTED (counted ``too_large`` and
        said in one line per receiver, not a traceback per call)."""
        try:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
        except grpc.aio.AbortError:
            self.d.outcome("invalid")
            raise
        except Exception:  # the status could not be sent: core ended the call itself
            self.d.outcome("too_large")
            if not self._oversize_logged:
                self._oversize_logged = True
                log.warning("%s: a message over max_recv_msg_size_mib (%.0f MiB) was refused by gRPC "
                            "(RESOURCE_EXHAUSTED); such calls are counted in "
                            "otel_straggler_collector_requests_total{outcome=\"too_large\"} and not logged again",
                            self.d.label, self.proto.max_recv_msg_size_mib)
            raise asyncio.CancelledError from None  # nothing left to answer: gRPC logs this at debug level

    async def _handle(self, signal: str, raw: bytes, tenant: Tenant) -> _Outcome:
        if len(raw) > self.limit:
            self.d.outcome("too_large")
            return _Outcome(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request of {len(raw)} bytes exceeds {self.limit}")
        pipe = self.d.only_pipeline(signal)
        if len(raw) <= INLINE_BYTES and pipe is not None:
            return await self._inline(signal, raw, tenant, pipe)
        assert self._workers is not None
        return await self._workers.run(self._process, signal, raw, tenant)

    async def _inline(self, signal: str, raw: bytes, tenant: Tenant, pipe: Pipeline) -> _Outcome:
        """A small request, on the event loop: decoded here (a fraction of a millisecond); when the client is to be
        told the partial success (``wait_for_processing`` > 0) and the pipeline is idle, processed here too
        (``Pipeline.process_now``: no thread woken, no hand-over and back); else queued on its pipeline without a
        thread waiting for it, and answered when the pipeline is done with it or after ``wait_for_processing``."""
        try:
            prepared = self.d.prepare(signal, raw, tenant=tenant)
        except DecodeFailure as e:
            return _Outcome(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Forbidden as e:
            return _Outcome(grpc.StatusCode.PERMISSION_DENIED, str(e))
        if isinstance(prepared, Refusal):
            return _refusal(prepared)
        msg, n = prepared
        if self.d.wait_s > 0:  # processed here when the pipeline is idle: answered with its partial success at once
            now = self.d.process_now(signal, pipe, msg, len(raw), n)
            if isinstance(now, Result):
                return _refusal(Refusal(now.reason, now.message or "throttled"))
            if now is not None:
                r = self.d.finished(now, True)
                return _Outcome(grpc.StatusCode.OK, body=export_response(signal, r).SerializeToString())
        loop = self._aloop
        done: asyncio.Future[bool] = loop.create_future()  # True: processed; False: wait_for_processing passed
        assert self._completions is not None
        item = self.d.offer(signal, pipe, msg, len(raw), n, _LoopWaiter(self._completions, done), tenant)
        if isinstance(item, Result):
            return _refusal(Refusal(item.reason, item.message or "throttled"))
        processed = False
        if self.d.wait_s > 0:
            timer = loop.call_later(self.d.wait_s, _resolve, done, False)
            processed = await done
            timer.cancel()
        r = self.d.finished(item, processed)
        return _Outcome(grpc.StatusCode.OK, body=export_response(signal, r).SerializeToString())

    def _refused(self, refusal: Refusal) -> _Outcome:
        """Count a refusal before decoding and answer it."""
        self.d.refused(refusal)
        return _refusal(refusal)

    def _process(self, signal: str, raw: bytes, tenant: Tenant) -> _Outcome:
        """On a worker thread: decode and hand to the pipelines; the gRPC status of the outcome."""
        try:
            r = self.d.decode_and_dispatch(signal, raw, tenant=tenant)
        except DecodeFailure as e:
            return _Outcome(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Forbidden as e:
            return _Outcome(grpc.StatusCode.PERMISSION_DENIED, str(e))
        if isinstance(r, Refusal):
            return _refusal(r)
        return _Outcome(grpc.StatusCode.OK, body=export_response(signal, r).SerializeToString())

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = LoopThread(f"grpc-{self.id}")
        self._loop.start()
        self._aloop = self._loop.loop
        self._completions = Completions(self._loop.loop)
        self._workers = Workers(self.proto.max_workers, f"grpc-{self.id}-worker")
        grpc_limit = self.limit + 64 * 1024  # room to answer a slightly bigger body with our own counted error

        async def health(_req: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
            # who answers, and its clock (ns since the epoch), for a client that asks (otel-straggler doctor)
            ctx.set_trailing_metadata((("otel-straggler-collector", SERVER), ("x-unix-time-ns", str(time.time_ns()))))
            return _SERVING if self.healthy() else _NOT_SERVING

        async def serve() -> int:
            p = self.proto
            server = grpc.aio.server(
                # no bandwidth-delay probing: a stream's flow-control window stays small until its message is read.
                # Connections are a budget before any token is seen: at most max_connections, each with at most
                # max_streams_per_connection calls, a TLS (or HTTP/2) handshake within handshake_timeout, and
                # closed after idle_timeout without a call.
                options=[("grpc.max_receive_message_length", grpc_limit), ("grpc.so_reuseport", 0),
                         ("grpc.http2.bdp_probe", 0),
                         ("grpc.max_allowed_incoming_connections", p.max_connections),
                         ("grpc.max_concurrent_streams", p.max_streams_per_connection),
                         ("grpc.server_handshake_timeout_ms", int(p.handshake_timeout * 1000)),
                         ("grpc.max_connection_idle_ms", int(p.idle_timeout * 1000))],
                maximum_concurrent_rpcs=CORE_RPC_HEADROOM * p.max_concurrent_calls,
            )
            handlers = [grpc.method_handlers_generic_handler(svc, {"Export": self._method(sig)})
                        for sig, svc in GRPC_SERVICES.items()]
            handlers.append(grpc.method_handlers_generic_handler(HEALTH_SERVICE, {
                "Check": grpc.unary_unary_rpc_method_handler(health)}))
            server.add_generic_rpc_handlers(handlers)
            addr = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
            if self.cfg.tls.enabled():
                port = server.add_secure_port(addr, server_credentials(self.cfg.tls))
            else:
                port = server.add_insecure_port(addr)
            if not port:
                raise OSError(f"cannot bind OTLP/gRPC on {addr}")
            await server.start()
            self._server = server
            return port

        try:
            self.port = self._loop.call(serve(), 30.0)
        except Exception:
            self._stop_loop()
            raise
        log.info("OTLP/gRPC receiver %s listening on %s:%d%s", self.id, self.host, self.port,
                 " (TLS)" if self.cfg.tls.enabled() else "")
        self.d.admitted(self.limit, held_per_byte=2)

    def stop_accepting(self, grace_s: float) -> None:
        """Refuse new RPCs, let in-flight ones finish within ``grace_s``."""
        server, self._server = self._server, None
        if server is not None and self._loop is not None:
            try:
                self._loop.call(server.stop(grace_s), grace_s + 1.0)
            except Exception:
                log.warning("OTLP/gRPC receiver %s: RPCs still running after %.1f s", self.id, grace_s)
        self._stop_loop()

    def _stop_loop(self) -> None:
        stop_runtime(self._workers, self._loop)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.stop_accepting(min(timeout_s, 2.0))

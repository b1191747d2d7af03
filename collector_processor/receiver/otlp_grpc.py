"""OTLP/gRPC receiver: ``TraceService``, ``MetricsService`` and ``LogsService`` ``Export``.

The methods are registered as generic handlers on the same method paths as the generated servicers, but take the
raw request bytes: that lets the receiver bound and count sizes itself and answer a body that does not parse with
INVALID_ARGUMENT (counted) rather than a bare gRPC deserialisation failure. Throttled requests get UNAVAILABLE
with the ``google.rpc.retryinfo-bin`` trailer, which is where the OTel Python exporter reads its retry delay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo

from collector_processor.config.model import MIB
from collector_processor.config.types import split_host_port
from collector_processor.receiver.auth import BearerAuth
from collector_processor.receiver.common import Config, Dispatcher, GrpcProtocol, export_response
from collector_processor.receiver.decode import GRPC_SERVICES, RETRY_INFO_KEY, DecodeFailure, decode
from collector_processor.telemetry import Telemetry

log = logging.getLogger(__name__)


HEALTH_SERVICE = "grpc.health.v1.Health"
# grpc.health.v1.HealthCheckResponse{status: SERVING (1) | NOT_SERVING (2)}, encoded by hand (field 1, varint):
# the standard health protocol without a dependency on grpcio-health-checking.
_SERVING, _NOT_SERVING = b"\x08\x01", b"\x08\x02"


def retry_info_bytes(delay_s: float) -> bytes:
    d = Duration()
    d.FromNanoseconds(int(delay_s * 1e9))
    return RetryInfo(retry_delay=d).SerializeToString()


def server_credentials(tls) -> grpc.ServerCredentials:
    key = Path(tls.key_file).read_bytes()
    cert = Path(tls.cert_file).read_bytes()
    ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


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
        self._retry = retry_info_bytes(cfg.retry_delay)
        self._server: grpc.Server | None = None
        self.host, self.port = split_host_port(proto.endpoint, 4317)

    def _refuse(self, context: grpc.ServicerContext, outcome: str, code: grpc.StatusCode, details: str) -> None:
        self.d.outcome(outcome)
        context.abort(code, details)

    def _method(self, signal: str):
        def export(raw: bytes, context: grpc.ServicerContext) -> bytes:
            if self.auth.enabled:
                md = dict(context.invocation_metadata() or ())
                if not self.auth.check(md.get("authorization")):
                    self.t.unauthenticated.labels(self.d.label).inc()
                    self._refuse(context, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED,
                                 "missing or bad bearer token")
            if len(raw) > self.limit:
                self._refuse(context, "too_large", grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"request of {len(raw)} bytes exceeds {self.limit}")
            if not self.d.has(signal):
                self._refuse(context, "invalid", grpc.StatusCode.UNIMPLEMENTED, f"no {signal} pipeline")
            try:
                msg = decode(signal, raw)
            except DecodeFailure as e:
                self._refuse(context, "invalid", grpc.StatusCode.INVALID_ARGUMENT, str(e)[:300])
            r = self.d.dispatch(signal, msg, len(raw))
            if r.status != "ok":
                context.set_trailing_metadata(((RETRY_INFO_KEY, self._retry),))
                context.set_code(grpc.StatusCode.UNAVAILABLE)
                context.set_details(r.message or "throttled")
                return b""
            return export_response(signal, r).SerializeToString()

        return grpc.unary_unary_rpc_method_handler(export)

    def start(self) -> None:
        grpc_limit = self.limit + 64 * 1024  # room to answer a slightly bigger body with our own counted error
        server = grpc.server(
            ThreadPoolExecutor(max_workers=self.proto.max_workers, thread_name_prefix=f"grpc-{self.id}"),
            options=[("grpc.max_receive_message_length", grpc_limit), ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=self.proto.max_workers * 4,
        )
        handlers = [grpc.method_handlers_generic_handler(svc, {"Export": self._method(sig)})
                    for sig, svc in GRPC_SERVICES.items()]
        handlers.append(grpc.method_handlers_generic_handler(HEALTH_SERVICE, {
            "Check": grpc.unary_unary_rpc_method_handler(
                lambda _req, _ctx: _SERVING if self.healthy() else _NOT_SERVING)}))
        server.add_generic_rpc_handlers(handlers)
        addr = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        if self.cfg.tls.enabled():
            port = server.add_secure_port(addr, server_credentials(self.cfg.tls))
        else:
            port = server.add_insecure_port(addr)
        if not port:
            raise OSError(f"cannot bind OTLP/gRPC on {addr}")
        self.port = port
        server.start()
        self._server = server
        log.info("OTLP/gRPC receiver %s listening on %s:%d%s", self.id, self.host, port,
                 " (TLS)" if self.cfg.tls.enabled() else "")

    def stop_accepting(self, grace_s: float) -> None:
        """Refuse new RPCs, let in-flight ones finish within ``grace_s``."""
        if self._server is not None:
            self._server.stop(grace_s).wait(grace_s + 1.0)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.stop_accepting(min(timeout_s, 2.0))

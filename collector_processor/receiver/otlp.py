"""The ``otlp`` receiver: its gRPC and HTTP servers (each optional) behind one component, feeding the pipelines
that list it, per signal."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from collector_processor.component import Endpoint
from collector_processor.pipeline import Pipeline
from collector_processor.receiver.auth import BearerAuth
from collector_processor.receiver.common import Config, Dispatcher, TenantLedger
from collector_processor.receiver.otlp_grpc import OtlpGrpcReceiver
from collector_processor.receiver.otlp_http import OtlpHttpReceiver
from collector_processor.registry import BuildContext, Factory
from collector_processor.telemetry import Telemetry


class OtlpReceiver:
    def __init__(self, rid: str, cfg: Config, consumers: Mapping[str, list[Pipeline]], telemetry: Telemetry,
                 healthy: Callable[[], bool] = lambda: True) -> None:
        self.id = rid
        auth = BearerAuth(cfg.auth)
        by_signal = {sig: list(pipes) for sig, pipes in consumers.items()}
        ledger = TenantLedger(telemetry)  # both protocols' requests share each tenant's memory share
        self.servers: list[OtlpGrpcReceiver | OtlpHttpReceiver] = []
        if cfg.protocols.grpc is not None:
            d = Dispatcher(f"{rid}/grpc", telemetry, by_signal, cfg.wait_for_processing, cfg.max_items_per_request,
                           ledger)
            self.servers.append(OtlpGrpcReceiver(rid, cfg, cfg.protocols.grpc, d, telemetry, auth, healthy))
        if cfg.protocols.http is not None:
            d = Dispatcher(f"{rid}/http", telemetry, by_signal, cfg.wait_for_processing, cfg.max_items_per_request,
                           ledger)
            self.servers.append(OtlpHttpReceiver(rid, cfg, cfg.protocols.http, d, telemetry, auth, healthy))

    def start(self) -> None:
        started = []
        try:
            for s in self.servers:
                s.start()
                started.append(s)
        except Exception:
            for s in started:
                s.shutdown(1.0)
            raise

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(self.id, s.what, s.host, s.port) for s in self.servers]

    def stop_accepting(self, grace_s: float) -> None:
        for s in self.servers:
            s.stop_accepting(grace_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        for s in self.servers:
            s.shutdown(timeout_s)


def _create(ctx: BuildContext, rid: str, cfg: Config) -> OtlpReceiver:
    return OtlpReceiver(rid, cfg, ctx.consumers_for(rid), ctx.telemetry, ctx.healthy)


FACTORY = Factory("receiver", "otlp", Config, _create)

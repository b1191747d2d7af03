"""Component factories by type, in the OTel Collector's manner: ``kind`` + ``type`` -> config model + constructor.

Exporter type aliases follow upstream renames: ``otlp`` = ``otlp_grpc``, ``otlphttp`` = ``otlp_http``. The straggler
processor's factory is imported lazily (on first use), so the service and config tooling load without it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from collector_processor.processor.straggler.model import Verdict
from collector_processor.telemetry import Telemetry

ALL = frozenset({"traces", "metrics", "logs"})


@dataclass
class BuildContext:
    telemetry: Telemetry
    emit_verdicts_for: Callable[[str], Callable[[list[Verdict]], None]] = lambda _id: lambda _v: None
    healthy: Callable[[], bool] = lambda: True


@dataclass(frozen=True)
class Factory:
    kind: str  # receiver | processor | exporter
    type: str
    signals: frozenset[str]
    module: str  # module holding ``Config`` and ``create_default_config``
    create: Callable[[BuildContext, str, Any], Any]
    verdict_source: bool = False  # a processor whose verdicts can feed ``logs`` pipelines (a connector upstream)
    extra: dict[str, Any] = field(default_factory=dict)

    def config_model(self) -> type[BaseModel]:
        return importlib.import_module(self.module).Config

    def default_config(self) -> BaseModel:
        return importlib.import_module(self.module).create_default_config()


def _otlp_receiver(ctx: BuildContext, cid: str, cfg: Any) -> Any:
    raise RuntimeError("the otlp receiver is built by the service (it needs the pipelines)")


def _memory_limiter(ctx: BuildContext, cid: str, cfg: Any) -> Any:
    from collector_processor.processor.memory_limiter import create_processor

    return create_processor(cfg, ctx.telemetry)


def _straggler(ctx: BuildContext, cid: str, cfg: Any) -> Any:
    mod = importlib.import_module("collector_processor.processor.straggler.factory")
    return mod.create_processor(cfg, ctx.telemetry, ctx.emit_verdicts_for(cid))


def _otlp_grpc(ctx: BuildContext, cid: str, cfg: Any) -> Any:
    from collector_processor.exporter.otlp import OtlpGrpcExporter

    return OtlpGrpcExporter(cid, cfg, ctx.telemetry)


def _otlp_http(ctx: BuildContext, cid: str, cfg: Any) -> Any:
    from collector_processor.exporter.otlp import OtlpHttpExporter

    return OtlpHttpExporter(cid, cfg, ctx.telemetry)


def _prometheus(ctx: BuildContext, cid: str, cfg: Any) -> Any:
    from collector_processor.exporter.prometheus import PrometheusExporter

    return PrometheusExporter(cid, cfg, ctx.telemetry, ctx.healthy)


def _file(ctx: BuildContext, cid: str, cfg: Any) -> Any:
    from collector_processor.exporter.evidence import EvidenceExporter

    return EvidenceExporter(cid, cfg, ctx.telemetry)


def _debug(ctx: BuildContext, cid: str, cfg: Any) -> Any:
    from collector_processor.exporter.debug import DebugExporter

    return DebugExporter(cid, cfg, ctx.telemetry)


_P = "collector_processor."
FACTORIES: dict[tuple[str, str], Factory] = {
    ("receiver", "otlp"): Factory("receiver", "otlp", ALL, _P + "receiver.common", _otlp_receiver),
    ("processor", "memory_limiter"): Factory("processor", "memory_limiter", ALL, _P + "processor.memory_limiter",
                                             _memory_limiter),
    ("processor", "straggler"): Factory("processor", "straggler", frozenset({"traces"}),
                                        _P + "processor.straggler.factory", _straggler, verdict_source=True),
    ("exporter", "otlp_grpc"): Factory("exporter", "otlp_grpc", frozenset({"traces", "logs"}), _P + "exporter.otlp",
                                       _otlp_grpc),
    ("exporter", "otlp_http"): Factory("exporter", "otlp_http", frozenset({"traces", "logs"}), _P + "exporter.otlp",
                                       _otlp_http),
    ("exporter", "prometheus"): Factory("exporter", "prometheus", frozenset({"metrics"}), _P + "exporter.prometheus",
                                        _prometheus),
    ("exporter", "file"): Factory("exporter", "file", frozenset({"logs"}), _P + "exporter.evidence", _file,
                                  extra={"verdicts_only": True}),
    ("exporter", "debug"): Factory("exporter", "debug", ALL, _P + "exporter.debug", _debug),
}
ALIASES: dict[tuple[str, str], str] = {("exporter", "otlp"): "otlp_grpc", ("exporter", "otlphttp"): "otlp_http"}


def component_type(cid: str) -> str:
    return cid.split("/", 1)[0]


def lookup(kind: str, cid: str) -> Factory | None:
    typ = component_type(cid)
    typ = ALIASES.get((kind, typ), typ)
    return FACTORIES.get((kind, typ))


def known_types(kind: str) -> list[str]:
    return sorted([t for k, t in FACTORIES if k == kind] + [t for k, t in ALIASES if k == kind])

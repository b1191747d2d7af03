"""``filter`` processor: keeps the resource spans of the listed services (``include_services``), drops the rest
(a request with nothing left goes no further down its pipeline).

The straggler collector of the compose stack forwards only its own spans this way, the ``straggler.verdict``
spans its processor appends under ``service.name = otel-straggler-collector``, to Jaeger and Tempo: the gateway
already sends them every stage span. What is dropped here is by configuration, not lost, so it is not counted.
"""

from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans
from pydantic import Field

import otel_straggler_schema as s
from collector_processor.config.types import Strict
from collector_processor.registry import BuildContext, Factory


class Config(Strict):
    include_services: list[str] = Field(min_length=1, max_length=64)


def service_name(rs: ResourceSpans) -> str:
    for kv in rs.resource.attributes:
        if kv.key == s.RES_SERVICE_NAME:
            return kv.value.string_value
    return ""


class SpanFilter:
    def __init__(self, cfg: Config) -> None:
        self.services = frozenset(cfg.include_services)

    def process_traces(self, req: ExportTraceServiceRequest) -> ExportTraceServiceRequest | None:
        keep = [rs for rs in req.resource_spans if service_name(rs) in self.services]
        if not keep:
            return None
        if len(keep) == len(req.resource_spans):
            return req
        out = ExportTraceServiceRequest()
        out.resource_spans.extend(keep)
        return out

    def start(self) -> None:
        return

    def shutdown(self, timeout_s: float = 5.0) -> None:
        return


def _create(ctx: BuildContext, cid: str, cfg: Config) -> SpanFilter:
    return SpanFilter(cfg)


FACTORY = Factory("processor", "filter", Config, _create, signals=frozenset({"traces"}))

"""Component contracts of the collector, in the OTel Collector's shape (receiver -> processor -> exporter).

A component type registers a factory (``TYPE``, ``Config`` pydantic model, ``create_default_config``,
``create_*``). Pipelines hand OTLP protobuf requests from one component to the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector_processor.processor.straggler.model import Verdict


class Component(Protocol):
    def start(self) -> None: ...

    def shutdown(self, timeout_s: float = 5.0) -> None: ...


class TracesProcessor(Component, Protocol):
    def process_traces(self, request: ExportTraceServiceRequest) -> ExportTraceServiceRequest | None:
        """Return the (possibly mutated) request to pass on, or None to drop it."""
        ...

    def tick(self, now_s: float) -> None:
        """Called by the service at least every 0.5 s (closes wall-clock and grace-expired windows)."""
        ...


class TracesExporter(Component, Protocol):
    def export_traces(self, request: ExportTraceServiceRequest) -> None: ...


class LogsExporter(Component, Protocol):
    def export_logs(self, request: ExportLogsServiceRequest) -> None: ...


class MetricsExporter(Component, Protocol):
    def export_metrics(self, request: ExportMetricsServiceRequest) -> None: ...


class VerdictExporter(Component, Protocol):
    """Exporters that want verdicts as objects rather than log records (JSONL evidence, console)."""

    def export_verdicts(self, verdicts: list[Verdict]) -> None: ...


VerdictConsumer = Callable[[list[Verdict]], None]

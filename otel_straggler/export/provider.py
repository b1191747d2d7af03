"""TracerProvider / MeterProvider from the standard OTEL_* environment, with counting wrappers.

The SDK exporters read their own env (``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT/HEADERS/TIMEOUT/
COMPRESSION/INSECURE``); the batch processor reads ``OTEL_BSP_*``. The protocol comes from
``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]PROTOCOL`` (``grpc`` default, ``http/protobuf``);
``OTEL_TRACES_EXPORTER``/``OTEL_METRICS_EXPORTER`` = ``none`` disables a signal.

What the SDK drops silently is counted here: a span ended while the batch queue is at ``max_queue_size``
(the deque evicts the oldest) counts ``dropped_queue_full``; spans of a failed or raising export count
``dropped_export_failed``; exported spans count ``spans_exported``. Both wrappers go inert in a forked
child (pid check) so a fork of the process never exports duplicates or touches the parent's channel.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator

from otel_straggler import schema
from otel_straggler.identity import DEFAULT_SERVICE_NAME

log = logging.getLogger(__name__)


class Counters:
    """Thread-safe cumulative counters (dict snapshot for self-metrics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._values[key] = self._values.get(key, 0) + n

    def get(self, key: str) -> int:
        return self._values.get(key, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


def _protocol(signal: str) -> str:
    value = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    return value.strip().lower()


def build_resource(attributes: Mapping[str, Any]) -> Resource:
    """Identity attributes + OTEL_RESOURCE_ATTRIBUTES (identity wins) + service.name, and the step-summary
    flag: this export side always puts the step summary on its rank-step spans."""
    attrs = dict(attributes)
    attrs[schema.RES_STEP_SUMMARY] = True
    env_service = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    if env_service:
        attrs[schema.RES_SERVICE_NAME] = env_service
    elif not attrs.get(schema.RES_SERVICE_NAME) or str(attrs[schema.RES_SERVICE_NAME]).startswith("unknown_service"):
        attrs[schema.RES_SERVICE_NAME] = DEFAULT_SERVICE_NAME
    resource = Resource.create(attrs)
    if str(resource.attributes.get(schema.RES_SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({schema.RES_SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


def make_span_exporter() -> SpanExporter | None:
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if kind == "none":
        return None
    if _protocol("TRACES").startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

        return HttpSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

    return GrpcSpanExporter()


def make_metric_exporter() -> MetricExporter | None:
    kind = os.environ.get("OTEL_METRICS_EXPORTER", "otlp").strip().lower()
    if kind == "none":
        return None
    if _protocol("METRICS").startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter

        return HttpMetricExporter()
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter

    return GrpcMetricExporter()


class CountingSpanExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, counters: Counters) -> None:
        self._inner = inner
        self._counters = counters
        self._pid = os.getpid()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if os.getpid() != self._pid:  # forked child: inert
            return SpanExportResult.SUCCESS
        try:
            result = self._inner.export(spans)
        except Exception:
            self._counters.add("faults_export")
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self._counters.add("spans_exported", len(spans))
        else:
            self._counters.add("dropped_export_failed", len(spans))
        return result

    def shutdown(self) -> None:
        if os.getpid() == self._pid:
            self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class CountingMetricExporter(MetricExporter):
    def __init__(self, inner: MetricExporter, counters: Counters) -> None:
        super().__init__(
            preferred_temporality=getattr(inner, "_preferred_temporality", None),
            preferred_aggregation=getattr(inner, "_preferred_aggregation", None),
        )
        self._inner = inner
        self._counters = counters
        self._pid = os.getpid()

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        if os.getpid() != self._pid:
            return MetricExportResult.SUCCESS
        try:
            return self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:
            self._counters.add("faults_metric_export")
            return MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        if os.getpid() == self._pid:
            self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


class _EvictionCountingDeque(collections.deque):
    """The SDK's span queue, counting what its ``maxlen`` evicts. ``appendleft`` (the emitting thread) and
    ``pop`` (the SDK's worker) share a lock, so a full queue and its eviction are seen together: a check
    before the SDK's own ``appendleft`` would race with the worker's pops and over-count."""

    def __init__(self, maxlen: int, on_evict: Callable[[], None]) -> None:
        super().__init__((), maxlen)
        self._lock = threading.Lock()
        self._on_evict = on_evict

    def appendleft(self, item: object) -> None:
        with self._lock:
            if self.maxlen is not None and len(self) >= self.maxlen:
                self._on_evict()
            super().appendleft(item)

    def pop(self) -> object:
        with self._lock:
            return super().pop()


class CountingBatchSpanProcessor(SpanProcessor):
    """A BatchSpanProcessor that counts the spans its full queue evicts and those ended after shutdown."""

    def __init__(self, exporter: SpanExporter, counters: Counters) -> None:
        self._bsp = BatchSpanProcessor(exporter)
        self._counters = counters
        bp = getattr(self._bsp, "_batch_processor", None)
        self.max_queue_size = int(getattr(bp, "_max_queue_size", 0) or 0)
        self._queue: collections.deque | None = None
        if bp is not None and self.max_queue_size:
            # the SDK drops the oldest span silently when its deque is full; count each eviction
            self._queue = bp._queue = _EvictionCountingDeque(
                self.max_queue_size, lambda: counters.add("dropped_queue_full"))
        self._closed = False

    def queue_len(self) -> int:
        return len(self._queue) if self._queue is not None else 0

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if self._closed:
            self._counters.add("dropped_shutdown")
            return
        self._bsp.on_end(span)

    def shutdown(self) -> None:
        self._closed = True
        self._bsp.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._bsp.force_flush(timeout_millis)


def run_bounded(fn: Callable[[], Any], timeout_s: float, name: str) -> bool:
    """Run ``fn`` on a daemon helper thread and wait at most ``timeout_s`` (SDK flushes ignore timeouts)."""
    done = threading.Event()
    result: list[Any] = [False]

    def _target() -> None:
        try:
            result[0] = fn()
        except Exception:
            log.debug("%s raised", name, exc_info=True)
            result[0] = False
        finally:
            done.set()

    threading.Thread(target=_target, name=f"otel-straggler-{name}", daemon=True).start()
    if not done.wait(max(0.0, timeout_s)):
        return False
    return result[0] is not False


class Providers:
    """The tracer + meter providers of one export pipeline."""

    def __init__(
        self,
        resource_attributes: Mapping[str, Any],
        id_generator: IdGenerator,
        counters: Counters,
        *,
        span_exporter: SpanExporter | None = None,
        metric_exporter: MetricExporter | None = None,
        metrics: bool = True,
        scope_version: str = "0",
    ) -> None:
        self.counters = counters
        self.resource = build_resource(resource_attributes)
        self.tracer_provider = TracerProvider(resource=self.resource, id_generator=id_generator, shutdown_on_exit=False)
        exporter = span_exporter if span_exporter is not None else make_span_exporter()
        self.processor: CountingBatchSpanProcessor | None = None
        if exporter is not None:
            self.processor = CountingBatchSpanProcessor(CountingSpanExporter(exporter, counters), counters)
            self.tracer_provider.add_span_processor(self.processor)
        self.tracer = self.tracer_provider.get_tracer(schema.SCOPE_NAME, scope_version)
        self.step_tracer = self.tracer_provider.get_tracer(schema.SCOPE_STEP_NAME, scope_version)
        self.meter_provider: MeterProvider | None = None
        if metrics:
            mexp = metric_exporter if metric_exporter is not None else make_metric_exporter()
            if mexp is not None:
                reader = PeriodicExportingMetricReader(CountingMetricExporter(mexp, counters))
                self.meter_provider = MeterProvider(
                    resource=self.resource, metric_readers=[reader], shutdown_on_exit=False
                )

    def queue_len(self) -> int:
        return self.processor.queue_len() if self.processor is not None else 0

    def flush(self, timeout_s: float) -> bool:
        if self.processor is None:
            return True
        proc = self.processor
        lost_before = self._lost()
        ok = run_bounded(lambda: proc.force_flush(int(timeout_s * 1000)), timeout_s, "flush")
        return ok and proc.queue_len() == 0 and self._lost() == lost_before

    def _lost(self) -> int:
        c = self.counters
        return c.get("dropped_export_failed") + c.get("dropped_queue_full") + c.get("dropped_shutdown")

    def shutdown(self, timeout_s: float) -> bool:
        """Flush spans, then push the last self-metrics; each step bounded by what is left of timeout_s."""
        import time

        deadline = time.monotonic() + max(0.0, timeout_s)
        ok = True
        if self.processor is not None:
            proc = self.processor
            ok = run_bounded(proc.shutdown, max(0.0, deadline - time.monotonic()) * 0.8, "span-shutdown")
            left = proc.queue_len()
            if left:
                self.counters.add("dropped_shutdown", left)
                ok = False
        if self.meter_provider is not None:
            mp = self.meter_provider
            remaining = max(0.0, deadline - time.monotonic())
            ok = run_bounded(lambda: mp.shutdown(timeout_millis=remaining * 1000), remaining, "metric-shutdown") and ok
        return ok

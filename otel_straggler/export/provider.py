"""TracerProvider / MeterProvider built from the validated ``OtelSettings``, with counting wrappers.

The exporters, the batch span processor and the metric reader get every value explicitly from
``otel_env.OtelSettings`` (the standard ``OTEL_*`` variables, validated in the training process), so
nothing the SDK would parse again can fail here. Headers, ``INSECURE`` and the TLS files the SDK reads
itself, with their per-signal variants.

What the SDK would drop silently is counted, through public API only: ``CountingBatchSpanProcessor``
feeds the SDK's ``BatchSpanProcessor`` from a bounded hold of its own, one batch at a time, so the SDK's
queue never overflows (where it would evict the oldest span unseen); when the hold is full its oldest span
is dropped and counted ``dropped_queue_full``. Spans of a failed or raising
export count ``dropped_export_failed``; exported spans count ``spans_exported``. The exporter wrappers go
inert in a forked child (pid check) so a fork never exports duplicates or touches the parent's channel.
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
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

import otel_straggler_schema as schema
from otel_straggler.export.otel_env import GRPC, NONE, OtelSettings, SignalSettings
from otel_straggler.identity import DEFAULT_SERVICE_NAME, service_name_from_env

log = logging.getLogger(__name__)
SDK_DEFAULT_SCHEDULE_DELAY_MS = 5000
# Each SDK BatchSpanProcessor registers an at-fork hook that is never removed and starts a worker: bound the swaps.
MAX_DELAY_SWAPS = 8


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


def build_resource(attributes: Mapping[str, Any]) -> Resource:
    """Identity attributes + ``OTEL_RESOURCE_ATTRIBUTES`` (identity wins) + the step-summary flag (this export
    side always puts the step summary on its rank-step spans). ``service.name``: ``OTEL_SERVICE_NAME``, else
    the one in ``OTEL_RESOURCE_ATTRIBUTES``, else the identity's (``megatron-training`` by default)."""
    attrs = dict(attributes)
    attrs[schema.RES_STEP_SUMMARY] = True
    attrs[schema.RES_SERVICE_NAME] = (service_name_from_env(os.environ) or attrs.get(schema.RES_SERVICE_NAME)
                                      or DEFAULT_SERVICE_NAME)
    return Resource.create(attrs)


def make_span_exporter(s: SignalSettings) -> SpanExporter | None:
    if s.exporter == NONE:
        return None
    if s.protocol == GRPC:
        from grpc import Compression as GrpcCompression
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

        return GrpcSpanExporter(endpoint=s.endpoint, timeout=s.timeout_s,
                                compression=_compression(GrpcCompression, s.compression))
    from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter

    return HttpSpanExporter(endpoint=s.endpoint, timeout=s.timeout_s,
                            compression=_compression(HttpCompression, s.compression))


def make_metric_exporter(s: SignalSettings) -> MetricExporter | None:
    if s.exporter == NONE:
        return None
    if s.protocol == GRPC:
        from grpc import Compression as GrpcCompression
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter

        return GrpcMetricExporter(endpoint=s.endpoint, timeout=s.timeout_s,
                                  compression=_compression(GrpcCompression, s.compression))
    from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter

    return HttpMetricExporter(endpoint=s.endpoint, timeout=s.timeout_s,
                              compression=_compression(HttpCompression, s.compression))


def _compression(enum: Any, name: str) -> Any:
    """The exporter package's ``Compression`` member for ``none``/``gzip``/``deflate``."""
    return {"none": enum.NoCompression, "gzip": enum.Gzip, "deflate": enum.Deflate}[name]


class CountingSpanExporter(SpanExporter):
    """Counts what each export does with its spans; ``on_export(n)`` is told when a batch of n leaves the
    batch processor's queue (the processor's admission count)."""

    def __init__(self, inner: SpanExporter, counters: Counters) -> None:
        self._inner = inner
        self._counters = counters
        self._pid = os.getpid()
        self.on_export: Callable[[int], None] = lambda n: None
        self._failing = False  # one warning per run of failed exports, not one per batch

    def _say_failing(self, n: int) -> None:
        endpoint = getattr(self._inner, "_endpoint", "") or "the OTLP endpoint"
        log.warning("otel-straggler: cannot export spans to %s (%d dropped); the straggler collector sees nothing "
                    "of this rank. Run `otel-straggler doctor` on this node with the ranks' environment to check the "
                    "endpoint", endpoint, n)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.on_export(len(spans))
        if os.getpid() != self._pid:  # forked child: inert
            return SpanExportResult.SUCCESS
        try:
            result = self._inner.export(spans)
        except Exception:
            self._counters.add("faults_export")
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self._counters.add("spans_exported", len(spans))
            if self._failing:
                self._failing = False
                log.warning("otel-straggler: span export works again")
        else:
            self._counters.add("dropped_export_failed", len(spans))
            if not self._failing:
                self._failing = True
                self._say_failing(len(spans))
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


class _Lease(SpanExporter):
    """One batch processor's use of the shared exporter: its shutdown leaves the exporter open (a processor
    retired for a new schedule delay must not close the channel the next one uses)."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self._exporter.export(spans)

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class CountingBatchSpanProcessor(SpanProcessor):
    """The SDK's ``BatchSpanProcessor`` fed through a bounded hold of our own, so every drop is counted.

    At most one batch (``max_export_batch_size``, B) of spans whose export has not begun is in the SDK's
    queue at a time: ``CountingSpanExporter`` reports each batch as it leaves that queue (the SDK's worker
    pops a batch, then calls the exporter), and that many held spans move in. The SDK's queue therefore
    never fills (where it would evict unseen), and it exports as soon as it holds a full batch, as it
    always does. The rest waits here, oldest first, up to ``max_queue_size`` - B; beyond, the OLDEST held
    span is dropped and counted ``dropped_queue_full``, so after an outage the newest spans go out first.
    Flush and shutdown move everything held into the SDK's queue (it fits: at most ``max_queue_size``)
    and let it export. A span ended after shutdown counts ``dropped_shutdown``. Public SDK API only.

    ``set_schedule_delay`` replaces the SDK processor by one with the new delay (its schedule delay is fixed
    at construction); the old one exports what it holds and stops on a helper thread. One at a time, and at
    most ``MAX_DELAY_SWAPS`` over the processor's life (one processor per export process): a swap beyond is
    refused, counted ``delay_swaps_refused`` and warned about once, and the delay stays as it is.
    """

    def __init__(self, exporter: CountingSpanExporter, counters: Counters, settings: OtelSettings,
                 schedule_delay_ms: int | None = None) -> None:
        """``schedule_delay_ms``: the delay to start with when ``settings`` leaves it open (fitted later)."""
        self.max_queue_size = settings.bsp_max_queue_size
        self._settings = settings
        self._batch = settings.bsp_max_export_batch_size
        self._hold_cap = self.max_queue_size - self._batch
        self._held: collections.deque[ReadableSpan] = collections.deque()
        self._unstarted = 0  # spans in an SDK queue (or about to be) whose export has not begun
        # the span-ending thread vs. the SDK's workers (and a flushing caller); also orders hand-overs with
        # a processor swap, so no span goes to a retired processor
        self._lock = threading.Lock()
        self._counters = counters
        self._closed = False
        self._exporter = exporter
        exporter.on_export = self._on_export
        self.fixed_delay = settings.bsp_schedule_delay_ms is not None
        self.schedule_delay_ms = (settings.bsp_schedule_delay_ms or schedule_delay_ms
                                  or SDK_DEFAULT_SCHEDULE_DELAY_MS)
        self._bsp = self._new_bsp(self.schedule_delay_ms)
        self._retiring: threading.Thread | None = None
        self.swaps = 0
        self._cap_warned = False

    def _new_bsp(self, delay_ms: int) -> BatchSpanProcessor:
        return BatchSpanProcessor(
            _Lease(self._exporter),
            max_queue_size=self.max_queue_size,
            schedule_delay_millis=delay_ms,
            max_export_batch_size=self._batch,
            export_timeout_millis=self._settings.bsp_export_timeout_ms,
        )

    def queue_len(self) -> int:
        """Spans waiting for their export to begin (held here or in an SDK queue)."""
        return len(self._held) + self._unstarted

    def _hand_over_locked(self, limit: int) -> None:
        """Held spans (oldest first) into the current SDK queue while fewer than ``limit`` wait there."""
        while self._held and self._unstarted < limit:
            self._bsp.on_end(self._held.popleft())  # a deque append and an event: never blocks
            self._unstarted += 1

    def _on_export(self, n: int) -> None:
        """A batch of ``n`` left an SDK queue for the exporter: as many held spans take its place."""
        with self._lock:
            self._unstarted = max(0, self._unstarted - n)
            self._hand_over_locked(self._batch)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if self._closed:
            self._counters.add("dropped_shutdown")
            return
        if not (span.context and span.context.trace_flags.sampled):
            return  # the batch processor would skip it too
        with self._lock:
            if len(self._held) >= self._hold_cap:
                self._counters.add("dropped_queue_full")
                if not self._held:
                    return  # no room to hold anything (queue size == batch size): the new span goes
                self._held.popleft()
            self._held.append(span)
            self._hand_over_locked(self._batch)

    def set_schedule_delay(self, delay_ms: int) -> bool:
        """Export with ``delay_ms`` from now on (not when OTEL_BSP_SCHEDULE_DELAY was set); False when nothing
        changed (same delay, closed, the previous processor is still being retired, or ``MAX_DELAY_SWAPS`` made:
        then counted ``delay_swaps_refused``)."""
        if self.fixed_delay or self._closed or delay_ms == self.schedule_delay_ms:
            return False
        if self._retiring is not None and self._retiring.is_alive():
            return False
        if self.swaps >= MAX_DELAY_SWAPS:
            self._counters.add("delay_swaps_refused")
            if not self._cap_warned:
                self._cap_warned = True
                log.warning("otel-straggler: batch schedule delay kept at %d ms: %d processor swaps made, the most "
                            "allowed", self.schedule_delay_ms, MAX_DELAY_SWAPS)
            return False
        new = self._new_bsp(delay_ms)
        with self._lock:
            old, self._bsp = self._bsp, new
            self.schedule_delay_ms = delay_ms
        self._retiring = threading.Thread(target=old.shutdown, name="otel-straggler-bsp-retire", daemon=True)
        self._retiring.start()
        self.swaps += 1
        return True

    def _wait_retired(self, timeout_s: float) -> bool:
        t = self._retiring
        if t is not None:
            t.join(max(0.0, timeout_s))
            return not t.is_alive()
        return True

    def shutdown(self) -> None:
        self._closed = True
        with self._lock:
            self._hand_over_locked(self.max_queue_size)
            bsp = self._bsp
        bsp.shutdown()
        self._wait_retired(30.0)
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            self._hand_over_locked(self.max_queue_size)
            bsp = self._bsp
        ok = bsp.force_flush(timeout_millis)
        return self._wait_retired(timeout_millis / 1000.0) and ok


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
        settings: OtelSettings,
        span_exporter: SpanExporter | None = None,
        metric_exporter: MetricExporter | None = None,
        metrics: bool = True,
        scope_version: str = "0",
        schedule_delay_ms: int | None = None,
    ) -> None:
        """``span_exporter``/``metric_exporter``: instead of the OTLP ones of ``settings`` (tests);
        ``schedule_delay_ms``: the batch delay to start with when ``OTEL_BSP_SCHEDULE_DELAY`` is not set."""
        self.counters = counters
        self.resource = build_resource(resource_attributes)
        # ALWAYS_ON, never the application's OTEL_TRACES_SAMPLER: a thinning sampler starves the detector (otel_env)
        self.tracer_provider = TracerProvider(resource=self.resource, id_generator=id_generator, sampler=ALWAYS_ON,
                                              shutdown_on_exit=False)
        exporter = span_exporter if span_exporter is not None else make_span_exporter(settings.traces)
        self.processor: CountingBatchSpanProcessor | None = None
        if exporter is not None:
            self.processor = CountingBatchSpanProcessor(CountingSpanExporter(exporter, counters), counters, settings,
                                                        schedule_delay_ms)
            self.tracer_provider.add_span_processor(self.processor)
        self.tracer = self.tracer_provider.get_tracer(schema.SCOPE_NAME, scope_version)
        self.step_tracer = self.tracer_provider.get_tracer(schema.SCOPE_STEP_NAME, scope_version)
        self.meter_provider: MeterProvider | None = None
        if metrics:
            mexp = metric_exporter if metric_exporter is not None else make_metric_exporter(settings.metrics)
            if mexp is not None:
                reader = PeriodicExportingMetricReader(
                    CountingMetricExporter(mexp, counters),
                    export_interval_millis=settings.metric_export_interval_ms,
                    export_timeout_millis=settings.metric_export_timeout_ms,
                )
                self.meter_provider = MeterProvider(
                    resource=self.resource, metric_readers=[reader], shutdown_on_exit=False
                )

    def queue_len(self) -> int:
        return self.processor.queue_len() if self.processor is not None else 0

    def set_schedule_delay(self, delay_ms: int) -> bool:
        return self.processor.set_schedule_delay(delay_ms) if self.processor is not None else False

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

"""Aggregation + span building + providers + self-metrics for one rank: the body of both sinks.

Not thread-safe by itself: the thread sink calls it from the readout thread only, the sidecar from its
main loop only (flush/shutdown are called on that same thread).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import otel_straggler_schema as schema
from otel_straggler.config import DEFAULTS, EmitterConfig
from otel_straggler.export.aggregate import KIND_RANK_STEP, SpanRecord, StepAggregator
from otel_straggler.export.batch_delay import DelayFit
from otel_straggler.export.ids import PresetIdGenerator
from otel_straggler.export.otel_env import OtelSettings
from otel_straggler.export.provider import Counters, Providers
from otel_straggler.export.selfmetrics import SelfMetrics, normalize
from otel_straggler.export.span_builder import SpanBuilder
from otel_straggler.interval import Interval

try:
    from importlib.metadata import version as _dist_version

    SCOPE_VERSION = _dist_version("otel-straggler")
except Exception:  # pragma: no cover - not installed
    SCOPE_VERSION = "0"


class ExportPipeline:
    def __init__(
        self,
        resource_attributes: Mapping[str, Any],
        *,
        rank: int,
        job_id: str,
        config: EmitterConfig = DEFAULTS,
        otel: OtelSettings | None = None,
        counters: Counters | None = None,
        span_exporter: Any = None,
        metric_exporter: Any = None,
        metrics: bool = True,
    ) -> None:
        self.counters = counters if counters is not None else Counters()
        self._agg_counts: dict[str, int] = {}
        self.config = config
        self.nvml: Any = None
        if config.nvml_interval_s > 0:  # cause hints: imported and started only when asked for (nvml.py)
            from otel_straggler.nvml import NvmlSampler, device_of

            sampler = NvmlSampler(config.nvml_interval_s, device_of(resource_attributes))
            self.nvml = sampler if sampler.start() else None
        self.aggregator = StepAggregator(rank=rank, config=config, counters=self._agg_counts,
                                         hints=self.nvml.latest if self.nvml is not None else None)
        self.ids = PresetIdGenerator()
        self.otel = otel if otel is not None else OtelSettings.from_env()
        # the batch delay follows the step time unless OTEL_BSP_SCHEDULE_DELAY says otherwise (batch_delay.py)
        self.delay_fit = DelayFit(config.readout_interval_ms / 1000.0) if self.otel.bsp_schedule_delay_ms is None \
            else None
        self.providers = Providers(
            resource_attributes,
            self.ids,
            self.counters,
            settings=self.otel,
            span_exporter=span_exporter,
            metric_exporter=metric_exporter,
            metrics=metrics,
            scope_version=SCOPE_VERSION,
            schedule_delay_ms=self.delay_fit.delay_ms if self.delay_fit is not None else None,
        )
        self.builder = SpanBuilder(self.providers.tracer, self.ids, job_id=job_id, rank=rank,
                                   step_tracer=self.providers.step_tracer,
                                   run_id=str(resource_attributes.get(schema.RES_RUN_ID, "")))
        self._stats: dict[str, int | float] = {}
        self._out: list[SpanRecord] = []
        self.self_metrics: SelfMetrics | None = None
        if self.providers.meter_provider is not None:
            meter = self.providers.meter_provider.get_meter(schema.SCOPE_NAME, SCOPE_VERSION)
            self.self_metrics = SelfMetrics(meter, self.snapshot)

    def snapshot(self) -> dict[str, int | float]:
        """Training-side stats plus the export side's own counters."""
        snap: dict[str, int | float] = dict(self._stats)
        for key, value in self.export_counters().items():
            snap[key] = snap.get(key, 0) + value
        return snap

    def export_counters(self) -> dict[str, int]:
        """The export side's own counters (no training-side stats)."""
        snap = self.counters.snapshot()
        for key, value in self._agg_counts.items():
            snap[key] = snap.get(key, 0) + value
        return snap

    def set_stats(self, stats: Mapping[str, int | float]) -> None:
        self._stats = normalize(dict(stats))

    def _emit(self) -> None:
        if self._out:
            if self.delay_fit is not None:
                self._fit_delay()
            try:
                self.builder.build(self._out)
            except Exception:
                self.counters.add("faults_span_build")
            finally:
                self._out.clear()

    def _fit_delay(self) -> None:
        fit = self.delay_fit
        assert fit is not None
        for rec in self._out:
            if rec.kind == KIND_RANK_STEP:
                new = fit.observe(rec.step, rec.end_ns)
                if new is not None and self.providers.set_schedule_delay(new):
                    fit.applied(new)

    def add(self, intervals: Sequence[Interval], now_ns: int | None = None) -> None:
        self.counters.add("intervals_received", len(intervals))
        self.aggregator.add(intervals, time.monotonic_ns() if now_ns is None else now_ns, self._out)
        self._emit()

    def tick(self, now_ns: int | None = None) -> None:
        self.aggregator.tick(time.monotonic_ns() if now_ns is None else now_ns, self._out)
        self._emit()

    def close_steps(self) -> None:
        self.aggregator.close_all(self._out)
        self._emit()

    def flush(self, timeout_s: float) -> bool:
        self.close_steps()
        return self.providers.flush(timeout_s)

    def shutdown(self, timeout_s: float) -> bool:
        self.close_steps()
        self.counters.add("ended")  # the last metrics (exported by the meter provider's shutdown) say so
        if self.nvml is not None:
            self.nvml.stop()
        return self.providers.shutdown(timeout_s)

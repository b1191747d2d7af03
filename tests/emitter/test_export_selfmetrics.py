"""Self-metrics: the training side's cumulative stats and the export side's counters, as OTel instruments."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import otel_straggler_schema as schema
from otel_straggler.export.selfmetrics import SelfMetrics, normalize


def collect(snapshot: dict, units: dict[str, str] | None = None) -> dict[tuple[str, tuple], float]:
    """One collection of the self-metrics over ``snapshot``: (instrument, attributes) -> value; ``units`` gets
    each instrument's unit."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    SelfMetrics(provider.get_meter("t"), lambda: snapshot)
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if units is not None:
                    units[m.name] = m.unit
                for dp in m.data.data_points:
                    out[(m.name, tuple(sorted(dp.attributes.items())))] = dp.value
    provider.shutdown()
    return out


def test_training_stats_and_export_counters_map_to_schema_instruments() -> None:
    training = {  # the shape EmitterCounters.snapshot() publishes
        "intervals": 120,
        "dropped_ring_full": 3,
        "degraded_no_cuda": 100,
        "degraded_unbalanced": 2,
        "barriers_skipped": 4,
        "unbalanced": 5,
        "faults": 6,
        "faults_training": 1,
        "faults_readout": 2,
        "faults_config_error": 0,
        "faults_sink": 3,
        "pool_high_water": 9,
        "readout_lag_ms": 12,
        "quarantined": 0,
        "names_truncated": 5,
    }
    snap = normalize(training)
    for key, value in {
        "dropped_pipe_full": 7,
        "dropped_queue_full": 8,
        "spans_exported": 50,
        "steps_evicted": 2,
        "sidecar_restarts": 1,
        "faults_export": 1,
    }.items():
        snap[key] = value
    m = collect(snap)
    assert m[(schema.SM_INTERVALS, ())] == 120
    assert m[(schema.SM_SPANS_EXPORTED, ())] == 50
    r = schema.SM_REASON_ATTR
    assert m[(schema.SM_DROPPED, ((r, "ring_full"),))] == 3
    assert m[(schema.SM_DROPPED, ((r, "pipe_full"),))] == 7
    assert m[(schema.SM_DROPPED, ((r, "queue_full"),))] == 8
    assert m[(schema.SM_DEGRADED, ((r, "no_cuda"),))] == 100
    assert m[(schema.SM_DEGRADED, ((r, "unbalanced"),))] == 2  # not overwritten by the call counter
    faults = {k[1][0][1]: v for k, v in m.items() if k[0] == schema.SM_FAULTS and v}
    assert faults == {"training": 1, "readout": 2, "sink": 3, "export": 1}
    assert sum(faults.values()) == training["faults"] + 1  # no double count of the total
    assert m[(schema.SM_BARRIERS_SKIPPED, ())] == 4
    assert m[(schema.SM_POOL_HIGH_WATER, ())] == 9
    assert m[(schema.SM_READOUT_LAG, ())] == 0.012  # seconds
    assert m[(schema.SM_STEPS_EVICTED, ())] == 2 and m[(schema.SM_SIDECAR_RESTARTS, ())] == 1
    assert m[(schema.SM_NAMES_TRUNCATED, ())] == 5


def test_faults_total_alone_is_training_faults() -> None:
    m = collect(normalize({"faults": 4, "intervals": 1}))
    assert m[(schema.SM_FAULTS, (("where", "training"),))] == 4


def test_every_counter_and_every_reason_exists_at_zero_from_the_start() -> None:
    """Before anything happened (nothing published yet) every counter series is there at 0, so the first
    eviction, restart or drop is a step a rate() sees; units are base units."""
    units: dict[str, str] = {}
    m = collect({}, units)
    scalars = (schema.SM_INTERVALS, schema.SM_SPANS_EXPORTED, schema.SM_BARRIERS_SKIPPED, schema.SM_STEPS_EVICTED,
               schema.SM_SIDECAR_RESTARTS, schema.SM_POOL_HIGH_WATER, schema.SM_READOUT_LAG,
               schema.SM_NAMES_TRUNCATED, schema.SM_ENDED)
    for name in scalars:
        assert m[(name, ())] == 0, name
    r = schema.SM_REASON_ATTR
    for reason in schema.SM_DROPPED_REASONS:
        assert m[(schema.SM_DROPPED, ((r, reason),))] == 0
    for reason in schema.DEGRADED_REASONS:
        assert m[(schema.SM_DEGRADED, ((r, reason),))] == 0
    for where in schema.SM_FAULT_WHERES:
        assert m[(schema.SM_FAULTS, (("where", where),))] == 0
    assert len(m) == len(scalars) + len(schema.SM_DROPPED_REASONS) + len(schema.DEGRADED_REASONS) + len(
        schema.SM_FAULT_WHERES)
    assert units[schema.SM_READOUT_LAG] == "s"
    assert {u for name, u in units.items() if name != schema.SM_READOUT_LAG} == {"1"}
    m = collect({"dropped_brand_new": 2})  # a reason outside the list still shows
    assert m[(schema.SM_DROPPED, ((r, "brand_new"),))] == 2


def test_the_last_metrics_of_a_shut_down_export_say_the_rank_ended() -> None:
    """A normal end (the pipeline's shutdown, as ``otel_straggler.shutdown``, atexit and SIGTERM run it) exports
    ``ended`` 1 in the last metrics the meter provider pushes; before it, 0."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_straggler.export.pipeline import ExportPipeline

    class Recording(MetricExporter):
        def __init__(self) -> None:
            super().__init__()
            self.batches: list = []

        def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):  # type: ignore[no-untyped-def]
            self.batches.append(metrics_data)
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
            return None

    metrics = Recording()
    pipe = ExportPipeline({schema.RES_RANK: 0}, rank=0, job_id="j", span_exporter=InMemorySpanExporter(),
                          metric_exporter=metrics)

    def ended() -> list[float]:
        return [dp.value for batch in metrics.batches for sm in batch.resource_metrics
                for s in sm.scope_metrics for m in s.metrics if m.name == schema.SM_ENDED for dp in m.data.data_points]

    assert pipe.providers.meter_provider is not None
    pipe.providers.meter_provider.force_flush()
    assert ended() == [0]
    assert pipe.shutdown(10.0)
    assert ended()[-1] == 1

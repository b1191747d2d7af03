"""Replays, late samples, malformed spans and every cap: counted, never re-judged, never unbounded."""

from __future__ import annotations

from straggler_build import request, span, step_request
from straggler_sim import Clock, Sim, make_processor, run

from collector_processor.processor.straggler.config import Config, MetricsConfig
from otel_straggler import schema as s


def _counter(telemetry, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    v = telemetry.registry.get_sample_value(name, labels)
    return v or 0.0


def test_replayed_spans_are_duplicates_and_change_nothing() -> None:
    proc, _, tel = make_processor()
    sim = Sim(seed=3)
    reqs = [sim.request([st]) for st in range(0, 30)]
    for r in reqs:
        proc.process_traces(r)
        assert proc.last_rejected == 0
    before = proc.stats()
    replay = reqs[-1]
    stage_spans = sum(1 for rs in replay.resource_spans for ss in rs.scope_spans for sp in ss.spans
                      if any(a.key == s.ATTR_STAGE for a in sp.attributes))
    out = proc.process_traces(replay)
    assert out is replay  # still forwarded
    assert proc.last_rejected == stage_spans
    after = proc.stats()
    assert after["rejected_duplicate"] == stage_spans
    assert after["spans_accepted"] == before["spans_accepted"]
    assert _counter(tel, s.M_SPANS_REJECTED, reason="duplicate") == stage_spans


def test_late_samples_for_closed_windows_are_fenced() -> None:
    proc, emitted, tel = make_processor()
    for st in range(0, 20):
        proc.process_traces(step_request(st, {r: (60.0, 10.0) for r in range(4)}))
    closed = proc.stats()["windows_closed"]
    assert closed == 3
    proc.process_traces(step_request(3, {0: (600.0, 10.0), 1: (600.0, 10.0)}))  # window 0: closed
    assert proc.last_rejected == 2
    st = proc.stats()
    assert st["rejected_late"] == 2 and st["windows_closed"] == closed
    assert _counter(tel, s.M_SPANS_REJECTED, reason="late") == 2
    assert [v for v in emitted if v.verdict == s.VERDICT_STRAGGLER] == []


def test_malformed_stage_spans_are_rejected_and_other_spans_pass() -> None:
    proc, _, tel = make_processor()
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
    no_rank = ResourceSpans(resource=Resource(), scope_spans=[ScopeSpans(spans=[span("forward-compute", 1, 5.0, 5.0)])])
    no_duration = request({0: [span("forward-compute", 1, None, None)]})
    plain = Span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="other")
    req = ExportTraceServiceRequest(resource_spans=[no_rank, *no_duration.resource_spans,
                                                    ResourceSpans(scope_spans=[ScopeSpans(spans=[plain])])])
    out = proc.process_traces(req)
    assert out is not None and len(out.resource_spans) == 3
    assert proc.last_rejected == 2
    assert _counter(tel, s.M_SPANS_REJECTED, reason="malformed") == 2
    assert proc.stats()["spans_accepted"] == 0


def test_cohort_cap_evicts_least_recent_and_counts() -> None:
    proc, _, tel = make_processor(Config(max_cohorts=2))
    for i, key in enumerate(["a", "b", "c"]):
        proc.process_traces(step_request(i, {0: (60.0, 10.0)}, cohort=key))
    st = proc.stats()
    assert st["cohorts"] == 2 and st["evicted_cohorts"] == 1 and st["evicted_windows"] == 1
    assert _counter(tel, s.M_EVICTIONS, structure="cohorts") == 1


def test_rank_and_stage_caps() -> None:
    proc, _, tel = make_processor(Config(max_ranks_per_cohort=4, max_stages=2))
    proc.process_traces(step_request(0, {r: (60.0, 10.0) for r in range(6)}))
    assert proc.stats()["evicted_ranks"] == 2
    assert _counter(tel, s.M_EVICTIONS, structure="cohort_ranks") == 2
    for stage in ("a", "b", "c", "d"):
        proc.process_traces(step_request(1, {0: (60.0, 10.0)}, stage=stage))
    assert proc.stats()["evicted_stages"] == 3  # forward-compute + a fill the 2 slots
    assert _counter(tel, s.M_EVICTIONS, structure="stages") == 3


def test_open_window_cap_closes_oldest_early() -> None:
    """Rank 7 stalls at step 0 while others run ahead: at most max_open_windows stay open."""
    cfg = Config(max_open_windows=3, rank_timeout_s=1e9, grace_s=1e9)
    proc, _, tel = make_processor(cfg)
    proc.process_traces(step_request(0, {r: (60.0, 10.0) for r in range(8)}))
    for st in range(1, 40):
        proc.process_traces(step_request(st, {r: (60.0, 10.0) for r in range(7)}))
        assert proc.stats()["open_windows"] <= 3
    st = proc.stats()
    assert st["windows_closed_early"] == 5 and st["windows_closed"] == 5
    assert _counter(tel, s.M_EVICTIONS, structure="open_windows") == 5
    # a sample older than every open window of a full set is late, not a new window
    proc.process_traces(step_request(1, {7: (60.0, 10.0)}))
    assert proc.last_rejected == 1


def test_dedup_set_is_bounded() -> None:
    proc, _, _ = make_processor(Config(dedup_capacity=10))
    for st in range(0, 5):
        proc.process_traces(step_request(st, {r: (60.0, 10.0) for r in range(4)}))
    assert proc.stats()["dedup_entries"] == 10
    assert proc.stats()["evicted_dedup"] == 10


def test_metric_series_cap_is_counted() -> None:
    cfg = Config(metrics=MetricsConfig(max_series=5))
    clock = Clock()
    proc, _, tel = make_processor(cfg, clock)
    run(proc, Sim(), range(0, 30), clock=clock)
    st = proc.stats()
    # per-rank series stop one short of the cap (max(1, 10 %) is kept for alert series, see
    # test_alert_series_keep_room_when_rank_series_fill_the_cap)
    assert st["metric_series"] == 4 and st["metric_series_refused"] > 0
    assert _counter(tel, s.M_EVICTIONS, structure="metric_series") == st["metric_series_refused"]


def test_shutdown_closes_everything_and_emits() -> None:
    proc, emitted, _ = make_processor(Config(warmup_windows=0, persistence_windows=1))
    for st in range(0, 4):  # one window, never closed by progress
        proc.process_traces(step_request(st, {r: (90.0 if r == 1 else 60.0, 10.0) for r in range(4)}))
    assert emitted == [] and proc.stats()["open_windows"] == 1
    proc.shutdown(timeout_s=1.0)
    assert proc.stats()["open_windows"] == 0
    assert [(v.rank, v.verdict) for v in emitted] == [(1, s.VERDICT_STRAGGLER)]


def test_emit_failure_fails_open() -> None:
    from collector_processor.processor.straggler.processor import StragglerProcessor
    from collector_processor.telemetry import Telemetry

    def boom(_):  # type: ignore[no-untyped-def]
        raise RuntimeError("consumer down")

    proc = StragglerProcessor(Config(warmup_windows=0, persistence_windows=1), Telemetry(), boom, clock=Clock())
    for st in range(0, 12):
        assert proc.process_traces(step_request(st, {r: (90.0 if r == 1 else 60.0, 10.0) for r in range(4)}))
    assert proc.stats()["emit_failures"] >= 1


def test_alert_series_keep_room_when_rank_series_fill_the_cap() -> None:
    """More ranks than the series cap covers (a job of thousands of ranks per process): per-rank dashboard
    series stop at 90 % of the cap, so a straggler's alert series is still created and can fire."""
    from prometheus_client import generate_latest

    clock = Clock()
    proc, emitted, tel = make_processor(Config(metrics=MetricsConfig(max_series=50)), clock=clock)
    sim = Sim(ranks=40, seed=2, noise=0.005,
              device_factor=lambda r, n, st: 1.3 if (r == 3 and n == "forward-compute" and st >= 15) else 1.0)
    run(proc, sim, range(0, 40), clock=clock)
    assert [(v.rank, v.stage) for v in emitted if v.verdict == s.VERDICT_STRAGGLER] == [(3, "forward-compute")]
    assert proc.stats()["metric_series_refused"] > 0  # the per-rank series did overflow
    assert proc.stats()["metric_series"] <= 50
    text = generate_latest(tel.registry).decode()
    active = [ln for ln in text.splitlines() if ln.startswith(s.M_STRAGGLER_ACTIVE + "{")]
    assert len(active) == 1 and 'rank="3"' in active[0] and active[0].endswith(" 1.0")

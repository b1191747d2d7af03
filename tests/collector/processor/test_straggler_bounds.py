"""Replays, late samples, malformed spans and every cap: counted, never re-judged, never unbounded."""

from __future__ import annotations

import itertools

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from straggler_build import request, resource, span, step_request
from straggler_sim import Sim, kv, make_processor, run

import otel_straggler_schema as s
from collector_processor.processor.straggler.config import Config, MetricsConfig
from jobsim.arrival import SimClock


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
    proc, _, tel = make_processor(Config(dedup_capacity=10))
    for st in range(0, 5):
        proc.process_traces(step_request(st, {r: (60.0, 10.0) for r in range(4)}))
    assert proc.stats()["dedup_entries"] == 10
    assert proc.stats()["evicted_dedup"] == 10
    assert _counter(tel, s.M_EVICTIONS, structure="dedup") == 10


def test_metric_series_cap_is_counted() -> None:
    cfg = Config(metrics=MetricsConfig(max_series=5))
    clock = SimClock()
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

    proc = StragglerProcessor(Config(warmup_windows=0, persistence_windows=1), Telemetry(), boom, clock=SimClock())
    for st in range(0, 12):
        assert proc.process_traces(step_request(st, {r: (90.0 if r == 1 else 60.0, 10.0) for r in range(4)}))
    assert proc.stats()["emit_failures"] >= 1


def test_alert_series_keep_room_when_rank_series_fill_the_cap() -> None:
    """More ranks than the series cap covers (a job of thousands of ranks per process): per-rank dashboard
    series stop at 90 % of the cap, so a straggler's alert series is still created and can fire."""
    from prometheus_client import generate_latest

    clock = SimClock()
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


# --- a client re-sending one step: bounded by the data's identity and by age ------------------------------
_fresh = itertools.count(1)
_SUMMARY_STAGES = ("forward-compute", "backward-compute", "optimizer")


def _rank_step(rank: int, step: int, span_id: bytes | None = None,
               stages: tuple[str, ...] = _SUMMARY_STAGES) -> ResourceSpans:
    """One rank-step with its step summary (schema 2), as the emitter sends it; ``span_id`` None: a fresh id
    (the emitter's own is deterministic per job, step and rank: a re-send with fresh ids is not a retry)."""
    attrs = [kv(s.ATTR_STAGE, s.SPAN_RANK_STEP), kv(s.ATTR_STAGE_GROUP, "step"), kv(s.ATTR_ITERATION, step),
             kv(s.ATTR_HOST_MS, 100.0), kv(s.ATTR_SUMMARY_STAGES, list(stages)),
             kv(s.ATTR_SUMMARY_GROUPS, [stage.split("-")[0] for stage in stages]),
             kv(s.ATTR_SUMMARY_DEVICE_MS, [60.0] * len(stages)), kv(s.ATTR_SUMMARY_HOST_MS, [10.0] * len(stages)),
             kv(s.ATTR_SUMMARY_COUNTS, [1] * len(stages))]
    span = Span(trace_id=s.trace_id_for_step("job-1", step).to_bytes(16, "big"),
                span_id=span_id or (1 << 40 | next(_fresh)).to_bytes(8, "big"), name=s.SPAN_RANK_STEP,
                start_time_unix_nano=1, end_time_unix_nano=100_000_001, attributes=attrs)
    res = resource(rank)
    res.attributes.append(kv(s.RES_STEP_SUMMARY, True))
    return ResourceSpans(resource=res, scope_spans=[
        ScopeSpans(scope=InstrumentationScope(name=s.SCOPE_STEP_NAME), spans=[span])])


def _summaries(step: int, ranks: range | list[int] = range(4), **kw: object) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(resource_spans=[_rank_step(r, step, **kw) for r in ranks])  # type: ignore[arg-type]


def _held(proc) -> int:  # type: ignore[no-untyped-def]
    return proc.stats()["window_samples"]


def test_a_step_resent_with_fresh_span_ids_is_one_rank_step() -> None:
    """A client re-sending step 7 of rank 1 with fresh span ids: every copy after the first is a duplicate of
    the rank-step (counted, reported as rejected), the window holds one copy, and other steps still count."""
    proc, _, tel = make_processor()
    proc.process_traces(_summaries(7))
    accepted, held = proc.stats()["spans_accepted"], _held(proc)
    assert accepted == 4 * (1 + len(_SUMMARY_STAGES)) and held > 0
    for _ in range(300):
        proc.process_traces(_summaries(7, ranks=[1]))
        assert proc.last_rejected == 1
    st = proc.stats()
    assert (st["spans_accepted"], _held(proc)) == (accepted, held)
    assert st["rejected_duplicate"] == 300 and _counter(tel, s.M_SPANS_REJECTED, reason="duplicate") == 300
    proc.process_traces(_summaries(8, ranks=[1]))  # the next step of the same rank and window is new data
    assert proc.last_rejected == 0 and proc.stats()["spans_accepted"] == accepted + 1 + len(_SUMMARY_STAGES)


def test_a_summary_naming_a_stage_twice_is_malformed() -> None:
    """One entry per timer is the summary's contract: a stage listed twice would put two samples of one
    (rank, step, stage) in the window, so the summary is malformed, none of it used."""
    proc, _, tel = make_processor()
    proc.process_traces(_summaries(7, ranks=[0], stages=("forward-compute",) * 1000))
    assert proc.last_rejected == 1 and proc.stats()["spans_accepted"] == 0 and _held(proc) == 0
    assert _counter(tel, s.M_SPANS_REJECTED, reason="malformed") == 1


def test_stage_spans_are_capped_per_rank_step_and_stage() -> None:
    """Stage spans (schema 1): several per (rank, step, stage) are legitimate (interval detail: one per
    microbatch), so repeats are kept up to ``max_samples_per_step``; beyond it they are rejected ``over_cap``
    and counted. Other stages and steps of the rank are unaffected."""
    proc, _, tel = make_processor(Config(max_samples_per_step=8))
    microbatches = [span("forward-compute", 3, 60.0, 10.0) for _ in range(8)]
    proc.process_traces(request({0: microbatches}))
    assert proc.last_rejected == 0 and proc.stats()["spans_accepted"] == 8
    held = _held(proc)
    for _ in range(50):  # the same step again and again, fresh span ids
        proc.process_traces(request({0: [span("forward-compute", 3, 60.0, 10.0) for _ in range(20)]}))
        assert proc.last_rejected == 20
    st = proc.stats()
    assert st["spans_accepted"] == 8 and _held(proc) == held
    assert st["rejected_over_cap"] == 1000 and _counter(tel, s.M_SPANS_REJECTED, reason="over_cap") == 1000
    proc.process_traces(request({0: [span("optimizer", 3, 60.0, 10.0, group="optimizer"),
                                     span("forward-compute", 4, 60.0, 10.0)]}))
    assert proc.last_rejected == 0 and proc.stats()["spans_accepted"] == 10
    assert Config().max_samples_per_step == 256


def test_an_idle_collector_closes_its_windows_by_age() -> None:
    """The job stops: nobody moves past the last window, so neither progress nor grace closes it. Ticks with
    no new data close it ``window_idle_s`` after its last sample (and judge it)."""
    clock = SimClock()
    proc, _, tel = make_processor(Config(window_idle_s=60.0), clock=clock)
    for st in range(0, 8):
        proc.process_traces(step_request(st, {r: (60.0, 10.0) for r in range(4)}))
        clock.t += 0.5
    assert (proc.stats()["windows_closed"], proc.stats()["open_windows"]) == (1, 1)
    for _ in range(59):
        clock.t += 1.0
        proc.tick(clock.t)
    assert proc.stats()["windows_closed"] == 1  # not idle long enough yet
    for _ in range(2):
        clock.t += 1.0
        proc.tick(clock.t)
    st = proc.stats()
    assert (st["windows_closed"], st["windows_closed_by_age"], st["open_windows"]) == (2, 1, 0)
    assert _counter(tel, s.M_WINDOWS_CLOSED) == 2


def test_a_window_flooded_with_a_resent_step_closes_when_idle() -> None:
    """Rank 1 re-sends step 7 every second while its peers stopped: the window never completes, and copies
    of a rank-step it holds are no news, so it closes ``window_idle_s`` after its last accepted sample; later
    copies of the step are ``late``. The window holds one copy throughout."""
    clock = SimClock()
    proc, _, _ = make_processor(clock=clock)
    proc.process_traces(_summaries(7))
    held = _held(proc)
    closed_at = None
    for t in range(1, 200):
        clock.t += 1.0
        proc.process_traces(_summaries(7, ranks=[1]))
        proc.tick(clock.t)
        if closed_at is None and proc.stats()["windows_closed"]:
            closed_at = t
        assert _held(proc) <= held
    st = proc.stats()
    assert closed_at == 60 and st["windows_closed_by_age"] == 1 and st["open_windows"] == 0
    assert (st["rejected_duplicate"], st["rejected_late"]) == (60, 199 - 60)


def test_a_window_that_never_completes_closes_at_its_maximum_age() -> None:
    """A new rank joins step 7 every second (each new data, so the window is never idle, and never complete
    while ranks keep coming): it closes ``window_max_age_s`` after it opened."""
    clock = SimClock()
    proc, _, _ = make_processor(Config(window_max_age_s=120.0), clock=clock)
    proc.process_traces(_summaries(7))
    closed_at = None
    for t in range(1, 200):
        clock.t += 1.0
        proc.process_traces(_summaries(7, ranks=[3 + t]))
        proc.tick(clock.t)
        if closed_at is None and proc.stats()["windows_closed"]:
            closed_at = t
    st = proc.stats()
    assert closed_at == 120 and st["windows_closed_by_age"] == 1 and st["open_windows"] == 0
    assert st["rejected_late"] == 199 - 120


def test_a_dropped_rank_step_is_logged_once_per_rank_and_interval(caplog) -> None:  # type: ignore[no-untyped-def]
    """Every duplicate rank-step is counted; the log says so once per (job, rank) and interval, with how many
    were dropped since its last line."""
    import logging

    clock = SimClock()
    proc, _, _ = make_processor(clock=clock)
    proc.process_traces(_summaries(7))
    with caplog.at_level(logging.WARNING, logger="collector_processor.processor.straggler.processor"):
        for _ in range(100):
            proc.process_traces(_summaries(7, ranks=[1, 2]))
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2 and "rank 1: 1 duplicate" in lines[0] and "rank 2: 1 duplicate" in lines[1]
        assert "step 7" in lines[0]
        clock.t += 3600.0
        proc.process_traces(_summaries(7, ranks=[1]))
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 3 and "rank 1: 100 duplicate rank-step(s)" in lines[2]
    assert proc.stats()["rejected_duplicate"] == 201

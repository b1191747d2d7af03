"""Events, evidence dicts, verdict spans and the Prometheus view; attribution and impact rules."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from straggler_build import step_request
from straggler_sim import make_processor

import otel_straggler_schema as s
from collector_processor.processor.straggler.attribution import attribute, collective_evidence
from collector_processor.processor.straggler.config import Config, MetricsConfig
from collector_processor.processor.straggler.events import verdict_span, verdict_to_dict, verdicts_to_logs
from collector_processor.processor.straggler.impact import impact, step_period_ms
from collector_processor.processor.straggler.model import Verdict
from jobsim.arrival import SimClock


def _verdict(**kw: object) -> Verdict:
    base = dict(job="j", cohort="c", rank=3, host="h3", gpu="GPU-3", stage="forward-compute", group="forward",
                verdict=s.VERDICT_STRAGGLER, reason="slower_than_reference", deviation=0.1, value_ms=66.0,
                reference_rank=0, reference_ms=60.0, measurement=s.MEASUREMENT_DEVICE, window_start=50,
                window_end=54, step=54, attribution=s.ATTRIBUTION_GPU, step_time_lost_ms=6.0,
                gpu_seconds_per_hour=100.0, cohort_size=8, collective_evidence="waits_least:grad-sync",
                trace_id=s.trace_id_for_step("j", 54).to_bytes(16, "big"), emitted_unix_ns=123)
    base.update(kw)
    return Verdict(**base)  # type: ignore[arg-type]


def test_attribution_rule() -> None:
    """One rule: convicted on host time -> host; on device time, host only when the host excess the device
    excess does not explain is beyond the host tolerance (of the host reference) and the host floor."""
    dev, host = s.MEASUREMENT_DEVICE, s.MEASUREMENT_HOST_ONLY

    def a(dg, hg, m=dev, href=20.0, group="forward"):  # type: ignore[no-untyped-def]
        return attribute(convicted_on=m, group=group, device_excess_ms=dg, host_excess_ms=hg,
                         host_reference_ms=href, host_tolerance=0.1, host_floor_ms=5.0)

    assert a(6, 0) == s.ATTRIBUTION_GPU  # device up, host flat (the host runs ahead of the stream)
    assert a(6, 6) == s.ATTRIBUTION_GPU  # a blocked host tracks a slow GPU: the device explains the host
    assert a(30, 34) == s.ATTRIBUTION_GPU  # 4 ms left over: under the host floor
    assert a(6, 12, href=100.0) == s.ATTRIBUTION_GPU  # 6 ms left over, within 10 % of a 100 ms host reference
    assert a(6, 12) == s.ATTRIBUTION_HOST  # 6 ms the device does not explain: a host stall starved the stream
    assert a(-1, 12) == s.ATTRIBUTION_HOST  # a negative device excess explains nothing
    assert a(6, None) == s.ATTRIBUTION_GPU  # no host time
    assert a(None, 12, host) == s.ATTRIBUTION_HOST  # convicted on host time (host_stall, or no device samples)
    assert a(None, None, host) == s.ATTRIBUTION_HOST
    # the data loader's work is the host's: its device interval only tracks the host's (the stream waits)
    assert a(20, 20, group="data") == s.ATTRIBUTION_HOST


def test_collective_evidence_is_lowest_wait_only() -> None:
    per = {"grad-sync": {0: 20.0, 1: 21.0, 2: 20.5, 3: 12.0}, "p2p": {0: 5.0, 1: 5.0, 2: 5.0, 3: 5.0}}
    assert collective_evidence(3, per, 0.05) == "waits_least:grad-sync"
    assert collective_evidence(0, per, 0.05) == ""


def test_impact_formula() -> None:
    assert step_period_ms([300.0, 310.0, 290.0], 0, 0) == 300.0
    assert step_period_ms([], 5 * 250_000_000, 5) == 250.0
    # 6 ms/step lost, 7 waiting ranks, 12000 steps/h -> 504 GPU-s/h
    assert math.isclose(impact(6.0, 8, 300.0), 0.006 * 7 * 12000)
    assert impact(6.0, 8, None) == 0.0


def test_log_record_carries_the_event_contract() -> None:
    v = _verdict()
    req = verdicts_to_logs([v, _verdict(verdict=s.VERDICT_RECOVERED, reason="within_tolerance"),
                            _verdict(verdict=s.VERDICT_UNCERTAIN, reason="below_absolute_floor", step=None,
                                     trace_id=b"")])
    rl = req.resource_logs[0]
    assert {a.key: a.value.string_value for a in rl.resource.attributes}[s.RES_SERVICE_NAME] == \
        "otel-straggler-collector"
    recs = rl.scope_logs[0].log_records
    assert [r.severity_text for r in recs] == ["WARN", "INFO", "DEBUG"]
    attrs = {a.key: a.value for a in recs[0].attributes}
    assert attrs[s.EVENT_NAME_ATTR].string_value == s.EVENT_VERDICT
    for name in (s.EV_JOB, s.EV_COHORT, s.EV_RANK, s.EV_HOST, s.EV_GPU, s.EV_STAGE, s.EV_STAGE_GROUP, s.EV_VERDICT,
                 s.EV_REASON, s.EV_DEVIATION, s.EV_VALUE_MS, s.EV_REFERENCE_RANK, s.EV_REFERENCE_MS,
                 s.EV_MEASUREMENT, s.EV_WINDOW_START, s.EV_WINDOW_END, s.EV_STEP, s.EV_ATTRIBUTION,
                 s.EV_STEP_TIME_LOST_MS, s.EV_GPU_SECONDS_PER_HOUR, s.EV_COHORT_SIZE, s.EV_COLLECTIVE_EVIDENCE,
                 s.EV_TRACE_ID):
        assert name in attrs, name
    assert attrs[s.EV_RANK].int_value == 3 and attrs[s.EV_DEVIATION].double_value == 0.1
    assert recs[0].trace_id == v.trace_id and attrs[s.EV_TRACE_ID].string_value == v.trace_id.hex()
    assert "rank 3" in recs[0].body.string_value and "\n" not in recs[0].body.string_value
    assert recs[2].trace_id == b"" and recs[2].span_id == b""
    span = verdict_span(v)
    assert span is not None and recs[0].span_id == span.span_id and len(recs[0].span_id) == 8


def test_evidence_dict_is_json_safe() -> None:
    d = verdict_to_dict(_verdict(deviation=math.inf, value_ms=math.nan))
    line = json.dumps(d, allow_nan=False)
    assert json.loads(line)["trace_id"] == s.trace_id_for_step("j", 54).to_bytes(16, "big").hex()
    assert d["deviation"] is None and d["value_ms"] is None


def test_verdict_span_is_child_of_the_job_step() -> None:
    sp = verdict_span(_verdict())
    assert sp is not None and sp.name == s.SPAN_VERDICT
    assert sp.parent_span_id == s.job_step_span_id("j", 54).to_bytes(8, "big")
    assert verdict_span(_verdict(step=None, trace_id=b"")) is None


def test_verdict_and_recovery_spans_live_in_the_convicting_steps_trace() -> None:
    """A straggler verdict's span (and its recovery's, fired windows later) sits in the trace of the step where
    the alert was first convicted, under that step's ``train-step`` root, with its rank, stage, attribution,
    deviation and cost."""
    clock = SimClock()
    spans: list = []
    proc, _, _ = make_processor(Config(), clock)
    for st in range(0, 60):
        slow = st < 30
        req = step_request(st, {r: (72.0 if (r == 3 and slow) else 60.0, 10.0) for r in range(8)})
        out = proc.process_traces(req)
        assert out is not None
        spans += [sp for rs in out.resource_spans for ss in rs.scope_spans for sp in ss.spans
                  if sp.name == s.SPAN_VERDICT]
        clock.t += 0.3
    kinds = [(next(a.value.string_value for a in sp.attributes if a.key == s.EV_VERDICT), sp) for sp in spans]
    conv = [sp for k, sp in kinds if k == s.VERDICT_STRAGGLER]
    rec = [sp for k, sp in kinds if k == s.VERDICT_RECOVERED]
    assert len(conv) == 1 and len(rec) == 1, [k for k, _ in kinds]
    attrs = {a.key: a.value for a in conv[0].attributes}
    first = attrs[s.EV_FIRST_STEP].int_value
    assert attrs[s.EV_STEP].int_value == first and attrs[s.EV_RANK].int_value == 3
    assert attrs[s.EV_STAGE].string_value == "forward-compute"
    assert attrs[s.EV_ATTRIBUTION].string_value == s.ATTRIBUTION_GPU
    assert attrs[s.EV_DEVIATION].double_value > 0.1 and attrs[s.EV_GPU_SECONDS_PER_HOUR].double_value > 0
    trace = s.trace_id_for_step("job-1", first).to_bytes(16, "big")
    root = s.job_step_span_id("job-1", first).to_bytes(8, "big")
    rec_attrs = {a.key: a.value for a in rec[0].attributes}
    assert rec_attrs[s.EV_STEP].int_value > first and rec_attrs[s.EV_FIRST_STEP].int_value == first
    for sp in (conv[0], rec[0]):
        assert sp.trace_id == trace and sp.parent_span_id == root
    assert rec[0].span_id != conv[0].span_id


def test_a_verdict_on_a_rank_beyond_64_lives_in_its_blocks_trace_linked_to_its_reference() -> None:
    """A 512-rank job whose cohort holds ranks 3, 67, ..., 451 (one per block of 64): the slow rank 195's verdict
    span, its log record's trace and its evidence name block 3's step trace, under that trace's ``train-step``
    root, with a link to the reference rank's ``rank-step`` span in the reference's own block trace."""
    clock = SimClock()
    ranks = [3 + 64 * i for i in range(8)]
    slow = ranks[3]
    spans: list = []
    proc, _, _ = make_processor(Config(), clock)
    for st in range(0, 30):
        req = step_request(st, {r: (72.0 if r == slow else 60.0, 10.0) for r in ranks}, world=512)
        out = proc.process_traces(req)
        assert out is not None
        spans += [sp for rs in out.resource_spans for ss in rs.scope_spans for sp in ss.spans
                  if sp.name == s.SPAN_VERDICT]
        clock.t += 0.3
    (conv,) = [sp for sp in spans if {a.key: a.value for a in sp.attributes}[s.EV_VERDICT].string_value
               == s.VERDICT_STRAGGLER]
    attrs = {a.key: a.value for a in conv.attributes}
    first = attrs[s.EV_FIRST_STEP].int_value
    assert attrs[s.EV_RANK].int_value == slow and s.trace_block(slow) == 3
    trace = s.trace_id_for_step("job-1", first, block=3)
    assert conv.trace_id == trace.to_bytes(16, "big")
    assert conv.parent_span_id == s.job_step_span_id("job-1", first, block=3).to_bytes(8, "big")
    assert attrs[s.EV_TRACE_ID].string_value == f"{trace:032x}"
    ref = attrs[s.EV_REFERENCE_RANK].int_value
    assert ref in ranks and ref != slow
    (link,) = conv.links
    assert link.trace_id == s.trace_id_for_step("job-1", first, block=s.trace_block(ref)).to_bytes(16, "big")
    assert link.span_id == s.rank_step_span_id("job-1", first, ref).to_bytes(8, "big")


def test_prometheus_view_follows_the_alert() -> None:
    clock = SimClock()
    cfg = Config(metrics=MetricsConfig(series_ttl_s=60.0))
    proc, _, tel = make_processor(cfg, clock)

    def feed(steps, slow):  # type: ignore[no-untyped-def]
        for st in steps:
            proc.process_traces(step_request(st, {r: (72.0 if (r == 3 and slow) else 60.0, 10.0) for r in range(8)}))
            clock.t += 0.3

    feed(range(0, 30), True)
    text = generate_latest(tel.registry).decode()
    active = [ln for ln in text.splitlines() if ln.startswith(s.M_STRAGGLER_ACTIVE + "{")]
    assert len(active) == 1 and 'rank="3"' in active[0] and active[0].endswith(" 1.0")
    assert 'attribution="gpu_stream_stall"' in active[0]
    alert = proc.active()[0]
    assert alert.first_step is not None and alert.first_step < alert.step  # refreshed since its conviction
    first_trace = s.trace_id_for_step("job-1", alert.first_step).to_bytes(16, "big").hex()
    assert alert.first_trace_id.hex() == first_trace
    labels = {"training_job": "job-1", "cohort": alert.cohort, "rank": "3", "host": "h3", "gpu": "GPU-3",
              "stage": "forward-compute", "attribution": "gpu_stream_stall"}
    alert_labels = {**labels, "first_step": str(alert.first_step), "trace_id": first_trace}
    lost = tel.registry.get_sample_value(s.M_STEP_TIME_LOST, alert_labels)
    assert lost is not None and math.isclose(lost, 0.012)
    ratio = tel.registry.get_sample_value(s.M_GPU_LOST_RATIO, alert_labels)
    assert ratio is not None and math.isclose(ratio, alert.gpu_seconds_per_hour / 3600.0)
    cost = tel.registry.get_sample_value(s.M_GPU_LOST_SECONDS, labels)
    assert cost is not None and cost > 0
    assert tel.registry.get_sample_value(s.M_VERDICTS, {"training_job": "job-1", "verdict": "straggler",
                                                        "reason": "slower_than_reference"}) == 1
    assert tel.registry.get_sample_value(s.M_RANK_DEVIATION, {"training_job": "job-1", "cohort": alert.cohort,
                                                              "rank": "3"}) is not None
    assert tel.registry.get_sample_value(s.M_JOB_LAST_SEEN, {"training_job": "job-1"}) is not None
    assert not re.search(r'[{,](job|instance)=', text) and '=""' not in text
    om = openmetrics_latest(tel.registry).decode()
    exemplars = [ln for ln in om.splitlines() if " # {" in ln]
    assert any(ln.startswith(s.M_VERDICTS + '{') and f'trace_id="{first_trace}"' in ln for ln in exemplars), om
    assert any(ln.startswith(s.M_GPU_LOST_SECONDS + '{') and f'trace_id="{first_trace}"' in ln
               for ln in exemplars), om
    assert f'{s.M_RANK_STAGE_SECONDS}{{' in text
    feed(range(30, 45), False)
    text = generate_latest(tel.registry).decode()
    active = [ln for ln in text.splitlines() if ln.startswith(s.M_STRAGGLER_ACTIVE + "{")]
    assert len(active) == 1 and active[0].endswith(" 0.0") and f'trace_id="{first_trace}"' in active[0]
    assert (tel.registry.get_sample_value(s.M_GPU_LOST_SECONDS, labels) or 0.0) >= cost  # a counter
    # no update for longer than the TTL: the series disappears
    clock.t += 120.0
    proc.tick(clock.t)
    text = generate_latest(tel.registry).decode()
    assert not [ln for ln in text.splitlines() if ln.startswith(s.M_STRAGGLER_ACTIVE + "{")]


def test_two_runs_under_one_job_id_are_series_of_their_own() -> None:
    """A second launch under the same job id (its own ``straggler.run.id``) gets its own series, told apart by the
    ``run`` label: the job's last-seen time, the per-rank view and the slow rank's alert."""
    from straggler_build import kv

    clock = SimClock()
    proc, _, tel = make_processor(Config(), clock)
    for run in ("run-a", "run-b"):
        for st in range(30):
            req = step_request(st, {r: (72.0 if r == 3 else 60.0, 10.0) for r in range(8)})
            for rs in req.resource_spans:
                rs.resource.attributes.append(kv(s.RES_RUN_ID, run))
            proc.process_traces(req)
            clock.t += 0.3
    text = generate_latest(tel.registry).decode()
    for name in (s.M_JOB_LAST_SEEN, s.M_RANK_DEVIATION, s.M_STRAGGLER_ACTIVE):
        lines = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
        assert {m for ln in lines for m in re.findall(r'[{,]run="([^"]+)"', ln)} == {"run-a", "run-b"}, (name, lines)
        assert all('training_job="job-1"' in ln for ln in lines)
    seen = [ln for ln in text.splitlines() if ln.startswith(s.M_JOB_LAST_SEEN + "{")]
    assert len(seen) == 2


def test_rank_deviation_ignores_comparisons_under_the_floor() -> None:
    """The dashboard's worst deviation per rank counts comparisons that cleared the absolute floor: rank 1's
    1 ms data stage +50 % (a 0.5 ms gap, under the 5 ms host floor) does not paint it; its forward-compute,
    1 % slow against the fastest peer, does."""
    proc, _, tel = make_processor()
    for st in range(0, 30):
        proc.process_traces(step_request(st, {r: (None, 1.5 if r == 1 else 1.0) for r in range(8)},
                                         stage="batch-generator", group="data"))
        proc.process_traces(step_request(st, {r: (60.6 if r == 1 else 60.0, 10.0) for r in range(8)}))
    cohort = next(iter(proc.cohorts)).key
    dev = tel.registry.get_sample_value(s.M_RANK_DEVIATION, {"training_job": "job-1", "cohort": cohort, "rank": "1"})
    assert dev is not None and math.isclose(dev, 0.01, abs_tol=1e-9)


def test_config_is_strict_and_has_documented_defaults() -> None:
    import pytest
    from pydantic import ValidationError

    cfg = Config()
    # tolerance 4 % and the device floor: docs/detection-defaults.md (+5 % on a 20 ms stage must be found)
    assert (cfg.window_steps, cfg.tolerance, cfg.absolute_floor_ms, cfg.device_floor_ms, cfg.device_min_stage_ms,
            cfg.warmup_windows, cfg.persistence_windows, cfg.min_cohort_size, cfg.workload_tolerance,
            cfg.reference) == (5, 0.04, 5.0, 0.5, 10.0, 2, 2, 3, 0.05, "fastest")
    with pytest.raises(ValidationError):
        Config(unknown_knob=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        Config(judged_groups=["forwards"])
    with pytest.raises(ValidationError):
        Config(host_stall_groups=["forwards"])
    # docs/detector.md: host_stall, hysteresis, windows
    assert cfg.host_stall_groups == cfg.judged_groups
    assert (cfg.recovery_windows, cfg.recovery_margin, cfg.grace_s, cfg.grace_max_s, cfg.max_open_windows) == (
        2, 0.02, 5.0, 30.0, 64)
    from collector_processor.processor.straggler import factory
    assert factory.TYPE == "straggler" and isinstance(factory.create_default_config(), Config)


def test_scrape_on_another_thread_while_processing() -> None:
    """The scrape thread reads snapshots only; processing and scraping run concurrently without errors."""
    import threading

    from straggler_sim import Sim

    clock = SimClock()
    proc, _, tel = make_processor(clock=clock)
    sim = Sim(device_factor=lambda r, n, st: 1.2 if r == 3 and n == "forward-compute" else 1.0)
    stop = threading.Event()
    errors: list[BaseException] = []
    scrapes = [0]

    def scrape() -> None:
        while not stop.is_set():
            try:
                generate_latest(tel.registry)
                scrapes[0] += 1
            except BaseException as e:
                errors.append(e)
                return

    th = threading.Thread(target=scrape, daemon=True)
    th.start()
    try:
        for st in range(0, 60):
            proc.process_traces(sim.request([st]))
            clock.t += 0.3
    finally:
        stop.set()
        th.join(timeout=5)
    assert not errors and scrapes[0] > 0
    assert 'rank="3"' in generate_latest(tel.registry).decode()


def test_verdict_spans_fed_back_are_not_judged() -> None:
    """A collector downstream of another receives verdict spans (they carry straggler.stage): skipped."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from collector_processor.processor.straggler.events import verdict_resource_spans

    proc, _, _ = make_processor()
    rs = verdict_resource_spans([_verdict(), _verdict(rank=4)])
    assert rs is not None
    proc.process_traces(ExportTraceServiceRequest(resource_spans=[rs]))
    assert proc.last_rejected == 0 and proc.stats()["spans_accepted"] == 0


def test_every_schema_reason_is_one_named_constant() -> None:
    """The detector's reasons are the schema's, one constant each; a name outside the schema fails at import."""
    from collector_processor.processor.straggler import model

    constants = [v for k, v in vars(model).items() if k.isupper() and isinstance(v, str)]
    assert sorted(constants) == sorted(s.REASONS)
    with pytest.raises(ValueError, match="REASONS"):
        model._reason("slow_ish")


def test_the_console_shows_a_verdict_as_a_warning_a_recovery_as_info_and_uncertain_only_at_debug(
        caplog: pytest.LogCaptureFixture) -> None:
    from collector_processor.exporter.debug import Config as DebugConfig
    from collector_processor.exporter.debug import DebugExporter
    from collector_processor.processor.straggler.events import VerdictEvents
    from collector_processor.telemetry import Telemetry

    batch = VerdictEvents([_verdict(), _verdict(verdict=s.VERDICT_RECOVERED, rank=4),
                           _verdict(verdict=s.VERDICT_UNCERTAIN, rank=5, reason="below_absolute_floor")])
    caplog.set_level(logging.INFO, logger="otel-straggler-collector.events")
    DebugExporter("debug", DebugConfig(), Telemetry()).export_events(batch)
    shown = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "otel-straggler-collector.events"]
    assert [lvl for lvl, _ in shown] == [logging.WARNING, logging.INFO]  # the uncertain window: DEBUG, not shown
    assert "verdict=straggler" in shown[0][1] and "rank=3" in shown[0][1]
    assert "verdict=recovered" in shown[1][1] and "rank=4" in shown[1][1]


def test_unknown_label_values_are_left_out_of_the_series() -> None:
    """A rank whose host and GPU are unknown, judged in a wall-clock window (no step, no trace): its alert series
    has no host, gpu, first_step or trace_id label rather than empty ones, and its verdict count no exemplar."""
    from prometheus_client import CollectorRegistry

    from collector_processor.processor.straggler.metrics import StragglerMetrics
    from collector_processor.telemetry import Telemetry

    tel = Telemetry(CollectorRegistry())
    m = StragglerMetrics(MetricsConfig(), tel)
    v = _verdict(host="", gpu="", step=None, trace_id=b"", window_gpu_seconds=2.0)
    m.record_alert(v, 1.0, judged=True)
    m.count_verdicts([v])
    m.publish(1.0)
    text = generate_latest(tel.registry).decode()
    (active,) = [ln for ln in text.splitlines() if ln.startswith(s.M_STRAGGLER_ACTIVE + "{")]
    assert active == ('otel_straggler_active{attribution="gpu_stream_stall",cohort="c",rank="3",'
                      'stage="forward-compute",training_job="j"} 1.0')
    assert '=""' not in text
    om = openmetrics_latest(tel.registry).decode()
    assert " # {" not in om  # no trace: no exemplar
    assert tel.registry.get_sample_value(s.M_GPU_LOST_SECONDS, {
        "training_job": "j", "cohort": "c", "rank": "3", "stage": "forward-compute",
        "attribution": "gpu_stream_stall"}) == 2.0

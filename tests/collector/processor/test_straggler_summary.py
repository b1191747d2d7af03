"""The step-summary path (schema 2): a resource announcing ``straggler.step_summary`` is judged from its
``rank-step`` summaries alone; its stage spans are never decoded. Equivalent verdicts to the stage-span path
(schema 1) on the same job; malformed, non-finite and retried summaries are counted like stage spans."""

from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from test_straggler_sharding import _key

import otel_straggler_schema as s
from collector_processor.otlp_values import key_value as kv
from collector_processor.processor.straggler import factory
from collector_processor.processor.straggler.decode import REJECT_MALFORMED, REJECT_NON_FINITE, decode_request
from collector_processor.telemetry import Telemetry
from jobsim.faults import COMPUTE_STAGES, Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, SimConfig


def _verdicts(summary: bool) -> tuple[list, dict]:
    faults = [Fault("device", 3, ("forward-compute",), 0.10, 40, 100),
              Fault("host", 12, ("forward-compute",), 0.3, 50, None),
              Fault("workload", 6, COMPUTE_STAGES, 0.15, 1)]
    cfg = SimConfig(layout=Layout(tp=2, dp=8), steps=120, seed=5, step_summary=summary)
    out: list = []
    proc = factory.create_processor(factory.create_default_config(), Telemetry(), out.extend)
    proc.start()
    for _step, req in JobStream(cfg, faults):
        proc.process_traces(req)
    proc.shutdown(5.0)
    return out, proc.stats()


def test_summary_and_stage_spans_give_the_same_verdicts() -> None:
    via_summary, st_summary = _verdicts(True)
    via_spans, st_spans = _verdicts(False)
    assert sorted(_key(v) for v in via_summary) == sorted(_key(v) for v in via_spans)
    assert st_summary["spans_accepted"] == st_spans["spans_accepted"] > 0
    assert {v.rank for v in via_summary if v.verdict == s.VERDICT_STRAGGLER} >= {3, 12}


def _resource(summary: bool = True) -> Resource:
    return Resource(attributes=[kv(s.RES_RANK, 1), kv(s.RES_COHORT_KEY, "c"), kv(s.RES_JOB_ID, "j"),
                                kv(s.RES_DP_SIZE, 4), kv(s.RES_STEP_SUMMARY, summary)])


def _rank_step(step: int = 7, **arrays: list) -> Span:
    base = {s.ATTR_SUMMARY_STAGES: ["forward-compute", "batch-generator", "optimizer"],
            s.ATTR_SUMMARY_GROUPS: ["forward", "data", "optimizer"],
            s.ATTR_SUMMARY_DEVICE_MS: [20.0, s.SUMMARY_NOT_MEASURED, float("nan")],
            s.ATTR_SUMMARY_HOST_MS: [2.0, 0.3, 5.0],
            s.ATTR_SUMMARY_COUNTS: [4, 4, 1]}
    base.update(arrays)
    span = Span(name=s.SPAN_RANK_STEP, trace_id=s.trace_id_for_step("j", step).to_bytes(16, "big"),
                span_id=s.rank_step_span_id("j", step, 1).to_bytes(8, "big"),
                start_time_unix_nano=10, end_time_unix_nano=30_000_010)
    span.attributes.extend([kv(s.ATTR_STAGE, s.SPAN_RANK_STEP), kv(s.ATTR_ITERATION, step),
                            kv(s.ATTR_HOST_MS, 30.0), kv(s.ATTR_WORKLOAD_TOKENS, 4096)]
                           + [kv(k, v) for k, v in base.items()])
    return span


def _request(*spans_by_scope: tuple[str, list[Span]], summary: bool = True) -> ExportTraceServiceRequest:
    rs = ResourceSpans(resource=_resource(summary), scope_spans=[
        ScopeSpans(scope=InstrumentationScope(name=name), spans=spans) for name, spans in spans_by_scope])
    return ExportTraceServiceRequest(resource_spans=[rs])


def _samples(res) -> list:  # type: ignore[no-untyped-def]
    return [x for summ in res.summaries for x in summ.samples()]


def _garbage_stage_span() -> Span:
    span = Span(name="forward-compute")
    span.attributes.extend([kv(s.ATTR_STAGE, "forward-compute"), kv(s.ATTR_HOST_MS, float("nan"))])
    return span


def test_summary_entries_become_samples_and_stage_spans_are_not_decoded() -> None:
    req = _request((s.SCOPE_NAME, [_garbage_stage_span()]), (s.SCOPE_STEP_NAME, [_rank_step()]))
    res = decode_request(req.resource_spans)
    assert res.samples == [] and len(res.summaries) == 1
    by_stage = {smp.stage: smp for smp in _samples(res)}
    assert set(by_stage) == {s.SPAN_RANK_STEP, "forward-compute", "batch-generator", "optimizer"}
    fc = by_stage["forward-compute"]
    assert (fc.device_ms, fc.host_ms, fc.count, fc.step, fc.tokens, fc.group) == (20.0, 2.0, 4, 7, 4096, "forward")
    assert (fc.rank, fc.cohort, fc.job, fc.dp_size) == (1, "c", "j", 4)
    assert by_stage["batch-generator"].device_ms is None  # -1: not measured, not an error
    assert by_stage["optimizer"].device_ms is None and by_stage["optimizer"].host_ms == 5.0  # NaN dropped
    assert res.non_finite_values == 1
    assert by_stage[s.SPAN_RANK_STEP].host_ms == 30.0
    # the garbage stage span of the summary resource was not read: no rejection for it
    assert res.rejected == {}
    # dedup keys: distinct per entry, deterministic across a retry
    again = decode_request(req.resource_spans)
    assert again.summaries[0].span_id == res.summaries[0].span_id == s.rank_step_span_id("j", 7, 1).to_bytes(8, "big")


def test_without_the_flag_stage_spans_are_decoded() -> None:
    req = _request((s.SCOPE_NAME, [_garbage_stage_span()]), summary=False)
    res = decode_request(req.resource_spans)
    assert res.rejected == {REJECT_NON_FINITE: 1}


def test_malformed_and_non_finite_summaries_are_counted() -> None:
    short = _rank_step(**{s.ATTR_SUMMARY_HOST_MS: [1.0]})
    res = decode_request(_request((s.SCOPE_STEP_NAME, [short])).resource_spans)
    assert res.rejected == {REJECT_MALFORMED: 1} and res.summaries == []
    nameless = _rank_step(**{s.ATTR_SUMMARY_STAGES: ["forward-compute", "", "optimizer"]})
    res = decode_request(_request((s.SCOPE_STEP_NAME, [nameless])).resource_spans)
    assert res.rejected == {REJECT_MALFORMED: 1}
    assert {x.stage for x in _samples(res)} == {s.SPAN_RANK_STEP, "forward-compute", "optimizer"}
    dead = _rank_step(**{s.ATTR_SUMMARY_DEVICE_MS: [float("inf")] * 3, s.ATTR_SUMMARY_HOST_MS: [-1.0] * 3})
    res = decode_request(_request((s.SCOPE_STEP_NAME, [dead])).resource_spans)
    assert res.rejected == {REJECT_NON_FINITE: 3} and res.non_finite_values == 6


def test_a_retried_summary_is_counted_once() -> None:
    proc = factory.create_processor(factory.create_default_config(), Telemetry(), lambda vs: None)
    proc.start()
    req = _request((s.SCOPE_STEP_NAME, [_rank_step()]))
    proc.process_traces(req)
    first = proc.stats()
    proc.process_traces(_request((s.SCOPE_STEP_NAME, [_rank_step()])))
    second = proc.stats()
    assert first["spans_accepted"] == 4
    assert second["spans_accepted"] == 4 and second["rejected_duplicate"] == 1  # one span, retried
    assert proc.last_rejected == 1


def test_integer_arrays_are_read_as_numbers_and_the_step_time_is_accounted() -> None:
    span = _rank_step(**{s.ATTR_SUMMARY_HOST_MS: [2, 1, 5], s.ATTR_SUMMARY_DEVICE_MS: [20, -1, 3]})
    res = decode_request(_request((s.SCOPE_STEP_NAME, [span])).resource_spans)
    by_stage = {x.stage: x for x in _samples(res)}
    assert [by_stage[k].host_ms for k in ("forward-compute", "batch-generator", "optimizer")] == [2.0, 1.0, 5.0]
    assert by_stage["batch-generator"].device_ms is None and by_stage["optimizer"].device_ms == 3.0
    # a rank-step without its host time: the entries are used, the missing step time is counted
    bare = _rank_step()
    del bare.attributes[[kv.key for kv in bare.attributes].index(s.ATTR_HOST_MS)]
    res = decode_request(_request((s.SCOPE_STEP_NAME, [bare])).resource_spans)
    assert res.rejected == {REJECT_MALFORMED: 1}
    assert s.SPAN_RANK_STEP not in {x.stage for x in _samples(res)} and len(_samples(res)) == 3


def test_summaries_without_span_id_are_not_deduplicated_against_each_other() -> None:
    proc = factory.create_processor(factory.create_default_config(), Telemetry(), lambda vs: None)
    proc.start()
    for step in (7, 8):
        span = _rank_step(step)
        span.span_id = b""
        proc.process_traces(_request((s.SCOPE_STEP_NAME, [span])))
    assert proc.stats()["rejected_duplicate"] == 0 and proc.stats()["spans_accepted"] == 8

"""A training job as another language's emitter would send it, built from ``docs/schema.md``: 8 data-parallel
ranks of one cohort, one of them slow in ``forward-compute`` from an onset step on. Per rank and step a
``rank-step`` span carrying the step summary (scope ``otel-straggler.step``, ids by the trace-id rule, parent the
``train-step`` span), rank 0's ``train-step`` span, and one stage span per timer (scope ``otel-straggler``).

The job is plain data (``Batch``: one process's resource and spans, hex ids, attribute values as JSON has them),
so that a client in any language replays it through its own SDK (``js/export.js``) and the test builds the same
requests as protobuf (``to_request``). One extra batch comes from a process without ``dl.rank`` on its resource:
its stage span is unusable, and the collector reports it as a partial success (``rejected_spans`` 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

import otel_straggler_schema as s
from otel_straggler_schema.stages import stage_group

JOB = "conformance-job"
RANKS = 8
SLOW_RANK = 5
ONSET = 10  # the first slow step
STEPS = 40
STEPS_PER_BATCH = 5  # a process's spans of this many steps go in one export
T0_NS = 1_800_000_000_000_000_000
STEP_NS = 1_000_000_000
# timer -> ms on a healthy rank; fractional, so that no emitter sends them as integers
TIMERS = {"forward-compute": 40.125, "backward-compute": 80.375, "optimizer": 10.625}
SLOW_FACTOR = 1.6
COHORT = s.cohort_key(topology_epoch=0, stage_schema="megatron-v1")
REJECTED_SPANS = 1  # the batch of the process without a rank


@dataclass
class SpanData:
    name: str
    scope: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


@dataclass
class Batch:
    resource: dict[str, Any]
    spans: list[SpanData] = field(default_factory=list)


def resource(rank: int) -> dict[str, Any]:
    res: dict[str, Any] = {
        s.RES_SERVICE_NAME: "megatron-training", s.RES_HOST_NAME: f"node{rank // 4}", s.RES_PROCESS_PID: 1000 + rank,
        s.RES_RANK: rank, s.RES_WORLD_SIZE: RANKS, s.RES_LOCAL_RANK: rank % 4,
        s.RES_JOB_ID: JOB, s.RES_RUN_ID: "r0", s.RES_GPU_UUID: f"GPU-{rank:04d}", s.RES_GPU_PCI_BUS_ID: "",
        s.RES_GPU_INDEX: rank % 4, s.RES_COHORT_KEY: COHORT, s.RES_TOPOLOGY_EPOCH: 0,
        s.RES_STAGE_SCHEMA: "megatron-v1", s.RES_SCHEMA_VERSION: s.SCHEMA_VERSION, s.RES_HOT_PATH: "native",
        s.RES_STEP_SUMMARY: True, s.RES_MODEL_CHUNK: 0, s.RES_DP_RANK: rank, s.RES_DP_SIZE: RANKS,
    }
    for r, z in ((s.RES_TP_RANK, s.RES_TP_SIZE), (s.RES_PP_RANK, s.RES_PP_SIZE), (s.RES_VPP_RANK, s.RES_VPP_SIZE),
                 (s.RES_CP_RANK, s.RES_CP_SIZE), (s.RES_EP_RANK, s.RES_EP_SIZE), (s.RES_ETP_RANK, s.RES_ETP_SIZE)):
        res[r], res[z] = 0, 1
    return res


def _hex(value: int, nbytes: int) -> str:
    return value.to_bytes(nbytes, "big").hex()


def _step_spans(rank: int, step: int) -> list[SpanData]:
    run = "r0"
    trace = _hex(s.trace_id_for_step(JOB, step, run), 16)
    root = _hex(s.job_step_span_id(JOB, step, run), 8)
    me = _hex(s.rank_step_span_id(JOB, step, rank, run), 8)
    start = T0_NS + step * STEP_NS
    spans: list[SpanData] = []
    t = start
    names, groups, device, host, counts = [], [], [], [], []
    for i, (timer, ms) in enumerate(TIMERS.items()):
        value = ms * (1 + 0.003 * ((rank + step + i) % 4))
        if rank == SLOW_RANK and step >= ONSET and timer == "forward-compute":
            value *= SLOW_FACTOR
        host_ms = value + 0.25
        end = t + int(host_ms * 1e6)
        spans.append(SpanData(timer, s.SCOPE_NAME, trace, f"{step:08x}{rank:02x}{i + 1:02x}abcd", me, t, end,
                              {s.ATTR_STAGE: timer, s.ATTR_STAGE_GROUP: stage_group(timer), s.ATTR_STAGE_LEVEL: 1,
                               s.ATTR_ITERATION: step, s.ATTR_DEVICE_MS: value, s.ATTR_HOST_MS: host_ms,
                               s.ATTR_MEASUREMENT: s.MEASUREMENT_DEVICE, s.ATTR_COUNT: 1,
                               s.ATTR_DETAIL: s.DETAIL_STEP}))
        names.append(timer)
        groups.append(stage_group(timer))
        device.append(value)
        host.append(host_ms)
        counts.append(1)
        t = end
    step_ms = (t - start) / 1e6
    spans.insert(0, SpanData("rank-step", s.SCOPE_STEP_NAME, trace, me, root, start, t, {
        s.ATTR_ITERATION: step, s.ATTR_STAGE: "rank-step", s.ATTR_STAGE_GROUP: "step", s.ATTR_HOST_MS: step_ms,
        s.ATTR_SUMMARY_STAGES: names, s.ATTR_SUMMARY_GROUPS: groups, s.ATTR_SUMMARY_DEVICE_MS: device,
        s.ATTR_SUMMARY_HOST_MS: host, s.ATTR_SUMMARY_COUNTS: counts}))
    if rank == 0:
        spans.insert(0, SpanData("train-step", s.SCOPE_STEP_NAME, trace, root, "", start, t, {
            s.ATTR_ITERATION: step, s.ATTR_STAGE_GROUP: "step"}))
    return spans


def job() -> list[Batch]:
    """Every process's exports in the order they are sent: steps advance together on all ranks."""
    out: list[Batch] = []
    for first in range(0, STEPS, STEPS_PER_BATCH):
        for rank in range(RANKS):
            b = Batch(resource(rank))
            for step in range(first, min(STEPS, first + STEPS_PER_BATCH)):
                b.spans.extend(_step_spans(rank, step))
            out.append(b)
        if first == 0:
            out.append(unranked())
    return out


def unranked() -> Batch:
    """A process whose resource lacks ``dl.rank``: its one stage span is rejected (a partial success)."""
    res = resource(0)
    del res[s.RES_RANK]
    res[s.RES_STEP_SUMMARY] = False
    trace = _hex(s.trace_id_for_step(JOB, 0, "r0"), 16)
    return Batch(res, [SpanData("forward-compute", s.SCOPE_NAME, trace, "00000000feedbeef", "", T0_NS,
                                T0_NS + 40_000_000, {s.ATTR_STAGE: "forward-compute", s.ATTR_ITERATION: 0,
                                                     s.ATTR_HOST_MS: 40.5, s.ATTR_COUNT: 1})])


def as_json(batches: list[Batch]) -> list[dict[str, Any]]:
    return [{"resource": b.resource, "spans": [sp.__dict__ for sp in b.spans]} for b in batches]


def _any(v: Any) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, str):
        return AnyValue(string_value=v)
    return AnyValue(array_value=ArrayValue(values=[_any(x) for x in v]))


def _kvs(attrs: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=_any(v)) for k, v in attrs.items()]


def to_request(b: Batch) -> ExportTraceServiceRequest:
    """One batch as the OTLP request an SDK makes of it (spans grouped by scope)."""
    scopes: dict[str, list[Span]] = {}
    for sp in b.spans:
        scopes.setdefault(sp.scope, []).append(Span(
            trace_id=bytes.fromhex(sp.trace_id), span_id=bytes.fromhex(sp.span_id),
            parent_span_id=bytes.fromhex(sp.parent_span_id), name=sp.name, kind=Span.SPAN_KIND_INTERNAL,
            start_time_unix_nano=sp.start_ns, end_time_unix_nano=sp.end_ns, attributes=_kvs(sp.attributes)))
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=Resource(attributes=_kvs(b.resource)),
        scope_spans=[ScopeSpans(scope=InstrumentationScope(name=n, version="0.1.0"), spans=spans)
                     for n, spans in scopes.items()])])

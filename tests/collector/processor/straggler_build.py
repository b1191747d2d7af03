"""Hand-built OTLP requests for rule-level tests: exact values, no noise."""

from __future__ import annotations

import itertools

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from straggler_sim import COHORT, kv

import otel_straggler_schema as s

_ids = itertools.count(1)


def span(stage: str, step: int | None, dev: float | None, host: float | None, *, group: str = "forward",
         tokens: int | None = None, start_ns: int = 0, span_id: bytes | None = None) -> Span:
    attrs = [kv(s.ATTR_STAGE, stage), kv(s.ATTR_STAGE_GROUP, group), kv(s.ATTR_COUNT, 1)]
    if step is not None:
        attrs.append(kv(s.ATTR_ITERATION, step))
    if dev is not None:
        attrs.append(kv(s.ATTR_DEVICE_MS, float(dev)))
    if host is not None:
        attrs.append(kv(s.ATTR_HOST_MS, float(host)))
    attrs.append(kv(s.ATTR_MEASUREMENT, s.MEASUREMENT_DEVICE if dev is not None else s.MEASUREMENT_HOST_ONLY))
    if tokens is not None:
        attrs.append(kv(s.ATTR_WORKLOAD_TOKENS, tokens))
    sid = span_id or next(_ids).to_bytes(8, "big")
    trace = s.trace_id_for_step("job-1", step or 0).to_bytes(16, "big")
    return Span(trace_id=trace, span_id=sid, name=stage, start_time_unix_nano=start_ns,
                end_time_unix_nano=start_ns + max(int((host or dev or 0) * 1e6), 0), attributes=attrs)


def resource(rank: int, *, cohort: str = COHORT, job: str = "job-1", world: int = 8) -> Resource:
    return Resource(attributes=[kv(s.RES_RANK, rank), kv(s.RES_WORLD_SIZE, world), kv(s.RES_HOST_NAME, f"h{rank}"),
                                kv(s.RES_GPU_UUID, f"GPU-{rank}"), kv(s.RES_JOB_ID, job),
                                kv(s.RES_COHORT_KEY, cohort)])


def request(per_rank: dict[int, list[Span]], **res_kw: object) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(resource_spans=[
        ResourceSpans(resource=resource(r, **res_kw), scope_spans=[ScopeSpans(spans=spans)])  # type: ignore[arg-type]
        for r, spans in per_rank.items()
    ])


def step_request(step: int, values: dict[int, tuple[float | None, float | None]], stage: str = "forward-compute",
                 group: str = "forward", tokens: dict[int, int] | None = None, **res_kw: object
                 ) -> ExportTraceServiceRequest:
    """One step of one stage: rank -> (device_ms, host_ms)."""
    return request({r: [span(stage, step, d, h, group=group, tokens=(tokens or {}).get(r))]
                    for r, (d, h) in values.items()}, **res_kw)

"""The ``filter`` processor keeps the resource spans of the listed services and drops the rest; with the straggler
processor before it, only the verdict spans go on (what the compose collector forwards to Jaeger and Tempo)."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from pydantic import ValidationError
from straggler_build import step_request
from straggler_sim import make_processor

import otel_straggler_schema as s
from collector_processor.processor.filter import Config, SpanFilter
from collector_processor.processor.straggler.config import Config as StragglerConfig
from jobsim.arrival import SimClock


def _rs(service: str | None, name: str) -> ResourceSpans:
    attrs = [KeyValue(key=s.RES_SERVICE_NAME, value=AnyValue(string_value=service))] if service else []
    return ResourceSpans(resource=Resource(attributes=attrs),
                         scope_spans=[ScopeSpans(spans=[Span(name=name, trace_id=b"\x01" * 16, span_id=b"\x02" * 8)])])


def test_keeps_only_the_listed_services() -> None:
    f = SpanFilter(Config(include_services=["otel-straggler-collector"]))
    req = ExportTraceServiceRequest(resource_spans=[_rs("megatron-training", "forward-compute"),
                                                    _rs("otel-straggler-collector", s.SPAN_VERDICT), _rs(None, "x")])
    out = f.process_traces(req)
    assert out is not None and [rs.scope_spans[0].spans[0].name for rs in out.resource_spans] == [s.SPAN_VERDICT]
    only = ExportTraceServiceRequest(resource_spans=[_rs("otel-straggler-collector", s.SPAN_VERDICT)])
    assert f.process_traces(only) is only  # nothing to drop: passed on as is
    assert f.process_traces(ExportTraceServiceRequest(resource_spans=[_rs("megatron-training", "a")])) is None


def test_config_needs_a_service() -> None:
    with pytest.raises(ValidationError):
        Config(include_services=[])
    with pytest.raises(ValidationError):
        Config(include_services=["a"], exclude=["b"])  # type: ignore[call-arg]


def test_after_the_straggler_processor_only_verdict_spans_remain() -> None:
    clock = SimClock()
    proc, _, _ = make_processor(StragglerConfig(), clock)
    f = SpanFilter(Config(include_services=["otel-straggler-collector"]))
    forwarded = []
    for st in range(30):
        out = proc.process_traces(step_request(st, {r: (72.0 if r == 3 else 60.0, 10.0) for r in range(8)}))
        assert out is not None
        kept = f.process_traces(out)
        if kept is not None:
            forwarded += [sp for rs in kept.resource_spans for ss in rs.scope_spans for sp in ss.spans]
        clock.t += 0.3
    assert forwarded and {sp.name for sp in forwarded} == {s.SPAN_VERDICT}

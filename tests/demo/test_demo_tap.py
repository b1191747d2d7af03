"""The demo's trace tap keeps at most ``max_points`` stage times and counts the rest; the run's result and its
JSON line carry that count."""

from __future__ import annotations

import json

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

import otel_straggler_schema as s
from otel_straggler_demo.options import DemoResult
from otel_straggler_demo.run import free_port
from otel_straggler_demo.tap import TraceTap


def _request(rank: int, steps: range) -> trace_service_pb2.ExportTraceServiceRequest:
    spans = [Span(name="forward-compute", attributes=[
        KeyValue(key=s.ATTR_STAGE, value=AnyValue(string_value="forward-compute")),
        KeyValue(key=s.ATTR_ITERATION, value=AnyValue(int_value=step)),
        KeyValue(key=s.ATTR_HOST_MS, value=AnyValue(double_value=50.0))]) for step in steps]
    rs = ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])
    rs.resource.attributes.append(KeyValue(key=s.RES_RANK, value=AnyValue(int_value=rank)))
    return trace_service_pb2.ExportTraceServiceRequest(resource_spans=[rs])


def test_stage_times_over_the_cap_are_counted_not_kept() -> None:
    tap, port = TraceTap(max_points=5), free_port()
    tap.start(port)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            export = trace_service_pb2_grpc.TraceServiceStub(ch).Export
            export(_request(0, range(3)), timeout=60)
            export(_request(1, range(4)), timeout=60)
    finally:
        tap.stop()
    points = tap.snapshot()
    assert len(points) == 5 and tap.dropped == 2 and tap.spans == 7
    assert [(p.rank, p.step) for p in points] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    result = DemoResult(detected=[], false_alarms=0, verdicts=0, injected={}, report_html=None, report_png=None,
                        evidence=None, spans_seen=tap.spans, elapsed_s=0.0, ok=True,
                        stage_points_dropped=tap.dropped)
    assert json.loads(result.to_json())["stage_points_dropped"] == 2

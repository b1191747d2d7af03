"""Backpressure: a full pipeline queue or the memory limiter refuses data with a retry delay the real OTel
exporters honour (gRPC ``google.rpc.retryinfo-bin`` trailer, HTTP 503 + Retry-After), and refusals are counted."""

from __future__ import annotations

import itertools
import os
import time
import urllib.error
import urllib.request

import grpc
import pytest
from google.rpc.error_details_pb2 import RetryInfo
from google.rpc.status_pb2 import Status
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import SpanExportResult
from service_support import BASE_RECEIVER, DoubleProcessor, make_spans, wait_for

SLOW = BASE_RECEIVER + """
    retry_delay: 250ms
    wait_for_processing: 0s
processors:
  double: {delay: %(delay)s}
exporters:
  debug: {}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [double], exporters: [debug], queue: {max_items: 1}}
"""


def _request(n: int = 3) -> trace_service_pb2.ExportTraceServiceRequest:
    req = trace_service_pb2.ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for _ in range(n):
        ss.spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="forward-compute")
    return req


def _fill(run, stub) -> DoubleProcessor:  # type: ignore[no-untyped-def]
    """One request in the (slow) processor and one waiting in the 1-item queue: the pipeline is full."""
    stub.Export(_request(), timeout=5)
    proc = DoubleProcessor.instances[0]
    assert wait_for(lambda: proc.concurrent == 1)
    stub.Export(_request(), timeout=5)
    return proc


def test_grpc_unavailable_with_retryinfo_and_sdk_exporter_waits_the_advertised_delay(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(SLOW % {"delay": "1.2s"})
    pipe = run.svc.pipelines["traces"]
    refused: list[float] = []
    orig = pipe.offer  # how the gRPC receiver queues a small request

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        r = orig(*a, **k)
        if getattr(r, "status", "ok") != "ok":
            refused.append(time.monotonic())
        return r

    pipe.offer = spy  # type: ignore[method-assign]
    with grpc.insecure_channel(run.grpc) as ch:
        stub = trace_service_pb2_grpc.TraceServiceStub(ch)
        proc = _fill(run, stub)
        # a raw call sees the status and the trailer
        with pytest.raises(grpc.RpcError) as ei:
            stub.Export(_request(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        trailer = dict(ei.value.trailing_metadata())["google.rpc.retryinfo-bin"]
        assert RetryInfo.FromString(trailer).retry_delay.ToNanoseconds() == 250_000_000
        refused.clear()
        exp = GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=10)
        t0 = time.monotonic()
        result = exp.export(make_spans(4))
        took = time.monotonic() - t0
        exp.shutdown()
    assert result == SpanExportResult.SUCCESS
    assert len(refused) >= 2, refused
    gaps = [b - a for a, b in itertools.pairwise(refused)]
    # every retry waits at least the advertised 0.25 s (no upper bound: a loaded machine stretches any wait)
    print(f"refusals={len(refused)} gaps_s={[round(g, 3) for g in gaps]} export_s={took:.3f}")
    assert all(g >= 0.2 for g in gaps), gaps
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/grpc", outcome="throttled") \
        == len(refused) + 1
    assert run.sample("otel_straggler_collector_spans_dropped_total", reason="queue_full") == 3 + 4 * len(refused)
    assert wait_for(lambda: len(proc.requests) == 3, timeout=8)  # the raw refused call is not retried


def test_http_503_with_retry_after_when_queue_full(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(SLOW % {"delay": "1s"})
    with grpc.insecure_channel(run.grpc) as ch:
        _fill(run, trace_service_pb2_grpc.TraceServiceStub(ch))
    req = urllib.request.Request(run.http + "/v1/traces", data=_request().SerializeToString(),
                                 headers={"Content-Type": "application/x-protobuf"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=5)
    assert ei.value.code == 503
    assert ei.value.headers["Retry-After"] == "1"  # 250 ms rounded up to whole seconds
    assert Status.FromString(ei.value.read()).code == 14  # UNAVAILABLE
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="throttled") == 1
    # the real OTLP/HTTP exporter waits Retry-After and then gets in (the slow processor frees the queue at ~1 s)
    exp = HttpSpanExporter(endpoint=run.http + "/v1/traces", timeout=10)
    t0 = time.monotonic()
    assert exp.export(make_spans(2)) == SpanExportResult.SUCCESS
    took = time.monotonic() - t0
    exp.shutdown()
    throttled = run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="throttled")
    assert throttled >= 2
    assert 0.9 * (throttled - 1) <= took, (took, throttled)  # waited Retry-After each time (no upper bound)


def test_memory_limiter_refuses_over_soft_limit(start_service) -> None:  # type: ignore[no-untyped-def]
    text = BASE_RECEIVER + """
processors:
  memory_limiter: {limit_mib: 4, spike_limit_mib: 1, check_interval: 100ms}
  double: {}
exporters:
  debug: {}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [memory_limiter, double], exporters: [debug]}
"""
    run = start_service(text)  # any Python process is far above 3 MiB RSS
    assert run.sample("otel_straggler_collector_memory_bytes") > 4 * 2**20
    with grpc.insecure_channel(run.grpc) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            trace_service_pb2_grpc.TraceServiceStub(ch).Export(_request(5), timeout=5)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "memory" in ei.value.details()
    assert run.sample("otel_straggler_collector_spans_dropped_total", reason="memory_limit") == 5
    assert DoubleProcessor.instances[0].requests == []

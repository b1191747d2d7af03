"""OTLP exporters: traces and verdict logs forwarded to real in-test backends (gRPC and HTTP), failures counted."""

from __future__ import annotations

import gzip

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult
from service_support import BASE_RECEIVER, free_port, make_spans, wait_for

import otel_straggler_schema as s


def _attrs(record) -> dict[str, object]:  # type: ignore[no-untyped-def]
    out = {}
    for kv in record.attributes:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which) if which else None
    return out


def test_traces_and_verdict_logs_reach_grpc_and_http_backends(grpc_sink, http_sink, start_service) -> None:  # type: ignore[no-untyped-def]
    text = BASE_RECEIVER + f"""
processors:
  double: {{verdicts: true}}
exporters:
  otlp/fwd: {{endpoint: 127.0.0.1:{grpc_sink.port}, tls: {{insecure: true}}, compression: gzip,
             headers: {{x-tenant: t1}}}}
  otlp_http/fwd: {{endpoint: "http://127.0.0.1:{http_sink.port}"}}
service:
  pipelines:
    traces: {{receivers: [otlp], processors: [double], exporters: [otlp/fwd, otlp_http/fwd]}}
    logs/verdicts: {{receivers: [double], exporters: [otlp/fwd, otlp_http/fwd]}}
"""
    run = start_service(text)
    exp = GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=5)
    spans = make_spans(6, rank=2)
    assert exp.export(spans) == SpanExportResult.SUCCESS
    exp.shutdown()
    assert wait_for(lambda: grpc_sink.traces and grpc_sink.logs and len(http_sink.posts) >= 2)
    fwd = grpc_sink.traces[0]
    got = [sp.span_id for rs in fwd.resource_spans for ss in rs.scope_spans for sp in ss.spans]
    assert sorted(got) == sorted(sp.context.span_id.to_bytes(8, "big") for sp in spans)
    assert grpc_sink.metadata[0]["x-tenant"] == "t1"
    rec = grpc_sink.logs[0].resource_logs[0].scope_logs[0].log_records[0]
    a = _attrs(rec)
    assert a[s.EVENT_NAME_ATTR] == s.EVENT_VERDICT and a[s.EV_RANK] == 3 and a[s.EV_VERDICT] == "straggler"
    assert rec.trace_id == bytes(range(16))
    by_path = {p: (h, b) for p, h, b in http_sink.posts}
    h, body = by_path["/v1/traces"]
    assert h["Content-Type"] == "application/x-protobuf" and h["Content-Encoding"] == "gzip"
    assert ExportTraceServiceRequest.FromString(gzip.decompress(body)) == fwd
    h, body = by_path["/v1/logs"]
    logs = ExportLogsServiceRequest.FromString(gzip.decompress(body))
    assert _attrs(logs.resource_logs[0].scope_logs[0].log_records[0])[s.EV_STAGE] == "forward-compute"
    assert run.sample("otel_straggler_collector_export_failures_total", exporter="otlp/fwd") == 0


def test_unreachable_backend_is_counted_not_fatal(start_service) -> None:  # type: ignore[no-untyped-def]
    dead = free_port()
    text = BASE_RECEIVER + f"""
processors:
  double: {{}}
exporters:
  otlp_grpc/dead: {{endpoint: "127.0.0.1:{dead}", tls: {{insecure: true}}, timeout: 200ms,
                   retry_on_failure: {{initial_interval: 50ms, max_elapsed_time: 400ms}}}}
  otlp_http/dead: {{endpoint: "http://127.0.0.1:{dead}", timeout: 200ms,
                   retry_on_failure: {{initial_interval: 50ms, max_elapsed_time: 400ms}}}}
service:
  pipelines:
    traces: {{receivers: [otlp], processors: [double], exporters: [otlp_grpc/dead, otlp_http/dead]}}
"""
    run = start_service(text)
    exp = GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=5)
    assert exp.export(make_spans(3)) == SpanExportResult.SUCCESS  # the collector accepted; forwarding fails later
    exp.shutdown()
    assert wait_for(lambda: run.sample("otel_straggler_collector_export_failures_total", exporter="otlp_grpc/dead")
                    == 1 and run.sample("otel_straggler_collector_export_failures_total",
                                        exporter="otlp_http/dead") == 1, timeout=5)
    assert run.sample("otel_straggler_collector_spans_dropped_total", reason="export_failed") == 6
    assert run.svc.healthy()


def test_retryable_http_status_is_retried_until_delivered(http_sink, start_service) -> None:  # type: ignore[no-untyped-def]
    http_sink.status = 503
    text = BASE_RECEIVER + f"""
processors:
  double: {{}}
exporters:
  otlp_http/b: {{endpoint: "http://127.0.0.1:{http_sink.port}", compression: none,
                retry_on_failure: {{initial_interval: 50ms, max_elapsed_time: 5s}}}}
service:
  pipelines:
    traces: {{receivers: [otlp], processors: [double], exporters: [otlp_http/b]}}
"""
    run = start_service(text)
    exp = GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=5)
    assert exp.export(make_spans(2)) == SpanExportResult.SUCCESS
    exp.shutdown()
    assert wait_for(lambda: len(http_sink.posts) >= 2, timeout=3)
    http_sink.status = 200
    assert wait_for(lambda: run.svc.exporters["otlp_http/b"].sent == 1, timeout=60)
    assert run.sample("otel_straggler_collector_export_failures_total", exporter="otlp_http/b") == 0
    assert "Content-Encoding" not in http_sink.posts[0][1]

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


def test_every_accepted_span_is_sent_or_counted_failed_by_reason(grpc_sink, start_service) -> None:  # type: ignore[no-untyped-def]
    """A slow trace store that also refuses one span of each request (a partial success), behind a sending queue
    of two requests: some requests fall off the queue, some spans are refused. Whatever happens, every span the
    collector accepted is accounted for at the exporter: enqueued = sent + failed (by reason) + queued, and after
    shutdown nothing is left queued."""
    grpc_sink.delay_s, grpc_sink.reject = 0.3, 1
    text = BASE_RECEIVER + f"""
processors:
  double: {{}}
exporters:
  otlp_grpc/slow: {{endpoint: "127.0.0.1:{grpc_sink.port}", tls: {{insecure: true}}, timeout: 5s,
                   sending_queue: {{queue_size: 2}}}}
service:
  pipelines:
    traces: {{receivers: [otlp], processors: [double], exporters: [otlp_grpc/slow]}}
"""
    run = start_service(text)
    exp = GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=5)
    for i in range(12):
        assert exp.export(make_spans(3, rank=i % 4)) == SpanExportResult.SUCCESS
    exp.shutdown()

    def count(name: str, **labels: str) -> float:
        return run.sample(f"otel_straggler_collector_exporter_{name}", exporter="otlp_grpc/slow", signal="traces",
                          **labels)

    def failed() -> dict[str, float]:
        return {r: count("failed_items_total", reason=r) for r in s.EXPORTER_FAILED_REASONS}

    def balanced() -> bool:
        return count("enqueued_items_total") == count("sent_items_total") + sum(failed().values()) + \
            count("queued_items")

    accepted = run.sample("otel_straggler_collector_spans_received_total", receiver="otlp/grpc")
    assert accepted == 36
    assert wait_for(lambda: count("enqueued_items_total") == accepted and count("queued_items") == 0, timeout=30)
    assert balanced()
    f = failed()
    assert f["queue_full"] > 0 and f["queue_full"] % 3 == 0  # whole requests fell off the queue
    delivered = len(grpc_sink.traces)
    assert f["partial"] == delivered  # one span refused per delivered request
    assert count("sent_items_total") == 3 * delivered - delivered
    assert run.sample("otel_straggler_collector_spans_dropped_total", reason="export_failed") == sum(f.values())
    run.svc.shutdown()
    assert balanced() and count("queued_items") == 0

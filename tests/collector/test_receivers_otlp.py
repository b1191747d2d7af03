"""OTLP receivers driven by the real OTel SDK exporters (gRPC and HTTP, gzip) and by raw clients for bad input."""

from __future__ import annotations

import gzip
import json
import os
import urllib.error
import urllib.request

import grpc
import pytest
from google.rpc.status_pb2 import Status
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import SpanExportResult
from service_support import BASE_RECEIVER, DoubleProcessor, make_spans, scrape, wait_for

CFG = BASE_RECEIVER + """
processors:
  double: {reject: %(reject)d}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [double], exporters: [debug]}
    metrics: {receivers: [otlp], exporters: [prometheus]}
exporters:
  debug: {}
  prometheus: {endpoint: 127.0.0.1:0}
"""
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _cfg(reject: int = 0) -> str:
    return CFG % {"reject": reject}


def _prom_port(run) -> int:  # type: ignore[no-untyped-def]
    return run.svc.exporters["prometheus"].port


def test_sdk_grpc_and_http_exporters_with_gzip_deliver_spans(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg())
    from opentelemetry.exporter.otlp.proto.grpc.exporter import Compression as GrpcCompression

    g = GrpcSpanExporter(endpoint=run.grpc, insecure=True, compression=GrpcCompression.Gzip, timeout=5)
    h = HttpSpanExporter(endpoint=run.http + "/v1/traces", compression=HttpCompression.Gzip, timeout=5)
    assert g.export(make_spans(5, rank=1)) == SpanExportResult.SUCCESS
    assert h.export(make_spans(7, rank=2)) == SpanExportResult.SUCCESS
    g.shutdown()
    h.shutdown()
    proc = DoubleProcessor.instances[0]
    assert wait_for(lambda: len(proc.requests) == 2)
    counts = sorted(sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans) for r in proc.requests)
    assert counts == [5, 7]
    assert proc.max_concurrent == 1
    m = scrape(f"http://127.0.0.1:{_prom_port(run)}/metrics")
    assert m["otel_straggler_collector_spans_received_total{receiver=otlp/grpc}"] == 5
    assert m["otel_straggler_collector_spans_received_total{receiver=otlp/http}"] == 7
    assert m["otel_straggler_collector_requests_total{outcome=ok,receiver=otlp/grpc}"] == 1
    assert m["otel_straggler_collector_requests_total{outcome=ok,receiver=otlp/http}"] == 1


def test_json_with_hex_ids_decodes_to_the_right_bytes(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg())
    trace_hex, span_hex, parent_hex = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174", "eee19b7ec3c1b173"
    body = {"resourceSpans": [{"resource": {"attributes": [{"key": "dl.rank", "value": {"intValue": "3"}}]},
                               "scopeSpans": [{"scope": {"name": "x"}, "spans": [{
                                   "traceId": trace_hex, "spanId": span_hex, "parentSpanId": parent_hex,
                                   "name": "forward-compute", "kind": 1, "startTimeUnixNano": "1000",
                                   "endTimeUnixNano": "2000", "unknownField": 1}]}]}]}
    for encoding in ("identity", "gzip"):
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if encoding == "gzip":
            data, headers["Content-Encoding"] = gzip.compress(data), "gzip"
        req = urllib.request.Request(run.http + "/v1/traces", data=data, headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "application/json"
            assert json.loads(resp.read()) == {}
    proc = DoubleProcessor.instances[0]
    assert wait_for(lambda: len(proc.requests) == 2)
    span = proc.requests[0].resource_spans[0].scope_spans[0].spans[0]
    assert span.trace_id == bytes.fromhex(trace_hex) and len(span.trace_id) == 16
    assert span.span_id == bytes.fromhex(span_hex)
    assert span.parent_span_id == bytes.fromhex(parent_hex)
    assert span.end_time_unix_nano == 2000
    assert proc.requests[0].resource_spans[0].resource.attributes[0].value.int_value == 3


def _post(url: str, data: bytes, ctype: str, encoding: str | None = None) -> tuple[int, bytes, dict[str, str]]:
    headers = {"Content-Type": ctype}
    if encoding:
        headers["Content-Encoding"] = encoding
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def test_malformed_bodies_get_400_with_status_and_service_survives(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg())
    good = trace_service_pb2.ExportTraceServiceRequest()
    good.resource_spans.add().scope_spans.add().spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="x")
    raw = good.SerializeToString()
    bad = [
        (os.urandom(256), "application/x-protobuf", None),  # random bytes
        (raw[: len(raw) // 2], "application/x-protobuf", None),  # truncated protobuf
        (b'{"resourceSpans": [', "application/json", None),  # bad JSON
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}', "application/json", None),
        (b'["not", "an", "object"]', "application/json", None),
        (raw, "application/x-protobuf", "gzip"),  # claims gzip, is not
        (gzip.compress(raw)[:-9], "application/x-protobuf", "gzip"),  # truncated gzip
    ]
    for data, ctype, enc in bad:
        code, body, _ = _post(run.http + "/v1/traces", data, ctype, enc)
        assert code == 400, (data[:20], ctype, enc)
        st = Status.FromString(body) if ctype != "application/json" else None
        if st is not None:
            assert st.code == 3 and st.message
    code, body, _ = _post(run.http + "/v1/traces", raw, "text/plain")
    assert code == 415
    assert Status.FromString(body).code == 3
    code, _, _ = _post(run.http + "/v1/nope", raw, "application/x-protobuf")
    assert code == 404
    # gRPC: garbage bytes through the raw method -> INVALID_ARGUMENT
    with grpc.insecure_channel(run.grpc) as ch:
        call = ch.unary_unary(TRACE_EXPORT)
        for junk in (os.urandom(64), raw[: len(raw) // 2]):
            with pytest.raises(grpc.RpcError) as ei:
                call(junk, timeout=5)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # still alive: a good request goes through the typed stub
        stub = trace_service_pb2_grpc.TraceServiceStub(ch)
        resp = stub.Export(good, timeout=5)
        assert not resp.HasField("partial_success")
    code, _, _ = _post(run.http + "/v1/traces", raw, "application/x-protobuf")
    assert code == 200
    with grpc.insecure_channel(run.grpc) as ch:  # standard gRPC health check: SERVING
        assert ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=5) == b"\x08\x01"
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="invalid") == 9
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/grpc", outcome="invalid") == 2
    assert wait_for(lambda: len(DoubleProcessor.instances[0].requests) == 2)


def test_both_protocols_report_the_collector_health(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg())

    def http_health() -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(run.http + "/healthz", timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def grpc_health() -> bytes:
        with grpc.insecure_channel(run.grpc) as ch:
            return ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=10)

    assert http_health() == (200, b"ok\n") and grpc_health() == b"\x08\x01"  # SERVING
    run.svc._running = False  # as before start or after shutdown, while the servers still answer
    try:
        assert http_health() == (503, b"unhealthy\n") and grpc_health() == b"\x08\x02"  # NOT_SERVING
    finally:
        run.svc._running = True


def test_oversized_requests_are_refused(start_service) -> None:  # type: ignore[no-untyped-def]
    text = _cfg().replace("grpc: {endpoint: 127.0.0.1:0}", "grpc: {endpoint: 127.0.0.1:0, max_recv_msg_size_mib: 0.01}")
    text = text.replace("http: {endpoint: 127.0.0.1:0}",
                        "http: {endpoint: 127.0.0.1:0, max_request_body_size_mib: 0.01}")
    run = start_service(text)
    req = trace_service_pb2.ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for _ in range(200):
        ss.spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="forward-compute" * 4)
    raw = req.SerializeToString()
    assert len(raw) > 0.01 * 2**20
    code, body, _ = _post(run.http + "/v1/traces", raw, "application/x-protobuf")
    assert code == 413 and Status.FromString(body).code == 8
    # a small gzip body that inflates past the limit (a gzip bomb) is refused without inflating it all
    bomb = gzip.compress(b"\0" * (4 * 2**20))
    assert len(bomb) < 0.01 * 2**20
    code, _, _ = _post(run.http + "/v1/traces", bomb, "application/x-protobuf", "gzip")
    assert code == 413
    with grpc.insecure_channel(run.grpc) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            trace_service_pb2_grpc.TraceServiceStub(ch).Export(req, timeout=5)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="too_large") == 2
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/grpc", outcome="too_large") == 1
    assert DoubleProcessor.instances[0].requests == []


def test_partial_success_reports_spans_the_processor_rejected(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg(reject=2))
    req = trace_service_pb2.ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for _ in range(5):
        ss.spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="x")
    with grpc.insecure_channel(run.grpc) as ch:
        resp = trace_service_pb2_grpc.TraceServiceStub(ch).Export(req, timeout=5)
    assert resp.partial_success.rejected_spans == 2
    assert "rejected" in resp.partial_success.error_message
    code, body, _ = _post(run.http + "/v1/traces", req.SerializeToString(), "application/x-protobuf")
    assert code == 200
    assert trace_service_pb2.ExportTraceServiceResponse.FromString(body).partial_success.rejected_spans == 2
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/grpc", outcome="partial") == 1


def test_bearer_token_is_required_when_configured(start_service) -> None:  # type: ignore[no-untyped-def]
    text = _cfg().replace("      http: {endpoint: 127.0.0.1:0}\n",
                          "      http: {endpoint: 127.0.0.1:0}\n    auth: {bearer_token: ${env:TOK}}\n")
    run = start_service(text, env={"TOK": "s3cret"})
    spans = make_spans(2)
    bad = GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=2, headers={"authorization": "Bearer nope"})
    assert bad.export(spans) == SpanExportResult.FAILURE
    bad.shutdown()
    good = GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=5, headers={"authorization": "Bearer s3cret"})
    assert good.export(spans) == SpanExportResult.SUCCESS
    good.shutdown()
    hb = HttpSpanExporter(endpoint=run.http + "/v1/traces", timeout=2)
    assert hb.export(spans) == SpanExportResult.FAILURE
    hg = HttpSpanExporter(endpoint=run.http + "/v1/traces", timeout=5, headers={"Authorization": "Bearer s3cret"})
    assert hg.export(spans) == SpanExportResult.SUCCESS
    assert run.sample("otel_straggler_collector_unauthenticated_total", endpoint="otlp/grpc") == 1
    assert run.sample("otel_straggler_collector_unauthenticated_total", endpoint="otlp/http") == 1
    assert wait_for(lambda: len(DoubleProcessor.instances[0].requests) == 2)


def test_concurrent_clients_are_served_and_the_processor_stays_single_threaded(start_service) -> None:  # type: ignore[no-untyped-def]
    import threading

    run = start_service(_cfg())
    results: list[SpanExportResult] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        exp = (HttpSpanExporter(endpoint=run.http + "/v1/traces", timeout=10) if i % 2
               else GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=10))
        for _ in range(5):
            r = exp.export(make_spans(3, rank=i))
            with lock:
                results.append(r)
        exp.shutdown()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [SpanExportResult.SUCCESS] * 40
    proc = DoubleProcessor.instances[0]
    assert wait_for(lambda: len(proc.requests) == 40)
    assert proc.max_concurrent == 1
    received = run.sample("otel_straggler_collector_spans_received_total", receiver="otlp/grpc") + run.sample(
        "otel_straggler_collector_spans_received_total", receiver="otlp/http")
    assert received == 120

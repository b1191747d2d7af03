"""Size limits at the receivers, honestly: a legitimate request just under the 16 MiB limit is admitted (its
decoding estimate fits the memory limiter's budget), and a gRPC message over the limit is answered
RESOURCE_EXHAUSTED, counted ``too_large`` and said in one log line per receiver, never a traceback per call."""

from __future__ import annotations

import logging
import os
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from service_support import BASE_RECEIVER, DoubleProcessor, wait_for

from collector_processor.processor.memory_limiter import rss_bytes
from collector_processor.receiver.decode import PROTOBUF_BYTES_PER_BYTE, decode_cost, small_messages

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from rel_support import rank_resource, stage_span

TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
MIB = 2**20
SHIPPED_LIMITER = "  memory_limiter: {limit_mib: 1024, spike_limit_mib: 256, check_interval: 1s}"
CFG = BASE_RECEIVER + """
processors:
  double: {}
%s
exporters:
  debug: {}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [memory_limiter, double], exporters: [debug]}
"""


def _honest(mib: float) -> bytes:
    """Stage spans of 8 ranks as the emitter's resources carry them (ints and doubles in attributes: many
    bytes below 8, which the former estimate counted as small messages), up to ``mib``."""
    req = ExportTraceServiceRequest()
    step = 0
    while step % 50 or req.ByteSize() < mib * MIB:
        for r in range(8):
            spans = [stage_span(step, r, st, host_ms=12.5, device_ms=12.0)
                     for st in ("forward-compute", "backward-compute", "optimizer", "batch-generator")]
            req.resource_spans.append(ResourceSpans(resource=rank_resource(r), scope_spans=[ScopeSpans(spans=spans)]))
        step += 1
    return req.SerializeToString()


def test_the_estimate_counts_small_messages_not_small_bytes() -> None:
    """A body of empty spans (``12 00`` pairs: all small messages) is estimated as before, 100 bytes of parsed
    messages per body byte; an honest body's doubles and small integers are not messages."""
    empty_spans = ExportTraceServiceRequest()
    ss = empty_spans.resource_spans.add().scope_spans.add()
    for _ in range(10_000):
        ss.spans.add()
    body = empty_spans.SerializeToString()
    assert small_messages(body) >= 10_000
    assert decode_cost(body) >= 100 * len(body)
    honest = _honest(1.0)
    zeros = sum(honest.count(bytes([i])) for i in range(8))
    assert small_messages(honest) < 0.5 * zeros
    assert decode_cost(honest) < 30 * len(honest)
    # chunked counting (bodies over 1 MiB) counts a pair cut by a chunk boundary once
    cut = b"x" * (MIB - 1) + b"\x0a\x00" + b"x" * 10
    assert small_messages(cut) == 1
    assert decode_cost(honest) >= PROTOBUF_BYTES_PER_BYTE * len(honest)


def test_an_honest_request_just_under_16_mib_is_admitted(start_service) -> None:  # type: ignore[no-untyped-def]
    """The shipped limits (1024 MiB, spike 256) leave a fresh collector (~110 MiB RSS) a budget of ~660 MiB; the
    limit here is raised by what this pytest process holds beyond that, so the budget is the same."""
    body = _honest(13.7)
    assert 13.7 * MIB <= len(body) < 16 * MIB
    assert decode_cost(body) < (1024 - 256 - 110) * MIB
    limit = 1024 + max(0, int(rss_bytes() / MIB) - 110)
    run = start_service(CFG % SHIPPED_LIMITER.replace("limit_mib: 1024", f"limit_mib: {limit}"))
    with grpc.insecure_channel(run.grpc, options=[("grpc.max_send_message_length", -1)]) as ch:
        ch.unary_unary(TRACE_EXPORT)(body, timeout=60)
    req = urllib.request.Request(run.http + "/v1/traces", data=body, method="POST",
                                 headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
    assert len(DoubleProcessor.instances[0].requests) == 2
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="too_large") == 0


def test_an_oversize_grpc_message_is_one_log_line_not_a_traceback(start_service, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.DEBUG)
    run = start_service((CFG % SHIPPED_LIMITER).replace("grpc: {endpoint: 127.0.0.1:0}",
                                                        "grpc: {endpoint: 127.0.0.1:0, max_recv_msg_size_mib: 1}"))
    with grpc.insecure_channel(run.grpc, options=[("grpc.max_send_message_length", -1)]) as ch:
        for _ in range(5):  # inflates past the limit: gRPC core refuses it after the handler started
            with pytest.raises(grpc.RpcError) as ei:
                ch.unary_unary(TRACE_EXPORT)(os.urandom(16) * (3 * MIB // 16), timeout=20,
                                             compression=grpc.Compression.Gzip)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert wait_for(lambda: run.sample("otel_straggler_collector_requests_total", receiver="otlp/grpc",
                                       outcome="too_large") == 5, 10.0)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in warnings if r.exc_info or "Traceback" in r.getMessage()], warnings
    oversize = [r for r in warnings if "max_recv_msg_size_mib" in r.getMessage()]
    assert len(oversize) == 1

"""Size limits at the receivers, honestly: a legitimate request just under the 16 MiB limit is admitted (its
decoding estimate fits the memory limiter's budget), and a gRPC message over the limit is answered
RESOURCE_EXHAUSTED, counted ``too_large`` and said in one log line per receiver, never a traceback per call."""

from __future__ import annotations

import logging
import os
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from service_support import BASE_RECEIVER, DoubleProcessor, wait_for

from collector_processor.component import Refusal
from collector_processor.processor.memory_limiter import BURST_BYTES, rss_bytes
from collector_processor.receiver import common
from collector_processor.receiver.common import Dispatcher
from collector_processor.receiver.decode import (
    BOUND_BYTES,
    CT_JSON,
    CT_PROTOBUF,
    PROTOBUF_BYTES_PER_BYTE,
    decode_cost,
    decode_cost_bound,
    small_messages,
)
from collector_processor.telemetry import Telemetry

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


def _honest(mib: float, steps: int = 50) -> bytes:
    """Stage spans of 8 ranks as the emitter's resources carry them (ints and doubles in attributes: many
    bytes below 8, which the former estimate counted as small messages), up to ``mib`` in whole runs of
    ``steps`` steps."""
    req = ExportTraceServiceRequest()
    step = 0
    while step % steps or req.ByteSize() < mib * MIB:
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


class _Gate:
    """An admission gate (``component.Admission``) with room for ``room`` bytes at once, recording each ask."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.asked: list[int] = []
        self.reserved = 0

    def reserve(self, nbytes: int) -> Refusal | None:
        self.asked.append(nbytes)
        if self.reserved + nbytes > self.room:
            return Refusal("memory_limit", "no room")
        self.reserved += nbytes
        return None

    def refusal(self) -> Refusal | None:
        return None

    def hold(self, nbytes: int) -> None:
        self.reserved += nbytes

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def budget(self) -> int:
        return self.room


def _prepare(gate: _Gate, body: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[object, int]:
    """``Dispatcher.prepare`` of ``body`` behind ``gate``: its result and how often the body was scanned."""
    scans = []

    def counted(data: bytes, ctype: str = CT_PROTOBUF) -> int:
        scans.append(len(data))
        return decode_cost(data, ctype)

    monkeypatch.setattr(common, "decode_cost", counted)
    d = Dispatcher("otlp/test", Telemetry(), {"traces": [SimpleNamespace(admission=[gate])]}, 0.0)  # type: ignore[list-item]
    return d.prepare("traces", body), len(scans)


def test_a_small_body_reserves_its_most_without_being_scanned(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room, a protobuf body of up to ``BOUND_BYTES`` reserves the most its decoding could take, known from
    its length; the scan, which costs about as much as parsing it, is skipped."""
    body = _honest(0.1, steps=1)
    assert len(body) <= BOUND_BYTES and decode_cost(body) > 1 * MIB  # reserved at all (UNRESERVED_BYTES)
    gate = _Gate(1 << 40)
    out, scans = _prepare(gate, body, monkeypatch)
    assert isinstance(out, tuple) and out[1] > 0
    assert scans == 0
    assert gate.asked == [decode_cost_bound(body)]
    assert gate.reserved == 0  # released once decoded


def test_when_the_most_is_refused_the_estimate_is_what_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Near the limit nothing changes: a body whose most does not fit but whose estimate does is admitted, one
    whose estimate does not fit either is refused, and nothing stays reserved."""
    body = _honest(0.1, steps=1)
    estimate, most = decode_cost(body), decode_cost_bound(body)
    assert most is not None and estimate < most
    gate = _Gate(estimate)
    out, scans = _prepare(gate, body, monkeypatch)
    assert isinstance(out, tuple)
    assert scans == 1 and gate.asked == [most, estimate] and gate.reserved == 0
    gate = _Gate(estimate - 1)
    out, _ = _prepare(gate, body, monkeypatch)
    assert isinstance(out, Refusal) and out.reason == "memory_limit"
    assert gate.asked == [most, estimate] and gate.reserved == 0


@given(st.binary(max_size=4096) | st.lists(st.sampled_from([b"\x0a\x00", b"\x12\x03abc", b"\x7a\x07", b"\x00"]),
                                           max_size=2000).map(b"".join))
@settings(max_examples=300, deadline=None)
def test_the_most_is_never_below_the_estimate(body: bytes) -> None:
    most = decode_cost_bound(body)
    assert most is not None and most >= decode_cost(body)


def test_only_small_protobuf_bodies_are_bounded_by_length() -> None:
    assert decode_cost_bound(b"\x0a\x00" * (BOUND_BYTES // 2)) is not None
    assert decode_cost_bound(b"\x0a\x00" * (BOUND_BYTES // 2) + b"x") is None  # scanned
    assert decode_cost_bound(b"{}", CT_JSON) is None
    assert decode_cost_bound(b"\x0a\x00", CT_PROTOBUF + "; charset=binary") is not None
    assert decode_cost_bound(b"\x0a\x00" * (BOUND_BYTES // 2)) < BURST_BYTES  # never marks a burst

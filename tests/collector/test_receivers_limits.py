"""Size limits at the receivers, honestly: a legitimate request just under the 16 MiB limit is admitted (its
decoding estimate fits the memory limiter's budget), and a gRPC message over the limit is answered
RESOURCE_EXHAUSTED, counted ``too_large`` and said in one log line per receiver, never a traceback per call."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from service_support import BASE_RECEIVER, DoubleProcessor, scrape, wait_for

from collector_processor.component import Refusal
from collector_processor.processor import memory_limiter
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
from jobsim.load import length_delimited

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from rel_support import rank_resource, stage_span

REPO = Path(__file__).resolve().parents[2]
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


# ---- what a receiver says it admits, and that it does ---------------------------------------------------------

_LISTEN = re.compile(r"listening: otlp (OTLP/GRPC|OTLP/HTTP|metrics) (?:https?://)?127\.0\.0\.1:(\d+)|"
                     r"listening: prometheus (metrics) http://127\.0\.0\.1:(\d+)")


def _costliest(nbytes: int) -> bytes:
    """A valid request of about ``nbytes`` that the decoding estimate prices highest per byte: one span whose
    attributes are empty KeyValues (``4a 00``: every other byte starts a message), none of them an item."""
    attrs = b"\x4a\x00" * ((nbytes - 16) // 2)
    return length_delimited(1, length_delimited(2, length_delimited(2, attrs)))


def test_the_shipped_collector_admits_what_it_says_it_admits_when_idle(tmp_path: Path) -> None:
    """A collector process on the shipped configuration exports, per receiver, the largest body it admits
    whatever the body holds (``receiver_admitted_bytes``, logged). A body of the costliest shape of that size is
    admitted over gRPC and then over HTTP once the first one was processed (the worker holds no request once it is
    done), and its memory comes back; one of twice that size is refused for good (413 / RESOURCE_EXHAUSTED)."""
    env = {**os.environ, "OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT": "127.0.0.1:0",
           "OTEL_STRAGGLER_OTLP_HTTP_ENDPOINT": "127.0.0.1:0", "OTEL_STRAGGLER_METRICS_ENDPOINT": "127.0.0.1:0",
           "OTEL_STRAGGLER_EVIDENCE_PATH": str(tmp_path / "verdicts.jsonl"), "OTEL_STRAGGLER_TRACES_ENDPOINT": ""}
    proc = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config",
                             str(REPO / "configs" / "collector.yaml")], cwd=tmp_path, env=env,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        ports: dict[str, int] = {}
        while len(ports) < 3:
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
            for m in _LISTEN.finditer(line):
                what, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
                ports[what] = int(port)
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
        metrics = f"http://127.0.0.1:{ports['metrics']}/metrics"
        admitted = {r: scrape(metrics)[f"otel_straggler_collector_receiver_admitted_bytes{{receiver=otlp/{r}}}"]
                    for r in ("grpc", "http")}
        # the shipped limits leave a fresh collector a budget of ~650 MiB: a few MiB of any body, under 16 MiB
        assert all(2 * MIB < a < 16 * MIB for a in admitted.values()), admitted
        assert any("admits any request up to" in x for x in lines)

        def idle() -> bool:
            return scrape(metrics)["otel_straggler_collector_queue_depth{queue=traces}"] == 0

        body = _costliest(int(admitted["grpc"]))
        assert len(body) <= admitted["grpc"] and decode_cost(body) > 120 * len(body)
        with grpc.insecure_channel(f"127.0.0.1:{ports['OTLP/GRPC']}",
                                   options=[("grpc.max_send_message_length", -1)]) as ch:
            ch.unary_unary(TRACE_EXPORT)(body, timeout=60)
            assert wait_for(idle, timeout=60)
            body = _costliest(int(admitted["http"]))
            req = urllib.request.Request(f"http://127.0.0.1:{ports['OTLP/HTTP']}/v1/traces", data=body,
                                         method="POST", headers={"Content-Type": "application/x-protobuf"})
            # a client retries after the 503's Retry-After (1 s), as the OTel exporters do
            assert wait_for(lambda: _status(req) == 200, timeout=30, interval=1.0), "".join(lines[-20:])
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(TRACE_EXPORT)(_costliest(2 * int(admitted["grpc"])), timeout=60)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        samples = scrape(metrics)
        assert samples["otel_straggler_collector_requests_total{outcome=too_large,receiver=otlp/grpc}"] == 1
        assert samples["otel_straggler_collector_requests_total{outcome=throttled,receiver=otlp/http}"] <= 2
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _status(req: urllib.request.Request) -> int:
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_limiter_returns_freed_heap_before_it_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """RSS may count heap the allocator kept after earlier requests. A reservation that RSS refuses trims first
    and looks again, at most every ``REFUSED_TRIM_EVERY_S``; what the trim cannot give back is refused."""
    rss = {"now": 100 * MIB, "after_trim": 100 * MIB}
    trims: list[int] = []

    def trim(collect: bool = True) -> None:
        trims.append(1)
        rss["now"] = rss["after_trim"]

    monkeypatch.setattr(memory_limiter, "rss_bytes", lambda: rss["now"])
    monkeypatch.setattr(memory_limiter, "trim", trim)
    lim = memory_limiter.MemoryLimiter(memory_limiter.Config(limit_mib=1000, spike_limit_mib=200), Telemetry())
    trims.clear()
    rss["now"] = 700 * MIB  # freed heap still counted: the trim gives it back
    assert lim.reserve(150 * MIB) is None and trims == [1]
    rss["now"] = 700 * MIB  # again within the second: refused without a trim
    assert isinstance(lim.reserve(100 * MIB), Refusal) and trims == [1]
    lim._refused_trim_s -= memory_limiter.REFUSED_TRIM_EVERY_S
    rss["after_trim"] = 700 * MIB  # really held: trimmed, still refused, nothing reserved by the refusal
    assert isinstance(lim.reserve(100 * MIB), Refusal) and trims == [1, 1]
    lim.release(150 * MIB)
    assert lim._reserved == 0


def test_a_tenant_reserves_at_most_its_share_of_the_memory_budget() -> None:
    """A tenant alone may reserve the whole budget (an idle collector admits what it holds). Once another tenant
    waits (refused by the gate) or holds memory, a tenant past half of the budget is refused (retry later) beyond
    its share, counted for it; the all-jobs token meets the gate alone; released memory comes back."""
    from collector_processor.receiver.auth import EVERYONE, Tenant

    tel = Telemetry()
    gate = _Gate(120 * MIB)
    d = Dispatcher("otlp/test", tel, {"traces": [SimpleNamespace(admission=[gate])]}, 0.0)  # type: ignore[list-item]
    a, b = Tenant("a", frozenset({"job-a"})), Tenant("b", frozenset({"job-b"}))
    assert [d.reserve("traces", 20 * MIB, a) for _ in range(5)] == [None] * 5  # alone: 100 of 120
    assert isinstance(d.reserve("traces", 40 * MIB, b), Refusal)  # the gate: no room; b now waits
    refusal = d.reserve("traces", 10 * MIB, a)  # a past half while b waits: over 120 // 2
    assert isinstance(refusal, Refusal) and refusal.retry and "share" in refusal.message
    assert tel.registry.get_sample_value("otel_straggler_collector_tenant_evictions_total",
                                         {"tenant": "a", "structure": "memory"}) == 1
    d.release("traces", 40 * MIB, a)
    assert d.reserve("traces", 40 * MIB, b) is None  # b's turn
    assert isinstance(d.reserve("traces", 10 * MIB, a), Refusal)  # a holds 60 of its 60 while b holds some
    assert d.reserve("traces", 10 * MIB, EVERYONE) is None and gate.reserved == 110 * MIB
    d.release("traces", 40 * MIB, b)
    assert d.reserve("traces", 10 * MIB, a) is None  # b is done, a's share grows back

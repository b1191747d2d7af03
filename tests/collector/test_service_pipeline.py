"""Pipeline behaviour: processor faults fail open, the queue's byte cap, the real straggler processor end to end
(verdict span forwarded in the step's trace, verdict event as an OTLP log, Prometheus series), and TLS."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from service_support import BASE_RECEIVER, make_spans, scrape, wait_for

import otel_straggler_schema as s
from collector_processor.pipeline import Pipeline, Result, Stage
from collector_processor.telemetry import Telemetry
from jobsim.faults import Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, SimConfig


class _Exploding:
    def process_traces(self, req):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    def tick(self, now_s: float) -> None:
        raise RuntimeError("tick boom")


class _Sink:
    def __init__(self) -> None:
        self.got: list[object] = []

    def export_traces(self, req) -> None:  # type: ignore[no-untyped-def]
        self.got.append(req)


def _req(n: int = 1, name: str = "x") -> trace_service_pb2.ExportTraceServiceRequest:
    req = trace_service_pb2.ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for _ in range(n):
        ss.spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name=name)
    return req


def test_processor_exception_fails_open_and_is_counted() -> None:
    t = Telemetry()
    sink = _Sink()
    p = Pipeline("traces", t, max_items=10, max_bytes=1 << 20, processors=[Stage("bad", _Exploding())],
                 exporters=[("sink", sink)])
    p.start()
    req = _req(3)
    assert p.submit(req, req.ByteSize(), 3, wait_s=2.0).status == "ok"
    assert wait_for(lambda: sink.got == [req])
    assert p.close(__import__("time").monotonic() + 2)
    assert t.registry.get_sample_value("otel_straggler_collector_component_errors_total", {"component": "bad"}) >= 2


class _Counting:
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def export_traces(self, req) -> None:  # type: ignore[no-untyped-def]
        self.sizes.append(req.ByteSize())


def test_a_waiting_worker_holds_no_request() -> None:
    """Once a request was handled, the worker waiting for the next one holds no reference to it: an idle collector
    gives a large request's memory back at once, not when the next request arrives."""
    sink = _Counting()
    p = Pipeline("traces", Telemetry(), max_items=10, max_bytes=1 << 20, processors=[], exporters=[("sink", sink)])
    p.start()
    req = _req(3)
    before = sys.getrefcount(req)
    assert p.submit(req, req.ByteSize(), 3, wait_s=2.0).status == "ok"
    assert wait_for(lambda: sink.sizes == [req.ByteSize()])
    assert wait_for(lambda: sys.getrefcount(req) == before, timeout=5), sys.getrefcount(req) - before
    assert p.close(time.monotonic() + 2)


def test_a_tenants_flood_fills_at_most_its_share_of_the_queue() -> None:
    """Past half of its caps, a queue refuses a tenant's request while the tenant holds its share (the caps over
    the tenants with requests queued plus one), counted for it: another tenant's requests still go in, the
    all-jobs token's are not shared out, and a share comes back as its requests leave the queue."""
    t = Telemetry()
    p = Pipeline("traces", t, max_items=12, max_bytes=1 << 20, processors=[], exporters=[])  # worker not started
    req = _req()

    def offer(share: str, times: int) -> list[str]:
        return [p.submit(req, 100, 1, share=share, label=share).status for _ in range(times)]

    assert offer("a", 10) == ["ok"] * 6 + ["throttled"] * 4  # alone past half: at most 12 // 2
    assert offer("b", 5) == ["ok"] * 4 + ["throttled"]  # a newcomer gets in, then holds 12 // 3
    assert offer("", 3) == ["ok", "ok", "throttled"]  # the all-jobs token: only the queue's own cap
    refused = {who: t.registry.get_sample_value("otel_straggler_collector_tenant_evictions_total",
                                                {"tenant": who, "structure": "queue:traces"}) for who in "ab"}
    assert refused == {"a": 4, "b": 1}
    assert p.submit(req, 100, 1, share="c").reason == "queue_full"  # the queue itself is full
    with p._lock:
        for _ in range(3):
            p._taken(p._q.get_nowait())  # three of a's requests leave
    assert p._shares["a"] == [3, 300] and offer("c", 1) == ["ok"]  # room again for a newcomer


def test_queue_byte_cap_refuses_and_counts() -> None:
    t = Telemetry()
    p = Pipeline("traces", t, max_items=100, max_bytes=1000, processors=[], exporters=[])  # worker not started
    big = _req(5, name="y" * 100)
    assert p.submit(big, 900, 5).status == "ok"
    r = p.submit(big, 900, 5)
    assert (r.status, r.reason) == ("throttled", "queue_full")
    assert p.submit(_req(), 50, 1).status == "ok"  # what still fits is taken
    # a single request bigger than the cap is accepted into an empty queue (it could never be sent otherwise)
    q = Pipeline("traces", t, max_items=100, max_bytes=10, processors=[], exporters=[])
    assert q.submit(big, 900, 5).status == "ok"


class _Recorder:
    """Rejects every other span; records the thread each request was processed on; sleeps ``delay`` s per request."""

    last_rejected = 0

    def __init__(self, delay: float = 0.0) -> None:
        self.threads: list[str] = []
        self.delay = delay

    def process_traces(self, req):  # type: ignore[no-untyped-def]
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        self.last_rejected = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans) // 2
        return req


def test_process_now_runs_on_the_callers_thread_only_when_the_pipeline_is_idle() -> None:
    t = Telemetry()
    rec, sink = _Recorder(), _Sink()
    p = Pipeline("traces", t, max_items=10, max_bytes=1 << 20, processors=[Stage("rec", rec)],
                 exporters=[("sink", sink)])
    req = _req(4)
    item = p.process_now(req, 100, 4)  # idle (worker not even started): processed here, rejections reported
    assert not isinstance(item, Result) and item is not None and item.rejected == 2
    assert rec.threads == [threading.current_thread().name] and sink.got == [req]
    assert p.submit(_req(), 10, 1).status == "ok"  # queued, worker not started: the next one must queue behind it
    assert p.process_now(_req(), 10, 1) is None
    p.start()
    assert wait_for(lambda: len(rec.threads) == 2) and rec.threads[1] == "pipeline-traces"
    assert p.close(time.monotonic() + 2)
    r = p.process_now(_req(), 10, 1)  # closing: refused like offer
    assert isinstance(r, Result) and r.reason == "shutting_down"


def test_process_now_stops_after_a_slow_item() -> None:
    rec = _Recorder(delay=0.3)  # 0.29 s charged against a 0.1 s budget
    p = Pipeline("traces", Telemetry(), max_items=10, max_bytes=1 << 20, processors=[Stage("rec", rec)],
                 exporters=[])
    assert p.process_now(_req(), 10, 1) is not None
    assert p.process_now(_req(), 10, 1) is None  # the slow processor must not hold a receiver's event loop
    assert rec.threads == [threading.current_thread().name]


def _inline_deferred(t: Telemetry, pid: str = "traces") -> float | None:
    return t.registry.get_sample_value(s.M_INLINE_DEFERRED, {"pipeline": pid})


def test_process_now_budget_bounds_the_callers_time_on_items_just_under_a_quarter_second() -> None:
    """A client whose requests each take just under 250 ms to process must not keep a receiver's event loop busy:
    once the inline budget is spent, such requests are queued (and counted) instead of processed on the caller's
    thread."""
    t = Telemetry()
    rec = _Recorder(delay=0.2)
    p = Pipeline("traces", t, max_items=10, max_bytes=1 << 20, processors=[Stage("rec", rec)], exporters=[])
    inline = [p.process_now(_req(), 10, 1) is not None for _ in range(4)]
    assert inline == [True, False, False, False]
    assert rec.threads == [threading.current_thread().name]
    assert _inline_deferred(t) == 3.0
    assert _inline_deferred(Telemetry()) is None
    Pipeline("traces", t2 := Telemetry(), max_items=1, max_bytes=1, processors=[], exporters=[])
    assert _inline_deferred(t2) == 0.0  # exported from the start


class _Clock:
    """A monotonic clock the test moves (``pipeline.time`` replaced: the budget's refill without waiting)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


class _Costly:
    """Takes ``cost`` seconds of the fake clock per request."""

    last_rejected = 0

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.cost = 0.0
        self.calls = 0

    def process_traces(self, req):  # type: ignore[no-untyped-def]
        self.calls += 1
        self.clock.now += self.cost
        return req


def test_process_now_budget_charges_only_long_items_and_refills(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import collector_processor.pipeline as pl

    clock = _Clock()
    monkeypatch.setattr(pl, "time", clock)
    t = Telemetry()
    proc = _Costly(clock)
    p = Pipeline("traces", t, max_items=10, max_bytes=1 << 20, processors=[Stage("c", proc)], exporters=[])
    proc.cost = pl.INLINE_FREE_S  # a quick item, back to back: never charged
    assert all(p.process_now(_req(), 10, 1) is not None for _ in range(1000))
    proc.cost = 0.07  # 60 ms charged each: the 0.1 s credit lasts two items
    assert [p.process_now(_req(), 10, 1) is not None for _ in range(3)] == [True, True, False]
    clock.now += 0.5  # refilled by 0.05 s: positive again, one more item
    assert p.process_now(_req(), 10, 1) is not None
    assert p.process_now(_req(), 10, 1) is None
    proc.cost = 100.0  # one pathological item: its debt is capped, the path is back within 10 s
    clock.now += 10.0
    assert p.process_now(_req(), 10, 1) is not None
    clock.now += 1.0 / pl.INLINE_BUDGET_S * pl.INLINE_MAX_DEBT_S + 0.01
    proc.cost = 0.0
    assert p.process_now(_req(), 10, 1) is not None
    assert _inline_deferred(t) == 2.0


def test_process_now_waits_for_the_worker_item() -> None:
    """While the worker processes an item, process_now does not run a second one beside it."""
    rec = _Recorder(delay=0.3)
    p = Pipeline("traces", Telemetry(), max_items=10, max_bytes=1 << 20, processors=[Stage("rec", rec)],
                 exporters=[])
    p.start()
    assert p.submit(_req(), 10, 1).status == "ok"
    assert wait_for(lambda: len(rec.threads) == 1)
    assert p.process_now(_req(), 10, 1) is None
    assert p.close(time.monotonic() + 2)


def test_real_straggler_processor_end_to_end(grpc_sink, start_service) -> None:  # type: ignore[no-untyped-def]
    text = BASE_RECEIVER + f"""
processors:
  straggler: {{}}
exporters:
  otlp_grpc/backend: {{endpoint: "127.0.0.1:{grpc_sink.port}", tls: {{insecure: true}}}}
  prometheus: {{endpoint: 127.0.0.1:0}}
service:
  pipelines:
    traces: {{receivers: [otlp], processors: [straggler], exporters: [otlp_grpc/backend]}}
    logs/verdicts: {{receivers: [straggler], exporters: [otlp_grpc/backend]}}
    metrics: {{receivers: [otlp], exporters: [prometheus]}}
"""
    run = start_service(text)
    stream = JobStream(SimConfig(layout=Layout(dp=8), steps=60, job="e2e"),
                       [Fault("device", rank=5, stages=("backward-compute",), size=0.3, onset=20)])
    with grpc.insecure_channel(run.grpc) as ch:
        stub = trace_service_pb2_grpc.TraceServiceStub(ch)
        for _step, req in stream:
            resp = stub.Export(req, timeout=10)
            assert resp.partial_success.rejected_spans == 0

    def verdict_logs() -> list[dict[str, object]]:
        out = []
        for lr in grpc_sink.logs:
            for rl in lr.resource_logs:
                for sl in rl.scope_logs:
                    for rec in sl.log_records:
                        out.append({kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in rec.attributes})
        return out

    assert wait_for(lambda: any(v.get(s.EV_VERDICT) == s.VERDICT_STRAGGLER for v in verdict_logs()), timeout=5)
    hit = next(v for v in verdict_logs() if v.get(s.EV_VERDICT) == s.VERDICT_STRAGGLER)
    assert (hit[s.EV_RANK], hit[s.EV_STAGE]) == (5, "backward-compute")
    # the verdict span is forwarded inside the trace of the step where it fired
    def verdict_spans() -> list[tuple[bytes, dict[str, object]]]:
        return [(sp.trace_id, {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in sp.attributes})
                for r in grpc_sink.traces for rs in r.resource_spans for ss in rs.scope_spans for sp in ss.spans
                if sp.name == s.SPAN_VERDICT]

    def straggler_span() -> tuple[bytes, dict[str, object]] | None:
        return next((x for x in verdict_spans() if x[1].get(s.EV_VERDICT) == s.VERDICT_STRAGGLER), None)

    assert wait_for(straggler_span, timeout=60)
    trace_id, attrs = straggler_span()  # type: ignore[misc]
    assert attrs[s.EV_RANK] == 5 and attrs[s.EV_STEP] == hit[s.EV_STEP]
    assert trace_id == s.trace_id_for_step("e2e", hit[s.EV_STEP]).to_bytes(16, "big")
    m = scrape(f"http://127.0.0.1:{run.svc.exporters['prometheus'].port}/metrics")
    active = [k for k, v in m.items() if k.startswith(s.M_STRAGGLER_ACTIVE + "{") and v == 1]
    assert len(active) == 1 and "rank=5" in active[0]
    assert m[s.M_SPANS_ACCEPTED] > 0


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary to make test certificates")
def test_mutual_tls_on_grpc_and_http(start_service, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=tmp_path)
    for who in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", f"{who}.key",
                 "-out", f"{who}.csr", cwd=tmp_path)
        (tmp_path / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "1", "-extfile", "ext.cnf", "-out", f"{who}.pem", cwd=tmp_path)
    text = BASE_RECEIVER + f"""
    tls: {{cert_file: "{tmp_path}/server.pem", key_file: "{tmp_path}/server.key",
           client_ca_file: "{tmp_path}/ca.pem"}}
processors:
  double: {{}}
exporters:
  debug: {{}}
service:
  pipelines:
    traces: {{receivers: [otlp], processors: [double], exporters: [debug]}}
"""
    run = start_service(text)
    ca = (tmp_path / "ca.pem").read_bytes()
    good = grpc.ssl_channel_credentials(ca, (tmp_path / "client.key").read_bytes(),
                                        (tmp_path / "client.pem").read_bytes())
    exp = OTLPSpanExporter(endpoint=f"localhost:{run.port('grpc')}", credentials=good, timeout=5)
    assert exp.export(make_spans(2)) == SpanExportResult.SUCCESS
    exp.shutdown()
    no_cert = OTLPSpanExporter(endpoint=f"localhost:{run.port('grpc')}",
                               credentials=grpc.ssl_channel_credentials(ca), timeout=1)
    assert no_cert.export(make_spans(1)) == SpanExportResult.FAILURE
    no_cert.shutdown()
    import ssl
    import urllib.request

    ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    ctx.load_cert_chain(str(tmp_path / "client.pem"), str(tmp_path / "client.key"))
    req = urllib.request.Request(f"https://localhost:{run.port('http')}/v1/traces",
                                 data=_req().SerializeToString(),
                                 headers={"Content-Type": "application/x-protobuf"}, method="POST")
    with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
        assert resp.status == 200

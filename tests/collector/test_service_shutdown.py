"""Graceful drain: queued requests are processed, the processor's shutdown verdicts reach the exporters, evidence is
flushed; a real collector subprocess on SIGTERM exits 0 within its bound."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from service_support import BASE_RECEIVER, DoubleProcessor, scrape, wait_for

import otel_straggler_schema as s
from jobsim.faults import Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, SimConfig

REPO = Path(__file__).resolve().parents[2]


def test_drain_processes_queue_then_flushes_processor_verdicts(start_service, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "v.jsonl"
    text = BASE_RECEIVER + f"""
    wait_for_processing: 0s
processors:
  double: {{delay: 100ms, verdicts: true}}
exporters:
  file/evidence: {{path: "{path}", flush_interval: 1h}}
  debug: {{}}
service:
  pipelines:
    traces: {{receivers: [otlp], processors: [double], exporters: [debug]}}
    logs/verdicts: {{receivers: [double], exporters: [file/evidence]}}
"""
    run = start_service(text)
    req = trace_service_pb2.ExportTraceServiceRequest()
    req.resource_spans.add().scope_spans.add().spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="x")
    with grpc.insecure_channel(run.grpc) as ch:
        stub = trace_service_pb2_grpc.TraceServiceStub(ch)
        for _ in range(6):
            stub.Export(req, timeout=5)
    proc = DoubleProcessor.instances[0]
    assert len(proc.requests) < 6  # still queued when the drain starts
    assert run.svc.shutdown(60.0) is True  # drained (True), within a generous bound
    assert len(proc.requests) == 6 and proc.shutdown_called
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 9999]  # in order, the shutdown verdict last
    assert run.sample("otel_straggler_collector_queue_depth", queue="traces") == 0


def _read_ports(proc: subprocess.Popen[str], lines: list[str]) -> dict[str, int]:
    ports: dict[str, int] = {}
    deadline = time.monotonic() + 20
    assert proc.stderr is not None
    while time.monotonic() < deadline and len(ports) < 2:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening: otlp OTLP/GRPC 127\.0\.0\.1:(\d+)", line)
        if m:
            ports["grpc"] = int(m.group(1))
        m = re.search(r"listening: prometheus metrics http://127\.0\.0\.1:(\d+)/metrics", line)
        if m:
            ports["metrics"] = int(m.group(1))
    return ports


def test_sigterm_drains_a_real_collector_process(tmp_path: Path) -> None:
    evidence = tmp_path / "ev" / "verdicts.jsonl"
    cfg = tmp_path / "c.yaml"
    cfg.write_text((REPO / "configs" / "collector.yaml").read_text())
    over = tmp_path / "over.yaml"
    over.write_text("exporters:\n  file/evidence: {flush_interval: 1h}\n")  # only the drain may write it
    env = {**os.environ, "OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT": "127.0.0.1:0",
           "OTEL_STRAGGLER_OTLP_HTTP_ENDPOINT": "127.0.0.1:0", "OTEL_STRAGGLER_METRICS_ENDPOINT": "127.0.0.1:0",
           "OTEL_STRAGGLER_EVIDENCE_PATH": str(evidence), "OTEL_STRAGGLER_TRACES_ENDPOINT": ""}
    proc = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config", str(cfg), "--config",
                             str(over)], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        ports = _read_ports(proc, lines)
        assert set(ports) == {"grpc", "metrics"}, "".join(lines)
        rest: list[str] = []
        pump = threading.Thread(target=lambda: rest.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
        pump.start()
        stream = JobStream(SimConfig(layout=Layout(dp=8), steps=60, job="sig-job"),
                           [Fault("device", rank=3, stages=("forward-compute",), size=0.3, onset=20)])
        n_spans = 0
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as ch:
            stub = trace_service_pb2_grpc.TraceServiceStub(ch)
            for _step, req in stream:
                n_spans += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
                stub.Export(req, timeout=10)
        url = f"http://127.0.0.1:{ports['metrics']}/metrics"
        assert wait_for(lambda: scrape(url).get(
            "otel_straggler_collector_spans_received_total{receiver=otlp/grpc}") == n_spans, timeout=60)
        assert not evidence.exists() or evidence.read_text() == ""
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - t0
        pump.join(2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    log = "".join(lines + rest)
    assert rc == 0, log
    print(f"drained and exited {took:.1f} s after SIGTERM")
    assert "received SIGTERM, draining" in log and "exit (drained)" in log
    verdicts = [json.loads(x) for x in evidence.read_text().splitlines()]
    assert verdicts, log
    stragglers = {(v["rank"], v["stage"]) for v in verdicts if v["verdict"] == s.VERDICT_STRAGGLER}
    assert (3, "forward-compute") in stragglers
    assert "verdict=straggler" in log and "rank=3" in log  # debug exporter on stderr


def test_drain_is_bounded_while_a_processor_is_busy_with_a_long_request(start_service) -> None:  # type: ignore[no-untyped-def]
    """A request the processor takes far longer than the shutdown timeout to process: the drain gives up on that
    processor (counted) instead of waiting for it."""
    text = BASE_RECEIVER + """
    wait_for_processing: 0s
processors:
  double: {delay: 60s}
exporters:
  debug: {}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [double], exporters: [debug]}
"""
    run = start_service(text)
    req = trace_service_pb2.ExportTraceServiceRequest()
    req.resource_spans.add().scope_spans.add().spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="x")
    with grpc.insecure_channel(run.grpc) as ch:
        trace_service_pb2_grpc.TraceServiceStub(ch).Export(req, timeout=5)
    proc = DoubleProcessor.instances[0]
    assert wait_for(lambda: proc.concurrent == 1)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(run.svc.shutdown(2.0)), daemon=True)
    t.start()
    t.join(30)  # generous: the processor would hold it for 60 s
    assert not t.is_alive() and result == [False]
    assert not proc.shutdown_called
    assert run.sample("otel_straggler_collector_component_errors_total", component="double") == 1

"""Other OpenTelemetry SDKs' OTLP exporters against the collector, as a team whose trainer is not Python would
send: a training job built from ``docs/schema.md`` (``straggler_job``: 8 ranks, one slow from step 10, one
process whose stage span is unusable) exported

* by the OpenTelemetry JavaScript SDK (``js/``: sdk-trace-base and its gRPC, OTLP/HTTP protobuf and OTLP/HTTP
  JSON trace exporters, as pinned in ``js/package-lock.json``), with and without gzip; its HTTP exporters send
  ``Transfer-Encoding: chunked`` bodies;
* through the OpenTelemetry Collector (``tests/stack/engines_support.otelcol``): its ``otlp_http`` (protobuf and
  JSON) and ``otlp_grpc`` exporters, with and without gzip, forwarding what it receives.

Each run: every export succeeds, the one partial success is reported as the OTLP specification says (an
``ExportTraceServiceResponse`` in the request's encoding whose ``partial_success.rejected_spans`` is 1, which the
exporter reports and does not retry), and the collector finds the slow rank. The collector runs in this process
(``Service``), with the shipped pipeline's straggler processor.

Nothing is faked. Without node and the installed packages (``npm ci --prefix tests/conformance/js``, which
``scripts/test`` runs) or the built collector (``scripts/engines``) a run skips; under ``CI=true`` it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import straggler_job as job

from collector_processor.allocator import rss_bytes
from collector_processor.config.loader import load_text
from collector_processor.config.validate import validate
from collector_processor.service import Service

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stack"))
from engines_support import otelcol

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
JS = HERE / "js"
COLLECTOR = """
receivers:
  otlp:
    protocols:
      grpc: {endpoint: 127.0.0.1:0}
      http: {endpoint: 127.0.0.1:0}
processors:
  memory_limiter: {limit_mib: %(limit)d, spike_limit_mib: 256, check_interval: 1s}
  straggler: {}
connectors:
  straggler: {}
exporters:
  debug: {verbosity: basic}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [memory_limiter, straggler], exporters: [straggler]}
    logs/verdicts: {receivers: [straggler], exporters: [debug]}
  telemetry: {metrics: {address: ""}}
  shutdown_timeout: 3
"""
WAIT_S = 60.0  # a bound for something that happens at once; never a measure of speed


def _missing(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"missing under CI: {why}")
    pytest.skip(why)


def _wait(cond: Callable[[], bool]) -> bool:
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


class Collector:
    def __init__(self) -> None:
        # the limiter reads this pytest process's RSS, which holds the rest of the suite: the shipped 1024 MiB
        # is raised by what the process holds beyond a fresh collector's ~110 MiB, so the budget is the same
        limit = 1024 + max(0, rss_bytes() // 2**20 - 110)
        raw, marks = load_text(COLLECTOR % {"limit": limit}, "conformance.yaml", {})
        self.svc = Service(validate(raw, marks))
        self.svc.start()
        ports = {e.what: e.port for e in self.svc.listening()}
        self.grpc = f"127.0.0.1:{ports['OTLP/GRPC']}"
        self.http = f"http://127.0.0.1:{ports['OTLP/HTTP']}"

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [(smp.labels, smp.value) for m in self.svc.t.registry.collect() for smp in m.samples
                if smp.name == name]

    def requests(self, receiver: str) -> dict[str, float]:
        return {lab["outcome"]: v for lab, v in self.samples("otel_straggler_collector_requests_total")
                if lab["receiver"] == receiver and v}

    def slow_ranks(self) -> set[tuple[str, str]]:
        return {(lab["rank"], lab["stage"]) for lab, v in self.samples("otel_straggler_active")
                if lab["training_job"] == job.JOB and v == 1}


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.svc.shutdown(3.0)


@pytest.fixture(scope="module")
def job_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("job") / "job.json"
    path.write_text(json.dumps(job.as_json(job.job())))
    return path


def _found(c: Collector) -> None:
    assert _wait(lambda: bool(c.slow_ranks())), "no straggler verdict"
    assert c.slow_ranks() == {(str(job.SLOW_RANK), "forward-compute")}


# ---- the JavaScript SDK ---------------------------------------------------------------------------------------

def _node() -> str:
    node = shutil.which("node")
    if node is None:
        _missing("node is not installed")
    if not (JS / "node_modules" / "@opentelemetry" / "sdk-trace-base").is_dir():
        _missing(f"the JavaScript SDK is not installed: npm ci --prefix {JS.relative_to(HERE.parents[1])}")
    return node  # type: ignore[return-value]


@pytest.mark.parametrize("compression", ["none", "gzip"])
@pytest.mark.parametrize("exporter", ["grpc", "proto", "json"])
def test_javascript_sdk_exporters(collector: Collector, job_file: Path, exporter: str, compression: str) -> None:
    node = _node()
    endpoint = f"http://{collector.grpc}" if exporter == "grpc" else f"{collector.http}/v1/traces"
    p = subprocess.run([node, str(JS / "export.js"), str(job_file), exporter, compression, endpoint],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    batches = job.job()
    assert [r["spans"] for r in out["results"]] == [len(b.spans) for b in batches]
    failed = [r for r in out["results"] if r["code"] != 0]
    assert not failed, failed[:3]
    # the one partial success, reported by the exporter (a warning) and not retried: one request counted
    partial = [w for w in out["warnings"] if w.startswith("Received Partial Success response:")]
    assert len(partial) == 1, out["warnings"]
    reported = json.loads(partial[0].split(":", 1)[1])
    assert int(reported["rejectedSpans"]) == job.REJECTED_SPANS  # int64: a JSON string, or a number
    assert "rejected" in reported["errorMessage"]
    receiver = "otlp/grpc" if exporter == "grpc" else "otlp/http"
    assert collector.requests(receiver) == {"ok": len(batches) - 1, "partial": 1}
    _found(collector)


# ---- the OpenTelemetry Collector ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return int(so.getsockname()[1])


def _otelcol_config(port: int, exporter: str, encoding: str, compression: str, c: Collector) -> str:
    if exporter == "otlp_http":
        exp = {"traces_endpoint": f"{c.http}/v1/traces", "encoding": encoding}
    else:
        exp = {"endpoint": c.grpc, "tls": {"insecure": True}}
    # synchronous: each request the collector receives is answered with its export's outcome
    exp.update({"compression": compression, "sending_queue": {"enabled": False},
                "retry_on_failure": {"enabled": False}})
    return json.dumps({
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"127.0.0.1:{port}"}}}},
        "exporters": {exporter: exp},
        "service": {"pipelines": {"traces": {"receivers": ["otlp"], "exporters": [exporter]}},
                    "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info", "encoding": "json"}}},
    })


def _post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, body, {"Content-Type": "application/x-protobuf"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        e.read()
        return int(e.code)


def _accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.parametrize(("exporter", "encoding", "compression"), [
    ("otlp_http", "proto", "none"), ("otlp_http", "proto", "gzip"), ("otlp_http", "json", "none"),
    ("otlp_http", "json", "gzip"), ("otlp_grpc", "proto", "none"), ("otlp_grpc", "proto", "gzip")])
def test_opentelemetry_collector_exporters(collector: Collector, tmp_path: Path, exporter: str, encoding: str,
                                           compression: str) -> None:
    binary = otelcol()
    port = _free_port()
    cfg = tmp_path / "otelcol.json"
    cfg.write_text(_otelcol_config(port, exporter, encoding, compression, collector))
    log = tmp_path / "otelcol.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([binary, "--config", str(cfg)], stdout=sink, stderr=subprocess.STDOUT)
    try:
        assert _wait(lambda: _accepting(port) or proc.poll() is not None) and proc.poll() is None, \
            log.read_text()[-3000:]
        batches = job.job()
        codes = [_post(f"http://127.0.0.1:{port}/v1/traces", job.to_request(b).SerializeToString())
                 for b in batches]
        assert codes == [200] * len(batches), log.read_text()[-3000:]
        receiver = "otlp/grpc" if exporter == "otlp_grpc" else "otlp/http"
        assert collector.requests(receiver) == {"ok": len(batches) - 1, "partial": 1}
        _found(collector)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    # the partial success, as the collector's exporter reads it: one warning with the count of dropped spans
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    partial = [r for r in records if r.get("msg") == "Partial success response"]
    assert [r.get("dropped_spans") for r in partial] == [job.REJECTED_SPANS], records[-20:]
    assert "rejected" in partial[0].get("message", "")

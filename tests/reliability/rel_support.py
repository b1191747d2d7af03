"""Helpers of the reliability tests: a real collector subprocess (ports parsed from its log), raw OTLP
clients (gRPC and HTTP), RSS peaks from /proc, and a small OTLP span factory. Waiting and /metrics
scraping come from the collector tests' ``service_support``."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

import otel_straggler_schema as s
from collector_processor.otlp_values import key_value

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "collector"))
from service_support import scrape, wait_for

ROOT = Path(__file__).resolve().parents[2]
CORPUS = Path(__file__).resolve().parent / "corpus"
TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
METRICS_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
HEALTH_METHOD = "/grpc.health.v1.Health/Check"

_LISTEN = re.compile(r"listening: (\S+) (OTLP/GRPC|OTLP/HTTP|metrics) (?:http://)?([\d.]+):(\d+)")


# ---- OTLP spans ------------------------------------------------------------------------------------------------


kv = key_value


def rank_resource(rank: int, cohort: str = "c0", job: str = "rel-job", world: int = 8, extra: dict | None = None
                  ) -> Resource:
    attrs: dict[str, object] = {s.RES_SERVICE_NAME: "training", s.RES_RANK: rank, s.RES_WORLD_SIZE: world,
                                s.RES_JOB_ID: job, s.RES_COHORT_KEY: cohort, s.RES_HOST_NAME: f"node{rank // 8}",
                                s.RES_GPU_UUID: f"GPU-{rank}"}
    attrs.update(extra or {})
    return Resource(attributes=[kv(k, v) for k, v in attrs.items()])


def stage_span(step: int, rank: int, stage: str = "forward-compute", host_ms: float = 10.0,
               device_ms: float | None = 9.0, start_ns: int = 1_800_000_000_000_000_000, span_id: bytes | None = None,
               trace_id: bytes | None = None, extra: dict | None = None, job: str = "rel-job") -> Span:
    attrs: dict[str, object] = {s.ATTR_STAGE: stage, s.ATTR_ITERATION: step, s.ATTR_HOST_MS: host_ms,
                                s.ATTR_COUNT: 1, s.ATTR_WORKLOAD_TOKENS: 4096}
    if device_ms is not None:
        attrs[s.ATTR_DEVICE_MS] = device_ms
        attrs[s.ATTR_MEASUREMENT] = s.MEASUREMENT_DEVICE
    attrs.update(extra or {})
    # crc32, not hash(): str hashes change per process, and two stages of one rank-step whose hashes met modulo
    # 97 shared a span id (one rejected as a duplicate, ~3 % of test runs)
    sid = span_id if span_id is not None else (
        step * 100_000 + rank * 100 + zlib.crc32(stage.encode()) % 97 + 1).to_bytes(8, "big")
    tid = trace_id if trace_id is not None else s.trace_id_for_step(job, step).to_bytes(16, "big")
    u64 = 2**64 - 1
    start = min(u64, max(0, start_ns + step * 1_000_000_000))
    dur = int(host_ms * 1e6) if 0.0 <= host_ms < 1e12 else 0  # NaN/inf/negative: the span's own times stay valid
    return Span(trace_id=tid, span_id=sid, name=stage, start_time_unix_nano=start,
                end_time_unix_nano=min(u64, start + dur), attributes=[kv(k, v) for k, v in attrs.items()])


def request(resource: Resource, spans: list[Span]) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=resource, scope_spans=[ScopeSpans(spans=spans)])])


def healthy_request(step: int, ranks: int = 8, job: str = "rel-job", cohort: str = "c0") -> ExportTraceServiceRequest:
    """One step of a healthy job: every rank within 1 % of the others on every judged stage."""
    req = ExportTraceServiceRequest()
    for r in range(ranks):
        spans = [stage_span(step, r, st, host_ms=ms * (1 + 0.002 * ((r + step) % 5)),
                            device_ms=ms * 0.9 * (1 + 0.002 * ((r + step) % 5)), job=job)
                 for st, ms in (("forward-compute", 40.0), ("backward-compute", 80.0), ("optimizer", 10.0))]
        req.resource_spans.append(ResourceSpans(resource=rank_resource(r, cohort, job, ranks),
                                                scope_spans=[ScopeSpans(spans=spans)]))
    return req


# ---- raw clients ---------------------------------------------------------------------------------------------


@dataclass
class Answer:
    code: str  # gRPC status name, or the HTTP status as text
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def grpc_call(channel: grpc.Channel, raw: bytes, method: str = TRACE_METHOD, timeout: float = 10.0,
              metadata: tuple = ()) -> Answer:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        body, c = call.with_call(raw, timeout=timeout, metadata=metadata or None)
        return Answer("OK", body or b"", {k: v for k, v in (c.trailing_metadata() or ()) if isinstance(v, str)})
    except grpc.RpcError as e:
        trail = {k: (v if isinstance(v, str) else v.hex()) for k, v in (e.trailing_metadata() or ())}
        return Answer(e.code().name, (e.details() or "").encode(), trail)


def http_post(base: str, path: str, body: bytes, ctype: str = "application/x-protobuf",
              headers: Mapping[str, str] | None = None, timeout: float = 10.0) -> Answer:
    h = {"Content-Type": ctype, **(headers or {})}
    req = urllib.request.Request(base + path, data=body, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Answer(str(resp.status), resp.read(), dict(resp.headers))
    except urllib.error.HTTPError as e:
        return Answer(str(e.code), e.read(), dict(e.headers or {}))


def http_declared(base: str, path: str, length: int, ctype: str = "application/x-protobuf") -> Answer:
    """Headers only, declaring a ``length`` body that is never sent: the answer to the declaration."""
    import http.client

    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", ctype)
        conn.putheader("Content-Length", str(length))
        conn.endheaders()
        resp = conn.getresponse()
        return Answer(str(resp.status), resp.read(), dict(resp.headers))
    finally:
        conn.close()


def http_get(url: str, headers: Mapping[str, str] | None = None, timeout: float = 5.0) -> Answer:
    req = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Answer(str(resp.status), resp.read(), dict(resp.headers))
    except urllib.error.HTTPError as e:
        return Answer(str(e.code), e.read(), dict(e.headers or {}))


def total(metrics: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    n = 0.0
    for key, v in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if p)
        if all(have.get(k) == v for k, v in labels.items()):
            n += v
    return n


def rss_bytes(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS = VmHWM) of a process."""
    cur = peak = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            cur = int(line.split()[1]) * 1024
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1]) * 1024
    return cur, peak


# ---- a real collector process ----------------------------------------------------------------------------------

MIN_CONFIG = """
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: 127.0.0.1:0, max_recv_msg_size_mib: {max_mib}}}
      http: {{endpoint: 127.0.0.1:0, max_request_body_size_mib: {max_mib}}}
    retry_delay: 250ms
    wait_for_processing: {wait}
{auth}
processors:
  memory_limiter: {{limit_mib: {limit_mib}, spike_limit_mib: {spike_mib}, check_interval: 100ms}}
  straggler: {{max_cohorts: {max_cohorts}, max_ranks_per_cohort: {max_ranks}, metrics: {{max_series: {proc_series}}}}}
connectors:
  straggler: {{}}
exporters:
  prometheus: {{endpoint: 127.0.0.1:0, max_series: {max_series}{prom_auth}}}
  file/evidence: {{path: "{evidence}", flush_interval: {flush}}}
  debug: {{verbosity: basic}}
  otlp_grpc/off: {{endpoint: ""}}
service:
  pipelines:
    traces:
      receivers: [otlp]
      processors: [memory_limiter, straggler]
      exporters: [otlp_grpc/off, straggler]
      queue: {{max_items: {queue}, max_bytes_mib: 64}}
    logs/verdicts:
      receivers: [straggler]
      exporters: [file/evidence, debug]
    metrics:
      receivers: [otlp]
      processors: [memory_limiter]
      exporters: [prometheus]
  telemetry: {{metrics: {{address: ""}}}}
  shutdown_timeout: 5
"""


def collector_config(tmp: Path, **kw: object) -> str:
    opts: dict[str, object] = dict(max_mib=4, wait="200ms", auth="", limit_mib=400, spike_mib=80, max_cohorts=64,
                                   max_ranks=1024, proc_series=2000, max_series=500, prom_auth="",
                                   evidence=str(tmp / "evidence" / "verdicts.jsonl"), flush="200ms", queue=64)
    opts.update(kw)
    return MIN_CONFIG.format(**opts)


class CollectorProcess:
    """``python -m collector_processor --config <file>``; stderr goes to a file (never a pipe that could fill)."""

    def __init__(self, tmp: Path, config_text: str, env: Mapping[str, str] | None = None, name: str = "c") -> None:
        self.tmp = tmp
        self.cfg_path = tmp / f"{name}.yaml"
        self.cfg_path.write_text(config_text)
        self.log_path = tmp / f"{name}.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        self.env.update(env or {})
        self.env["PYTHONPATH"] = str(ROOT) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}

    def start(self, timeout: float = 30.0) -> CollectorProcess:
        self.log_path.write_bytes(b"")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config", str(self.cfg_path),
                                      "--log-level", "DEBUG"], env=self.env, stdout=self._log, stderr=self._log,
                                     cwd=str(self.tmp))
        ok = wait_for(lambda: self.proc.poll() is not None or len(self._listening()) >= 3, timeout)
        assert ok and self.proc.poll() is None, self.log()[-3000:]
        self.ports = self._listening()
        return self

    def _listening(self) -> dict[str, int]:
        out = {}
        for m in _LISTEN.finditer(self.log()):
            out[{"OTLP/GRPC": "grpc", "OTLP/HTTP": "http", "metrics": "metrics"}[m.group(2)]] = int(m.group(4))
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        return scrape(self.metrics_url, headers)

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        a = http_get(f"http://127.0.0.1:{self.ports['metrics']}/healthz")
        if a.code != "200":
            return False
        with grpc.insecure_channel(self.grpc_target) as ch:
            h = grpc_call(ch, b"", HEALTH_METHOD, timeout=5.0)
        return h.code == "OK" and h.body == b"\x08\x01"  # HealthCheckResponse{status: SERVING}

    def rss(self) -> tuple[int, int]:
        return rss_bytes(self.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> float:
        """Signal the process and wait for it; returns the seconds it took to exit."""
        t0 = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if hasattr(self, "_log"):
            self._log.close()
        return time.monotonic() - t0


def evidence_lines(path: Path) -> list[dict]:
    """Every line of the evidence file parsed as JSON (a partial line fails the test)."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    assert raw == b"" or raw.endswith(b"\n"), "the last evidence line is incomplete"
    return [json.loads(line) for line in raw.decode().splitlines()]


class Stalling:
    """Accepts TCP connections and never answers (a collector that hangs after accept)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
                self.conns.append(conn)
            except OSError:
                continue

    def stop(self) -> None:
        self._stop = True
        for c in self.conns:
            c.close()
        self.sock.close()

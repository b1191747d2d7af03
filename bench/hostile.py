"""Reliability bench: hostile clients against a real collector process on loopback, each attack for a short,
bounded time while well-behaved clients (the real OTel SDK exporters, gRPC and HTTP, default timeout and
retries) keep exporting. Per attack: the collector's peak RSS (VmHWM of a fresh process, against the memory
limiter's ``limit_mib``), the share of valid exports that succeeded, and how the attack was answered.

Attacks (the collector runs ``configs/collector.yaml``, as shipped, on ephemeral ports):

  1 resent-steps   steps of one cohort re-sent out of order with fresh span ids; also replayed through the
                   straggler processor in-process with a clock that then moves an hour on: windows still open
                   then are leaked (``windows_leaked``)
  2 gzip-bomb      HTTP bodies of 64 gzip members (~1 MiB on the wire, 1 GiB inflated); gRPC messages of
                   64 MiB of zeros, gzip-compressed
  3 amplification  bodies that inflate while decoding, from many clients at once: protobuf of empty spans
                   (--body-mib; 4 HTTP and 32 gRPC clients, gRPC's concurrent-call limit), JSON of empty
                   objects, and 4 MiB protobuf of empty entries that fit one at a time
  4 pre-auth       with a token configured: HTTP requests with a wrong token announcing a 1 MiB body that never
                   comes, gRPC calls without the token that never send their message
  5 stalled        --stalled connections that send half a request line and stall, a flood of large requests
                   (answers counted: 200, 503, resets), then every stalled connection closed at once
  6 sigterm        SIGTERM while large requests are being read, decoded and processed (14 MiB of spans, six
                   4 MiB requests of one-span cohorts that take a second or more each, 2 MiB of JSON): seconds
                   to exit against ``service.shutdown_timeout`` (valid clients counted until the signal)
  7 protocol       a JSON integer of 5000 digits, two Content-Length values, a lowercase ``bearer``, 1e308 ms
                   durations (does /metrics show +Inf?)

  python bench/hostile.py                  # attack sequences on one long-lived collector (bench/hostile_sequence.py)
  python bench/hostile.py --quick          # the same, short: 4 s attacks, 10 s after each
  python bench/hostile.py --fresh          # the attacks above, each on a fresh collector (about 3 minutes)
  python bench/hostile.py --fresh --quick  # smoke: small sizes, 2 s per attack
  python bench/hostile.py --expansion      # decoder memory per body byte, each shape in a fresh process

Last line (--fresh): peak_rss_mb=<max over attacks> valid_client_success=<min over attacks> windows_leaked=<n>
Last line (sequences): peak_rss_mb= valid_client_success_during= valid_client_success_after= recover_s_max=
tenants_crossed=
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobsim.load import length_delimited  # noqa: E402

MIB = 1 << 20
TRACE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
TOKEN = "hostile-bench-token"
_LISTEN = re.compile(r"listening: (\S+) (OTLP/GRPC|OTLP/HTTP|metrics) (?:http://)?([\d.]+):(\d+)")


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- the collector ---------------------------------------------------------------------------------------------


class Collector:
    """``python -m collector_processor --config configs/collector.yaml`` on ephemeral loopback ports."""

    def __init__(self, tmp: Path, name: str, token: str = "", limit_mib: int = 1024, spike_mib: int = 256,
                 extra_yaml: str = "") -> None:
        self.tmp = tmp
        self.limit_mib = limit_mib
        self.log_path = tmp / f"{name}.log"
        over = tmp / f"{name}-over.yaml"
        over.write_text(f"processors:\n  memory_limiter: {{limit_mib: {limit_mib}, spike_limit_mib: {spike_mib}, "
                        "check_interval: 1s}\n" + extra_yaml)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update({"PYTHONPATH": str(ROOT), "OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT": "127.0.0.1:0",
                    "OTEL_STRAGGLER_OTLP_HTTP_ENDPOINT": "127.0.0.1:0",
                    "OTEL_STRAGGLER_METRICS_ENDPOINT": "127.0.0.1:0",
                    "OTEL_STRAGGLER_EVIDENCE_PATH": str(tmp / name / "verdicts.jsonl"),
                    "OTEL_STRAGGLER_TOKEN": token})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config",
                                      str(ROOT / "configs" / "collector.yaml"), "--config", str(over)],
                                     env=env, stdout=self._log, stderr=self._log, cwd=tmp)
        self.ports: dict[str, int] = {}
        end = time.monotonic() + 60
        while time.monotonic() < end and len(self.ports) < 3 and self.proc.poll() is None:
            for m in _LISTEN.finditer(self.log()):
                self.ports[{"OTLP/GRPC": "grpc", "OTLP/HTTP": "http", "metrics": "metrics"}[m.group(2)]] = int(
                    m.group(4))
            time.sleep(0.1)
        if len(self.ports) < 3:
            raise RuntimeError(f"collector did not start:\n{self.log()[-2000:]}")
        self._peak = 0.0
        threading.Thread(target=self._sample_peak, daemon=True).start()

    def _sample_peak(self) -> None:
        """VmHWM only grows: the last value read before the process exits is its peak."""
        while self.proc.poll() is None:
            self._peak = max(self._peak, self._read_hwm())
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    def _read_hwm(self) -> float:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def peak_rss_mb(self) -> float:
        return max(self._peak, self._read_hwm())

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['metrics']}/metrics", timeout=30) as r:
            return r.read().decode()

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        n = 0.0
        for fam in text_string_to_metric_families(self.metrics()):
            for smp in fam.samples:
                if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
                    n += smp.value
        return n

    def outcomes(self) -> dict[str, float]:
        """requests_total by outcome ({"unreachable": 1} when /metrics does not answer within 30 s)."""
        try:
            text = self.metrics()
        except OSError:
            return {"metrics_unreachable": 1.0}
        out: dict[str, float] = {}
        for m in re.finditer(r'^otel_straggler_collector_requests_total\{outcome="(\w+)",receiver="[^"]+"\} (\S+)',
                             text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> float:
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return time.monotonic() - t0


# ---- valid clients ---------------------------------------------------------------------------------------------


class ValidClients:
    """Two real OTel SDK exporters (gRPC, HTTP) exporting 20 spans every 0.25 s each, with the SDK's default
    10 s timeout and its retries (RetryInfo / Retry-After honoured)."""

    def __init__(self, c: Collector, token: str = "") -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.exporters = [GrpcExporter(endpoint=c.grpc, insecure=True, timeout=10, headers=headers or None),
                          HttpExporter(endpoint=c.http + "/v1/traces", timeout=10, headers=headers or None)]
        self.ok = 0
        self.sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, e), daemon=True)
                         for i, e in enumerate(self.exporters)]

    def start(self) -> ValidClients:
        for t in self._threads:
            t.start()
        return self

    def _run(self, i: int, exporter) -> None:  # type: ignore[no-untyped-def]
        from valid_client import export_valid_spans

        def record(_started: float, _ended: float, ok: bool) -> None:
            with self._lock:
                self.sent += 1
                self.ok += ok

        export_valid_spans(i, exporter, self._stop, record)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        for e in self.exporters:
            e.shutdown()
        return self.ok, self.sent


# ---- attack helpers --------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """How the attacker's requests were answered."""

    counts: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def text(self) -> str:
        return " ".join(f"{k}:{v}" for k, v in sorted(self.counts.items()))


def http_post(base: str, body: bytes, ctype: str = "application/x-protobuf", headers: dict | None = None,
              timeout: float = 30.0) -> str:
    req = urllib.request.Request(base + "/v1/traces", data=body, method="POST",
                                 headers={"Content-Type": ctype, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return str(r.status)
    except urllib.error.HTTPError as e:
        e.read()
        return str(e.code)
    except (ConnectionResetError, BrokenPipeError) as e:
        return f"reset({type(e).__name__})"
    except urllib.error.URLError as e:
        return "reset" if isinstance(e.reason, (ConnectionResetError, BrokenPipeError)) else \
            f"error({type(e.reason).__name__})"
    except OSError as e:
        return f"error({type(e).__name__})"


def grpc_raw(target: str, raw: bytes, compress: bool = False, metadata: tuple = (), timeout: float = 30.0) -> str:
    import grpc

    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1)]) as ch:
        try:
            ch.unary_unary(TRACE_METHOD)(raw, timeout=timeout, metadata=metadata or None,
                                         compression=grpc.Compression.Gzip if compress else None)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name


def repeat(stop: threading.Event, fn, tally: Tally) -> None:  # type: ignore[no-untyped-def]
    while not stop.is_set():
        tally.add(fn())


def run_threads(duration: float, jobs: list) -> None:  # type: ignore[type-arg]
    """Run ``jobs`` (functions of a stop event) on threads for ``duration`` seconds."""
    stop = threading.Event()
    threads = [threading.Thread(target=j, args=(stop,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    stop.wait(duration)
    stop.set()
    for t in threads:
        t.join(60)


def empty_spans(nbytes: int) -> bytes:
    """An ExportTraceServiceRequest of one resource, one scope and ~nbytes/2 empty spans."""
    return length_delimited(1, length_delimited(2, b"\x12\x00" * max(1, (nbytes - 16) // 2)))


def empty_json(nbytes: int) -> bytes:
    return b'{"resourceSpans":[' + b"{}," * max(1, (nbytes - 24) // 3) + b"{}]}"


def cohort_spans(nbytes: int, job: str = "cohorts-job") -> bytes:
    """One stage span per cohort (every span opens a cohort; the processor's cohort cap evicts as many): the
    costliest request per byte for the straggler processor to process."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    import otel_straggler_schema as s
    from collector_processor.otlp_values import key_value

    req = ExportTraceServiceRequest()
    i = 0
    size = 0
    while size < nbytes:
        res = Resource(attributes=[key_value(k, v) for k, v in {
            s.RES_RANK: i % 8, s.RES_WORLD_SIZE: 8, s.RES_JOB_ID: job, s.RES_COHORT_KEY: f"c{i}"}.items()])
        start = 1_800_000_000_000_000_000 + i * 1_000_000
        sp = Span(trace_id=s.trace_id_for_step(job, i).to_bytes(16, "big"),
                  span_id=(zlib.crc32(job.encode()) << 32 | i + 1).to_bytes(8, "big"),
                  name="forward-compute",
                  start_time_unix_nano=start, end_time_unix_nano=start + 40_000_000,
                  attributes=[key_value(k, v) for k, v in {s.ATTR_STAGE: "forward-compute", s.ATTR_ITERATION: i,
                                                           s.ATTR_HOST_MS: 40.0, s.ATTR_COUNT: 1}.items()])
        rs = ResourceSpans(resource=res, scope_spans=[ScopeSpans(spans=[sp])])
        size += rs.ByteSize() + 4
        req.resource_spans.append(rs)
        i += 1
    return req.SerializeToString()


def real_spans(nbytes: int, job: str = "big-job") -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from jobsim.job import Layout
    from jobsim.stream import JobStream, SimConfig

    req = ExportTraceServiceRequest()
    for _step, r in JobStream(SimConfig(layout=Layout(dp=64), steps=100_000, job=job), []):
        req.MergeFrom(r)
        if req.ByteSize() >= nbytes:
            break
    return req.SerializeToString()


# ---- attacks ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    attack: str
    seconds: float
    peak_rss_mb: float
    limit_mib: int
    valid_ok: int
    valid_sent: int
    answers: str
    notes: str = ""

    @property
    def success(self) -> float:
        return self.valid_ok / self.valid_sent if self.valid_sent else float("nan")


def resent_steps_requests(n: int, seed: int = 7) -> list[bytes]:
    """One cohort of 8 ranks (8 expected) whose steps arrive out of order and again, with fresh span ids."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    import otel_straggler_schema as s
    from collector_processor.otlp_values import key_value

    rnd = random.Random(seed)
    out = []
    for i in range(n):
        req = ExportTraceServiceRequest()
        step = rnd.choice([rnd.randrange(0, 40), rnd.randrange(0, 10_000)])  # re-sent and scattered steps
        for rank in range(7):  # rank 7 never reports: closing by progress waits for it
            res = Resource(attributes=[key_value(k, v) for k, v in {
                s.RES_RANK: rank, s.RES_WORLD_SIZE: 8, s.RES_JOB_ID: "resent", s.RES_COHORT_KEY: "c0",
                s.RES_DP_SIZE: 8, s.RES_HOST_NAME: f"n{rank}"}.items()])
            start = 1_800_000_000_000_000_000 + step * 1_000_000_000
            sp = Span(trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8), name="forward-compute",
                      start_time_unix_nano=start, end_time_unix_nano=start + 40_000_000,
                      attributes=[key_value(k, v) for k, v in {
                          s.ATTR_STAGE: "forward-compute", s.ATTR_ITERATION: step, s.ATTR_HOST_MS: 40.0 + i % 3,
                          s.ATTR_COUNT: 1}.items()])
            req.resource_spans.append(ResourceSpans(resource=res, scope_spans=[ScopeSpans(spans=[sp])]))
        out.append(req.SerializeToString())
    return out


def leaked_windows(requests: list[bytes]) -> tuple[int, int]:
    """Replay through the straggler processor in-process (default config) with a clock that then moves one hour
    on: (windows still open, most samples in one window cell)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from collector_processor.processor.straggler import factory
    from collector_processor.processor.straggler.processor import StragglerProcessor
    from collector_processor.telemetry import Telemetry

    now = [1_800_000_000.0]
    proc = StragglerProcessor(factory.create_default_config(), Telemetry(), lambda v: None, clock=lambda: now[0])
    biggest = 0
    for raw in requests:
        proc.process_traces(ExportTraceServiceRequest.FromString(raw))
        now[0] += 0.01
        proc.tick(now[0])
        for cohort in proc.cohorts:
            for w in cohort.steps.open.values():
                for ranks in w.cells.values():
                    for cell in ranks.values():
                        biggest = max(biggest, len(cell.host))
    now[0] += 3600.0
    proc.tick(now[0])
    return proc.stats()["open_windows"], biggest


def attack_resent(c: Collector, a: argparse.Namespace, tally: Tally) -> str:
    reqs = resent_steps_requests(60 if a.quick else 600)

    def send(stop: threading.Event) -> None:
        i = 0
        while not stop.is_set():
            tally.add(grpc_raw(c.grpc, reqs[i % len(reqs)]))
            i += 1

    run_threads(a.duration, [send, send])
    leaked, biggest = leaked_windows(reqs)
    a.windows_leaked = leaked
    return f"in-process replay: {leaked} windows open an hour later, most samples in one cell {biggest}"


def attack_gzip(c: Collector, a: argparse.Namespace, tally: Tally) -> str:
    member = gzip.compress(b"\0" * (a.body_mib * MIB), 9)
    bomb = member * 64
    zeros = b"\0" * ((4 if a.quick else 64) * MIB)
    jobs = [lambda stop: repeat(stop, lambda: "http " + http_post(c.http, bomb, headers={
        "Content-Encoding": "gzip"}), tally) for _ in range(4)]
    jobs.append(lambda stop: repeat(stop, lambda: "grpc " + grpc_raw(c.grpc, zeros, compress=True), tally))
    run_threads(a.duration, jobs)
    return f"HTTP body {len(bomb) / MIB:.2f} MiB on the wire, {64 * a.body_mib} MiB inflated"


def attack_amplification(c: Collector, a: argparse.Namespace, tally: Tally) -> str:
    size = a.body_mib * MIB - 64 * 1024
    pb = empty_spans(size)
    js = empty_json(size)
    fits = b"\x0a\x00" * (min(4 * MIB, size) // 2)
    jobs = [lambda stop: repeat(stop, lambda: "http-pb " + http_post(c.http, pb), tally) for _ in range(4)]
    jobs += [lambda stop: repeat(stop, lambda: "http-json " + http_post(c.http, js, "application/json"), tally)
             for _ in range(2)]
    jobs += [lambda stop: repeat(stop, lambda: "grpc-pb " + grpc_raw(c.grpc, pb), tally) for _ in range(32)]
    jobs += [lambda stop: repeat(stop, lambda: "fits " + http_post(c.http, fits), tally) for _ in range(8)]
    run_threads(a.duration, jobs)
    return (f"{len(pb) / MIB:.0f} MiB of empty spans (HTTP x4, gRPC x32) / of empty JSON objects (x2), "
            f"{len(fits) / MIB:.0f} MiB of empty entries (x8)")


def attack_preauth(c: Collector, a: argparse.Namespace, tally: Tally) -> str:
    import grpc

    head = ("POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Authorization: Bearer wrong\r\nContent-Length: {MIB}\r\n\r\n").encode()
    n_http = 20 if a.quick else 300

    def http_stall(stop: threading.Event) -> None:
        socks: list[socket.socket] = []
        while not stop.is_set():
            while len(socks) < n_http and not stop.is_set():
                try:
                    so = socket.create_connection(("127.0.0.1", c.ports["http"]), timeout=5)
                    so.sendall(head)
                    so.setblocking(False)
                    socks.append(so)
                except OSError:
                    tally.add("http connect failed")
                    break
            for so in list(socks):  # answered and closed by the server: count, open another
                try:
                    data = so.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data.startswith(b"HTTP/1.1 401"):
                    tally.add("http 401")
                if not data:
                    socks.remove(so)
                    so.close()
            stop.wait(0.05)
        for so in socks:
            so.close()

    def grpc_stall(stop: threading.Event) -> None:
        with grpc.insecure_channel(c.grpc) as ch:
            while not stop.is_set():
                release = threading.Event()

                def never(release: threading.Event = release):  # type: ignore[no-untyped-def]
                    release.wait(30)
                    yield from ()

                futs = [ch.stream_unary(TRACE_METHOD).future(never(), timeout=30) for _ in range(50)]
                for f in futs:
                    try:
                        f.result(timeout=max(0.1, a.duration))
                        tally.add("grpc OK")
                    except grpc.RpcError as e:
                        tally.add(f"grpc {e.code().name}")
                    except grpc.FutureTimeoutError:
                        tally.add("grpc still waiting")
                        f.cancel()
                release.set()

    run_threads(a.duration, [http_stall, grpc_stall])
    return f"{n_http} HTTP connections with a wrong token announcing 1 MiB, 50 gRPC calls without one"


def attack_stalled(c: Collector, a: argparse.Namespace, tally: Tally) -> str:
    socks: list[socket.socket] = []
    for _ in range(a.stalled):
        try:
            so = socket.create_connection(("127.0.0.1", c.ports["http"]), timeout=5)
            so.sendall(b"POST /v1/traces HTTP/1.1\r\nContent-Len")
            socks.append(so)
        except OSError:
            tally.add("stall connect failed")
            break
    body = real_spans((1 if a.quick else 4) * MIB, job="flood")
    jobs = [lambda stop: repeat(stop, lambda: "flood " + http_post(c.http, body), tally) for _ in range(16)]
    run_threads(a.duration / 2, jobs)
    t0 = time.monotonic()
    for so in socks:
        so.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # a reset each
        so.close()
    closed_s = time.monotonic() - t0
    run_threads(a.duration / 2, jobs)
    tracebacks = c.log().count("Traceback")
    return f"{len(socks)} stalled connections reset at once ({closed_s:.1f} s to close); tracebacks in the log: " \
           f"{tracebacks}"


def attack_sigterm(c: Collector, a: argparse.Namespace, tally: Tally) -> str:
    big = real_spans((2 if a.quick else 14) * MIB, job="sigterm-job")
    slow = cohort_spans((1 if a.quick else 4) * MIB)  # a second or more of processing each
    js = empty_json((1 if a.quick else 2) * MIB)  # fits the memory limit, takes seconds to decode
    jobs = [lambda: tally.add("big " + http_post(c.http, big))]
    jobs += [lambda: tally.add("cohorts " + http_post(c.http, slow)) for _ in range(6)]
    jobs += [lambda: tally.add("json " + http_post(c.http, js, "application/json"))]
    threads = [threading.Thread(target=j, daemon=True) for j in jobs]
    time.sleep(a.duration / 2)
    for t in threads:
        t.start()
        time.sleep(0.3)
    time.sleep(0.5)  # the large requests are being read, decoded, processed
    a.valid = a.clients.stop()  # valid exports are counted until the signal: the drain refuses new data
    drain = c.stop(signal.SIGTERM)
    for t in threads:
        t.join(60)
    text = c.log()
    how = "drained" if "exit (drained)" in text else "timed out draining" if "timed out draining" in text else "?"
    return (f"in flight: {len(big) / MIB:.0f} MiB of spans, 6 x {len(slow) / MIB:.0f} MiB of one-span cohorts, "
            f"{len(js) / MIB:.0f} MiB of JSON; exit {drain:.1f} s after SIGTERM (shutdown_timeout 10 s; {how}), "
            f"rc {c.proc.returncode}")


def stage_requests(steps: int, ranks: int = 8, slow_rank: int = 3, slow_ms: float = 1e308) -> list[bytes]:
    """A healthy cohort's stage spans, one request per step, one rank reporting ``slow_ms`` for every stage."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    import otel_straggler_schema as s
    from collector_processor.otlp_values import key_value

    out = []
    for step in range(steps):
        req = ExportTraceServiceRequest()
        for rank in range(ranks):
            res = Resource(attributes=[key_value(k, v) for k, v in {
                s.RES_RANK: rank, s.RES_WORLD_SIZE: ranks, s.RES_JOB_ID: "inf-job", s.RES_COHORT_KEY: "c0",
                s.RES_HOST_NAME: f"n{rank}", s.RES_GPU_UUID: f"GPU-{rank}"}.items()])
            spans = []
            for j, (stage, ms) in enumerate((("forward-compute", 40.0), ("backward-compute", 80.0))):
                value = slow_ms if rank == slow_rank else ms * (1 + 0.002 * ((rank + step) % 5))
                start = 1_800_000_000_000_000_000 + step * 1_000_000_000
                spans.append(Span(trace_id=s.trace_id_for_step("inf-job", step).to_bytes(16, "big"),
                                  span_id=(step * 1000 + rank * 10 + j + 1).to_bytes(8, "big"), name=stage,
                                  start_time_unix_nano=start, end_time_unix_nano=start + int(ms * 1e6),
                                  attributes=[key_value(k, v) for k, v in {
                                      s.ATTR_STAGE: stage, s.ATTR_ITERATION: step, s.ATTR_HOST_MS: value,
                                      s.ATTR_DEVICE_MS: value * 0.9, s.ATTR_MEASUREMENT: s.MEASUREMENT_DEVICE,
                                      s.ATTR_COUNT: 1}.items()]))
            req.resource_spans.append(ResourceSpans(resource=res, scope_spans=[ScopeSpans(spans=spans)]))
        out.append(req.SerializeToString())
    return out


def attack_protocol(c: Collector, a: argparse.Namespace, tally: Tally) -> str:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    tally.add("json-5000-digits " + http_post(c.http, b'{"resourceSpans": [], "x": ' + b"9" * 5000 + b"}",
                                              "application/json", auth))
    with socket.create_connection(("127.0.0.1", c.ports["http"]), timeout=10) as so:
        so.sendall(f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                   f"Authorization: Bearer {TOKEN}\r\nContent-Length: 0\r\nContent-Length: 5\r\n\r\n".encode())
        answer = so.recv(4096)
    tally.add("two-content-lengths " + (answer.split(b" ", 2)[1].decode() if answer else "closed"))
    tally.add("lowercase-bearer " + http_post(c.http, b"", headers={"authorization": f"bearer {TOKEN}"}))
    for raw in stage_requests(40):
        http_post(c.http, raw, headers=auth)
    time.sleep(1.0)
    inf = sorted({line.split("{")[0] for line in c.metrics().splitlines()
                  if line.endswith("+Inf") and "_bucket" not in line})
    return "+Inf on /metrics: " + (", ".join(inf) if inf else "none")


ATTACKS = {
    "1": ("resent-steps", attack_resent, False),
    "2": ("gzip-bomb", attack_gzip, False),
    "3": ("amplification", attack_amplification, False),
    "4": ("pre-auth", attack_preauth, True),
    "5": ("stalled", attack_stalled, False),
    "6": ("sigterm", attack_sigterm, False),
    "7": ("protocol", attack_protocol, True),
}


def run_attack(key: str, a: argparse.Namespace, tmp: Path) -> Row:
    name, fn, auth = ATTACKS[key]
    token = TOKEN if auth else ""
    c = Collector(tmp, name, token=token, limit_mib=a.limit_mib, spike_mib=a.spike_mib)
    tally = Tally()
    before = c.outcomes()
    a.clients = ValidClients(c, token).start()
    a.valid = None
    t0 = time.monotonic()
    try:
        notes = fn(c, a, tally)
        ok, sent = a.valid if a.valid is not None else a.clients.stop()
        if c.proc.poll() is None:
            after = c.outcomes()
            counted = {k: int(after[k] - before.get(k, 0)) for k in after if after[k] != before.get(k, 0)}
            notes += f"; counted by the collector: {counted}"
        return Row(name, time.monotonic() - t0, c.peak_rss_mb(), a.limit_mib, ok, sent, tally.text(), notes)
    finally:
        if c.proc.poll() is None:
            c.stop()


# ---- decoder memory per body byte --------------------------------------------------------------------------------

SHAPES = {
    "protobuf: empty spans": ("pb", "spans"),
    "protobuf: empty resource entries": ("pb", "entries"),
    "protobuf: nested resource > scope > span": ("pb", "nested"),
    "protobuf: empty log records": ("pb", "logs"),
    "protobuf: realistic stage spans (simulator)": ("pb", "real"),
    "JSON: empty objects": ("json", "objects"),
    "JSON: empty arrays (unknown field)": ("json", "arrays"),
    "JSON: 2-character strings": ("json", "strings"),
    "JSON: floats": ("json", "floats"),
    "JSON: realistic stage spans (simulator)": ("json", "real"),
}


def _shape_body(kind: str, shape: str, nbytes: int) -> tuple[str, bytes]:
    if kind == "pb":
        if shape == "spans":
            return "traces", empty_spans(nbytes)
        if shape == "entries":
            return "traces", b"\x0a\x00" * (nbytes // 2)
        if shape == "nested":
            return "traces", b"\x0a\x04\x12\x02\x12\x00" * (nbytes // 6)
        if shape == "logs":
            return "logs", length_delimited(1, length_delimited(2, b"\x12\x00" * (nbytes // 2)))
        return "traces", real_spans(nbytes)
    unit = {"objects": b"{},", "arrays": b"[],", "strings": b'"ab",', "floats": b"1.5,"}.get(shape)
    if unit is None:
        from google.protobuf import json_format
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        doc = json_format.MessageToDict(ExportTraceServiceRequest.FromString(real_spans(nbytes // 2)))
        for rs in doc.get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                for sp in ss.get("spans", []):
                    for k in ("traceId", "spanId", "parentSpanId"):
                        if k in sp:
                            import base64

                            sp[k] = base64.b64decode(sp[k]).hex()
        return "traces", json.dumps(doc).encode()
    if shape == "objects":
        return "traces", empty_json(nbytes)
    return "traces", b'{"junk":[' + unit * (nbytes // len(unit)) + b"0]}"


def expansion_child(kind: str, signal_: str, path: str) -> None:
    """Decode the body in ``path`` and print what it took (VmHWM over VmRSS before decoding)."""
    from collector_processor.receiver.decode import CT_JSON, CT_PROTOBUF, decode, decode_cost

    body = Path(path).read_bytes()
    ct = CT_JSON if kind == "json" else CT_PROTOBUF

    def status(field_: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_ + ":"):
                return int(line.split()[1]) * 1024
        return 0

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = status("VmRSS")
    msg = decode(signal_, body, ct)
    used = status("VmHWM") - base
    del msg
    print(json.dumps({"bytes": len(body), "used": used, "estimate": decode_cost(body, ct)}))


def expansion(a: argparse.Namespace) -> None:
    nbytes = (1 if a.quick else 4) * MIB
    log(f"decoder memory per body byte ({nbytes / MIB:.0f} MiB bodies, each decoded in a fresh process)")
    log("| body | MiB | used MiB | per byte | estimate MiB | estimate covers |")
    log("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, (kind, shape) in SHAPES.items():
            signal_, body = _shape_body(kind, shape, nbytes)
            path = Path(tmp) / "body"
            path.write_bytes(body)
            out = subprocess.run([sys.executable, __file__, "--expansion-child", kind, signal_, str(path)],
                                 capture_output=True, text=True, timeout=600, cwd=ROOT)
            if out.returncode != 0:
                log(f"| {label} | failed: {out.stderr[-300:]} |")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            log(f"| {label} | {r['bytes'] / MIB:.1f} | {r['used'] / MIB:.0f} | {r['used'] / r['bytes']:.1f} | "
                f"{r['estimate'] / MIB:.0f} | {r['estimate'] >= r['used']} |")


# ---- main ------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=12.0, help="seconds per attack")
    ap.add_argument("--attacks", default="1,2,3,4,5,6,7")
    ap.add_argument("--limit-mib", type=int, default=1024, help="memory_limiter limit_mib (the shipped value)")
    ap.add_argument("--spike-mib", type=int, default=256)
    ap.add_argument("--body-mib", type=int, default=16, help="bodies at the shipped size limit")
    ap.add_argument("--stalled", type=int, default=3000)
    ap.add_argument("--quick", action="store_true", help="smoke: 2 s per attack, small bodies, 50 stalled")
    ap.add_argument("--expansion", action="store_true", help="decoder memory per body byte, then exit")
    ap.add_argument("--fresh", action="store_true", help="each attack on a fresh collector (the former mode)")
    ap.add_argument("--after-s", type=float, default=60.0, help="sequences: seconds valid clients are checked "
                    "after each attack")
    ap.add_argument("--rounds", type=int, default=1, help="sequences: times the sequence of attacks runs")
    ap.add_argument("--flood", type=int, default=3000, help="sequences: connections held by connection-flood")
    ap.add_argument("--preauth-per-peer", type=int, default=0, help="sequences: the HTTP receiver's "
                    "max_preauth_connections_per_peer (0: as shipped)")
    ap.add_argument("--only", default="", help="sequences: only these attacks, comma-separated (e.g. slow-inline)")
    ap.add_argument("--expansion-child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.expansion_child:
        expansion_child(*a.expansion_child)
        return
    if not a.fresh and not a.expansion:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import hostile_sequence

        hostile_sequence.main(a)
        return
    if a.quick:
        a.duration, a.body_mib, a.stalled = min(a.duration, 2.0), 1, min(a.stalled, 50)
    if a.expansion:
        expansion(a)
        return
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, a.stalled + 1024)), hard))
    except (ValueError, OSError):
        pass
    import logging

    logging.getLogger("opentelemetry").setLevel(logging.ERROR)  # the SDK's own retry messages, expected here
    a.windows_leaked = -1
    rows: list[Row] = []
    keys = [k.strip() for k in a.attacks.split(",") if k.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        for i, key in enumerate(keys, 1):
            name = ATTACKS[key][0]
            log(f"[{i}/{len(keys)}] {name}: running {a.duration:.0f} s ...")
            row = run_attack(key, a, Path(tmp))
            rows.append(row)
            log(f"[{i}/{len(keys)}] {name}: peak RSS {row.peak_rss_mb:.0f} MiB (limit {row.limit_mib}), valid "
                f"{row.valid_ok}/{row.valid_sent}, attacker answers {row.answers}; {row.notes}")
    log("")
    log(f"| attack | s | peak RSS MiB (limit {a.limit_mib}) | valid exports ok | success | attacker answers | notes |")
    log("|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r.attack} | {r.seconds:.0f} | {r.peak_rss_mb:.0f} | {r.valid_ok}/{r.valid_sent} | {r.success:.3f} | "
            f"{r.answers} | {r.notes} |")
    peaks = [r.peak_rss_mb for r in rows if r.peak_rss_mb == r.peak_rss_mb]
    succ = [r.success for r in rows if r.valid_sent]
    log(f"peak_rss_mb={max(peaks) if peaks else float('nan'):.0f} "
        f"valid_client_success={min(succ) if succ else float('nan'):.3f} windows_leaked={a.windows_leaked}")


if __name__ == "__main__":
    main()

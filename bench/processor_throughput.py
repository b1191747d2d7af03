"""Collector throughput: spans/s of the full straggler collector against a parse-only OTLP/gRPC floor.

Requests are pre-encoded as the ranks' SDKs batch them (512 spans of one rank per request, ~50 spans per
rank-step; ``jobsim.load``) and the same client sends the same bytes over loopback
gRPC (``--inflight`` concurrent calls, retrying throttled ones) to

  (a) parse-only: a real gRPC server in its own process (same server model: ``grpc.server`` + thread pool)
      whose handler parses the ``ExportTraceServiceRequest`` and answers;
  (b) full: ``python -m collector_processor`` (gRPC receive, decode, queue, the traces pipeline as shipped:
      memory limiter (admission before decoding) and straggler processor (group, windows, detection);
      Prometheus metrics exporter; debug traces exporter) in its own process; timed until its pipeline has
      processed every request (its ``processing_seconds`` count). ``--no-memory-limiter``: the straggler
      processor alone.

  python bench/processor_throughput.py                 # ~400k spans per arm
  python bench/processor_throughput.py --spans 20000   # smoke
  python bench/processor_throughput.py --profile 15    # + cProfile of the processing path (in-process)
  python bench/processor_throughput.py --base ../base --pairs 5   # side by side with another checkout

Last line: spans_per_s=<b> parse_only_spans_per_s=<a> ratio=<b/a> rss_mb=<peak RSS of the collector>
cpu_s=<collector CPU seconds (user + system) while it took and processed the requests>

``--base PATH``: a checkout of another commit (``git worktree add --detach PATH <commit>``). The same requests go
to this checkout's collector and to the base's (``python -m collector_processor`` run from PATH, with PATH on
``PYTHONPATH``), ``--pairs`` times each, alternately (base first in odd pairs, this checkout first in even ones);
each run measures its own parse-only floor (the same code in both arms) just before its collector, so both arms
see the machine's load alike. The ratio of the medians is the comparison that counts on a loaded machine. Last
line: base_spans_per_s=<median> spans_per_s=<median> speedup=<median / base median> base_ratio=<median>
ratio=<median> base_cpu_s=<median> cpu_s=<median> pairs=<n>
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import otel_straggler_schema as s  # noqa: E402
from jobsim.job import Layout  # noqa: E402
from jobsim.load import LoadConfig, sdk_requests  # noqa: E402
from otel_straggler_demo.run import free_port  # noqa: E402

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
SHIPPED_MEMORY_LIMITER = {"limit_mib": 1024, "spike_limit_mib": 256, "check_interval": "1s"}

PARSE_ONLY_SERVER = r'''
import sys, time
from concurrent.futures import ThreadPoolExecutor
import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)
done = [0]
def export(raw, ctx):
    req = ExportTraceServiceRequest.FromString(raw)
    n = 0
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            n += len(ss.spans)
    done[0] += 1
    return ExportTraceServiceResponse().SerializeToString()
server = grpc.server(ThreadPoolExecutor(max_workers=8), options=[("grpc.max_receive_message_length", 17 << 20)])
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
    "opentelemetry.proto.collector.trace.v1.TraceService", {"Export": grpc.unary_unary_rpc_method_handler(export)})])
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
sys.stdin.read()
server.stop(1)
'''


def _peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def drive(port: int, requests: list[bytes], inflight: int, timeout_s: float) -> tuple[float, int]:
    """Send every request (``inflight`` concurrent unary calls, throttled ones retried). (seconds, retries)."""
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 17 << 20)])
    grpc.channel_ready_future(channel).result(timeout=30)
    call = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
    lock = threading.Lock()
    nxt = [0]
    retries = [0]
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s

    def worker() -> None:
        while time.monotonic() < deadline:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(requests):
                return
            while time.monotonic() < deadline:
                try:
                    call(requests[i], timeout=60)
                    break
                except grpc.RpcError as e:
                    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                        with lock:
                            retries[0] += 1
                        time.sleep(0.005)
                        continue
                    errors.append(str(e.code()))
                    return

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(inflight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    channel.close()
    if errors:
        raise RuntimeError(f"export failed: {errors[:3]}")
    return dt, retries[0]


def run_parse_only(requests: list[bytes], inflight: int, timeout_s: float) -> tuple[float, float]:
    proc = subprocess.Popen([sys.executable, "-c", PARSE_ONLY_SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        dt, _ = drive(port, requests, inflight, timeout_s)
        rss = _peak_rss_mb(proc.pid)
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return dt, rss


def _processed(metrics_url: str) -> int:
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(s.M_PROCESSING_SECONDS + "_count"):
            return int(float(line.split()[-1]))
    return 0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_listening(port: int, deadline: float, proc: subprocess.Popen[bytes]) -> None:
    """Until the collector's gRPC port takes connections. Its metrics endpoint can answer before its receivers
    listen; a first connection refused there costs the client gRPC's 1 s reconnect backoff inside the timed run."""
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("collector's gRPC port did not open") from None
            time.sleep(0.05)


def run_full(requests: list[bytes], inflight: int, timeout_s: float,
             root: Path = ROOT, memory_limiter: bool = True) -> tuple[float, float, int, float]:
    """The collector of the checkout at ``root``: (seconds, peak RSS MB, retries, CPU seconds)."""
    import yaml

    grpc_port, metrics_port = free_port(), free_port()
    processors: dict[str, object] = {"straggler": {}}
    if memory_limiter:  # as configs/collector.yaml ships it
        processors = {"memory_limiter": SHIPPED_MEMORY_LIMITER, **processors}
    conf = {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"}}}},
        "processors": processors,
        "exporters": {"debug": {"verbosity": "basic"}, "prometheus": {"endpoint": f"127.0.0.1:{metrics_port}"}},
        "service": {"pipelines": {
            "traces": {"receivers": ["otlp"], "processors": list(processors), "exporters": ["debug"]},
            "metrics": {"receivers": ["otlp"], "exporters": ["prometheus"]},
        }},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "collector.yaml"
        path.write_text(yaml.safe_dump(conf))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        proc = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config", str(path),
                                 "--log-level", "WARNING"], cwd=root, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            t_ready = time.monotonic() + 30
            while True:
                try:
                    base = _processed(url)
                    break
                except OSError:
                    if time.monotonic() > t_ready or proc.poll() is not None:
                        raise RuntimeError("collector did not start") from None
                    time.sleep(0.1)
            _wait_listening(grpc_port, t_ready, proc)
            cpu0 = _cpu_s(proc.pid)
            t0 = time.perf_counter()
            _, retries = drive(grpc_port, requests, inflight, timeout_s)
            deadline = time.monotonic() + timeout_s
            while _processed(url) - base < len(requests) and time.monotonic() < deadline:
                time.sleep(0.01)
            dt = time.perf_counter() - t0
            rss = _peak_rss_mb(proc.pid)
            cpu = _cpu_s(proc.pid) - cpu0
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    return dt, rss, retries, cpu


def profile_inprocess(requests: list[bytes], top: int) -> str:
    """cProfile of the collector's processing path on this thread: protobuf decode + straggler processor."""
    from collector_processor.processor.straggler import factory
    from collector_processor.receiver.decode import decode
    from collector_processor.telemetry import Telemetry

    proc = factory.create_processor(factory.create_default_config(), Telemetry(), lambda v: None)
    proc.start()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for raw in requests:
        proc.process_traces(decode("traces", raw))
    prof.disable()
    dt = time.perf_counter() - t0
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if "ncalls" in ln)
    return f"in-process decode+process under cProfile: {dt:.2f}s\n" + "\n".join(lines[start:start + top + 1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=400_000, help="spans per arm (about)")
    ap.add_argument("--dp", type=int, default=16)
    ap.add_argument("--cohorts", type=int, default=4, help="TP ranks = cohorts")
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--device-every", type=int, default=1)
    ap.add_argument("--detail", choices=("interval", "step"), default="interval",
                    help="stage spans per microbatch interval (~50 per rank-step) or per timer per step (14)")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP", help="also print the cProfile top TOP items")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--base", type=Path, metavar="PATH",
                    help="also run the collector of the checkout at PATH, alternately with this one")
    ap.add_argument("--pairs", type=int, default=5, help="with --base: runs of each arm")
    ap.add_argument("--no-memory-limiter", dest="memory_limiter", action="store_false",
                    help="the traces pipeline without the shipped memory_limiter (straggler processor only)")
    args = ap.parse_args()
    cfg = LoadConfig(Layout(dp=args.dp, tp=args.cohorts), device_every=args.device_every, detail=args.detail)
    ranks = args.dp * args.cohorts
    steps = max(12, round(args.spans / (ranks * cfg.spans_per_rank_step)))
    t0 = time.monotonic()
    requests = list(sdk_requests(cfg, range(1, steps + 1)))
    n_spans = ranks * steps * cfg.spans_per_rank_step
    print(f"{len(requests)} requests, {n_spans} spans ({ranks} ranks x {steps} steps x {cfg.spans_per_rank_step}), "
          f"{sum(map(len, requests)) / len(requests) / 1024:.0f} KiB/request, encoded in "
          f"{time.monotonic() - t0:.1f}s", file=sys.stderr)
    if args.base is not None:
        return side_by_side(requests, n_spans, args.base.resolve(), args.pairs, args.inflight, args.timeout,
                            args.memory_limiter)
    dt_a, rss_a = run_parse_only(requests, args.inflight, args.timeout)
    dt_b, rss_b, retries, cpu_b = run_full(requests, args.inflight, args.timeout, memory_limiter=args.memory_limiter)
    a, b = n_spans / dt_a, n_spans / dt_b
    print(f"\n{'arm':40} {'seconds':>8} {'spans/s':>10} {'peak RSS MB':>12}")
    print(f"{'(a) parse-only OTLP/gRPC receiver':40} {dt_a:8.2f} {a:10.0f} {rss_a:12.0f}")
    print(f"{'(b) full collector (straggler pipeline)':40} {dt_b:8.2f} {b:10.0f} {rss_b:12.0f}")
    print(f"throttled-and-retried requests in (b): {retries}")
    if args.profile:
        print(profile_inprocess(requests[: max(1, min(len(requests), 400))], args.profile))
    print(f"spans_per_s={b:.0f} parse_only_spans_per_s={a:.0f} ratio={b / a:.3f} rss_mb={rss_b:.0f} "
          f"spans={n_spans} requests={len(requests)} inflight={args.inflight} cpu_s={cpu_b:.2f}")
    return 0


def side_by_side(requests: list[bytes], n_spans: int, base: Path, pairs: int, inflight: int,
                 timeout_s: float, memory_limiter: bool = True) -> int:
    """``pairs`` runs of each arm, alternately; per run its parse-only floor, then its collector."""
    if not (base / "collector_processor").is_dir():
        raise SystemExit(f"--base {base}: not a checkout (no collector_processor/)")
    runs: dict[str, list[tuple[float, float, float, float]]] = {"base": [], "this": []}
    roots = {"base": base, "this": ROOT}
    print(f"{'pair':>4} {'arm':5} {'spans/s':>9} {'parse-only':>10} {'ratio':>6} {'cpu s':>6} {'RSS MB':>6}")
    for i in range(pairs):
        for arm in (("base", "this") if i % 2 == 0 else ("this", "base")):
            dt_a, _ = run_parse_only(requests, inflight, timeout_s)
            dt_b, rss, _, cpu = run_full(requests, inflight, timeout_s, roots[arm], memory_limiter)
            a, b = n_spans / dt_a, n_spans / dt_b
            runs[arm].append((b, a, b / a, cpu))
            print(f"{i + 1:4d} {arm:5} {b:9.0f} {a:10.0f} {b / a:6.3f} {cpu:6.2f} {rss:6.0f}", flush=True)

    def med(arm: str, k: int) -> float:
        return statistics.median(r[k] for r in runs[arm])

    def span(arm: str, k: int, fmt: str) -> str:
        vals = [r[k] for r in runs[arm]]
        return f"{format(med(arm, k), fmt)} ({format(min(vals), fmt)}-{format(max(vals), fmt)})"

    print(f"\nbase: {base}")
    for arm in ("base", "this"):
        print(f"{arm:5} median (min-max) of {pairs}: spans/s {span(arm, 0, ',.0f')}  ratio {span(arm, 2, '.3f')}  "
              f"parse-only {span(arm, 1, ',.0f')}  collector CPU s {span(arm, 3, '.2f')}")
    print(f"base_spans_per_s={med('base', 0):.0f} spans_per_s={med('this', 0):.0f} "
          f"speedup={med('this', 0) / med('base', 0):.3f} base_ratio={med('base', 2):.3f} ratio={med('this', 2):.3f} "
          f"base_cpu_s={med('base', 3):.2f} cpu_s={med('this', 3):.2f} pairs={pairs} spans={n_spans}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

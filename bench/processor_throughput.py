"""Collector throughput: spans/s of the full straggler collector against a parse-only OTLP/gRPC floor.

Requests are pre-encoded as the ranks' SDKs batch them (512 spans of one rank per request, ~50 spans per
rank-step; ``collector_processor.simulate.load``) and the same client sends the same bytes over loopback
gRPC (``--inflight`` concurrent calls, retrying throttled ones) to

  (a) parse-only: a real gRPC server in its own process (same server model: ``grpc.server`` + thread pool)
      whose handler parses the ``ExportTraceServiceRequest`` and answers;
  (b) full: ``python -m collector_processor`` (gRPC receive, decode, queue, straggler processor: group,
      windows, detection; Prometheus metrics exporter; debug traces exporter) in its own process; timed until
      its pipeline has processed every request (its ``processing_seconds`` count).

  python bench/processor_throughput.py                 # ~400k spans per arm
  python bench/processor_throughput.py --spans 20000   # smoke
  python bench/processor_throughput.py --profile 15    # + cProfile of the processing path (in-process)

Last line: spans_per_s=<b> parse_only_spans_per_s=<a> ratio=<b/a> rss_mb=<peak RSS of the collector>
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
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
from collector_processor.simulate.job import Layout  # noqa: E402
from collector_processor.simulate.load import LoadConfig, sdk_requests  # noqa: E402
from otel_straggler_demo.run import free_port  # noqa: E402

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

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


def run_full(requests: list[bytes], inflight: int, timeout_s: float) -> tuple[float, float, int]:
    import yaml

    grpc_port, metrics_port = free_port(), free_port()
    conf = {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"}}}},
        "processors": {"straggler": {}},
        "exporters": {"debug": {"verbosity": "basic"}, "prometheus": {"endpoint": f"127.0.0.1:{metrics_port}"}},
        "service": {"pipelines": {
            "traces": {"receivers": ["otlp"], "processors": ["straggler"], "exporters": ["debug"]},
            "metrics": {"receivers": ["otlp"], "exporters": ["prometheus"]},
        }},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "collector.yaml"
        path.write_text(yaml.safe_dump(conf))
        proc = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config", str(path),
                                 "--log-level", "WARNING"], cwd=ROOT, stdout=subprocess.DEVNULL,
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
            t0 = time.perf_counter()
            _, retries = drive(grpc_port, requests, inflight, timeout_s)
            deadline = time.monotonic() + timeout_s
            while _processed(url) - base < len(requests) and time.monotonic() < deadline:
                time.sleep(0.01)
            dt = time.perf_counter() - t0
            rss = _peak_rss_mb(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    return dt, rss, retries


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
    dt_a, rss_a = run_parse_only(requests, args.inflight, args.timeout)
    dt_b, rss_b, retries = run_full(requests, args.inflight, args.timeout)
    a, b = n_spans / dt_a, n_spans / dt_b
    print(f"\n{'arm':40} {'seconds':>8} {'spans/s':>10} {'peak RSS MB':>12}")
    print(f"{'(a) parse-only OTLP/gRPC receiver':40} {dt_a:8.2f} {a:10.0f} {rss_a:12.0f}")
    print(f"{'(b) full collector (straggler pipeline)':40} {dt_b:8.2f} {b:10.0f} {rss_b:12.0f}")
    print(f"throttled-and-retried requests in (b): {retries}")
    if args.profile:
        print(profile_inprocess(requests[: max(1, min(len(requests), 400))], args.profile))
    print(f"spans_per_s={b:.0f} parse_only_spans_per_s={a:.0f} ratio={b / a:.3f} rss_mb={rss_b:.0f} "
          f"spans={n_spans} requests={len(requests)} inflight={args.inflight}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

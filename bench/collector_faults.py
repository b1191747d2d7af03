"""Training step time while the collector is absent, hangs, refuses or answers: the emitter's default export
(``export_mode=process``, default OTel SDK settings) against the same loop with the export off, side by side.

A Megatron-like host-only step (``forward-backward`` around 2 microbatches of ``forward-compute`` 1 ms and
``backward-compute`` 2 ms, ~6.5 ms) runs through the real ``Timers`` for ``--steps`` steps per arm, after
``--warmup`` steps that start the export child. Arms, interleaved round by round so the machine's load falls on
all of them alike:

* ``off``: ``export_mode=off`` (the reference);
* ``ok``: a gRPC collector that accepts every export;
* ``absent``: nothing listens on the endpoint (connection refused);
* ``stall``: accepts the TCP connection and never answers;
* ``unavailable`` / ``invalid_argument``: a gRPC collector that refuses every export with that code;
* ``http_400``: an OTLP/HTTP collector that answers 400.

Per arm: mean step time over every measured step of every round (what a run pays) and its ratio to ``off``,
the median ratio beside it, the worst single step, and the spans the export child delivered (the ``ok`` arm's
proof that the export really ran; losses are counted by the child, ``tests/reliability``).

  python bench/collector_faults.py --rounds 5 --steps 300 --md bench/results/collector-faults.md

Last line: ``worst_mean_ratio=<x> worst_arm=<arm> worst_step_ms=<y> rounds=<n> steps=<m>``.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from otel_straggler.install import build_timers  # noqa: E402
from otel_straggler_demo.run import free_port  # noqa: E402

ARMS = ("off", "ok", "absent", "stall", "unavailable", "invalid_argument", "http_400")


class _Grpc(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """A gRPC collector that accepts (``code`` None) or refuses every export with ``code``."""

    def __init__(self, code: grpc.StatusCode | None) -> None:
        self.code = code
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        if self.code is not None:
            context.abort(self.code, "refused by the bench")
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            return trace_service_pb2.ExportTraceServiceResponse()
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def stop(self) -> None:
        self.server.stop(0)


class _Stall:
    """Accepts TCP connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                continue

    def stop(self) -> None:
        self._stop.set()
        for c in self.conns:
            c.close()
        self.sock.close()


class _Http400:
    """An OTLP/HTTP collector that answers 400 Bad Request to every export."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(400)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _collector(arm: str) -> tuple[dict[str, str], Callable[[], None]]:
    """The OTEL_* settings that point the emitter at the arm's collector, and how to stop that collector."""
    if arm == "absent":
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"}, lambda: None
    if arm == "stall":
        stall = _Stall()
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{stall.port}"}, stall.stop
    if arm == "http_400":
        http = _Http400()
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{http.port}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, http.stop
    code = {"ok": None, "unavailable": grpc.StatusCode.UNAVAILABLE,
            "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT}[arm]
    srv = _Grpc(code)
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{srv.port}"}, srv.stop


def _train(timers, first: int, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for step in range(first, first + steps):
        t0 = time.perf_counter()
        timers.set_step(step, 4096, 8, 2)
        timers("forward-backward", log_level=1).start()
        for _ in range(2):
            timers("forward-compute", log_level=2).start()
            time.sleep(0.001)
            timers("forward-compute").stop()
            timers("backward-compute", log_level=2).start()
            time.sleep(0.002)
            timers("backward-compute").stop()
        timers("forward-backward").stop()
        out.append(time.perf_counter() - t0)
    return out


def run_arm(arm: str, round_no: int, warmup: int, steps: int) -> tuple[list[float], dict[str, int]]:
    """One arm once: its step times and the export child's counters after a flush."""
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        del os.environ[key]
    stop: Callable[[], None] = lambda: None  # noqa: E731
    opts: dict[str, object] = {}
    if arm == "off":
        opts["export_mode"] = "off"
    else:
        env, stop = _collector(arm)
        os.environ.update(env)
    timers = build_timers(enabled=True, register_lifecycle=False, job_id=f"bench-{arm}-{round_no}",
                          shutdown_timeout_s=3.0, **opts)
    assert timers is not None
    try:
        _train(timers, 0, warmup)
        durations = _train(timers, warmup, steps)
        timers.flush(30.0)  # the export child's counters come with the flush's answer (a loaded host: its start)
        counters = dict(getattr(timers.sink, "child_counters", {}) or {})
    finally:
        timers.shutdown(3.0)
        stop()
    return durations, counters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300, help="measured steps per arm and round")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--md", type=Path, default=None, help="also write the report as markdown here")
    a = ap.parse_args()
    steps: dict[str, list[float]] = {arm: [] for arm in ARMS}
    exported: dict[str, int] = dict.fromkeys(ARMS, 0)
    t0 = time.monotonic()
    for r in range(a.rounds):
        order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]  # rotate: no arm always first after a pause
        for arm in order:
            durations, c = run_arm(arm, r, a.warmup, a.steps)
            steps[arm] += durations
            exported[arm] += int(c.get("spans_exported", 0))
    base_mean = statistics.fmean(steps["off"])
    base_median = statistics.median(steps["off"])
    lines = [f"{a.rounds} rounds x {a.steps} steps per arm (+{a.warmup} warm-up), arms interleaved; "
             f"python {platform.python_version()}, {os.cpu_count()} CPUs; {time.monotonic() - t0:.0f} s",
             f"{'arm':<17}{'mean ms':>9}{'mean ratio':>12}{'median ratio':>14}{'worst ms':>10}"
             f"{'exported':>10}"]
    worst_arm, worst_ratio = "off", 1.0
    for arm in ARMS:
        mean, median = statistics.fmean(steps[arm]), statistics.median(steps[arm])
        ratio = mean / base_mean
        if arm != "off" and ratio > worst_ratio:
            worst_arm, worst_ratio = arm, ratio
        lines.append(f"{arm:<17}{mean * 1e3:>9.2f}{ratio:>12.3f}{median / base_median:>14.3f}"
                     f"{max(steps[arm]) * 1e3:>10.1f}{exported[arm]:>10}")
    worst_step = max(max(v) for v in steps.values()) * 1e3
    lines.append(f"worst_mean_ratio={worst_ratio:.3f} worst_arm={worst_arm} worst_step_ms={worst_step:.1f} "
                 f"rounds={a.rounds} steps={a.steps}")
    print("\n".join(lines), flush=True)
    if a.md is not None:
        cmd = "python bench/collector_faults.py " + " ".join(sys.argv[1:])
        a.md.write_text("# Training step time under collector faults\n\n"
                        f"`{cmd}`\n\n```\n" + "\n".join(lines) + "\n```\n", encoding="utf-8")


if __name__ == "__main__":
    main()

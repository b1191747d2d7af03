"""What the export side costs the training process, per interval, on CPU (host-only timing).

A Megatron-like step (forward-backward, 8 microbatches x (batch-generator, forward-compute,
backward-compute), optimizer: 26 intervals) runs through the real ``Timers`` -> readout thread -> sink ->
real OTLP gRPC exporter -> a receiver in ANOTHER process (so the receiver costs this process nothing).
Each compute interval burns ``--work-us`` of GIL-holding CPU (a stand-in for kernel launches), at ~10x
the interval rate of the measured launch-bound H200 step (26 intervals per ~3.5 ms instead of ~35 ms).

Measured per arm (arms interleaved over rounds, medians reported):
* ``train_us``: CPU time of the training thread per interval (``time.thread_time_ns``) above the same loop
  with no-op timers: what the training thread itself pays (start/stop, step context, ring).
* ``bg_gil_us``: CPU time per interval of every other *Python* thread of the training process (readout
  thread, and in thread mode the batch span processor and metric reader): GIL time taken from training.
* ``sink_us``: the part of ``bg_gil_us`` spent inside the sink's ``submit``/``publish_stats`` on the readout
  thread (the export side's own cost there; the rest is the readout thread itself).
* ``bg_cpu_us``: all non-training-thread CPU of the training process per interval (adds gRPC C threads,
  which mostly run without the GIL).
* ``child_us``: CPU per interval of the export child (process mode), which is off the training process.
* ``wall_pct``: wall time of the loop versus the no-op arm: GIL hand-offs to the background threads plus
  CPU contention with the export child (this machine has 2 cores shared with other work, so it is
  noisy; the GPU-side step-time numbers are in ``/work/shared/reference/h200-measurements.md``).

Device timing (``device_every``) cannot be exercised without CUDA: every interval here is ``no_cuda``.
Last line: ``train_thread_us_per_interval=<x> background_gil_us_per_interval=<y>`` for the default config
(detail ``step``, export mode ``process``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")  # megatron-core import-time notices about optional kernels

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MICROBATCHES = 8
INTERVALS_PER_STEP = 2 + 3 * MICROBATCHES

RECEIVER = textwrap.dedent(
    """
    import sys, time
    from concurrent import futures
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as t, trace_service_pb2_grpc as tg
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as m, metrics_service_pb2_grpc as mg
    class T(tg.TraceServiceServicer):
        def Export(self, request, context):
            return t.ExportTraceServiceResponse()
    class M(mg.MetricsServiceServicer):
        def Export(self, request, context):
            return m.ExportMetricsServiceResponse()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    tg.add_TraceServiceServicer_to_server(T(), server)
    mg.add_MetricsServiceServicer_to_server(M(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    """
)


class TimedSink:
    """Wraps the real sink: CPU time the export side takes on the readout thread (pack + write, or spans)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.cpu_ns = 0

    @property
    def child_pid(self) -> int | None:
        return getattr(self.inner, "child_pid", None)

    def new_batch(self, capacity: int) -> object:
        t0 = time.thread_time_ns()
        batch = self.inner.new_batch(capacity)
        self.cpu_ns += time.thread_time_ns() - t0
        return batch

    def submit_batch(self, batch: object) -> None:
        t0 = time.thread_time_ns()
        self.inner.submit_batch(batch)
        self.cpu_ns += time.thread_time_ns() - t0

    def publish_stats(self, stats: dict[str, int]) -> None:
        t0 = time.thread_time_ns()
        self.inner.publish_stats(stats)
        self.cpu_ns += time.thread_time_ns() - t0

    def flush(self, timeout_s: float) -> bool:
        return self.inner.flush(timeout_s)

    def shutdown(self, timeout_s: float) -> None:
        self.inner.shutdown(timeout_s)


class NullTimer:
    __slots__ = ()

    def start(self, barrier: bool = False) -> None:
        return

    def stop(self, barrier: bool = False) -> None:
        return


class NullTimers:
    _t = NullTimer()

    def __call__(self, name: str, log_level: int | None = None) -> NullTimer:
        return self._t

    def set_step(self, *args: object) -> None:
        return


def spin(us: float) -> None:
    """Burn ``us`` of this thread's CPU time holding the GIL (time spent waiting for the GIL is not counted,
    so the work is fixed and anything a background thread takes shows up as extra wall time)."""
    end = time.thread_time_ns() + int(us * 1000)
    while time.thread_time_ns() < end:
        pass


def loop(timers: object, steps: int, work_us: float, first_step: int) -> None:
    for step in range(first_step, first_step + steps):
        timers.set_step(step, 4096, 8, MICROBATCHES)
        timers("forward-backward", log_level=1).start()
        for _ in range(MICROBATCHES):
            timers("batch-generator", log_level=2).start()
            timers("batch-generator").stop()
            timers("forward-compute", log_level=2).start()
            spin(work_us)
            timers("forward-compute").stop()
            timers("backward-compute", log_level=2).start()
            spin(work_us)
            timers("backward-compute").stop()
        timers("forward-backward").stop()
        timers("optimizer", log_level=1).start()
        timers("optimizer").stop()


def thread_cpu_ns(exclude: int) -> int:
    total = 0
    for t in threading.enumerate():
        if t.ident is None or t.ident == exclude:
            continue
        try:
            total += time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
        except (OSError, ProcessLookupError):
            pass
    return total


def child_cpu_ns(pid: int | None) -> int:
    if not pid:
        return 0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def run_arm(arm: tuple[str, str] | None, steps: int, work_us: float) -> dict[str, float]:
    from otel_straggler.install import build_timers

    main_id = threading.get_ident()
    timers: object
    if arm is None:
        timers = NullTimers()
    else:
        from otel_straggler.config import EmitterConfig
        from otel_straggler.export import create_sink
        from otel_straggler.identity import resolve_identity

        mode, detail = arm
        config = EmitterConfig.from_env(enabled=True, job_id="bench", export_mode=mode, detail=detail)
        ident = resolve_identity(rank=0, world_size=1, local_rank=0, job_id="bench")
        timed = TimedSink(create_sink(config, ident))
        timers = build_timers(enabled=True, job_id="bench", export_mode=mode, detail=detail, identity=ident, sink=timed)
        loop(timers, 5, work_us, 0)  # warm: spawn the export child, first names, first export
        timers.flush(10.0)
    sink: TimedSink | None = getattr(timers, "sink", None)
    child = getattr(sink, "child_pid", None)
    sink0 = sink.cpu_ns if sink is not None else 0
    bg0, ch0, proc0 = thread_cpu_ns(main_id), child_cpu_ns(child), time.process_time_ns()
    w0, t0 = time.perf_counter_ns(), time.thread_time_ns()
    loop(timers, steps, work_us, 10)
    t1, w1 = time.thread_time_ns(), time.perf_counter_ns()
    if arm is not None:
        timers.flush(10.0)  # the readout thread hands everything to the sink
        if sink is not None:
            sink.flush(10.0)  # and the sink exports it
    bg1, ch1, proc1 = thread_cpu_ns(main_id), child_cpu_ns(child), time.process_time_ns()
    sink1 = sink.cpu_ns if sink is not None else 0
    if arm is not None:
        timers.shutdown(5.0)
    n = steps * INTERVALS_PER_STEP
    return {
        "train_us": (t1 - t0) / n / 1000,
        "wall_us": (w1 - w0) / n / 1000,
        "bg_gil_us": (bg1 - bg0) / n / 1000,
        "bg_cpu_us": ((proc1 - proc0) - (t1 - t0)) / n / 1000,
        "child_us": (ch1 - ch0) / n / 1000,
        "sink_us": (sink1 - sink0) / n / 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work-us", type=float, default=200.0)
    args = ap.parse_args()

    rcv = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(rcv.stdout.readline())
    os.environ.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_METRIC_EXPORT_INTERVAL="1000",
    )
    arms: list[tuple[str, str] | None] = [
        None,
        ("process", "step"),
        ("process", "interval"),
        ("thread", "step"),
        ("thread", "interval"),
    ]
    results: dict[object, list[dict[str, float]]] = {a: [] for a in arms}
    try:
        for _ in range(args.rounds):
            for arm in arms:
                results[arm].append(run_arm(arm, args.steps, args.work_us))
    finally:
        rcv.stdin.close()
        rcv.wait(5)

    def med(arm: object, key: str) -> float:
        return statistics.median(r[key] for r in results[arm])

    null_train, null_wall = med(None, "train_us"), med(None, "wall_us")
    print(
        f"{args.rounds} rounds x {args.steps} steps x {INTERVALS_PER_STEP} intervals, work {args.work_us} us per "
        f"compute interval, host-only (no CUDA); medians"
    )
    print(f"no-op timers: train thread {null_train:.2f} us/interval, wall {null_wall:.2f} us/interval")
    header = (
        f"{'mode':8} {'detail':9} {'train_us':>9} {'bg_gil_us':>10} {'sink_us':>8} {'bg_cpu_us':>10} "
        f"{'child_us':>9} {'wall_pct':>9}"
    )
    print(header)
    print("-" * len(header))
    for arm in arms[1:]:
        mode, detail = arm
        train = med(arm, "train_us") - null_train
        wall_pct = (med(arm, "wall_us") / null_wall - 1.0) * 100
        print(
            f"{mode:8} {detail:9} {train:9.2f} {med(arm, 'bg_gil_us'):10.2f} {med(arm, 'sink_us'):8.2f} "
            f"{med(arm, 'bg_cpu_us'):10.2f} "
            f"{med(arm, 'child_us'):9.2f} {wall_pct:+8.1f}%"
        )
    default = ("process", "step")
    print(
        f"train_thread_us_per_interval={med(default, 'train_us') - null_train:.2f} "
        f"background_gil_us_per_interval={med(default, 'bg_gil_us'):.2f}"
    )


if __name__ == "__main__":
    main()

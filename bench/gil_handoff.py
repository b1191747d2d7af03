"""What the readout thread's GIL hand-offs cost a Python-bound training loop, on CPU: readout settings side by side.

A launch-bound step stand-in runs on the main thread: a Megatron-like step (``forward-backward`` around 8
microbatches x (``batch-generator``, ``forward-compute``, ``backward-compute``), then ``optimizer``: 26 intervals)
whose intervals each run ``--ops`` short "ops": a little Python (``--py-us``) and one C call that releases the
GIL (``zlib.crc32`` of a ``--gil-free-kb`` buffer), as a torch op releases it around its dispatch and launch.
The real ``Timers``, ring and readout time every interval, with device time on every step
(``device_every=1``) through a fake CUDA event pool (``tests/emitter/fake_cuda.py``: CUDA cannot run here; its
events answer ``elapsed_time`` in Python, with the GIL, like the pool's driver calls); each shim hands its
intervals to a real ``ProcessSink`` whose child reads the pipe and answers flushes (a stand-in for the export
child: its span building is not what this bench measures, and on these 2 cores its CPU would only add noise).

Arms take turns step by step (rotating order). Each shim's readout is woken once per readout period of the arm's
OWN step time, at a random interval in the first third of one of its own steps (a thread per arm runs
``Readout.wake``, the readout thread's body), so each arm pays its own wakes, as often as a run of that arm alone
would:

  off       no timers
  old       the readout as it was: every 100 ms; the pipe written with ``os.write`` (releases the GIL), the
            export child polled (``waitpid``, releases it) on every batch and stats, stats in a write of their own
  new       the defaults: ``readout_interval_ms`` from config.py, nothing in a wake releases the GIL
  old@500   the old drain, woken every 500 ms (what the period alone buys)
  new@100   the new drain, woken every 100 ms (what the drain alone buys)

Per arm: mean step time over ``off``'s (ratio of sums over rounds, bootstrap 95 % interval over rounds), and the
training thread's own counters per step, read between steps: voluntary context switches (it blocked: waiting for
the GIL) and involuntary ones (preempted) from ``getrusage(RUSAGE_THREAD)``; its time blocked, from
``/proc/self/task/<tid>/schedstat`` (wall minus time on a CPU minus time runnable but waiting for one: in this
loop the only thing it blocks on is the GIL, and unlike the wall time it does not include the preemptions
that other work on a shared machine causes); the readout wakes per step and the wall time of a wake. On a
busy 2-core machine the mean step ratio is noise-bound; the blocked time per wake is the resolved number.

  python bench/gil_handoff.py --seconds 240
  python bench/gil_handoff.py --report results.json        # the table again, from a saved run
Last line: ``old_mean_ratio=<x> new_mean_ratio=<y> old_vcsw_per_step=<a> new_vcsw_per_step=<b>`` (voluntary
switches of the training thread per step over ``off``'s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import textwrap
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests" / "emitter"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from fake_cuda import FakeDevice  # noqa: E402

from otel_straggler.config import DEFAULTS  # noqa: E402
from otel_straggler.event_pool import EventPool  # noqa: E402
from otel_straggler.export.process_sink import ProcessSink  # noqa: E402
from otel_straggler.interval import Interval  # noqa: E402
from otel_straggler.timers import Timers  # noqa: E402

MICROBATCHES = 8

# the export child's stand-in: reads the header, then frames; answers FLUSH like the real child (sidecar.py)
CHILD = textwrap.dedent(
    """
    import os, struct, sys
    FRAME = struct.Struct("<BI")
    sys.stdin.buffer.readline()
    buf = b""
    while True:
        data = os.read(0, 1 << 20)
        if not data:
            break
        buf += data
        pos = 0
        while len(buf) - pos >= FRAME.size:
            ftype, length = FRAME.unpack_from(buf, pos)
            if len(buf) - pos - FRAME.size < length:
                break
            if ftype == 4:
                seq = struct.unpack_from("<I", buf, pos + FRAME.size)[0]
                os.write(1, b"F%d 1 {}\\n" % seq)
            pos += FRAME.size + length
        buf = buf[pos:]
    """
)


class OldProcessSink(ProcessSink):
    """``ProcessSink`` as it wrote before: ``os.write`` (releases the GIL), the child polled (``waitpid``,
    releases it) before every batch and every stats publish, and stats written on their own after the batch
    and at every publish."""

    def _ensure_child(self) -> bool:
        if self._proc is not None and self._child_alive():
            return True
        if self._starts > self.max_restarts or time.monotonic() < self._next_start:
            return False
        return self._spawn()

    def _write(self, data: bytes) -> bool:
        try:
            if self._pending:
                n = os.write(self._fd, self._pending)
                self._pending = self._pending[n:]
                if self._pending:
                    return False
            n = os.write(self._fd, data)
        except BlockingIOError:
            return False
        except OSError:
            self._on_child_death()
            return False
        if n < len(data):
            self._pending = data[n:]
        return True

    def submit(self, intervals: Sequence[Interval]) -> None:
        if not intervals or not self._usable():
            return
        with self._lock:
            try:
                if not self._ensure_child():
                    self.counters.add("dropped_sidecar_down", len(intervals))
                    return
                data = self._encoder.encode_intervals(intervals)
                if self._write(data):
                    self._encoder.commit()
                else:
                    self._encoder.rollback()
                    self.counters.add("dropped_pipe_full", len(intervals))
                    return
                self._send_stats_locked()
            except Exception:
                self.counters.add("faults_process_sink")

    def publish_stats(self, stats: dict[str, int]) -> None:
        if not self._usable():
            return
        with self._lock:
            try:
                self._stats = dict(stats)
                if self._ensure_child():
                    self._send_stats_locked()
            except Exception:
                self.counters.add("faults_process_sink")


ARMS: dict[str, tuple[str, float | None]] = {  # name: (sink kind, readout period ms; None: the default)
    "old": ("old", 100.0),
    "new": ("new", None),
    "old@500": ("old", 500.0),
    "new@100": ("new", 100.0),
    "new@1000": ("new", 1000.0),
}


class Arm:
    """One shim: Timers on a fake pool, a process sink, and a thread that runs one readout wake per set()."""

    def __init__(self, name: str) -> None:
        kind, period = ARMS[name]
        self.name = name
        self.period_ms = float(period if period is not None else DEFAULTS.readout_interval_ms)
        cfg = replace(DEFAULTS, enabled=True, device_every=1, readout_interval_ms=self.period_ms)
        self.device = FakeDevice(auto_complete=True)
        pool = EventPool(cfg.pool_size, self.device.factory, synchronize=None)
        cls = OldProcessSink if kind == "old" else ProcessSink
        self.sink = cls({"service.name": "gil-handoff"}, rank=0, job_id=f"gil-{name}", config=cfg,
                        command=[sys.executable, "-c", CHILD])
        self.timers = Timers(2, "minmax", config=cfg, pool=pool, sink=self.sink)  # readout thread NOT started
        self.readout = self.timers.readout
        self.go = threading.Event()
        self.stop = False
        self.wakes: list[float] = []  # GIL-holding wall time of each wake, ms
        self.own_ns = 0
        self.thread = threading.Thread(target=self._run, name=f"readout-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.go.wait()
            self.go.clear()
            if self.stop:
                return
            t0 = time.perf_counter_ns()
            self.readout.wake()
            self.wakes.append((time.perf_counter_ns() - t0) / 1e6)

    def close(self) -> None:
        self.stop = True
        self.go.set()
        self.thread.join(5.0)
        self.timers.shutdown(3.0)


def make_op(py_us: float, gil_free_kb: int) -> Any:
    buf = bytes(gil_free_kb * 1024)
    loops = max(1, int(py_us * 14))  # ~14 additions per us on this machine; calibrated below
    crc = zlib.crc32

    def op() -> None:
        s = 0
        for i in range(loops):
            s += i
        crc(buf)

    return op


def step(timers: Timers | None, op: Any, ops: int, wake_at: int, arm: Arm | None) -> None:
    """One training step: 26 intervals; at interval ``wake_at`` (when >= 0) the arm's readout is woken."""
    k = 0
    if timers is None:
        for _ in range(2 + 3 * MICROBATCHES):
            for _ in range(ops):
                op()
        return
    fb = timers("forward-backward")
    fb.start()
    for _ in range(MICROBATCHES):
        for name in ("batch-generator", "forward-compute", "backward-compute"):
            if k == wake_at and arm is not None:
                arm.go.set()
            k += 1
            t = timers(name)
            t.start()
            for _ in range(ops):
                op()
            t.stop()
    for _ in range(ops):
        op()
    fb.stop()
    o = timers("optimizer")
    o.start()
    for _ in range(ops):
        op()
    o.stop()


def bootstrap(pairs: list[tuple[float, float]], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    vals = sorted(_ratio(rng.choices(pairs, k=len(pairs))) for _ in range(n))
    return vals[int(0.025 * n)], vals[int(0.975 * n) - 1]


def bootstrap_diff(arm: list[float], off: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of mean(arm) - mean(off) per step, resampling paired rounds."""
    rng = random.Random(seed)
    pairs = list(zip(arm, off))
    vals = sorted(statistics.fmean(a - b for a, b in rng.choices(pairs, k=len(pairs))) for _ in range(n))
    return vals[int(0.025 * n)], vals[int(0.975 * n) - 1]


def _ratio(pairs: list[tuple[float, float]]) -> float:
    return sum(a for a, _ in pairs) / sum(b for _, b in pairs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default="off,old,new", help=f"off and any of {list(ARMS)}")
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--rounds", type=int, default=100_000)
    ap.add_argument("--ops", type=int, default=270, help="ops per interval (270: ~30 ms steps here)")
    ap.add_argument("--py-us", type=float, default=3.0, help="GIL-holding Python work per op")
    ap.add_argument("--gil-free-kb", type=int, default=6, help="zlib.crc32 buffer per op (GIL released)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--report", default=None, help="print the table of a saved --json-out and exit")
    args = ap.parse_args()
    if args.report:
        report(json.loads(Path(args.report).read_text()))
        return 0
    names = args.arms.split(",")
    if names[0] != "off" or any(n not in ARMS for n in names[1:]):
        ap.error(f"arms: off first, then any of {list(ARMS)}")
    op = make_op(args.py_us, args.gil_free_kb)
    arms: dict[str, Arm | None] = {n: (Arm(n) if n != "off" else None) for n in names}
    rng = random.Random(1)
    fields = ("wall", "cpu", "vcsw", "ivcsw", "blocked")
    sched_fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)

    def sched() -> tuple[int, int, int]:
        """(ns on a CPU, ns runnable waiting for one, now ns) of the training thread."""
        run, wait, _ = os.pread(sched_fd, 256, 0).split()
        return int(run), int(wait), time.perf_counter_ns()

    rec: dict[str, dict[str, list[float]]] = {n: {f: [] for f in fields} for n in names}
    for a in arms.values():  # warm: the export children start, every name is sent once
        step(a.timers if a else None, op, args.ops, 0 if a else -1, a)
        if a is not None:
            time.sleep(0.05)
    t_end = time.monotonic() + args.seconds
    rounds = 0
    while rounds < args.rounds and time.monotonic() < t_end:
        order = names[rounds % len(names):] + names[: rounds % len(names)]
        for n in order:
            a = arms[n]
            wake_at = -1
            if a is not None and a.own_ns >= a.period_ms * 1e6:
                a.own_ns = 0
                wake_at = rng.randrange(MICROBATCHES)  # in the step's first third: the wake ends inside the step
            s0 = sched()
            r0 = resource.getrusage(resource.RUSAGE_THREAD)
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            step(a.timers if a else None, op, args.ops, wake_at, a)
            t1 = time.perf_counter_ns()
            c1 = time.thread_time_ns()
            r1 = resource.getrusage(resource.RUSAGE_THREAD)
            s1 = sched()
            if a is not None:
                a.own_ns += t1 - t0
            rec[n]["wall"].append((t1 - t0) / 1e6)
            rec[n]["cpu"].append((c1 - c0) / 1e6)
            rec[n]["vcsw"].append(r1.ru_nvcsw - r0.ru_nvcsw)
            rec[n]["ivcsw"].append(r1.ru_nivcsw - r0.ru_nivcsw)
            # blocked = wall - on CPU - runnable; the /proc reads sit outside t0..t1, so widen the wall to them
            rec[n]["blocked"].append(((s1[2] - s0[2]) - (s1[0] - s0[0]) - (s1[1] - s0[1])) / 1e6)
        rounds += 1
    time.sleep(0.2)
    counters = {}
    for n, a in arms.items():
        if a is not None:
            a.close()
            c = a.timers.counters.snapshot()
            counters[n] = {k: c[k] for k in ("intervals", "dropped_ring_full", "degraded_pool_exhausted",
                                             "degraded_readout_timeout", "faults", "pool_high_water")}
            counters[n].update({k: v for k, v in a.sink.counters.snapshot().items() if v})
    out: dict[str, Any] = {"rounds": rounds, "args": vars(args), "arms": {}, "steps": rec}
    for n, a in arms.items():
        if a is not None:
            out["arms"][n] = {"period_ms": a.period_ms, "wakes_per_step": len(a.wakes) / max(1, len(rec[n]["wall"])),
                              "wake_ms": statistics.fmean(a.wakes) if a.wakes else 0.0, "counters": counters[n]}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out))
    report(out)
    return 0


def report(out: dict[str, Any]) -> None:
    """Per arm against ``off``, from the per-step records: the mean step ratio and the training thread's
    counters per step (differences to ``off`` with bootstrap 95 % intervals over rounds)."""
    rec = out["steps"]
    names = list(rec)
    off = rec["off"]
    args = out["args"]
    print(f"{out['rounds']} rounds; off step {statistics.fmean(off['wall']):.2f} ms (median "
          f"{statistics.median(off['wall']):.2f}); {args['ops']} ops per interval, 26 intervals per step, device time "
          f"on every step (fake pool); off per step: {statistics.fmean(off['vcsw']):.3f} voluntary switches, "
          f"{statistics.fmean(off['ivcsw']):.2f} involuntary, {statistics.fmean(off['cpu']):.2f} ms CPU, "
          f"{statistics.fmean(off['blocked']):.3f} ms blocked")
    print(f"{'arm':>8} {'period':>6} {'mean ratio (95% CI)':>24} {'vcsw - off /step':>22} "
          f"{'ivcsw - off /step':>22} {'cpu - off ms/step':>22} {'blocked - off ms/step':>24} {'wakes/step':>10} "
          f"{'vcsw/wake':>9} {'wake ms':>7} {'drops':>5}")

    def diff(f: str, arm: str, digits: int) -> str:
        m = statistics.fmean(rec[arm][f]) - statistics.fmean(off[f])
        lo, hi = bootstrap_diff(rec[arm][f], off[f])
        return f"{m:+.{digits}f} ({lo:+.{digits}f}..{hi:+.{digits}f})"

    summary: dict[str, dict[str, float]] = {}
    for n in names[1:]:
        a = out["arms"][n]
        period = a.get("period_ms", ARMS[n][1] or DEFAULTS.readout_interval_ms)
        pairs = list(zip(rec[n]["wall"], off["wall"]))
        ratio = _ratio(pairs)
        lo, hi = bootstrap(pairs)
        dv = statistics.fmean(rec[n]["vcsw"]) - statistics.fmean(off["vcsw"])
        per_wake = dv / a["wakes_per_step"] if a["wakes_per_step"] else 0.0
        drops = sum(v for k, v in a["counters"].items() if k.startswith(("dropped", "degraded")))
        summary[n] = {"ratio": ratio, "vcsw": dv,
                      "blocked": statistics.fmean(rec[n]["blocked"]) - statistics.fmean(off["blocked"])}
        print(f"{n:>8} {period:4.0f}ms {ratio:8.4f} ({lo:.4f}-{hi:.4f}) {diff('vcsw', n, 3):>22} "
              f"{diff('ivcsw', n, 2):>22} {diff('cpu', n, 3):>22} {diff('blocked', n, 3):>24} "
              f"{a['wakes_per_step']:10.3f} {per_wake:9.2f} {a['wake_ms']:7.2f} {drops:5d}")
    last = [f"{n}_mean_ratio={summary[n]['ratio']:.4f}" for n in ("old", "new") if n in summary]
    last += [f"{n}_vcsw_per_step={summary[n]['vcsw']:.3f}" for n in ("old", "new") if n in summary]
    print(" ".join(last))


if __name__ == "__main__":
    sys.exit(main())

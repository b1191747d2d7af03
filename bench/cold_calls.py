"""What each of Megatron's timer calls costs when its code and data are cold, on both hot paths.

Between a step's kernel launches the timers' code and objects have been evicted by the step's own work, so a call
costs what its cache misses cost, not its tight-loop time (``bench/in_situ.py`` measures a whole start+stop between
operations). This probe isolates the parts: before each timed call it sweeps ``--sweep-mb`` of memory and a list of
objects (evicting L1/L2 and most of the last-level cache), then times one call with ``perf_counter_ns``:

* ``lookup``: ``timers(name, log_level=level)``, the lookup Megatron makes before every start and stop;
* ``start``, ``stop``: a host-only start and stop (no CUDA here);
* ``barrier_start``: ``start(barrier=True)`` (Megatron passes ``barrier_with_L1_time`` to level-1 timers; the
  shim counts it);
* ``noop_lookup``, ``noop_start``: Megatron's call shape into a Python lookup and a no-op timer (the floor of a
  Python ``__call__``).

Each row is the mean (and median) minus that of an empty timed region after the same sweep. Each hot path runs in
its own child process (``OTEL_STRAGGLER_HOT_PATH``), ``--children`` of each, alternating.

Usage: ``python bench/cold_calls.py`` (last line: ``native_lookup_ns=<x> python_lookup_ns=<y>``, means).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NAMES = ["forward-backward", "forward-compute", "batch-generator", "backward-compute", "all-grads-sync", "optimizer"] \
    + [f"optimizer-stage-{i}" for i in range(6)]
ROWS = ("lookup", "start", "stop", "barrier_start", "noop_lookup", "noop_start")


def child(reps: int, sweep_mb: int) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    from otel_straggler import hot_path
    from otel_straggler.config import EmitterConfig
    from otel_straggler.timers import Timers

    t = Timers(2, "minmax", config=EmitterConfig(enabled=True, export_mode="off", ring_size=1 << 16))
    for n in NAMES:
        t(n, 2 if n in ("forward-compute", "batch-generator", "backward-compute") else 1)
    big = bytearray(sweep_mb << 20)
    junk = [object() for _ in range(200_000)]

    def sweep() -> None:
        s = 0
        for i in range(0, len(big), 4096):
            big[i] = (big[i] + 1) & 255
        for o in junk[::7]:
            s ^= id(o)

    class Noop:
        def start(self, barrier: bool = False) -> None:
            pass

    noop = Noop()

    class NoopTimers:
        def __init__(self) -> None:
            self._timers = dict.fromkeys(NAMES, noop)

        def __call__(self, name: str, log_level: int | None = None) -> Noop:
            return self._timers[name]

    nt = NoopTimers()
    pc = time.perf_counter_ns
    got: dict[str, list[int]] = {k: [] for k in (*ROWS, "empty")}
    # each call is timed inline, not through a helper: a helper's frame would sit inside the timed region, and a
    # cold Python frame costs about what a C start does (the noop_start row)
    for rep in range(reps):
        t.set_step(rep)
        name = NAMES[rep % len(NAMES)]
        level = t._log_levels[name]
        sweep()
        a = pc()
        b = pc()
        got["empty"].append(b - a)
        sweep()
        a = pc()
        tm = t(name, log_level=level)
        b = pc()
        got["lookup"].append(b - a)
        sweep()
        a = pc()
        tm.start()
        b = pc()
        got["start"].append(b - a)
        sweep()
        a = pc()
        tm.stop()
        b = pc()
        got["stop"].append(b - a)
        sweep()
        a = pc()
        tm.start(barrier=True)
        b = pc()
        got["barrier_start"].append(b - a)
        tm.stop()
        sweep()
        a = pc()
        x = nt(name, log_level=level)
        b = pc()
        got["noop_lookup"].append(b - a)
        sweep()
        a = pc()
        x.start()
        b = pc()
        got["noop_start"].append(b - a)
    warm = reps // 20
    base_mean = statistics.fmean(got["empty"][warm:])
    base_med = statistics.median(got["empty"][warm:])
    out = {"path": hot_path.NAME, "empty_ns": base_mean}
    for k in ROWS:
        out[f"{k}_mean"] = statistics.fmean(got[k][warm:]) - base_mean
        out[f"{k}_median"] = statistics.median(got[k][warm:]) - base_med
    t.shutdown(1.0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--sweep-mb", type=int, default=32)
    ap.add_argument("--children", type=int, default=2, help="child processes per hot path, alternating")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.reps, args.sweep_mb)))
        return 0
    print(f"Python {sys.version.split()[0]}; {args.reps} calls of each kind per child, {args.sweep_mb} MB swept "
          f"before each; ns over an empty timed region (mean / median)")
    res: dict[str, list[dict]] = {"native": [], "python": []}
    for _ in range(args.children):
        for path in ("native", "python"):
            env = dict(os.environ, OTEL_STRAGGLER_HOT_PATH=path)
            cmd = [sys.executable, __file__, "--child", "--reps", str(args.reps), "--sweep-mb", str(args.sweep_mb)]
            r = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            if r["path"] != path:
                print(f"  the {path} path did not run ({r['path']} did): is the C module built?")
            res[r["path"]].append(r)
    print(f"{'call':>14} " + " ".join(f"{p + ' #' + str(i + 1):>16}" for p in res for i in range(len(res[p]))))
    for k in ROWS:
        cells = [f"{r[k + '_mean']:7.0f} / {r[k + '_median']:6.0f}" for p in res for r in res[p]]
        print(f"{k:>14} " + " ".join(f"{c:>16}" for c in cells))
    last = {p: statistics.fmean(r["lookup_mean"] for r in rs) for p, rs in res.items() if rs}
    print(" ".join(f"{p}_lookup_ns={v:.0f}" for p, v in last.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

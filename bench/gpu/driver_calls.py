"""What each CUDA driver call of the emitter costs on the host, in a tight loop and between a step's launches,
and what the readout's drain costs per interval on real events.

The overhead bench (``bench/gpu/overhead.py``) prices a device-sampled launch-bound step as a whole; this one
splits it (``bench/results/gpu-h200.md`` section 3):

* ``tight``: ``cuEventRecord``, ``cuEventElapsedTime`` and ``cuEventQuery`` through the pool's ctypes calls,
  back to back on two warm events (the best case);
* ``in situ``: the same calls between small kernel launches (``--ops`` element-wise ops per record, as a
  launch-bound step launches them): blocks of iterations with and without the call alternate, and the cost is the
  difference of the mean iteration time (mean and median of the block pairs);
* ``start+stop``: one timer interval between 3 or 30 small launches, through no-op timers, the real timers on a
  host-only step and on a device-sampled one (``bench/in_situ.py``);
* ``elapsed cold``: the first ``cuEventElapsedTime`` on each of many completed pairs recorded between launches,
  then the second read of the same pairs;
* ``drain``: ``Readout.drain`` through the real ``Timers``, ring and pool over ``--steps`` Megatron-like steps
  (``bench/readout_cost.py``'s ``megatron_step`` and ``drain_once``: 21 intervals, one small kernel in each
  innermost one), per interval, for device time on every step, without event reuse, and host-only, into the
  process sink's wire records: packed by the C drain (``drain_us``) and as ``Interval`` objects that the encoder
  packs (``objects_us``, the path without the C module).

Usage (GPU machine, checkout root): ``python bench/gpu/driver_calls.py``; last line
``record_tight_us= record_in_situ_us= elapsed_cold_us= drain_device_us= drain_host_us= objects_device_us=``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from in_situ import boundaries_in_situ  # noqa: E402
from readout_cost import ObjectSink, PackedSink, drain_once  # noqa: E402

from otel_straggler.config import EmitterConfig  # noqa: E402
from otel_straggler.event_pool import EventPool  # noqa: E402
from otel_straggler.timers import Timers  # noqa: E402


def tight(pool: EventPool, n: int) -> dict[str, float]:
    import torch

    a, b = pool.free.popleft(), pool.free.popleft()
    rec, el, q = pool.record, pool.elapsed, pool.query
    out = {}
    for name, fn in (("record", lambda: rec(a)), ("elapsed", lambda: el(a, b)), ("query", lambda: q(b)),
                     ("noop", lambda: None)):
        rec(a)
        rec(b)
        torch.cuda.synchronize()
        best = []
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            best.append((time.perf_counter_ns() - t0) / n / 1000)
        out[name] = statistics.median(best)
    torch.cuda.synchronize()
    pool.free.extend((a, b))
    return out


def in_situ(pool: EventPool, ops: int, iters: int, blocks: int) -> dict[str, Any]:
    """Per-iteration mean time of ``ops`` small launches, with and without one driver call each iteration."""
    import torch

    x = torch.zeros(1024, device="cuda")
    evs = [pool.free.popleft() for _ in range(2)]
    rec, el = pool.record, pool.elapsed
    rec(evs[0])
    rec(evs[1])
    torch.cuda.synchronize()

    def run(call: Any) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            for _ in range(ops):
                x.add_(1.0)
            if call is not None:
                call()
        torch.cuda.synchronize()
        return (time.perf_counter_ns() - t0) / iters / 1000

    calls = {"record": lambda: rec(evs[0]), "elapsed": lambda: el(evs[0], evs[1])}
    res: dict[str, Any] = {}
    for name, call in calls.items():
        diffs = []
        for k in range(blocks):
            if k % 2:
                with_call, without = run(call), run(None)
            else:
                without, with_call = run(None), run(call)
            diffs.append(with_call - without)
        res[name] = {"mean_us": statistics.fmean(diffs), "median_us": statistics.median(diffs),
                     "sem_us": statistics.stdev(diffs) / len(diffs) ** 0.5}
    res["iteration_us"] = run(None)
    torch.cuda.synchronize()
    pool.free.extend(evs)
    return res


def elapsed_cold(pool: EventPool, pairs: int, ops: int) -> dict[str, float]:
    import torch

    x = torch.zeros(1024, device="cuda")
    rec, el = pool.record, pool.elapsed
    ps = []
    for _ in range(pairs):
        a, b = pool.free.popleft(), pool.free.popleft()
        rec(a)
        for _ in range(ops):
            x.add_(1.0)
        rec(b)
        ps.append((a, b))
    torch.cuda.synchronize()
    out = {}
    for label in ("first", "second"):
        t0 = time.perf_counter_ns()
        for a, b in ps:
            el(a, b)
        out[label] = (time.perf_counter_ns() - t0) / pairs / 1000
    for a, b in ps:
        pool.free.extend((a, b))
    return out


def drains(pool_size: int, steps: int, reps: int) -> dict[str, Any]:
    import torch

    x = torch.zeros(1024, device="cuda")
    arms = {"device": EmitterConfig(enabled=True, device_every=1, pool_size=pool_size),
            "device-own": EmitterConfig(enabled=True, device_every=1, pool_size=pool_size, share_gap_us=0.0),
            "host": EmitterConfig(enabled=True, device_every=1 << 40, pool_size=pool_size)}
    out: dict[str, Any] = {}
    for name, cfg in arms.items():
        row: dict[str, Any] = {}
        for key, sink in (("drain", PackedSink()), ("objects", ObjectSink())):
            t = Timers(2, "minmax", config=cfg, pool=EventPool(cfg.pool_size), sink=sink)
            per = []
            for rep in range(reps + 3):
                us, n = drain_once(t, lambda: x.add_(1.0), rep * steps, steps, torch.cuda.synchronize)
                if rep >= 3:
                    per.append(us)
            row[f"{key}_us"] = statistics.median(per)
            row[f"{key}_us_mean"] = statistics.fmean(per)
            row["intervals_per_drain"] = n
            row["records_per_step"] = t.share.records / ((reps + 3) * steps)
            t.shutdown(2.0)
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="calls per tight-loop timing")
    ap.add_argument("--ops", type=int, default=3, help="small launches per in-situ iteration")
    ap.add_argument("--iters", type=int, default=400, help="iterations per in-situ block")
    ap.add_argument("--blocks", type=int, default=200, help="in-situ blocks per call (alternating)")
    ap.add_argument("--pairs", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=13, help="steps per drain (a 500 ms period of 37 ms steps)")
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args(argv)
    pool = EventPool(4096)
    print(f"record_api={pool.record_api}", flush=True)
    res: dict[str, Any] = {"tight_us": tight(pool, args.n)}
    print("tight:", json.dumps(res["tight_us"]), flush=True)
    res["in_situ"] = in_situ(pool, args.ops, args.iters, args.blocks)
    print("in situ:", json.dumps(res["in_situ"]), flush=True)
    res["elapsed_cold_us"] = elapsed_cold(pool, args.pairs, args.ops)
    print("elapsed cold:", json.dumps(res["elapsed_cold_us"]), flush=True)
    for ops in (3, 30):
        res[f"boundaries_ops{ops}"] = boundaries_in_situ(ops, max(50, args.iters * 3 // ops), args.blocks, "cuda")
        print(f"start+stop between {ops} launches:", json.dumps(res[f"boundaries_ops{ops}"]), flush=True)
    res["drain"] = drains(4096, args.steps, args.reps)
    for k, v in res["drain"].items():
        print(f"drain {k}:", json.dumps(v), flush=True)
    print(json.dumps(res), file=sys.stderr)
    d = res["drain"]
    print(f"record_tight_us={res['tight_us']['record']:.2f} "
          f"record_in_situ_us={res['in_situ']['record']['mean_us']:.2f} "
          f"elapsed_cold_us={res['elapsed_cold_us']['first']:.2f} drain_device_us={d['device']['drain_us']:.2f} "
          f"drain_host_us={d['host']['drain_us']:.2f} objects_device_us={d['device']['objects_us']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

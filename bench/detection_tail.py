"""The healthy tail of sequential_excess: how close do healthy ranks come to its threshold?

False alarms per 1e5 rank-steps are too rare to count directly at the rates a 16k-rank job needs; this
bench runs healthy simulated jobs through the real processor and records, at every window close, the
largest standardised lookback sum ``T`` of every rank on stages of at least ``device_min_stage_ms`` whose
mean excess in this window clears the margin (the statistic sequential_excess compares with
``sequential_threshold``), then prints how often ``T`` reached each level next to a standard normal tail.
The threshold's margin is read off the table (``docs/detection-defaults.md``).

  python bench/detection_tail.py --jitter 0.02 --runs 400      # ~3 minutes on 2 cores

Last line: rank_steps=<> tests=<> false_alarms=<> t_ge_4=<> t_ge_4_5=<> t_ge_5=<> t_ge_threshold=<>
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from multiprocessing import Pool
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import detection as bench  # noqa: E402

from collector_processor.processor.straggler import factory, sequential  # noqa: E402
from jobsim.stream import Noise  # noqa: E402

LEVELS = (3.0, 3.5, 4.0, 4.5, 5.0, 5.5)


def _one(job: tuple[int, float, dict, float]) -> tuple[list[float], int, int]:
    seed, jitter, overrides, min_stage_ms = job
    cfg = factory.create_default_config().model_copy(update=overrides)
    seen: list[float] = []
    update = sequential.update

    def observe(*args, **kwargs):  # type: ignore[no-untyped-def]
        res = update(*args, **kwargs)
        items = args[2]
        if items and items[0][2] >= min_stage_ms and res.window_excess >= cfg.sequential_margin:
            seen.append(res.score)
        return res

    sequential.update = observe  # the detector calls it through the module
    try:
        args = argparse.Namespace(tp=2, dp=8, steps=150, jitter=jitter, host_jitter=Noise.host_jitter,
                                  step_jitter=Noise.step_jitter, device_every=1)
        run = bench.Run("healthy", None, bench.TARGET_STAGE_MS if seed % 2 else 48.0)
        score, _ = bench.run_one(bench.sim_config(args, run, seed), None, overrides)
    finally:
        sequential.update = update
    return seen, score.false_alarms, score.healthy_rank_steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jitter", type=float, default=0.02)
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE")
    args = ap.parse_args()
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg = factory.create_default_config().model_copy(update=overrides)
    rng = random.Random(args.seed)
    jobs = [(rng.getrandbits(32), args.jitter, overrides, cfg.device_min_stage_ms) for _ in range(args.runs)]
    t0 = time.monotonic()
    with Pool(args.workers) as pool:
        results = []
        for i, res in enumerate(pool.imap_unordered(_one, jobs)):
            results.append(res)
            if (i + 1) % 50 == 0:
                print(f"  {i + 1}/{len(jobs)} runs, {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    scores = [x for seen, _, _ in results for x in seen]
    rank_steps = sum(h for _, _, h in results)
    false_alarms = sum(f for _, f, _ in results)
    print(f"device jitter {args.jitter:.1%}, {args.runs} healthy runs, {rank_steps} healthy rank-steps, "
          f"{len(scores)} tests (rank x stage >= {cfg.device_min_stage_ms:g} ms x window with the margin), "
          f"false alarms {false_alarms}, threshold {cfg.sequential_threshold:g}")
    print(f"{'T >=':>6} {'count':>6} {'per test':>9} {'normal tail':>11}")
    for c in LEVELS:
        k = sum(1 for x in scores if x >= c)
        per = k / len(scores) if scores else 0.0
        print(f"{c:6.1f} {k:6d} {per:9.2e} {0.5 * math.erfc(c / math.sqrt(2)):11.2e}")

    def ge(c: float) -> int:
        return sum(1 for x in scores if x >= c)

    print(f"rank_steps={rank_steps} tests={len(scores)} false_alarms={false_alarms} t_ge_4={ge(4.0)} "
          f"t_ge_4_5={ge(4.5)} t_ge_5={ge(5.0)} t_ge_threshold={ge(cfg.sequential_threshold)} "
          f"max_t={max(scores) if scores else 0:.2f} jitter={args.jitter} seconds={time.monotonic() - t0:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

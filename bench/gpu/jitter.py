"""Device-time jitter of Megatron's stages on a real GPU, as the shim measures it.

The detector's defaults (``docs/detection-defaults.md``) and the simulator (``jobsim``)
assume the per-step device time of a compute stage varies by about 1 % (Gaussian sigma). This measures it:
a real megatron-core GPT (local spec, bf16, TP = PP = 1) alone on the GPU, timed by this project's Timers
with device events on every step, the intervals captured in-process (no export). Per stage and step the
device times of the microbatch repeats are summed (the emitter's default ``step`` detail), and over the
steps after warmup reported: median ms, the robust relative sigma (1.4826 x MAD / median), the plain
coefficient of variation (std / mean, spikes included), and the largest step / median.

  python bench/gpu/jitter.py --sizes detection,gpu-bound --steps 200 --warmup 20
Last line: compute_sigma_pct_max=<robust sigma, worst forward/backward stage> compute_sigma_pct_median=<>
all_stages_sigma_pct_max=<>
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from otel_straggler.interval import DecodingSink  # noqa: E402
from otel_straggler_demo.run import free_port  # noqa: E402


class CaptureSink(DecodingSink):
    """An IntervalSink that keeps the device time per (step, stage) in memory (bench only)."""

    def __init__(self) -> None:
        super().__init__()
        self.device: dict[tuple[int, str], float] = defaultdict(float)
        self.group: dict[str, str] = {}
        self.host_only = 0

    def submit(self, intervals) -> None:
        for iv in intervals:
            self.group[iv.name] = iv.group
            if iv.device_ms is None:
                self.host_only += 1
            else:
                self.device[(iv.step, iv.name)] += iv.device_ms

    def publish_stats(self, stats) -> None:
        pass


def run_size(size_name: str, steps: int, warmup: int) -> dict:
    import otel_straggler
    from otel_straggler_demo.megatron_gpt import SIZES, MegatronGPT

    model = MegatronGPT(SIZES[size_name])
    sink = CaptureSink()
    timers = otel_straggler.configure(enabled=True, sink=sink, device_every=1, register_lifecycle=False)
    model.set_timers(timers)
    t0 = time.perf_counter()
    for it in range(1, steps + 1):
        timers.set_step(it)
        model.train_step()
    model.torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    timers.shutdown(10.0)
    model.set_timers(None)
    per_stage: dict[str, list[float]] = defaultdict(list)
    for (step, name), ms in sorted(sink.device.items()):
        if step > warmup:
            per_stage[name].append(ms)
    rows = []
    for name, vals in sorted(per_stage.items(), key=lambda kv: -statistics.median(kv[1])):
        if len(vals) < 10:
            continue
        med = statistics.median(vals)
        mad = statistics.median(abs(v - med) for v in vals)
        rows.append({"stage": name, "group": sink.group.get(name, "other"), "steps": len(vals),
                     "median_ms": med, "robust_sigma_pct": 100.0 * 1.4826 * mad / med if med > 0 else 0.0,
                     "cv_pct": 100.0 * statistics.pstdev(vals) / statistics.fmean(vals) if med > 0 else 0.0,
                     "max_over_median": max(vals) / med if med > 0 else 0.0})
    del model
    return {"size": size_name, "steps": steps, "warmup": warmup, "step_ms": 1000.0 * wall / steps,
            "host_only_intervals": sink.host_only, "stages": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="detection,gpu-bound")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import torch

    from otel_straggler_demo.megatron_gpt import init_single_process

    init_single_process(free_port())
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}", flush=True)
    results = [run_size(name, args.steps, args.warmup) for name in args.sizes.split(",")]
    compute, every = [], []
    for r in results:
        print(f"\n{r['size']}: {r['steps']} steps ({r['warmup']} warmup), {r['step_ms']:.1f} ms/step, "
              f"{r['host_only_intervals']} host-only intervals")
        print(f"  {'stage':38} {'group':10} {'median ms':>10} {'sigma %':>8} {'cv %':>7} {'max/med':>8}")
        for row in r["stages"]:
            print(f"  {row['stage']:38} {row['group']:10} {row['median_ms']:10.3f} {row['robust_sigma_pct']:8.2f} "
                  f"{row['cv_pct']:7.2f} {row['max_over_median']:8.2f}")
            if row["median_ms"] >= 1.0:
                every.append(row["robust_sigma_pct"])
                if row["group"] in ("forward", "backward"):
                    compute.append(row["robust_sigma_pct"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    print(f"compute_sigma_pct_max={max(compute, default=float('nan')):.3f} "
          f"compute_sigma_pct_median={statistics.median(compute) if compute else float('nan'):.3f} "
          f"all_stages_sigma_pct_max={max(every, default=float('nan')):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Detection on real device times: megatron-core GPT replicas sharing the GPU, one slowed.

Runs the demo in megatron mode (``otel_straggler.demo``: every rank a real megatron-core GPT on CUDA, an
independent replica in its own one-process NCCL world, all in one cohort; spans to a straggler collector
on loopback) three times:
  device   rank 1's forward-compute gets extra GPU work on its stream   -> expect gpu_stream_stall
  host     rank 1's forward-compute waits on the host                     -> expect host_only_stall
  healthy  no injection                                                   -> expect no straggler verdict
Reports steps to detect, attribution and false alarms per run.

  python bench/gpu/detection.py --ranks 4 --steps 150 --inject-ms 1.5
Last line: device_detected=<0|1> device_steps_to_detect=<n> device_attribution=<a> host_detected=<>
host_steps_to_detect=<> host_attribution=<> healthy_false_alarms=<n>
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from otel_straggler.demo.run import DemoOptions, run_demo

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--inject-rank", type=int, default=1)
    ap.add_argument("--inject-from", type=int, default=50)
    ap.add_argument("--inject-ms", type=float, default=1.5, help="per forward-compute microbatch")
    ap.add_argument("--size", default="detection")
    ap.add_argument("--runs", default="device,host,healthy")
    ap.add_argument("--out", default="gpu-detection")
    args = ap.parse_args()
    summary: dict[str, object] = {}
    rows = []
    for kind in args.runs.split(","):
        healthy = kind == "healthy"
        opts = DemoOptions(ranks=args.ranks, steps=args.steps, model=f"megatron:{args.size}",
                           inject_rank=None if healthy else args.inject_rank, inject_stage="forward-compute",
                           inject_kind="device" if kind == "device" else "host", inject_ms=args.inject_ms,
                           inject_from=args.inject_from, out=f"{args.out}/{kind}", json=False)
        print(f"== run {kind}", flush=True)
        res = run_demo(opts)
        hits = [d for d in res.detected if d.rank == args.inject_rank and not healthy]
        first = hits[0] if hits else None
        rows.append({"run": kind, "ok": res.ok, "detected": bool(first),
                     "stage": first.stage if first else None,
                     "steps_to_detect": first.steps_to_detect if first else None,
                     "deviation": first.deviation if first else None,
                     "attribution": first.attribution if first else None,
                     "false_alarms": res.false_alarms, "verdict_records": res.verdicts,
                     "spans": res.spans_seen})
        if healthy:
            summary["healthy_false_alarms"] = res.false_alarms + len(res.detected if healthy else [])
        else:
            summary[f"{kind}_detected"] = int(bool(first))
            summary[f"{kind}_steps_to_detect"] = first.steps_to_detect if first else -1
            summary[f"{kind}_attribution"] = first.attribution if first else "none"
            summary[f"{kind}_false_alarms"] = res.false_alarms
    print(json.dumps(rows, indent=1))
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Detection on real device times: megatron-core GPT replicas sharing the GPU, one slowed.

Runs the demo in megatron mode (``otel_straggler_demo``: every rank a real megatron-core GPT on CUDA, an
independent replica in its own one-process NCCL world, all in one cohort; spans to a straggler collector
on loopback) three times:
  device   rank 1's forward-compute gets extra GPU work on its stream     -> expect gpu_stream_stall
  host     rank 1's batch-generator (the data fetch, Megatron's level-2 timer nested in forward-compute)
           waits on the host: a slow data loader                            -> expect host_only_stall
  healthy  no injection                                                     -> expect no straggler verdict
With ``--turns`` (default) the replicas take turns on the GPU step by step (``--gpu-turns``): one GPU per
rank is what a job has, and replicas time-slicing one GPU would put each other's kernels inside their
device intervals. A straggler verdict on another rank, or on the slowed rank before the onset, is a false
alarm. Reports every straggler verdict, steps to detect and attribution per run.

  python bench/gpu/detection.py --ranks 4 --steps 130 --device-ms 1.0 --host-ms 1.5
Last line: device_detected=<0|1> device_steps_to_detect=<n> device_attribution=<a> device_false_alarms=<n>
host_detected=<> host_steps_to_detect=<> host_attribution=<> host_false_alarms=<> healthy_false_alarms=<n>
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from otel_straggler_demo.run import DemoOptions, run_demo

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=130)
    ap.add_argument("--inject-rank", type=int, default=1)
    ap.add_argument("--inject-from", type=int, default=50)
    ap.add_argument("--device-ms", type=float, default=1.0, help="extra GPU work per forward-compute microbatch")
    ap.add_argument("--host-ms", type=float, default=1.5, help="host wait per batch-generator call")
    ap.add_argument("--size", default="detection")
    ap.add_argument("--runs", default="device,host,healthy")
    ap.add_argument("--turns", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default="gpu-detection")
    args = ap.parse_args()
    summary: dict[str, object] = {}
    rows = []
    for kind in args.runs.split(","):
        healthy = kind == "healthy"
        stage = "forward-compute" if kind == "device" else "batch-generator"
        opts = DemoOptions(ranks=args.ranks, steps=args.steps, model=f"megatron:{args.size}",
                           inject_rank=None if healthy else args.inject_rank, inject_stage=stage,
                           inject_kind="device" if kind == "device" else "host",
                           inject_ms=args.device_ms if kind == "device" else args.host_ms,
                           inject_from=args.inject_from, out=f"{args.out}/{kind}", json=False,
                           gpu_turns=args.turns)
        print(f"== run {kind}", flush=True)
        res = run_demo(opts)
        verdicts = [{"rank": d.rank, "stage": d.stage, "step": d.step, "deviation": d.deviation,
                     "attribution": d.attribution, "recovered_step": d.recovered_step} for d in res.detected]
        on_time = [d for d in res.detected if not healthy and d.rank == args.inject_rank
                   and d.step is not None and d.step >= args.inject_from]
        first = min(on_time, key=lambda d: d.step or 0) if on_time else None
        false_alarms = len(res.detected) - len(on_time)
        rows.append({"run": kind, "ok": res.ok, "injected": None if healthy else
                     {"rank": args.inject_rank, "stage": stage, "kind": opts.inject_kind, "ms": opts.inject_ms},
                     "detected": bool(first), "stage": first.stage if first else None,
                     "steps_to_detect": (first.step - args.inject_from) if first and first.step else None,
                     "attribution": first.attribution if first else None, "false_alarms": false_alarms,
                     "straggler_verdicts": verdicts, "verdict_records": res.verdicts, "spans": res.spans_seen})
        if healthy:
            summary["healthy_false_alarms"] = false_alarms
        else:
            summary[f"{kind}_detected"] = int(bool(first))
            summary[f"{kind}_steps_to_detect"] = rows[-1]["steps_to_detect"] if first else -1
            summary[f"{kind}_attribution"] = first.attribution if first else "none"
            summary[f"{kind}_false_alarms"] = false_alarms
    print(json.dumps(rows, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(rows, indent=1))
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

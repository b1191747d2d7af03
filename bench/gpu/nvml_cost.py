"""Cost of the NVML cause-hint sampler (``otel_straggler/nvml.py``) on a training loop, measured on a real GPU.

Two loops on the GPU, each timed per step on the host (``torch.cuda.synchronize`` at the step's end): ``launch``
(many small kernels: the host's launches pace the stream, where a background thread taking the GIL shows most)
and ``gpu`` (a few large bf16 matmuls: GPU-bound). Per loop, blocks of ``--steps`` steps with the sampler off,
on at ``--interval`` and on at the stress interval ``--stress-interval``, alternated block by block (ABC ABC ...)
so drift hits all three alike; the step time of each is the median over its blocks' steps. The sampler runs as a
thread of the training process itself: the ``thread`` export mode, the worse case (the default ``process`` export
mode samples in the export child, off the training process). Also one sample's latency (every counter read,
``NvmlSampler.sample``), p50 and p99 over ``--samples`` calls.

Needs CUDA and the ``nvml`` extra (``pip install nvidia-ml-py``).

  python bench/gpu/nvml_cost.py
Last line: nvml_cost: launch_off_ms=<> launch_on_ms=<> launch_ratio=<> launch_stress_ratio=<> gpu_off_ms=<>
gpu_on_ms=<> gpu_ratio=<> gpu_stress_ratio=<> sample_us_p50=<> sample_us_p99=<> interval_s=<> stress_interval_s=<>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from otel_straggler.nvml import NvmlSampler  # noqa: E402


def loops(torch) -> dict[str, Callable[[], None]]:  # type: ignore[no-untyped-def]
    dev = torch.device("cuda", torch.cuda.current_device())
    small = [torch.randn(256, 256, device=dev) for _ in range(4)]
    big_a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    big_b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def launch() -> None:
        x = small[0]
        for _ in range(400):
            x = torch.relu(x @ small[1]) + small[2]
        torch.cuda.synchronize()

    def gpu() -> None:
        for _ in range(8):
            torch.mm(big_a, big_b)
        torch.cuda.synchronize()

    return {"launch": launch, "gpu": gpu}


def timed(step: Callable[[], None], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50, help="steps per block")
    ap.add_argument("--blocks", type=int, default=20, help="blocks per condition (8 left a launch-bound loop drifting)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--interval", type=float, default=2.0, help="the sampler's interval (s)")
    ap.add_argument("--stress-interval", type=float, default=0.05, help="a stress interval (s)")
    ap.add_argument("--samples", type=int, default=500, help="sample() calls for its latency")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("nvml_cost: no CUDA device", file=sys.stderr)
        return 2
    index = torch.cuda.current_device()
    probe = NvmlSampler(args.interval, index)
    if not probe.start():
        print("nvml_cost: NVML not available (pip install nvidia-ml-py)", file=sys.stderr)
        return 2
    probe.stop()
    lat = []
    s = NvmlSampler(args.interval, index)
    s.start()
    for _ in range(args.samples):
        t0 = time.perf_counter()
        s.sample()
        lat.append((time.perf_counter() - t0) * 1e6)
    s.stop()
    lat.sort()
    result: dict[str, float] = {}
    for name, step in loops(torch).items():
        timed(step, args.warmup)
        runs: dict[str, list[float]] = {"off": [], "on": [], "stress": []}
        for _ in range(args.blocks):
            for cond in ("off", "on", "stress"):
                sampler = None
                if cond != "off":
                    sampler = NvmlSampler(args.interval if cond == "on" else args.stress_interval, index)
                    sampler.start()
                runs[cond] += timed(step, args.steps)
                if sampler is not None:
                    sampler.stop()
        off, on, stress = (statistics.median(runs[c]) for c in ("off", "on", "stress"))
        result.update({f"{name}_off_ms": off, f"{name}_on_ms": on, f"{name}_ratio": on / off,
                       f"{name}_stress_ratio": stress / off})
        print(f"{name}: off {off:.3f} ms, on ({args.interval:g} s) {on:.3f} ms, on ({args.stress_interval:g} s) "
              f"{stress:.3f} ms per step (median of {len(runs['off'])} steps each)", file=sys.stderr)
    result.update({"sample_us_p50": lat[len(lat) // 2], "sample_us_p99": lat[int(0.99 * (len(lat) - 1))],
                   "interval_s": args.interval, "stress_interval_s": args.stress_interval})
    print("nvml_cost: " + " ".join(f"{k}={v:.4g}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Step-time overhead of timing a real megatron-core GPT on one GPU: off vs Megatron's Timers vs the shim.

Three arms at the same timing log level (2), interleaved in rounds inside one process (the arm order
rotates every round), on two model sizes: launch-bound (~35 ms steps) and GPU-bound (>= 150 ms):
  off     config.timers = None
  native  megatron.core.timers.Timers(2, "minmax")   (syncs the device at every start/stop)
  shim    otel_straggler, exporting spans over OTLP to a straggler collector on loopback
Each step ends with torch.cuda.synchronize() in every arm (Megatron's loss reduction syncs each step too).
Reported: median step time per arm, per-round paired ratios arm/off (median, min, max).
The shim's readout thread and exporter child stay alive during the other arms (idle: an empty ring
polled every 20 ms), so the off and native arms carry that idle cost too; it is small and biases the
shim ratio towards 1 by that amount, not more.

Usage (on a GPU machine):
  python bench/gpu/overhead.py --sizes launch-bound,gpu-bound --rounds 8 --steps 30
Last line: launch_bound_ratio=<shim/off> gpu_bound_ratio=<> native_launch_bound_ratio=<> native_gpu_bound_ratio=<>
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_collector(workdir: Path) -> tuple[subprocess.Popen, int, int]:
    import urllib.request

    import yaml

    from otel_straggler.demo.run import collector_config

    grpc_port, http_port, metrics_port, tap_port = (_free_port() for _ in range(4))
    cfg = collector_config(grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port,
                           tap_port=tap_port, evidence=workdir / "verdicts.jsonl")
    # no trace backend in the benchmark: the processor runs, spans end in a one-line debug summary
    cfg["exporters"].pop("otlp_grpc/tap")
    cfg["exporters"]["debug"] = {"verbosity": "basic"}
    cfg["service"]["pipelines"]["traces"]["exporters"] = ["debug"]
    path = workdir / "collector.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = (workdir / "collector.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.3)
    return proc, grpc_port, metrics_port


def measure(model, steps: int) -> list[float]:
    torch = model.torch
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.train_step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def run_size(size_name: str, rounds: int, steps: int, warmup: int, shim) -> dict:
    from megatron.core.timers import Timers as NativeTimers

    from otel_straggler.demo.megatron_gpt import SIZES, MegatronGPT

    model = MegatronGPT(SIZES[size_name])
    native = NativeTimers(2, "minmax")
    arms = {"off": None, "native": native, "shim": shim}
    names = list(arms)
    model.set_timers(None)
    measure(model, warmup * 2)  # compile/allocator warmup outside any arm
    per_round: dict[str, list[float]] = {n: [] for n in names}
    all_steps: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for arm in order:
            model.set_timers(arms[arm])
            measure(model, warmup)
            times = measure(model, steps)
            per_round[arm].append(statistics.median(times))
            all_steps[arm].extend(times)
        print(f"  {size_name} round {r + 1}/{rounds}: "
              + " ".join(f"{a}={per_round[a][-1]:.2f}ms" for a in names), flush=True)
    model.set_timers(None)
    res: dict = {"size": size_name, "rounds": rounds, "steps_per_arm_round": steps}
    for arm in names:
        res[f"{arm}_median_ms"] = statistics.median(all_steps[arm])
    for arm in ("native", "shim"):
        ratios = [a / b for a, b in zip(per_round[arm], per_round["off"])]
        res[f"{arm}_ratio_median"] = statistics.median(ratios)
        res[f"{arm}_ratio_min"] = min(ratios)
        res[f"{arm}_ratio_max"] = max(ratios)
        res[f"{arm}_ratios"] = [round(x, 4) for x in ratios]
    del model
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="launch-bound,gpu-bound")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import torch

    import otel_straggler
    from otel_straggler.demo.megatron_gpt import init_single_process

    init_single_process(_free_port())
    work = Path(tempfile.mkdtemp(prefix="overhead-"))
    collector, grpc_port, metrics_port = start_collector(work)
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{grpc_port}",
                       "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_STRAGGLER_JOB_ID": "overhead-bench"})
    shim = otel_straggler.install_megatron(enabled=True, set_global=False)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}, shim {type(shim).__name__}",
          flush=True)
    results = [run_size(name, args.rounds, args.steps, args.warmup, shim) for name in args.sizes.split(",")]
    shim.shutdown(5.0)
    metrics = ""
    try:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
            metrics = r.read().decode()
    except OSError:
        pass
    collector.terminate()
    collector.wait(timeout=20)
    accepted = [ln for ln in metrics.splitlines() if ln.startswith("otel_straggler_collector_spans_accepted")]
    print("collector:", accepted[:1])
    print(f"{'size':14} {'off ms':>9} {'native ms':>10} {'shim ms':>9} {'native/off':>11} {'shim/off':>9} "
          f"{'shim spread':>16}")
    for r in results:
        print(f"{r['size']:14} {r['off_median_ms']:9.2f} {r['native_median_ms']:10.2f} {r['shim_median_ms']:9.2f} "
              f"{r['native_ratio_median']:11.4f} {r['shim_ratio_median']:9.4f} "
              f"{r['shim_ratio_min']:7.4f}-{r['shim_ratio_max']:.4f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    by = {r["size"]: r for r in results}
    parts = []
    for key, size in (("launch_bound", "launch-bound"), ("gpu_bound", "gpu-bound")):
        if size in by:
            parts.append(f"{key}_ratio={by[size]['shim_ratio_median']:.4f}")
    for key, size in (("launch_bound", "launch-bound"), ("gpu_bound", "gpu-bound")):
        if size in by:
            parts.append(f"native_{key}_ratio={by[size]['native_ratio_median']:.4f}")
    print(" ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

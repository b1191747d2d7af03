"""Step-time overhead of timing a real megatron-core GPT on one GPU: off vs Megatron's Timers vs the shim.

Three arms at the same timing log level (2), interleaved finely inside one process: every round runs each
arm (rotating order) for ``--warmup`` unmeasured steps then ``--steps`` measured ones, on two model sizes:
launch-bound (~40 ms steps, the host's launches are the critical path) and GPU-bound (>= 150 ms):
  off     config.timers = None
  native  megatron.core.timers.Timers(2, "minmax")   (syncs the device at every start/stop)
  shim    otel_straggler, exporting spans over OTLP to a straggler collector on loopback, device events on
          every N-th step with N what ``device_every=auto`` picks for this model when it runs alone (found
          by a 30-step calibration run of an auto shim first, then pinned: interleaving makes the shim's
          own steps look 3-4x longer to the auto rule, which would pick a smaller N than in real use)
  host    (``--host-arm``) the same shim timing host-only (no CUDA event): what the events cost on top
  shim20  (``--prev-arm``) the shim with the previous emitter defaults (readout every 20 ms, export child
          at the training process's priority), side by side with the current ones
  shimT   (``--torch-arm``) the shim recording its events with torch's ``Event.record`` instead of the
          driver's ``cuEventRecord`` (``record_api=torch``), same N
Each step ends with torch.cuda.synchronize() in every arm (Megatron's loss reduction syncs each step too).
Short arms (1-2 steps) make slow drift of a shared machine (clocks, neighbours: +-15 % over minutes on the
lent VM) cancel inside each round; the per-round paired ratio arm/off is then noisy only by step-to-step
jitter, and the median over hundreds of rounds is reported with a bootstrap 95 % interval. Also reported:
the training thread's CPU time per step (``time.thread_time``, excludes the final synchronize), which is
what the shim adds in the launch-bound regime and is far less noisy than wall time.
The shim's readout thread and exporter child stay alive during the other arms. With 1-step arms a shim's
readout drain (every 100 ms) mostly lands in the steps of the arms after it, so its GIL time is spread over
every arm and the shim's ratio is optimistic by part of it; ``--steps 6 --warmup 2`` keeps each arm's
drains inside its own turn (the warmup steps absorb the previous arm's last drain), and a round's value is
the mean of its steps (sampled and not), so the ratio is what a run pays.

Usage (on a GPU machine):
  python bench/gpu/overhead.py --sizes launch-bound,gpu-bound --rounds 400 --seconds 150
Last line: launch_bound_ratio=<shim/off> gpu_bound_ratio=<> native_launch_bound_ratio=<> native_gpu_bound_ratio=<>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from otel_straggler.demo.run import free_port  # noqa: E402


def start_collector(workdir: Path) -> tuple[subprocess.Popen, int, int]:
    import urllib.request

    import yaml

    from otel_straggler.demo.run import collector_config

    grpc_port, http_port, metrics_port, tap_port = (free_port() for _ in range(4))
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


def measure(model, steps: int) -> tuple[list[float], list[float]]:
    """Wall ms per step (including the final synchronize) and the training thread's CPU ms (excluding it)."""
    torch = model.torch
    wall, cpu = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        c0 = time.thread_time()
        model.train_step()
        c1 = time.thread_time()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1000.0)
        cpu.append((c1 - c0) * 1000.0)
    return wall, cpu


def bootstrap_ci(values: list[float], stat=statistics.median, n: int = 2000, seed: int = 0  # type: ignore[no-untyped-def]
                 ) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of ``stat`` (the median; the mean for the throughput cost)."""
    import random

    rng = random.Random(seed)
    k = len(values)
    meds = sorted(stat(rng.choices(values, k=k)) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]



def _shim(device_every: int, **settings):  # type: ignore[no-untyped-def]
    import otel_straggler

    return otel_straggler.install_megatron(enabled=True, set_global=False, device_every=device_every, **settings)


def calibrate_every(model, steps: int = 60) -> int:
    """The N that ``device_every=auto`` settles on for this model when the shim times every step."""
    auto = _shim(0)
    model.set_timers(auto)
    measure(model, steps)
    n = auto.ctx.device_every
    model.set_timers(None)
    auto.shutdown(5.0)
    return n


_ALL_CPUS = sorted(os.sched_getaffinity(0))


def _pin_others() -> int:
    """Move this thread (and so whatever it starts next: collector, export children, readout threads) off
    one physical core; return that core's first CPU, for the training thread to take once they run."""
    cpus = _ALL_CPUS
    train = cpus[0]
    try:
        sib = Path(f"/sys/devices/system/cpu/cpu{train}/topology/thread_siblings_list").read_text().strip()
        siblings: set[int] = set()
        for part in sib.split(","):
            lo, _, hi = part.partition("-")
            siblings.update(range(int(lo), int(hi or lo) + 1))
    except OSError:
        siblings = {train}
    print(f"cpus {cpus}; training core {train} with siblings {sorted(siblings)}", flush=True)
    os.sched_setaffinity(0, [c for c in cpus if c not in siblings])
    return train


def run_size(size_name: str, rounds: int, steps: int, warmup: int, seconds: float, host_arm: bool,
             train_cpu: int | None = None, prev_arm: bool = False, torch_arm: bool = False) -> dict:
    from megatron.core.timers import Timers as NativeTimers

    from otel_straggler.demo.megatron_gpt import SIZES, MegatronGPT

    model = MegatronGPT(SIZES[size_name])
    model.set_timers(None)
    measure(model, 10)  # compile/allocator warmup outside any arm
    every = calibrate_every(model)
    arms = {"off": None, "native": NativeTimers(2, "minmax"), "shim": _shim(every)}
    if host_arm:
        arms["host"] = _shim(1 << 40)  # never a sampled step: host-only timing
    if prev_arm:
        arms["shim20"] = _shim(every, readout_interval_ms=20.0, export_nice=0)
    if torch_arm:
        arms["shimT"] = _shim(every, record_api="torch")
    names = list(arms)
    if train_cpu is not None:  # the shims' threads and children started on the other cores
        os.sched_setaffinity(0, [train_cpu])
    print(f"  {size_name}: device_every=auto settles on N={every}; the shim records events with "
          f"{arms['shim'].pool.record_api}", flush=True)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    sampled: dict[str, list[bool]] = {n: [] for n in names}  # was the arm's step device-sampled
    cpu_round: dict[str, list[float]] = {n: [] for n in names}
    all_steps: dict[str, list[float]] = {n: [] for n in names}
    all_cpu: dict[str, list[float]] = {n: [] for n in names}
    t_end = time.monotonic() + seconds
    done = 0
    for r in range(rounds):
        if time.monotonic() > t_end:
            break
        order = names[r % len(names):] + names[: r % len(names)]
        for arm in order:
            model.set_timers(arms[arm])
            measure(model, warmup)
            wall, cpu = measure(model, steps)
            per_round[arm].append(statistics.fmean(wall))  # a round's cost: every step of it, sampled or not
            ctx = getattr(arms[arm], "ctx", None)
            sampled[arm].append(bool(ctx is not None and ctx.device_on))
            cpu_round[arm].append(statistics.fmean(cpu))
            all_steps[arm].extend(wall)
            all_cpu[arm].extend(cpu)
        done = r + 1
        if done % 50 == 0:
            print(f"  {size_name} round {done}: "
                  + " ".join(f"{a}={statistics.median(all_steps[a]):.2f}ms" for a in names), flush=True)
    model.set_timers(None)
    if train_cpu is not None:
        _pin_others()
    for arm in ("shim", "host", "shim20", "shimT"):
        if arm in arms:
            arms[arm].shutdown(5.0)
    res: dict = {"size": size_name, "rounds": done, "steps_per_arm_round": steps, "warmup_per_arm_round": warmup,
                 "device_every": every, "arms": names, "record_api": arms["shim"].pool.record_api}
    for arm in names:
        res[f"{arm}_median_ms"] = statistics.median(all_steps[arm])
        res[f"{arm}_cpu_median_ms"] = statistics.median(all_cpu[arm])
        res[f"{arm}_p10_ms"] = statistics.quantiles(all_steps[arm], n=10)[0]
        res[f"{arm}_p90_ms"] = statistics.quantiles(all_steps[arm], n=10)[-1]
    for arm in names[1:]:
        ratios = [a / b for a, b in zip(per_round[arm], per_round["off"])]
        cpu_ratios = [a / b for a, b in zip(cpu_round[arm], cpu_round["off"]) if b > 0]
        res[f"{arm}_ratio_median"] = statistics.median(ratios)
        res[f"{arm}_ratio_ci95"] = bootstrap_ci(ratios)
        res[f"{arm}_ratio_iqr"] = (statistics.quantiles(ratios, n=4)[0], statistics.quantiles(ratios, n=4)[-1])
        res[f"{arm}_ratio_of_medians"] = res[f"{arm}_median_ms"] / res["off_median_ms"]
        res[f"{arm}_cpu_ratio_median"] = statistics.median(cpu_ratios)
        res[f"{arm}_cpu_ratio_ci95"] = bootstrap_ci(cpu_ratios)
        res[f"{arm}_ratios"] = [round(x, 4) for x in ratios]
        res[f"{arm}_ratio_mean"] = statistics.fmean(ratios)
        res[f"{arm}_ratio_mean_ci95"] = bootstrap_ci(ratios, statistics.fmean)
        on = [x for x, s in zip(ratios, sampled[arm]) if s]
        off = [x for x, s in zip(ratios, sampled[arm]) if not s]
        res[f"{arm}_sampled_share"] = len(on) / len(ratios) if ratios else 0.0
        res[f"{arm}_ratio_sampled_median"] = statistics.median(on) if on else None
        res[f"{arm}_ratio_unsampled_median"] = statistics.median(off) if off else None
    del model
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="launch-bound,gpu-bound")
    ap.add_argument("--rounds", type=int, default=400, help="most rounds per size")
    ap.add_argument("--steps", type=int, default=1, help="measured steps per arm per round")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps per arm per round (after a switch)")
    ap.add_argument("--seconds", type=float, default=150.0, help="time budget per size (rounds stop after it)")
    ap.add_argument("--host-arm", action="store_true", help="add a host-only shim arm")
    ap.add_argument("--torch-arm", action="store_true",
                    help="add a shim arm recording events with torch's Event.record (record_api=torch)")
    ap.add_argument("--prev-arm", action="store_true",
                    help="add a shim arm with the previous defaults (readout 20 ms, export child not niced)")
    ap.add_argument("--pin", action="store_true",
                    help="training thread alone on one physical core; collector, export children and the "
                         "readout thread on the other cores (as on a GPU node with spare cores)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import torch

    from otel_straggler.demo.megatron_gpt import init_single_process

    init_single_process(free_port())
    train_cpu = _pin_others() if args.pin else None
    work = Path(tempfile.mkdtemp(prefix="overhead-"))
    collector, grpc_port, metrics_port = start_collector(work)
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{grpc_port}",
                       "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_STRAGGLER_JOB_ID": "overhead-bench"})
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}, training thread on cpu "
          f"{train_cpu if train_cpu is not None else 'any'}", flush=True)
    results = [run_size(name, args.rounds, args.steps, args.warmup, args.seconds, args.host_arm, train_cpu,
                        args.prev_arm, args.torch_arm) for name in args.sizes.split(",")]
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
    print(f"{'size':14} {'N':>2} {'rounds':>6} {'arm':>7} {'median ms':>9} {'arm/off':>8} {'95% CI':>15} "
          f"{'cpu arm/off':>11} {'cpu 95% CI':>15} {'mean':>7} {'mean 95% CI':>15} {'sampled':>7} {'unsampl':>7}")
    for r in results:
        print(f"{r['size']:14} {r['device_every']:2d} {r['rounds']:6d} {'off':>7} {r['off_median_ms']:9.2f}")
        for arm in r["arms"][1:]:
            lo, hi = r[f"{arm}_ratio_ci95"]
            clo, chi = r[f"{arm}_cpu_ratio_ci95"]
            mlo, mhi = r[f"{arm}_ratio_mean_ci95"]
            son, soff = r[f"{arm}_ratio_sampled_median"], r[f"{arm}_ratio_unsampled_median"]
            print(f"{'':14} {'':2} {'':6} {arm:>7} {r[f'{arm}_median_ms']:9.2f} {r[f'{arm}_ratio_median']:8.4f} "
                  f"{lo:7.4f}-{hi:.4f} {r[f'{arm}_cpu_ratio_median']:11.4f} {clo:7.4f}-{chi:.4f} "
                  f"{r[f'{arm}_ratio_mean']:7.4f} {mlo:7.4f}-{mhi:.4f} "
                  f"{'-' if son is None else f'{son:.4f}':>7} {'-' if soff is None else f'{soff:.4f}':>7}")
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

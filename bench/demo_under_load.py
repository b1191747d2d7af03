"""The demo under background CPU load: host jitter of its stages, the detector's view of it, and detection.

Runs the real demo (``otel_straggler_demo.run.run_demo``: collector subprocess, gloo rank processes, the
injection knob) while ``scripts/cpu-load`` keeps every core busy, for one or more stage sizes interleaved
run by run. Per run, from the stage times the collector passed on (``stage-times.csv``) of the injected
stage after the warm-up:

* ``noise``: relative step-to-step sigma within a rank's window, as the detector measures it
  (``pooled_relative_sigma``, through ``outcome.relative_step_noise``), and ``p99_ms``: the 99th percentile of
  |step - the rank's window median| in ms: the host jitter;
* ``tol``: the detector's noise-aware tolerance of each window (``noise_raised_tolerance`` of the window's
  ``pooled_relative_sigma``), median and max over windows;
* ``healthy_max``: the largest deviation of a healthy rank's window median from the fastest other rank's
  (what a false alarm would need beyond tol and the floor); ``injected``: the slowed rank's median deviation
  and ``gap_ms`` its median gap in ms (what the absolute floor is compared with);
* the demo's own outcome: steps to detect, false alarms, ok.

  python bench/demo_under_load.py --runs 6 --healthy-runs 2 --sizes 25/25,12/20 \\
      --md bench/results/demo-under-load.md

Last line: runs=<> detected=<> false_alarms=<> median_steps_to_detect=<> max_steps_to_detect=<> (first size)
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collector_processor.processor.straggler.statistics import (  # noqa: E402
    noise_raised_tolerance,
    pooled_relative_sigma,
)
from otel_straggler_demo.options import DemoOptions, inject_gap_ms  # noqa: E402
from otel_straggler_demo.outcome import relative_step_noise, window_deviations  # noqa: E402
from otel_straggler_demo.run import detector_settings, run_demo  # noqa: E402
from otel_straggler_demo.tap import StagePoint  # noqa: E402


@dataclass
class Row:
    size: str
    injected: bool
    ok: bool
    steps_to_detect: int | None
    false_alarms: int
    noise: float
    p99_ms: float
    tol_median: float
    tol_max: float
    healthy_max: float
    injected_dev: float | None
    gap_ms: float | None
    elapsed_s: float
    problems: str


def read_points(path: Path) -> list[StagePoint]:
    import csv

    out = []
    with path.open(encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            out.append(StagePoint(int(r["rank"]), r["stage"], r["group"], int(r["step"]),
                                  float(r["host_ms"]) if r["host_ms"] else None,
                                  float(r["device_ms"]) if r["device_ms"] else None))
    return out


def window_tolerances(points: list[StagePoint], stage: str, first_step: int) -> list[float]:
    det = detector_settings()
    per: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for p in points:
        if p.stage == stage and p.step >= first_step and p.host_ms:
            per[p.step // det.window_steps][p.rank].append(p.host_ms)
    tols = []
    for groups in per.values():
        sigma = pooled_relative_sigma(list(groups.values()))
        if sigma is not None:
            tols.append(noise_raised_tolerance(det.tolerance, det.noise_z, sigma, det.window_steps))
    return tols


def p99_jitter_ms(points: list[StagePoint], stage: str, window_steps: int, first_step: int) -> float:
    per: dict[tuple[int, int], list[float]] = defaultdict(list)
    for p in points:
        if p.stage == stage and p.step >= first_step and p.host_ms:
            per[(p.rank, p.step // window_steps)].append(p.host_ms)
    devs = sorted(abs(v - statistics.median(vs)) for vs in per.values() if len(vs) >= 3 for v in vs)
    return devs[int(0.99 * (len(devs) - 1))] if devs else float("nan")


def measure(opts: DemoOptions, size: str) -> Row:
    det = detector_settings(opts.ranks)
    res = run_demo(opts)
    points = read_points(Path(res.stage_times or ""))
    stage, w = opts.inject_stage, det.window_steps
    warm = (det.warmup_windows + 1) * w
    devs = window_deviations(points, stage, w, first_step=warm, fastest_quantile=det.fastest_quantile)
    slow = opts.inject_rank
    onset = -(-opts.inject_from // w)  # first window slowed in full
    healthy = [d for r, ws in devs.items() if r != slow for d in ws.values()]
    injected = [d for win, d in devs.get(slow, {}).items() if win >= onset] if slow is not None else []
    gaps = []
    if slow is not None:
        series: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for p in points:
            if p.stage == stage and p.host_ms and p.step >= onset * w:
                series[p.step // w][p.rank].append(p.host_ms)
        for ranks in series.values():
            if slow in ranks and len(ranks) > 1:
                others = [statistics.median(v) for r, v in ranks.items() if r != slow]
                gaps.append(statistics.median(ranks[slow]) - min(others))
    tols = window_tolerances(points, stage, warm)
    hit = [d for d in res.detected if d.injected]
    return Row(size=size, injected=slow is not None, ok=res.ok,
               steps_to_detect=hit[0].steps_to_detect if hit else None, false_alarms=res.false_alarms,
               noise=relative_step_noise(points, stage, w, first_step=warm) or float("nan"),
               p99_ms=p99_jitter_ms(points, stage, w, warm),
               tol_median=statistics.median(tols) if tols else float("nan"),
               tol_max=max(tols) if tols else float("nan"),
               healthy_max=max(healthy) if healthy else float("nan"),
               injected_dev=statistics.median(injected) if injected else None,
               gap_ms=statistics.median(gaps) if gaps else None, elapsed_s=res.elapsed_s,
               problems=" / ".join(res.problems))


def _pct(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.1%}"


def table(rows: list[Row]) -> str:
    head = ("| size fwd/bwd ms | injected | ok | steps to detect | false alarms | noise/step | p99 jitter ms | "
            "tol median | tol max | healthy max | injected dev | gap ms | wall s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r.size} | {'+10 %' if r.injected else 'none'} | {r.ok} | "
        f"{'' if r.steps_to_detect is None else r.steps_to_detect} | {r.false_alarms} | {r.noise:.2%} | "
        f"{r.p99_ms:.2f} | {r.tol_median:.1%} | {r.tol_max:.1%} | {_pct(r.healthy_max)} | {_pct(r.injected_dev)} | "
        f"{'' if r.gap_ms is None else f'{r.gap_ms:.1f}'} | {r.elapsed_s:.0f} |\n"
        for r in rows)
    return head + body


def summary(rows: list[Row], size: str) -> str:
    inj = [r for r in rows if r.size == size and r.injected]
    det = [r.steps_to_detect for r in inj if r.steps_to_detect is not None]
    fa = sum(r.false_alarms for r in rows if r.size == size)
    return (f"runs={len(inj)} detected={len(det)} false_alarms={fa} "
            f"healthy_runs={sum(1 for r in rows if r.size == size and not r.injected)} "
            f"median_steps_to_detect={statistics.median(det) if det else 'nan'} "
            f"max_steps_to_detect={max(det) if det else 'nan'} size={size}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=6, help="runs with rank 3 slowed +10 %% per size")
    ap.add_argument("--healthy-runs", type=int, default=2, help="runs without a slowed rank per size")
    ap.add_argument("--sizes", default="25/25", help="forward/backward ms per microbatch, comma-separated")
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy loops (0: none)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--md", default=None, help="append the table and the summary to this markdown file")
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    load = None
    if args.load > 0:
        load = subprocess.Popen([str(ROOT / "scripts" / "cpu-load"), str(args.load)], start_new_session=True,
                                stderr=subprocess.DEVNULL)
    rows: list[Row] = []
    started = time.strftime("%Y-%m-%d %H:%M")
    loadavg = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory(prefix="demo-load-") as tmp:
            plan = [(i, True) for i in range(args.runs)] + [(i, False) for i in range(args.healthy_runs)]
            for i, injected in plan:
                for size in sizes:
                    fwd, bwd = (float(x) for x in size.split("/"))
                    opts = DemoOptions(ranks=args.ranks, steps=args.steps, forward_ms=fwd, backward_ms=bwd,
                                       inject_rank=3 if injected else None, quiet=True,
                                       out=f"{tmp}/{size.replace('/', '-')}-{i}-{int(injected)}")
                    row = measure(opts, size)
                    rows.append(row)
                    print(f"size={size} injected={injected} ok={row.ok} std={row.steps_to_detect} "
                          f"fa={row.false_alarms} noise={row.noise:.2%} p99_ms={row.p99_ms:.2f} "
                          f"tol={row.tol_median:.1%}/{row.tol_max:.1%} healthy_max={_pct(row.healthy_max)} "
                          f"injected={_pct(row.injected_dev)} gap_ms={row.gap_ms} wall={row.elapsed_s:.0f}s "
                          f"gap_injected_ms={inject_gap_ms(opts):.1f} {row.problems}", flush=True)
    finally:
        if load is not None:
            os.killpg(load.pid, signal.SIGTERM)
            load.wait(timeout=10)
    text = table(rows)
    print(text)
    lines = [summary(rows, size) for size in sizes]
    if args.md:
        cmd = "python bench/demo_under_load.py " + " ".join(sys.argv[1:])
        with open(args.md, "a", encoding="utf-8") as fh:
            fh.write(f"\n## {started}: `{cmd}`\n\n{os.cpu_count()} cores, {args.load} busy loops, load average at "
                     f"start {loadavg[0]:.1f}; {args.ranks} ranks x {args.steps} steps, rank 3 forward-compute "
                     f"+10 % from step 50 in the injected runs.\n\n{text}\n"
                     + "".join(f"    {line}\n" for line in lines))
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

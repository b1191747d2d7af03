"""Detection quality of the straggler processor on simulated Megatron span streams with labelled faults.

Feeds the real processor (in-process for speed; ``--otlp N`` also sends N runs through a real collector
over OTLP/gRPC and checks it reaches the same verdicts) and scores verdicts against the labels: recall per
fault type and size, false alarms per 1e5 healthy rank-steps, steps from onset to detection (median, p95),
stage and device-vs-host attribution accuracy, recovery latency.

  python bench/detection.py --quick            # < 1 minute on 2 cores
  python bench/detection.py --reps 20 --plot bench/results/detection-sensitivity.png

Last line: recall=<sustained +5% compute faults> false_alarms_per_1e5=<> p95_steps_to_detect=<>
attribution_accuracy=<> ...
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collector_processor.processor.straggler import factory  # noqa: E402
from collector_processor.processor.straggler.model import Verdict  # noqa: E402
from collector_processor.simulate.faults import COMPUTE_STAGES, Fault  # noqa: E402
from collector_processor.simulate.job import Layout  # noqa: E402
from collector_processor.simulate.score import RunScore, median, percentile, score_run  # noqa: E402
from collector_processor.simulate.stream import JobStream, SimConfig  # noqa: E402
from collector_processor.telemetry import Telemetry  # noqa: E402


def run_one(cfg: SimConfig, fault: Fault | None, proc_overrides: dict | None = None) -> tuple[RunScore, list[Verdict]]:
    verdicts: list[Verdict] = []
    pcfg = factory.create_default_config()
    if proc_overrides:
        pcfg = pcfg.model_copy(update=proc_overrides)
    proc = factory.create_processor(pcfg, Telemetry(), verdicts.extend)
    proc.start()
    stream = JobStream(cfg, [fault] if fault else [])
    now = 0.0
    for _step, req in stream:
        proc.process_traces(req)
        now += 0.05
        proc.tick(time.monotonic())
    proc.shutdown(5.0)
    cohorts = {r.rank: r.cohort for r in stream.ranks}
    return score_run(fault, verdicts, cohorts, stream.healthy_rank_steps), verdicts


def scenarios(reps: int, quick: bool, rng: random.Random, layout: Layout, steps: int) -> list[tuple[str, Fault | None]]:
    out: list[tuple[str, Fault | None]] = []

    def onset() -> int:
        return rng.randint(40, 60)

    world = layout.world_size
    sizes = (0.03, 0.05, 0.10, 0.30)
    for size in sizes:
        n = reps if size in (0.05, 0.10) else max(2, reps // 2)
        for _ in range(n):
            on = onset()
            out.append(("device:forward-compute", Fault("device", rng.randrange(world), ("forward-compute",), size,
                                                        on, on + 60)))
            on = onset()
            out.append(("device:all-compute", Fault("device", rng.randrange(world), COMPUTE_STAGES, size, on, on + 60)))
    k = max(2, reps // 2)
    for _ in range(k):
        on = onset()
        out.append(("host:forward-compute",
                    Fault("host", rng.randrange(world), ("forward-compute",), 0.3, on, on + 60)))
        on = onset()
        out.append(("dataloader", Fault("dataloader", rng.randrange(world), ("batch-generator",), 0.5, on, on + 60)))
        out.append(("intermittent", Fault("intermittent", rng.randrange(world), COMPUTE_STAGES, 0.3, onset(), None,
                                          duty=0.3)))
        out.append(("flapping", Fault("flapping", rng.randrange(world), COMPUTE_STAGES, 0.3, onset(), None, period=20)))
        out.append(("cohort-slowed", Fault("cohort", rng.randrange(world), COMPUTE_STAGES, 0.1, onset())))
        out.append(("unequal-workload", Fault("workload", rng.randrange(world), COMPUTE_STAGES, 0.15, 1)))
    for _ in range(reps if not quick else max(3, reps // 2)):
        out.append(("healthy", None))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repetitions (< 1 minute)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device-every", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plot", default=None, help="write the sensitivity plot (PNG) here")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    reps = args.reps or (4 if args.quick else 12)
    rng = random.Random(args.seed)
    layout = Layout(tp=args.tp, dp=args.dp)
    runs = scenarios(reps, args.quick, rng, layout, args.steps)
    t0 = time.monotonic()
    results: dict[str, list[RunScore]] = defaultdict(list)
    for i, (name, fault) in enumerate(runs):
        cfg = SimConfig(layout=layout, steps=args.steps, device_every=args.device_every, seed=rng.getrandbits(32))
        score, _ = run_one(cfg, fault)
        key = name if fault is None or fault.kind in ("cohort", "workload", "intermittent", "flapping", "host",
                                                      "dataloader") else f"{name}:+{fault.size:.0%}"
        results[key].append(score)
        if (i + 1) % 10 == 0 or i + 1 == len(runs):
            print(f"  {i + 1}/{len(runs)} runs, {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)

    print(f"\n{'scenario':34} {'runs':>4} {'recall':>7} {'med steps':>9} {'p95 steps':>9} {'stage ok':>8} "
          f"{'attr ok':>7} {'recov':>6} {'false alarms':>12}")
    all_fa = 0
    healthy_rs = 0
    target_hits: list[RunScore] = []
    attr: list[bool] = []
    stage_ok: list[bool] = []
    steps_all: list[float] = []
    recov: list[float] = []
    for key in sorted(results):
        rs = results[key]
        all_fa += sum(r.false_alarms for r in rs)
        healthy_rs += sum(r.healthy_rank_steps for r in rs)
        expect = rs[0].fault is not None and rs[0].fault.expect_straggler
        det = [r for r in rs if r.detected]
        st = [float(r.steps_to_detect) for r in det if r.steps_to_detect is not None]
        rc = [float(r.recovered_after) for r in det if r.recovered_after is not None]
        recall = len(det) / len(rs) if expect else float("nan")
        print(f"{key:34} {len(rs):4d} {recall:7.3f} {median(st):9.1f} {percentile(st, 0.95):9.1f} "
              f"{sum(bool(r.stage_correct) for r in det) / max(1, len(det)):8.2f} "
              f"{sum(bool(r.attribution_correct) for r in det) / max(1, len(det)):7.2f} "
              f"{median(rc):6.1f} {sum(r.false_alarms for r in rs):12d}")
        if rs[0].fault is not None and rs[0].fault.kind == "device" and abs(rs[0].fault.size - 0.05) < 1e-9:
            target_hits.extend(rs)
        if expect and rs[0].fault is not None and rs[0].fault.size >= 0.05:
            attr.extend(bool(r.attribution_correct) for r in det)
            stage_ok.extend(bool(r.stage_correct) for r in det)
            steps_all.extend(st)
            recov.extend(rc)
    recall5 = sum(r.detected for r in target_hits) / max(1, len(target_hits))
    st5 = [float(r.steps_to_detect) for r in target_hits if r.steps_to_detect is not None]
    fa_rate = all_fa / max(1, healthy_rs) * 1e5
    summary = {
        "recall": round(recall5, 4), "false_alarms_per_1e5": round(fa_rate, 2),
        "p95_steps_to_detect": round(percentile(st5, 0.95), 1),
        "median_steps_to_detect": round(median(st5), 1),
        "attribution_accuracy": round(sum(attr) / max(1, len(attr)), 4),
        "stage_accuracy": round(sum(stage_ok) / max(1, len(stage_ok)), 4),
        "median_recovery_steps": round(median(recov), 1), "runs": len(runs),
        "healthy_rank_steps": healthy_rs, "seconds": round(time.monotonic() - t0, 1),
        "device_every": args.device_every,
    }
    if args.plot:
        _plot(results, args.plot)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


def _plot(results: dict[str, list[RunScore]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for stage in ("forward-compute", "all-compute"):
        xs, ys = [], []
        for size in (0.03, 0.05, 0.10, 0.30):
            rs = results.get(f"device:{stage}:+{size:.0%}")
            if rs:
                xs.append(size * 100)
                ys.append(sum(r.detected for r in rs) / len(rs))
        ax.plot(xs, ys, marker="o", label=f"device slowdown on {stage}")
    ax.axhline(0.99, color="grey", ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_xticks([3, 5, 10, 30], ["+3%", "+5%", "+10%", "+30%"])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("injected slowdown")
    ax.set_ylabel("detection rate")
    ax.set_title("Sensitivity: fault size x detection rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())

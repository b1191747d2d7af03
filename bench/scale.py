"""Scale: a 16,384-rank job (DP 128 x 128 cohorts, ~50 spans per rank-step, 5 s steps) on straggler processors
sharded by cohort. Per process: processing rate (protobuf parse + straggler processor, in-process), peak RSS
and the processor's state sizes, for a growing number of ranks per process (each size in a fresh
subprocess), so memory vs ranks is visible and bounded state can be checked (a longer run at one size shows
state does not grow with steps).

Requests: one per rank and step (~50 spans): with 5 s steps the SDK's 5 s schedule delay flushes before 512
spans accumulate. (With 512-span requests, ~10 steps of one rank each, the first rank's request closes windows
0-1 by progress before its peers are known, and a round over 8k ranks outlasts the 5 s grace, so windows close
before every rank reported: ``--batch 512`` shows those ``late`` counts.)

Real time: the job emits 16384 x spans_per_rank_step / 5 s spans/s; sharded by cohort over --processes
processes each needs 1/N of that. The rate here excludes gRPC receive and queueing: see
``bench/processor_throughput.py`` for the full-collector / in-process ratio.

  python bench/scale.py                          # 1k, 4k, 8k ranks per process, 30 steps (~8 min on 2 cores)
  python bench/scale.py --sizes 256 --steps 12 --long-steps 0   # smoke

Last line: ranks=16384 processes=2 needed_spans_per_s_per_process=<> achieved_spans_per_s=<at the largest
size> keeps_up=<> peak_rss_mb=<at the largest size> ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOB_RANKS = 16384
DP = 128
STEP_S = 5.0


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def child(ranks: int, steps: int, batch: int) -> dict:
    """One process, ``ranks`` ranks (ranks/128 cohorts of DP 128): process ``steps`` steps."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from collector_processor.processor.straggler import factory
    from collector_processor.telemetry import Telemetry
    from jobsim.job import Layout
    from jobsim.load import LoadConfig, sdk_requests

    cfg = LoadConfig(Layout(dp=DP, tp=max(1, ranks // DP)), step_s=STEP_S)
    if batch:
        cfg.spans_per_request = batch
    else:
        cfg.spans_per_request = cfg.spans_per_rank_step
    verdicts: list = []
    proc = factory.create_processor(factory.create_default_config(), Telemetry(), verdicts.extend)
    proc.start()
    base_rss = _rss_mb("VmRSS")
    busy = 0.0
    n_req = 0
    t_all = time.perf_counter()
    for raw in sdk_requests(cfg, range(1, steps + 1)):
        t0 = time.perf_counter()
        proc.process_traces(ExportTraceServiceRequest.FromString(raw))
        n_req += 1
        if n_req % 64 == 0:
            proc.tick(time.time())
        busy += time.perf_counter() - t0
    wall = time.perf_counter() - t_all
    st = proc.stats()
    spans = cfg.layout.world_size * steps * cfg.spans_per_rank_step
    return {"ranks": cfg.layout.world_size, "cohorts": cfg.layout.tp, "steps": steps, "spans": spans,
            "requests": n_req, "busy_s": round(busy, 2), "wall_s": round(wall, 1),
            "spans_per_s": round(spans / busy), "peak_rss_mb": round(_rss_mb("VmHWM"), 1),
            "base_rss_mb": round(base_rss, 1), "states": st["states"], "open_windows": st["open_windows"],
            "dedup_entries": st["dedup_entries"], "windows_closed": st["windows_closed"],
            "late": st["rejected_late"], "metric_series": st["metric_series"],
            "metric_series_refused": st["metric_series_refused"],
            "stragglers": sum(1 for v in verdicts if v.verdict == "straggler"),
            "spans_per_rank_step": cfg.spans_per_rank_step}


def run_child(ranks: int, steps: int, batch: int, timeout_s: float) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(ranks), str(steps), str(batch)], capture_output=True,
                         text=True, timeout=timeout_s, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"child {ranks} ranks failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,4096,8192", help="ranks per process (multiples of 128)")
    ap.add_argument("--steps", type=int, default=30, help="steps per size (>= 30: steady state, see below)")
    ap.add_argument("--long-steps", type=int, default=60, help="steps of the bounded-state run at the smallest size")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--batch", type=int, default=0, help="spans per request (0: one request per rank-step)")
    ap.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = []
    for n in sizes:
        rows.append(run_child(n, args.steps, args.batch, args.timeout))
        print(f"  {n} ranks done: {rows[-1]['spans_per_s']} spans/s, {rows[-1]['peak_rss_mb']} MB", file=sys.stderr)
    long_row = run_child(sizes[0], args.long_steps, args.batch, args.timeout) if args.long_steps else None
    sprs = rows[-1]["spans_per_rank_step"]
    needed_total = JOB_RANKS * sprs / STEP_S
    needed = needed_total / args.processes
    print(f"\n{'ranks/process':>13} {'cohorts':>7} {'steps':>5} {'spans':>9} {'spans/s':>8} {'peak RSS MB':>11} "
          f"{'states':>7} {'open win':>8} {'dedup':>7} {'closed':>6} {'late':>7} {'series':>6} {'refused':>7}")
    for r in [*rows, *([long_row] if long_row else [])]:
        print(f"{r['ranks']:13d} {r['cohorts']:7d} {r['steps']:5d} {r['spans']:9d} {r['spans_per_s']:8d} "
              f"{r['peak_rss_mb']:11.0f} {r['states']:7d} {r['open_windows']:8d} {r['dedup_entries']:7d} "
              f"{r['windows_closed']:6d} {r['late']:7d} {r['metric_series']:6d} {r['metric_series_refused']:7d}")
    big = rows[-1]
    per_rank_kb = ((big["peak_rss_mb"] - rows[0]["peak_rss_mb"]) * 1024 / max(1, big["ranks"] - rows[0]["ranks"])
                   if len(rows) > 1 else float("nan"))
    print(f"job: {JOB_RANKS} ranks x {sprs} spans / {STEP_S:g} s = {needed_total:.0f} spans/s; "
          f"{args.processes} processes sharded by cohort need {needed:.0f} spans/s each")
    print(f"memory slope: {per_rank_kb:.1f} KiB per rank (between {rows[0]['ranks']} and {big['ranks']} ranks)")
    fields = {
        "ranks": JOB_RANKS, "processes": args.processes, "needed_spans_per_s_per_process": round(needed),
        "achieved_spans_per_s": big["spans_per_s"], "ranks_per_process_measured": big["ranks"],
        "keeps_up": big["spans_per_s"] >= needed and big["ranks"] * args.processes >= JOB_RANKS,
        "peak_rss_mb": big["peak_rss_mb"], "kib_per_rank": round(per_rank_kb, 1),
    }
    if long_row:
        short = rows[0]
        fields["state_growth_with_steps"] = round(long_row["states"] / max(1, short["states"]), 3)
        fields["rss_growth_with_steps"] = round(long_row["peak_rss_mb"] / max(1.0, short["peak_rss_mb"]), 3)
    print(" ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a demo run found: detections from the verdict evidence, false alarms, and, when the injected rank
was missed, why (in the detector's words and in plain ones)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable

import otel_straggler_schema as s
from collector_processor.processor.straggler.statistics import pooled_relative_sigma
from otel_straggler_demo.options import DemoOptions, Detection, injecting
from otel_straggler_demo.tap import StagePoint

# Plain words for every verdict reason of the schema (docs/schema.md, docs/detector.md).
REASON_TEXT = {
    "slower_than_reference": "slower than its fastest comparable peer, beyond the tolerance and the absolute "
                             "floor, in consecutive windows",
    "persistent_excess": "slower than the median of its peers step after step, for two windows in a row "
                         "(summed per-step evidence)",
    "within_tolerance": "back within tolerance of its peers",
    "below_absolute_floor": "slower in relative terms, but by fewer milliseconds per step than the detector's "
                            "absolute floor: gaps that small come from host jitter alone, so they are not "
                            "counted as evidence",
    "workload_incomparable": "its tokens per step differ from its peers', so its time cannot be compared",
    "cohort_below_min_size": "too few comparable peers reported in this window to judge it",
    "missing_samples": "it sent no usable timing in a window its peers filled",
    "recovery_evidence_insufficient": "a flagged straggler whose latest window could not be judged (gap under "
                                      "the floor, or no usable timing): the alert is held, not cleared",
    "non_finite_sample": "it sent only invalid or implausible timings (NaN, infinite, negative, over a day)",
    "pair_ambiguous": "one of only two comparable ranks is slower, but nothing says which one changed: neither "
                      "its own history nor the job's other parallel roles",
    "collective_wait": "its stage is longer because it waits in a collective for a slower rank (the one named "
                       "as reference), not because it is slow itself",
    "node_slow": "most GPUs of one machine are slower than their peers at the same time: the machine (cooling, "
                 "power, a shared link), not one GPU",
    "group_slow": "the GPUs of one tensor- or context-parallel group are slower together and no timing says which "
                  "of them holds the others: check every GPU of the group",
    "host_contention": "its host time is long, but every peer it could be compared with runs on its own machine: "
                       "the machine's CPUs are contended, and nothing says this rank is the cause",
    "intermittent_excess": "slow in recurring spikes rather than every step: over the lookback the spikes cost "
                           "the job as much as a steadily slow rank would",
    "collective_slow": "a collective of this group takes longer than it used to on every member: time is lost in "
                       "the network or a link, not in one rank's compute (reported, never paged)",
}


def explain(reason: str) -> str:
    return REASON_TEXT.get(reason, reason)


def expected_stages(opts: DemoOptions) -> set[str]:
    """Stages a detection of the injected rank may name: the injected timer and the timers wrapping it that
    the detector judges (``optimizer`` wraps the ``optimizer-*`` timers)."""
    stages = {opts.inject_stage}
    if opts.inject_stage.startswith("optimizer-"):
        stages.add("optimizer")
    return stages


def _is_injected(v: dict, opts: DemoOptions) -> bool:
    if not injecting(opts) or int(v.get("rank", -1)) != opts.inject_rank:
        return False
    if str(v.get("stage", "")) not in expected_stages(opts):
        return False
    step = v.get("step")
    return step is None or int(step) >= opts.inject_from


def summarise(verdicts: list[dict], opts: DemoOptions) -> tuple[list[Detection], int]:
    """First straggler verdict per (rank, stage), the injected detections first; false alarms are straggler
    verdicts anywhere else (other ranks, other stages, or the injected rank before its slowdown began)."""
    first: dict[tuple[int, str], Detection] = {}
    recovered: dict[tuple[int, str], int] = {}
    for v in verdicts:
        key = (int(v.get("rank", -1)), str(v.get("stage", "")))
        if v.get("verdict") == s.VERDICT_STRAGGLER and key not in first:
            step = v.get("step")
            hit = _is_injected(v, opts)
            first[key] = Detection(
                rank=key[0], stage=key[1], verdict=s.VERDICT_STRAGGLER, deviation=v.get("deviation"),
                steps_to_detect=int(step) - opts.inject_from if hit and step is not None else None,
                attribution=str(v.get("attribution", "")), step=step, injected=hit,
                step_time_lost_ms=v.get("step_time_lost_ms"), gpu_seconds_per_hour=v.get("gpu_seconds_per_hour"),
                host=str(v.get("host", "")), gpu=str(v.get("gpu", "")), reference_rank=v.get("reference_rank"))
        elif v.get("verdict") == s.VERDICT_RECOVERED and key in first and key not in recovered:
            recovered[key] = int(v.get("step") or 0)
    for key, det in first.items():
        det.recovered_step = recovered.get(key)
    detections = sorted(first.values(), key=lambda d: (not d.injected, d.step or 0))
    false_alarms = sum(1 for d in detections if not d.injected)
    return detections, false_alarms


def stage_series(points: Iterable[StagePoint], stage: str, first_step: int = 0) -> dict[int, dict[int, float]]:
    """rank -> step -> ms of one stage, one kind of time throughout (as the detector never mixes them): device
    time when most of the stage's samples have it, else host time; steps from ``first_step``."""
    mine = [p for p in points if p.stage == stage and p.step >= first_step]
    device = sum(1 for p in mine if p.device_ms is not None) * 2 > len(mine)
    series: dict[int, dict[int, float]] = defaultdict(dict)
    for p in mine:
        value = p.device_ms if device else p.host_ms
        if value is not None and value > 0:
            series[p.rank][p.step] = float(value)
    return series


def window_medians(series: dict[int, dict[int, float]], window_steps: int) -> dict[int, dict[int, float]]:
    """rank -> window index -> the rank's median over the window's steps (``series``: rank -> step -> ms)."""
    out: dict[int, dict[int, float]] = {}
    for rank, by_step in series.items():
        per: dict[int, list[float]] = defaultdict(list)
        for step, value in by_step.items():
            per[step // window_steps].append(value)
        out[rank] = {w: statistics.median(v) for w, v in per.items()}
    return out


def series_window_deviations(series: dict[int, dict[int, float]], window_steps: int, *,
                             fastest_quantile: float) -> dict[int, dict[int, float]]:
    """rank -> window index -> deviation of the rank's window median from its reference among the other ranks'
    window medians, as the detector compares them (``reference_of`` "fastest" at ``fastest_quantile``); a
    window where no other rank has a sample is left out."""
    from collector_processor.processor.straggler.statistics import reference_of

    medians = window_medians(series, window_steps)
    out: dict[int, dict[int, float]] = defaultdict(dict)
    for r, ws in medians.items():
        for w, mine in ws.items():
            ref = reference_of({q: m[w] for q, m in medians.items() if q != r and w in m}, "fastest",
                               fastest_quantile)
            if ref is not None and ref[1] > 0:
                out[r][w] = mine / ref[1] - 1.0
    return out


def window_deviations(points: Iterable[StagePoint], stage: str, window_steps: int, first_step: int = 0, *,
                      fastest_quantile: float) -> dict[int, dict[int, float]]:
    """``series_window_deviations`` of one stage's times (``stage_series``), windows from ``first_step``."""
    return series_window_deviations(stage_series(points, stage, first_step), window_steps,
                                    fastest_quantile=fastest_quantile)


def relative_step_noise(points: Iterable[StagePoint], stage: str, window_steps: int,
                        first_step: int = 0) -> float | None:
    """Relative step-to-step sigma of the stage within a rank's window, as the detector measures the noise its
    tolerance rises with (``pooled_relative_sigma``), over every rank's windows; None without a window of at
    least 3 steps."""
    per: dict[tuple[int, int], list[float]] = defaultdict(list)
    for rank, by_step in stage_series(points, stage, first_step).items():
        for step, value in by_step.items():
            per[(rank, step // window_steps)].append(value)
    return pooled_relative_sigma(per.values(), min_groups=1)


def problems(verdicts: list[dict], detections: list[Detection], opts: DemoOptions, points: list[StagePoint],
             *, window_steps: int, absolute_floor_ms: float, tolerance: float,
             fastest_quantile: float) -> list[str]:
    """One line per reason the run did not show what it was asked to show (empty: it did)."""
    out: list[str] = []
    if injecting(opts) and not any(d.injected for d in detections):
        out.append(missed_reason(verdicts, opts, points, window_steps=window_steps,
                                 absolute_floor_ms=absolute_floor_ms, tolerance=tolerance,
                                 fastest_quantile=fastest_quantile))
    for d in detections:
        if not d.injected:
            why = ("before its slowdown began" if d.rank == opts.inject_rank and d.stage in expected_stages(opts)
                   else "which the demo did not slow")
            out.append(f"false alarm: rank {d.rank} {d.stage} convicted at step {d.step} "
                       f"({(d.deviation or 0):+.1%} vs rank {d.reference_rank}, {d.attribution}), {why}")
    return out


def missed_reason(verdicts: list[dict], opts: DemoOptions, points: list[StagePoint], *, window_steps: int,
                  absolute_floor_ms: float, tolerance: float, fastest_quantile: float) -> str:
    """Why the injected rank was not convicted: what the detector said about it, and what was measured."""
    rank, stage = opts.inject_rank, opts.inject_stage
    head = f"not detected: rank {rank} {stage} (slowed from step {opts.inject_from}) was never convicted"
    mine = [v for v in verdicts if v.get("rank") == rank and v.get("stage") in expected_stages(opts)
            and (v.get("step") or 0) >= opts.inject_from]
    reasons: dict[str, int] = defaultdict(int)
    for v in mine:
        reasons[str(v.get("reason"))] += 1
    if not any(p.rank == rank and p.stage == stage for p in points):
        return f"{head}: no timing of that stage arrived from rank {rank} (see its rank{rank}.log)"
    devs = window_deviations(points, stage, window_steps, first_step=opts.inject_from,
                             fastest_quantile=fastest_quantile)
    measured = sorted(devs.get(rank, {}).values())
    noise = relative_step_noise(points, stage, window_steps, first_step=opts.inject_from)
    facts = []
    if measured:
        facts.append(f"measured {statistics.median(measured):+.1%} against the fastest peer (median over "
                     f"{len(measured)} windows of {window_steps} steps)")
    if noise is not None:
        facts.append(f"host noise {noise:.1%} per step")
    said = "; ".join(f"{n} x uncertain/{r} ({explain(r)})" for r, n in sorted(reasons.items()))
    if said:
        return f"{head}: the detector said {said}" + (f"; {', '.join(facts)}" if facts else "")
    tail = f"; {', '.join(facts)}" if facts else ""
    return (f"{head}: no window of it was beyond the detector's tolerance ({tolerance:.0%} at least, raised "
            f"with the measured noise) and the {absolute_floor_ms:g} ms floor{tail}")

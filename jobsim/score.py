"""Score the processor's verdicts against the labelled faults of one simulated run."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import otel_straggler_schema as s
from collector_processor.processor.straggler.model import Verdict
from jobsim.faults import Fault

_SUSTAINED = ("device", "host", "dataloader", "ramp")  # faults that stay on from onset to end


@dataclass
class RunScore:
    fault: Fault | None
    detected: bool = False
    steps_to_detect: int | None = None
    stage_correct: bool | None = None
    attribution_correct: bool | None = None
    recovered_after: int | None = None  # steps from fault end to the recovered verdict
    flaps: int = 0  # recovered verdicts on the convicted rank and stage while a sustained fault still ran
    false_alarms: int = 0  # straggler verdicts that no label explains
    healthy_rank_steps: int = 0
    # straggler verdicts on a rank of the fault's group that carry no victim_of (a waiter convicted on its own;
    # where the group is the answer, also the culprit convicted alone)
    victims_convicted: int = 0


def score_run(fault: Fault | None, verdicts: Iterable[Verdict], healthy_rank_steps: int,
              node_host: str | None = None, group: set[int] | None = None, expect_group: bool = False) -> RunScore:
    """``node_host``: with a ``node`` fault, its host: detected by the node verdict naming it (``node.py``);
    rank verdicts on the host are explained, on any other host false alarms. ``group``: the ranks of the fault
    rank's DP replica, which wait for it (``culprit.py``): detected by a verdict naming the fault's rank as the
    culprit (``expect_group``: by the group verdict naming the group, as the timers cannot tell)."""
    res = RunScore(fault=fault, healthy_rank_steps=healthy_rank_steps)
    if fault is not None and fault.kind == "node":
        return _score_node(res, fault, verdicts, node_host)
    if fault is not None and group is not None:
        return _score_group(res, fault, verdicts, group, expect_group)
    verdicts = sorted(verdicts, key=lambda v: (v.step if v.step is not None else 0))
    first_hit: Verdict | None = None
    for v in verdicts:
        if v.verdict != s.VERDICT_STRAGGLER:
            continue
        explained = False
        if fault is not None and fault.expect_straggler and v.rank == fault.rank and (
            v.step is None or v.step >= fault.onset
        ):
            explained = True
            if first_hit is None:
                first_hit = v
        if (fault is not None and (fault.kind == "intermittent" or fault.expect is False) and v.rank == fault.rank
                and (v.step or 0) >= fault.onset):
            explained = True  # slowness was injected on this rank; detection optional
        if not explained:
            res.false_alarms += 1
    if first_hit is not None and fault is not None:
        res.detected = True
        res.steps_to_detect = max(0, (first_hit.step or fault.due) - fault.due)
        res.stage_correct = first_hit.stage in fault.stages or (
            fault.kind == "dataloader" and first_hit.group == "data")
        res.attribution_correct = first_hit.attribution == fault.expected_attribution
        if fault.kind in _SUSTAINED:
            res.flaps = sum(1 for v in verdicts if v.verdict == s.VERDICT_RECOVERED and v.rank == fault.rank
                            and v.stage == first_hit.stage and v.step is not None
                            and first_hit.step is not None and first_hit.step <= v.step
                            and (fault.end is None or v.step < fault.end))
        if fault.end is not None:
            for v in verdicts:
                if (v.verdict == s.VERDICT_RECOVERED and v.rank == fault.rank and v.stage == first_hit.stage
                        and (v.step or 0) >= fault.end):
                    res.recovered_after = (v.step or fault.end) - fault.end
                    break
    return res


def _score_node(res: RunScore, fault: Fault, verdicts: Iterable[Verdict], host: str | None) -> RunScore:
    first: Verdict | None = None
    for v in sorted(verdicts, key=lambda v: (v.step if v.step is not None else 0)):
        on_host = v.host == host and (v.step is None or v.step >= fault.onset)
        if v.verdict == s.VERDICT_STRAGGLER:
            if not on_host:
                res.false_alarms += 1
            elif first is None and v.stage == s.NODE_STAGE:
                first = v
        elif (v.verdict == s.VERDICT_RECOVERED and first is not None and v.stage == s.NODE_STAGE and on_host
              and fault.end is not None and (v.step or 0) >= fault.end and res.recovered_after is None):
            res.recovered_after = (v.step or fault.end) - fault.end
    if first is not None:
        res.detected = True
        res.steps_to_detect = max(0, (first.step or fault.due) - fault.due)
        res.stage_correct = True
        res.attribution_correct = first.attribution == fault.expected_attribution
    return res


def _score_group(res: RunScore, fault: Fault, verdicts: Iterable[Verdict], group: set[int],
                 expect_group: bool) -> RunScore:
    first: Verdict | None = None
    for v in sorted(verdicts, key=lambda v: (v.step if v.step is not None else 0)):
        if v.verdict != s.VERDICT_STRAGGLER:
            continue
        if v.step is not None and v.step < fault.onset:
            res.false_alarms += 1
        elif v.group_ranks:  # a group verdict
            if fault.rank not in v.group_ranks:
                res.false_alarms += 1
            elif expect_group and first is None:
                first = v
        elif v.rank not in group:
            res.false_alarms += 1
        elif v.victim_of:
            pass  # a victim that says whom it waits for (or a member of the group verdict)
        elif v.rank == fault.rank and not expect_group:
            if first is None:
                first = v
        else:
            res.victims_convicted += 1
    if first is not None:
        res.detected = True
        res.steps_to_detect = max(0, (first.step or fault.due) - fault.due)
        res.stage_correct = first.stage in fault.stages
        res.attribution_correct = first.attribution == fault.expected_attribution
    return res


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")

"""Stages that hold a wait in a collective: ``collective_wait`` and the stages marked collective.

In synchronous data parallelism every rank waits for the slowest in the next collective. Where that collective
sits inside a judged stage (plain PyTorch DDP: ``loss.backward()`` holds the gradient all-reduce), the waiters'
stage is longer than the slow rank's by the slow rank's own excess elsewhere, and against the fastest peer,
which in that stage is the slow rank itself, every waiter looks slow. Two ways out:

* **marked** (``stage(..., collective=True)`` on the emitter; ``straggler.stage.collective`` /
  ``straggler.summary.collective`` on the wire): such a stage is never judged (its time is the rank's work plus
  a wait that depends on the others); it is evidence only, ``waits_least:<stage>`` on the verdict of the rank
  that waited least there. The slow rank is found in the stages that hold its own work.
* **collective_wait** (unmarked stages): rank r slower than its reference q in stage S is not convicted when
  (ii) q is slower than r in another judged stage of the same window (not a collective group, not marked), by
  at least ``collective_wait_fraction`` of r's gap in S and beyond that stage's tolerance and floor: the split
  of the step is inverted, r's excess in S matches q's excess elsewhere; and, in a cohort of 3 or more, (i) r
  is at par (within tolerance) with at least as many of its peers as are below it beyond tolerance: the
  waiters are the many, the slow rank the one. A real straggler is above all its peers, so (i) never exempts
  it however the wait of the others falls. With 2 ranks (i) cannot hold, and a stage holding the collective
  cannot be told from the stage holding the slow rank's work: both ranks' excesses are ``collective_wait``
  (mark the stage to name the rank). The verdict is ``uncertain/collective_wait`` with the reference q: the
  rank this one waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import otel_straggler_schema as s
from collector_processor.processor.straggler.attribution import collective_evidence
from collector_processor.processor.straggler.evidence import DEVICE, HOST, RankStat, values_of_kind
from collector_processor.processor.straggler.statistics import median
from collector_processor.processor.straggler.window_evidence import Comparison, StageEvidence, WindowEvidence


def majority_at_par(rank: int, kind: str, value: float, per: Mapping[int, RankStat], peers: list[int],
                    tolerance: float) -> bool:
    """(i): at least as many of ``peers`` within ``tolerance`` of ``value`` as below it beyond tolerance, and
    at least one."""
    at_par = below = 0
    for p in peers:
        if p == rank:
            continue
        v = per[p].value(kind)
        if v is None or v <= 0.0:
            continue
        if value / v - 1.0 > tolerance:
            below += 1
        elif abs(v / value - 1.0) <= tolerance:
            at_par += 1
    return at_par >= 1 and at_par >= below


def excess_elsewhere(rank: int, ref: int, gap: float, stage: str, stats: Mapping[str, Mapping[int, RankStat]],
                     candidate: Callable[[str], bool], tolerance: Callable[[str, str], float],
                     floor: Callable[[str, float], float], fraction: float) -> str | None:
    """(ii): a stage other than ``stage`` (``candidate`` says which count) where ``ref`` is slower than ``rank``
    by at least ``fraction`` x ``gap``, beyond that stage's tolerance and floor; its name, or None."""
    need = fraction * gap
    for other, per in stats.items():
        if other == stage or not candidate(other):
            continue
        a, b = per.get(rank), per.get(ref)
        if a is None or b is None:
            continue
        vals = values_of_kind(a, b)
        if vals is None:
            continue
        kind, mine, theirs = vals
        g = theirs - mine
        if mine <= 0.0 or g < need or g / mine <= tolerance(other, kind) or g < floor(kind, mine):
            continue
        return other
    return None


def waited_least(rank: int, stages: Mapping[str, Mapping[int, RankStat]], candidate: Callable[[str], bool],
                 tolerance: float, floor: Callable[[str, float], float]) -> list[str]:
    """``waits_least:<stage>`` evidence: the stages (``candidate``: marked collective, or judged ones that may
    hold a wait) where ``rank`` spent the least time of its cohort while its peers' median is beyond
    ``tolerance`` and the floor above it."""
    found: list[str] = []
    for name, per in stages.items():
        mine_st = per.get(rank)
        if mine_st is None or len(per) < 2 or not candidate(name):
            continue
        kind = DEVICE if all(st.dev is not None for st in per.values()) else HOST
        mine = mine_st.value(kind)
        peers = [v for r, st in per.items() if r != rank and (v := st.value(kind)) is not None]
        if mine is None or mine <= 0.0 or not peers or mine > min(peers):
            continue
        m = median(peers)
        if m > mine * (1.0 + tolerance) and m - mine >= floor(kind, mine):
            found.append(f"waits_least:{name}")
    return found


def waits(ev: WindowEvidence, se: StageEvidence, rank: int, cmp: Comparison) -> bool:
    """``collective_wait``: ``rank``'s excess over its reference in ``se`` is the wait for the reference's own
    excess in another judged stage of the window ((ii), ``excess_elsewhere``), and in a cohort of 3 or more the
    rank is with the many at par, not the one above them ((i), ``majority_at_par``)."""
    ref = cmp.ref_rank
    if ref is None or cmp.measurement is None or cmp.value is None or cmp.gap <= 0.0:
        return False
    if cmp.size >= 3:
        peers = cmp.peers if cmp.peers is not None else se.others(rank)
        tol = se.tols.of(cmp.measurement)
        if not majority_at_par(rank, cmp.measurement, cmp.value, se.per, peers, tol):
            return False
    cohort = ev.cohort
    judged = frozenset(ev.cfg.judged_groups)

    def candidate(stage: str) -> bool:
        group = cohort.stages.get(stage, "other")
        return group in judged and group not in s.COLLECTIVE_GROUPS and stage not in cohort.collective

    return excess_elsewhere(rank, ref, cmp.gap, se.name, ev.stats, candidate,
                            ev.tolerance, ev.floor, ev.cfg.collective_wait_fraction) is not None


def wait_evidence(ev: WindowEvidence, rank: int) -> str:
    """``straggler.evidence.collective_wait`` of a straggler verdict: where ``rank`` waited least, the collective
    groups (``attribution.collective_evidence``), then the stages marked collective and, with ``collective_wait``
    on, the judged stages that may hold the others' wait."""
    cfg = ev.cfg
    cohort = ev.cohort
    judged = frozenset(cfg.judged_groups)

    def candidate(stage: str) -> bool:
        return stage in cohort.collective or (cfg.collective_wait and cohort.stages.get(stage, "other") in judged)

    found = waited_least(rank, ev.stats, candidate, cfg.tolerance, ev.floor)
    groups = collective_evidence(rank, ev.collectives, cfg.tolerance)
    return ",".join([groups, *found] if groups else found)

"""``collective_signal``: the time a cohort loses in its collectives beyond the cohort's own baseline
(``docs/detector.md``, "Collective signal"): a job-level signal and a non-paging event, never a rank's conviction.

A cohort is one ring of each collective it times: its ranks (the DP replicas at one TP/PP position) all-reduce the
gradients together (``grad-sync``) and all-gather the parameters (``param-gather``); its pipeline stage's sends and
receives (``p2p``) and its model-parallel group's all-reduces (``mp_wait_stages``, ring ``model-parallel``) are
timed there too. A rank's interval of a collective is its wait for the last rank to arrive plus the collective
itself, and the last to arrive waits for nobody: per step the **minimum** over the ranks is the collective's own
time. A compute straggler makes every other rank wait longer but leaves the minimum alone (it arrives last); a slow
link slows the collective for every member of its ring, the minimum with it.

Per cohort and collective stage, each closed window (warm ranks only):

* **statistic**: the median over the window's steps of the per-step minimum, on device time where every rank timed
  the step on the device, else the minimum of the ranks' host medians;
* **baseline**: the median of the latest ``collective_baseline_windows`` statistics of windows not lost (at least 3
  before anything is said), its noise 1.4826 x their median absolute deviation;
* **lost**: statistic - baseline, when beyond ``collective_tolerance`` of the baseline, 4 noise sigmas and the floor
  of its kind (``WindowEvidence.floor``).

After ``persistence_windows`` consecutive lost windows the signal opens: one derived ``uncertain/collective_slow``
event naming the ring (``straggler.collective.ring``, its ranks in ``straggler.group.ranks``) with the time lost per
step as its cost, again every ``uncertain_every_windows`` windows while it lasts; ``recovery_windows`` consecutive
windows not lost close it with ``recovered/within_tolerance``. ``WindowOutcome.collective_lost`` carries the time
lost per step of every judged ring (0 when not lost) to ``otel_straggler_collective_lost_seconds``.

**Naming**: in a ring every member waits for the slowest link alike, so interval times cannot say whose link it
is. The event names a rank (``dl.rank`` and ``straggler.collective.rank``) only where evidence does: one member's
NVML sample (``straggler.gpu.pcie_replay_errors``, ``straggler.gpu.nvlink_errors``) shows link errors beyond every
other member's (its ``straggler.hint`` says which).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import otel_straggler_schema as s
from collector_processor.processor.straggler import hints
from collector_processor.processor.straggler.collective_ring import Ring, Rings
from collector_processor.processor.straggler.evidence import DEVICE, HOST, RankStat
from collector_processor.processor.straggler.impact import impact
from collector_processor.processor.straggler.model import COLLECTIVE_SLOW, WITHIN_TOLERANCE, Verdict
from collector_processor.processor.straggler.statistics import median, relative_deviation
from collector_processor.processor.straggler.window import KIND_STEP
from collector_processor.processor.straggler.window_evidence import WindowEvidence

RING_MODEL_PARALLEL = "model-parallel"  # the ring of the mp_wait_stages (the model-parallel group's all-reduces)
_MIN_BASELINE = 3  # windows of baseline before a window can be lost
_NOISE_SIGMAS = 4.0  # a lost window is beyond this many of the baseline's noise sigmas
_MAD_SIGMA = 1.4826
_LINK_KEYS = (s.ATTR_GPU_PCIE_REPLAYS, s.ATTR_GPU_NVLINK_ERRORS)


def ring_of(stage: str, group: str, mp_wait_stages: frozenset[str]) -> str | None:
    """The ring a stage's time is spent in: its collective group, ``model-parallel`` for the model-parallel group's
    all-reduces, None for a stage of the rank's own work."""
    if group in s.COLLECTIVE_GROUPS:
        return group
    if stage in mp_wait_stages:
        return RING_MODEL_PARALLEL
    return None


def statistic(per: dict[int, RankStat]) -> tuple[str, float] | None:
    """(kind, the median over the window's steps of the per-step minimum over the ranks) on device time where every
    rank timed a step on the device, else (host, the minimum of the ranks' host medians); None with fewer than 2
    ranks."""
    if len(per) < 2:
        return None
    by_step: dict[int, list[float]] = {}
    if all(st.dev_samples and st.dev_steps and len(st.dev_steps) == len(st.dev_samples) for st in per.values()):
        for st in per.values():
            assert st.dev_steps is not None
            for t, v in zip(st.dev_steps, st.dev_samples, strict=True):
                by_step.setdefault(t, []).append(v)
        mins = [min(vs) for vs in by_step.values() if len(vs) == len(per)]
        if mins:
            return DEVICE, median(mins)
    hosts = [h for st in per.values() if (h := st.host) is not None]
    if len(hosts) < len(per):
        return None
    return HOST, min(hosts)


def judge(ev: WindowEvidence, rings: Rings) -> None:
    """Every collective stage of the window: its ring's statistic against its baseline, the signal opened, said
    again or closed (``ev.out.verdicts``), and the time lost per step (``ev.out.collective_lost``)."""
    cfg = ev.cfg
    if not cfg.collective_signal or ev.window.kind != KIND_STEP:
        return
    mp = frozenset(cfg.mp_wait_stages)
    cohort = ev.cohort
    idx = ev.window.index
    for stage, per in ev.stats.items():
        group = cohort.stages.get(stage, "other")
        ring_name = ring_of(stage, group, mp)
        if ring_name is None:
            continue
        stat = statistic(per)
        if stat is None:
            continue
        kind, value = stat
        ring = rings.by_stage.get(stage)
        if ring is None:
            if len(rings.by_stage) >= cfg.max_stages:
                continue
            ring = rings.by_stage[stage] = Ring(deque(maxlen=cfg.collective_baseline_windows), kind)
        if ring.kind != kind:  # device timing started or stopped: a new baseline
            ring.baseline.clear()
            ring.kind = kind
            ring.streak = 0
        consecutive = ring.last_index == idx - 1
        ring.last_index = idx
        lost = _lost(ev, ring, kind, value)
        ev.out.collective_lost[(stage, ring_name)] = (lost or 0.0, _named(ev, per))
        if lost is None:
            if len(ring.baseline) < _MIN_BASELINE or ring.open is None:
                ring.baseline.append(value)
            ring.streak = 0
            if ring.open is not None:
                ring.par = ring.par + 1 if consecutive else 1
                if ring.par >= cfg.recovery_windows:
                    ev.out.verdicts.append(replace(
                        ring.open, verdict=s.VERDICT_RECOVERED, reason=WITHIN_TOLERANCE, value_ms=value,
                        deviation=relative_deviation(value, median(list(ring.baseline))), step_time_lost_ms=0.0,
                        gpu_seconds_per_hour=0.0, window_gpu_seconds=0.0, window_start=ev.window.start,
                        window_end=ev.window.end, step=ev.step, trace_id=ev.trace_of(ring.open.rank),
                        emitted_unix_ns=ev.now_ns))
                    ring.open = None
                    ring.par = 0
            continue
        ring.par = 0
        ring.streak = ring.streak + 1 if consecutive else 1
        if ring.streak < cfg.persistence_windows:
            continue
        if ring.open is not None and idx - ring.said_index < cfg.uncertain_every_windows:
            continue
        base = median(list(ring.baseline))
        v = _event(ev, stage, group, ring_name, per, kind, value, base, lost, ring.open)
        ring.open = v
        ring.said_index = idx
        ev.out.verdicts.append(v)


def _lost(ev: WindowEvidence, ring: Ring, kind: str, value: float) -> float | None:
    """The time lost per step (ms) when the statistic is beyond its baseline's tolerance, noise and floor."""
    if len(ring.baseline) < _MIN_BASELINE:
        return None
    base_values = list(ring.baseline)
    base = median(base_values)
    noise = _MAD_SIGMA * median([abs(b - base) for b in base_values])
    limit = max(ev.cfg.collective_tolerance * base, _NOISE_SIGMAS * noise, ev.floor(kind, base))
    gap = value - base
    return gap if gap > limit else None


def _named(ev: WindowEvidence, per: dict[int, RankStat]) -> int | None:
    """The ring member whose latest NVML sample shows link errors beyond every other member's (None: no such
    evidence)."""
    ranks = ev.cohort.ranks
    best: tuple[int, int] | None = None  # (errors, rank)
    second = 0
    for r in per:
        info = ranks.get(r)
        sample = info.gpu_hints if info is not None else None
        if not sample:
            continue
        n = sum(int(v) for k in _LINK_KEYS if isinstance(v := sample.get(k), int | float))
        if best is None or n > best[0]:
            if best is not None:
                second = max(second, best[0])
            best = (n, r)
        else:
            second = max(second, n)
    if best is None or best[0] <= 0 or best[0] <= second:
        return None
    return best[1]


def _event(ev: WindowEvidence, stage: str, group: str, ring_name: str, per: dict[int, RankStat],
           kind: str, value: float, base: float, lost: float, previous: Verdict | None) -> Verdict:
    """The ring's ``uncertain/collective_slow`` event: the time lost per step, the ring and, where evidence names
    one, the member whose links are the cause."""
    cohort = ev.cohort
    members = tuple(sorted(per))
    named = _named(ev, per)
    info = cohort.ranks.get(named) if named is not None else None
    hint = ""
    if info is not None and info.gpu_hints:
        hint = hints.describe(info.gpu_hints, (cohort.ranks[p].gpu_hints for p in members
                                               if p != named and p in cohort.ranks))
    per_hour = impact(lost, ev.world_size, ev.period_ms)
    window_s = (ev.period_ms or 0.0) / 1000.0 * (ev.window.end - ev.window.start + 1)
    rank = named if named is not None else members[0]
    first_step, first_trace = (previous.first_step, previous.first_trace_id) if previous is not None \
        else (ev.step, ev.trace_of(rank))
    return Verdict(
        job=cohort.job, cohort=cohort.key, rank=rank,
        host=info.host if info is not None else "", gpu=info.gpu if info is not None else "", stage=stage,
        group=group, verdict=s.VERDICT_UNCERTAIN, reason=COLLECTIVE_SLOW, deviation=relative_deviation(value, base),
        value_ms=value, reference_rank=None, reference_ms=base, measurement=kind, window_start=ev.window.start,
        window_end=ev.window.end, step=ev.step, attribution=s.ATTRIBUTION_UNKNOWN, step_time_lost_ms=lost,
        gpu_seconds_per_hour=per_hour, cohort_size=len(members), collective_evidence="", trace_id=ev.trace_of(rank),
        emitted_unix_ns=ev.now_ns, first_step=first_step, first_trace_id=first_trace,
        window_gpu_seconds=per_hour / 3600.0 * window_s, group_ranks=members, derived=True, hint=hint,
        ring=ring_name, link_rank=named)

"""``culprit``: the ranks of one model-parallel group slow together are one fault, said once, naming the culprit
when the timers can tell it, else the group.

Ranks of one DP replica (same job and run, same ``dl.data_parallel.rank``: its TP, CP and EP peers and its
pipeline stages) wait for each other in the collectives inside their stages: a TP rank 15 % slower in compute
holds its TP peers in the all-reduces inside their compute timers, and each of them is then slow in its own
cohort (its DP peers run at par), with the same excess in the same windows. Stage times alone cannot say which
GPU holds the others: the slow one spends the time in its kernels, the others in the collective's.

What can tell them apart is a **stage the culprit is slow in alone**: a stage where one member of the group is
beyond its tolerance and floor against its own cohort while every other member of the group with a sample there
is not. A slow GPU (clocks, thermals, a bad link) is slow in its collective-free work too (the optimizer's inner
step, a stage marked ``collective``-free by the emitter's timers), its peers are not; a waiter's excess only
appears in stages that hold a collective of the group. Per DP replica the latest ``culprit_history_windows``
window indices keep, per rank, the stages it is beyond in (``WindowOutcome.stage_excess``); a rank is the
**culprit** when it has such solo evidence in at least two of those windows and is the only member with any,
or has at least twice the windows of the next one.

``Correlator.observe`` follows every batch of verdicts before they are emitted. Per (replica, stage) it tracks
the ranks holding a straggler alert; when two or more hold one together a decision is made once and held until
none does:

* **culprit** (a member with solo evidence, itself holding an alert in the stage): its verdict lists the
  ``victims`` and names the ``mp_group``; each victim's verdict (and its alert, ``cover``) carries
  ``victim_of = "rank:<culprit>"`` and no cost: the cost is the culprit's, counted once.
* **group** (no member with solo evidence, or several alike: identical excess everywhere): one derived verdict
  ``straggler``/``group_slow`` on the stage naming the group (``mp_group``, ``group_ranks``) with the cost of its
  worst member, and every member's verdict carries ``victim_of = "group:<name>"`` and no cost. It ends with
  ``recovered`` when no member holds an alert in the stage.

Limits: a culprit whose slowdown is confined to the stages that hold its group's collectives (a slow kernel in
compute only, every member's timers then read the same) is never named: that is the ``group`` case. A member
convicted one window before the others is emitted as an ordinary straggler first; its alert is covered from the
next window on (inside the alert's ``for: 1m``). Ranks that publish no ``dl.data_parallel.rank`` are never
correlated. Only cohorts held by one collector instance are seen (sharded by cohort key, a group spans shards).

Bounded: at most ``culprit_max_groups`` replicas tracked, least recently touched first out (counted,
``culprit_groups_evicted``); per replica ``culprit_history_windows`` window indices.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import otel_straggler_schema as s
from collector_processor.processor.straggler.cohort import Cohort, CohortRegistry
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.model import (
    GROUP_SLOW,
    INTERMITTENT_EXCESS,
    PERSISTENT_EXCESS,
    SLOWER_THAN_REFERENCE,
    WITHIN_TOLERANCE,
    Verdict,
)

_CONVICTIONS = (SLOWER_THAN_REFERENCE, PERSISTENT_EXCESS, INTERMITTENT_EXCESS)
_PP = re.compile(r"\.pp(\d+)\.")
_GroupKey = tuple[str, str, int]  # (job, run id, DP replica)
_MIN_SOLO_WINDOWS = 2  # a culprit is slow alone in at least this many windows (one noisy window names nobody)


@dataclass(slots=True)
class _Decision:
    name: str  # the group's name, "dp3.pp0" (or "dp3" across pipeline stages)
    culprit: int | None  # None: the timers cannot tell (a group verdict)
    verdict: Verdict | None = None  # the group verdict (culprit None)


@dataclass(slots=True)
class _Group:
    # window index -> rank -> stages the rank is beyond tolerance and floor in (its cohort's window)
    windows: OrderedDict[int, dict[int, set[str]]] = field(default_factory=OrderedDict)
    # window index -> rank -> stages it was judged in (beyond or not)
    judged: OrderedDict[int, dict[int, set[str]]] = field(default_factory=OrderedDict)
    # window index -> ranks that waited in a model-parallel collective (mp_wait): victims, never the culprit
    waits: dict[int, set[int]] = field(default_factory=dict)
    active: dict[str, dict[int, Verdict]] = field(default_factory=dict)  # stage -> rank -> its latest verdict
    decisions: dict[str, _Decision] = field(default_factory=dict)  # stage -> the decision while it holds
    pp: dict[int, str] = field(default_factory=dict)  # rank -> its pipeline stage ("" unknown)


class Correlator:
    def __init__(self, config: Config, counters: dict[str, int], cohorts: CohortRegistry) -> None:
        self.cfg = config
        self.c = counters
        self.cohorts = cohorts
        self.groups: OrderedDict[_GroupKey, _Group] = OrderedDict()

    # --- evidence, per closed window ----------------------------------------------------------------
    def window(self, cohort: Cohort, index: int, stage_excess: dict[tuple[int, str], tuple[float, bool]],
               mp_waits: Iterable[tuple[int, str]] = ()) -> None:
        """The stages each rank of ``cohort`` is beyond in window ``index`` (solo evidence is read from these), and
        the ranks that waited in a model-parallel collective there (``mp_waits``: never the culprit)."""
        if not self.cfg.culprit or (not stage_excess and not mp_waits):
            return
        run = s.cohort_run(cohort.key)
        m = _PP.search(cohort.key)
        pp = m.group(1) if m else ""
        entries = [(rank, stage, beyond, False) for (rank, stage), (_rel, beyond) in stage_excess.items()]
        entries += [(rank, stage, False, True) for rank, stage in mp_waits]
        for rank, stage, beyond, waited in entries:
            info = cohort.ranks.get(rank)
            if info is None or info.dp_rank < 0:
                continue
            g = self._group((cohort.job, run, info.dp_rank))
            g.pp[rank] = pp
            judged = g.judged.get(index)
            if judged is None:
                if len(g.judged) >= self.cfg.culprit_history_windows and index < min(g.judged):
                    continue  # a cohort closing a window older than every one kept: no longer evidence
                judged = g.judged[index] = {}
                g.windows[index] = {}
                self._trim(g)
            if waited:
                g.waits.setdefault(index, set()).add(rank)
                continue
            judged.setdefault(rank, set()).add(stage)
            if beyond:
                g.windows.setdefault(index, {}).setdefault(rank, set()).add(stage)

    # --- verdicts, per batch ------------------------------------------------------------------------
    def observe(self, verdicts: list[Verdict]) -> list[Verdict]:
        """``verdicts`` with each group verdict that opened or ended in this batch added, and the verdicts of a
        culprit and its victims marked."""
        if not self.cfg.culprit or not self.groups:
            return verdicts
        replica = _Replicas(self.cohorts)
        touched: set[tuple[_GroupKey, str]] = set()
        for v in verdicts:
            if v.derived or v.stage == s.NODE_STAGE or v.verdict == s.VERDICT_UNCERTAIN:
                continue
            key = replica.get((v.job, v.cohort, v.rank))
            if key is None:
                continue
            g = self.groups.get(key)
            if v.verdict == s.VERDICT_STRAGGLER and v.reason in _CONVICTIONS:
                if g is None:
                    g = self._group(key)
                g.active.setdefault(v.stage, {})[v.rank] = v
            elif v.verdict == s.VERDICT_RECOVERED and g is not None:
                ranks = g.active.get(v.stage)
                if ranks is not None:
                    ranks.pop(v.rank, None)
            else:
                continue
            touched.add((key, v.stage))
        added: list[Verdict] = []
        for key, stage in sorted(touched):
            g = self.groups.get(key)
            if g is None:
                continue
            ranks = g.active.get(stage, {})
            d = g.decisions.get(stage)
            if d is None and len(ranks) >= 2:
                d = self._decide(key, g, stage)
                if d is not None:
                    g.decisions[stage] = d
                    self.c["culprit_decisions"] = self.c.get("culprit_decisions", 0) + 1
                    if d.verdict is not None:
                        added.append(d.verdict)
            elif d is not None and not ranks:
                if d.verdict is not None:
                    last = max((v for v in verdicts if v.stage == stage and replica.get((v.job, v.cohort, v.rank))
                                == key), key=lambda v: v.window_end, default=d.verdict)
                    added.append(replace(d.verdict, verdict=s.VERDICT_RECOVERED, reason=WITHIN_TOLERANCE,
                                         step_time_lost_ms=0.0, gpu_seconds_per_hour=0.0, window_gpu_seconds=0.0,
                                         window_start=last.window_start, window_end=last.window_end, step=last.step,
                                         trace_id=last.trace_id, emitted_unix_ns=last.emitted_unix_ns))
                del g.decisions[stage]
            if not ranks:
                g.active.pop(stage, None)
        out = [self.cover(v) for v in verdicts]
        out.extend(added)
        return out

    def cover(self, v: Verdict) -> Verdict:
        """``v`` (a rank's verdict or alert) marked as its group's decision says: the culprit's lists its
        victims, a victim's names what it waits for and carries no cost."""
        if (not self.cfg.culprit or not self.groups or v.derived or v.verdict == s.VERDICT_UNCERTAIN
                or v.stage == s.NODE_STAGE):
            return v
        key = _Replicas(self.cohorts).get((v.job, v.cohort, v.rank))
        g = self.groups.get(key) if key is not None else None
        d = g.decisions.get(v.stage) if g is not None else None
        if d is None or g is None:
            return v
        if d.culprit == v.rank:
            victims = tuple(sorted(r for r in g.active.get(v.stage, {}) if r != v.rank))
            return replace(v, mp_group=d.name, victims=victims)
        if v.rank not in g.active.get(v.stage, {}) and v.verdict != s.VERDICT_RECOVERED:
            return v
        victim_of = f"rank:{d.culprit}" if d.culprit is not None else f"group:{d.name}"
        return replace(v, mp_group=d.name, victim_of=victim_of, step_time_lost_ms=0.0, gpu_seconds_per_hour=0.0,
                       window_gpu_seconds=0.0)

    def alert(self, job: str, run: str, dp: int, stage: str, alerts: Iterable[Verdict]
              ) -> tuple[Verdict, bool] | None:
        """The group verdict holding on the replica's ``stage`` and whether a member was judged in this batch:
        with the cost of its worst member among ``alerts`` (as judged, before ``cover``), counted once; None
        when none holds."""
        key = (job, run, dp)
        g = self.groups.get(key)
        d = g.decisions.get(stage) if g is not None else None
        if d is None or d.verdict is None:
            return None
        replica = _Replicas(self.cohorts)
        worst = max((a for a in alerts if a.stage == stage and a.job == job
                     and replica.get((a.job, a.cohort, a.rank)) == key), key=lambda a: a.step_time_lost_ms,
                    default=None)
        if worst is None:
            return d.verdict, False
        return replace(d.verdict, deviation=worst.deviation, value_ms=worst.value_ms,
                       step_time_lost_ms=worst.step_time_lost_ms, gpu_seconds_per_hour=worst.gpu_seconds_per_hour,
                       window_gpu_seconds=worst.window_gpu_seconds), True

    def key_of(self, v: Verdict) -> _GroupKey | None:
        """(job, run, DP replica) of a rank's verdict or alert."""
        return _Replicas(self.cohorts).get((v.job, v.cohort, v.rank))

    # --- the rule -------------------------------------------------------------------------------------
    def _decide(self, key: _GroupKey, g: _Group, stage: str) -> _Decision | None:
        """The culprit of the replica's ranks convicted together in ``stage``, or the group; None when a
        culprit stands out that is not itself convicted there (decided when it is)."""
        ranks = g.active[stage]
        pps = {g.pp.get(r, "") for r in ranks}
        name = f"dp{key[2]}" + (f".pp{next(iter(pps))}" if len(pps) == 1 and "" not in pps else "")
        waiters = set().union(*g.waits.values()) if g.waits else set()
        solo: dict[int, int] = {}
        for idx, beyond in g.windows.items():
            judged = g.judged.get(idx, {})
            for r, stages in beyond.items():
                if r in waiters:
                    continue  # it waited for a member of its group: a victim, never the culprit
                for st in stages:
                    others = [o for o, js in judged.items() if o != r and st in js]
                    if others and not any(st in beyond.get(o, ()) for o in others):
                        solo[r] = solo.get(r, 0) + 1
                        break
        culprit: int | None = None
        if solo:
            order = sorted(solo.items(), key=lambda kv: -kv[1])
            if order[0][1] >= _MIN_SOLO_WINDOWS and (len(order) == 1 or order[0][1] >= 2 * order[1][1]):
                culprit = order[0][0]
        if culprit is not None and culprit in ranks and _outrun(culprit, ranks):
            culprit = None  # a member waiting for it is slower beyond noise: the evidence conflicts, say the group
        if culprit is not None:
            if culprit not in ranks:
                return None
            return _Decision(name, culprit)
        worst = max(ranks.values(), key=lambda v: v.step_time_lost_ms)
        members = tuple(sorted(ranks))
        hosts = sorted({v.host for v in ranks.values() if v.host})
        gpus = ",".join(ranks[r].gpu for r in members if ranks[r].gpu)
        verdict = replace(worst, reason=GROUP_SLOW, cohort="", rank=members[0], host=hosts[0] if len(hosts) == 1
                          else ",".join(hosts), gpu=gpus, reference_rank=None, mp_group=name, group_ranks=members,
                          derived=True, collective_evidence="", node="")
        return _Decision(name, None, verdict)

    # --- bookkeeping --------------------------------------------------------------------------------
    def _group(self, key: _GroupKey) -> _Group:
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = _Group()
            while len(self.groups) > self.cfg.culprit_max_groups:
                self.groups.popitem(last=False)
                self.c["culprit_groups_evicted"] = self.c.get("culprit_groups_evicted", 0) + 1
        else:
            self.groups.move_to_end(key)
        return g

    def _trim(self, g: _Group) -> None:
        keep = self.cfg.culprit_history_windows
        while len(g.judged) > keep:
            oldest = min(g.judged)
            del g.judged[oldest]
            g.windows.pop(oldest, None)
            g.waits.pop(oldest, None)



def _outrun(culprit: int, ranks: dict[int, Verdict]) -> bool:
    """Another member's deviation in the stage exceeds the named culprit's by more than the culprit's own
    excess would allow: one that waits for it cannot be slower than it beyond the noise (a tenth of the
    culprit's deviation, and 1 %)."""
    mine = ranks[culprit].deviation
    if mine is None:
        return False
    margin = max(0.01, 0.1 * abs(mine))
    return any(v.deviation is not None and v.deviation > mine + margin for r, v in ranks.items() if r != culprit)


class _Replicas:
    """(job, cohort key, rank) -> (job, run, DP replica), looked up in the cohort registry; None when the
    cohort is no longer held or the rank publishes no replica."""

    __slots__ = ("cohorts",)

    def __init__(self, cohorts: CohortRegistry) -> None:
        self.cohorts = cohorts

    def get(self, k: tuple[str, str, int]) -> _GroupKey | None:
        c = self.cohorts.find(k[0], k[1])
        info = c.ranks.get(k[2]) if c is not None else None
        if info is None or info.dp_rank < 0:
            return None
        return (k[0], s.cohort_run(k[1]), info.dp_rank)

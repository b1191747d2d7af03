"""One rank's judgement of one stage at a window's close, and the interface of a rule.

A ``Rule`` (each in its own module of ``rules/``, run in the order of ``rules.RULES``) looks at the judgement and
either decides (returns True: it emitted a verdict, refreshed or held an alert, or stayed quiet on purpose, and the
judgement ends) or passes (False: the next rule judges). A rule that passes may leave the comparison the later
rules decide on in ``Judgement.cmp`` (``reference``, ``pair``, ``host_stall``).

``Judgement`` is what the rules share: the rank's evidence (``mine``, its sequential and intermittent evidence),
its rank-stage state (``state.py``: streak, active alert, uncertain rate limit), and the ways a rule acts on them:
``emit`` builds every ``Verdict`` (its reason a constant of ``model.py`` named after the rule), ``alert`` opens or
refreshes an alert, ``unusable`` holds an alert or says ``uncertain`` (rate-limited), ``recover`` ends an alert.
"""

from __future__ import annotations

import math
from typing import Protocol

import otel_straggler_schema as s
from collector_processor.processor.straggler import collective, hints, intermittent, sequential
from collector_processor.processor.straggler.attribution import attribute, unexplained_host_excess
from collector_processor.processor.straggler.cohort import Cohort, RankInfo
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.evidence import DEVICE, HOST
from collector_processor.processor.straggler.impact import impact
from collector_processor.processor.straggler.intermittent import IntResult
from collector_processor.processor.straggler.model import (
    INTERMITTENT_EXCESS,
    RECOVERY_EVIDENCE_INSUFFICIENT,
    WITHIN_TOLERANCE,
    Verdict,
)
from collector_processor.processor.straggler.state import RankStageState, StateKey, StateStore
from collector_processor.processor.straggler.statistics import (
    median,
    reference_of,
    relative_deviation,
    within_relative,
)
from collector_processor.processor.straggler.window import KIND_STEP
from collector_processor.processor.straggler.window_evidence import (
    Comparison,
    StageEvidence,
    WindowEvidence,
)

_CONTENTION_SHARE = 0.25  # host_contention: the share of the rank's peers that spike on the host too
_CONTENTION_MIN_PEERS = 2  # and at least this many
_SPIKE = 1.5  # a host sample this many times its rank's median (and the host floor above it) is a spike
_PAR_SE = 2.0  # hysteresis: the recovery margin is at least this many standard errors of a window median


class Rule(Protocol):
    """One detection rule (a module of ``rules/``): its ``name`` (``docs/detector.md``) and ``judge``."""

    name: str

    def judge(self, j: Judgement) -> bool:
        """True when the rule decided the judgement (nothing after it runs)."""
        ...


def _spikes(samples: list[float], floor_ms: float) -> bool:
    """Some sample is a spike: ``_SPIKE`` x the samples' median and ``floor_ms`` above it."""
    if len(samples) < 2:
        return False
    m = median(samples)
    return any(x > _SPIKE * m and x - m >= floor_ms for x in samples)


def state_key(cohort: Cohort, rank: int, stage: str) -> StateKey:
    """The key of a rank-stage's state (``state.py``)."""
    return (cohort.job, cohort.key, rank, stage)


class Judgement:
    """One rank's judgement of one stage; ``kind`` and ``value``: the rank's statistic (device time, else host
    time: never mixed), ``cmp`` the comparison once ``reference`` made it."""

    __slots__ = ("c", "cfg", "cmp", "ev", "intm", "key", "kind", "mine", "rank", "se", "seq", "st", "states",
                 "value")
    cmp: Comparison  # set by ``reference`` before any later rule reads it

    def __init__(self, cfg: Config, states: StateStore, counters: dict[str, int], ev: WindowEvidence,
                 se: StageEvidence, rank: int, st: RankStageState) -> None:
        self.cfg = cfg
        self.states = states
        self.c = counters
        self.ev = ev
        self.se = se
        self.rank = rank
        self.key = state_key(ev.cohort, rank, se.name)
        self.st = st
        mine = self.mine = se.per.get(rank)
        self.seq = se.seq.get(rank)
        self.intm = se.intm.get(rank)
        if mine is not None and mine.dev is not None:
            self.kind, self.value = DEVICE, mine.dev
        else:
            self.kind, self.value = HOST, mine.host if mine is not None else None

    # --- comparisons ------------------------------------------------------------------------------------
    def compare(self, kind: str, value: float) -> Comparison:
        """``reference``: the rank's value against its reference peer among the comparable peers with a sample of
        the same kind (``ref_ms`` None when they are fewer than ``min_cohort_size`` with the rank), with the
        deviation, the gap and the tolerance of that kind."""
        cfg = self.cfg
        se = self.se
        r = self.rank
        q = cfg.fastest_quantile
        tok = self.ev.rank_tokens.get(r)
        peers: list[int] | None = None
        if se.uniform or tok is None:
            # every peer's work is comparable: O(1) per rank against pre-sorted values
            view = se.views.of(kind)
            size = 1 + view.peers(r)
            ref = view.reference(r, cfg.reference, q) if size >= cfg.min_cohort_size else None
        else:
            # unequal work in the cohort: the reference set is the rank's comparable class, O(n) per rank
            rank_tokens = self.ev.rank_tokens
            peers = [p for p in se.per if p != r and
                     (p not in rank_tokens or within_relative(tok, rank_tokens[p], cfg.workload_tolerance))]
            peer_vals: dict[int, float] = {}
            for p in peers:
                v = se.per[p].value(kind)
                if v is not None:
                    peer_vals[p] = v
            size = 1 + len(peer_vals)
            ref = reference_of(peer_vals, cfg.reference, q) if size >= cfg.min_cohort_size else None
        if ref is None:
            return Comparison(kind, value, size=size, peers=peers)
        ref_rank, ref_ms = ref
        dev = relative_deviation(value, ref_ms)
        if dev is None:
            dev = math.inf if value > 0 else 0.0
        tol = se.tols.of(kind)
        return Comparison(kind, value, ref_rank, ref_ms, dev, size, value - ref_ms, tol, peers=peers)

    def counts_against(self, cmp: Comparison) -> bool:
        """The window would count against the rank: slow, or ``sequential_excess`` firing."""
        seq = self.seq
        return cmp.slow or (seq is not None and seq.fires and self.sequential_fires())

    def sequential_fires(self) -> bool:
        """``sequential_excess`` fires and the gap at the lookback's median excess clears the device floor."""
        seq = self.seq
        if seq is None or not seq.fires or seq.value_ms is None or seq.reference_ms is None:
            return False
        return seq.value_ms - seq.reference_ms >= self.ev.floor(DEVICE, seq.reference_ms)

    def intermittent_comparison(self, im: IntResult, cmp: Comparison) -> Comparison:
        """The intermittent evidence as a comparison: the peers' mean per-step median plus the cost per step."""
        ref = im.reference_ms
        return Comparison(DEVICE, ref + im.cost_ms, None, ref, relative_deviation(ref + im.cost_ms, ref), cmp.size,
                          im.cost_ms, self.cfg.sequential_margin, peers=cmp.peers)

    def excess(self, kind: str, peers: list[int] | None) -> tuple[float, float] | None:
        """(the rank's window statistic of ``kind`` minus the comparable peers' median of it, that median);
        None without a value or a peer with one. ``peers`` None: every other rank (pre-sorted views)."""
        mine = self.mine
        assert mine is not None
        value = mine.value(kind)
        if value is None:
            return None
        if peers is None:
            view = self.se.views.of(kind)
            ref = view.reference(self.rank, "median")
        else:
            per = self.se.per
            vals = {p: v for p in peers if (v := per[p].value(kind)) is not None}
            ref = reference_of(vals, "median")
        if ref is None:
            return None
        return value - ref[1], ref[1]

    def host_unexplained(self, peers: list[int] | None) -> bool:
        """The rank's host excess that its device excess does not explain is evidence of its own
        (``attribution.unexplained_host_excess``)."""
        host = self.excess(HOST, peers)
        if host is None:
            return False
        dev = self.excess(DEVICE, peers)
        return unexplained_host_excess(device_excess_ms=dev[0] if dev is not None else None,
                                       host_excess_ms=host[0], host_reference_ms=host[1],
                                       host_tolerance=self.se.tols.host, host_floor_ms=self.cfg.absolute_floor_ms)

    def at_par(self, cmp: Comparison) -> bool:
        """The window is at par (``hysteresis``): the rank within the recovery margin of the comparable peers'
        median and, with sequential evidence, its mean per-step excess within half the sequential margin. The
        margin is ``recovery_margin``, or where the measured noise is larger two standard errors of a window
        median (the noise-raised tolerance is ``noise_z`` of them), never more than the base ``tolerance``:
        a noisy rank at par can show it, a rank beyond tolerance never does."""
        cfg = self.cfg
        seq = self.seq
        if cmp.measurement == DEVICE and seq is not None and seq.window_excess > cfg.sequential_margin / 2:
            return False
        x = self.excess(cmp.measurement or DEVICE, cmp.peers)
        if x is None or x[1] <= 0:
            return cmp.deviation is not None and cmp.deviation <= cfg.tolerance
        noise = _PAR_SE * cmp.tolerance / cfg.noise_z if cfg.noise_z > 0 else 0.0
        return x[0] <= min(cfg.tolerance, max(cfg.recovery_margin, noise)) * x[1]

    def shared_host_spikes(self, cmp: Comparison, episodes: bool = False) -> bool:
        """Every comparable peer runs on the rank's host, and at least a quarter of them (and 2) spike on the host
        in the window (``host_contention``) or, with ``episodes``, have spike episodes of their own in the
        stage's intermittent lookback (``intermittent_excess``: a machine deschedules all its ranks in turn)."""
        ranks = self.ev.cohort.ranks
        info = ranks.get(self.rank)
        if info is None or not info.host:
            return False
        per = self.se.per
        peers = cmp.peers if cmp.peers is not None else self.se.others(self.rank)
        with_host = [p for p in peers if p in ranks and per[p].host is not None]
        if {ranks[p].host for p in with_host} != {info.host}:
            return False
        # shared: the machine deschedules the peers too (steps far above their own median), not this rank alone
        floor = self.cfg.absolute_floor_ms
        intm = self.se.intm
        spiking = sum(1 for p in with_host if _spikes(per[p].host_samples, floor)
                      or (episodes and (im := intm.get(p)) is not None and im.episodes >= _CONTENTION_MIN_PEERS))
        return spiking >= max(_CONTENTION_MIN_PEERS, _CONTENTION_SHARE * len(with_host))

    def attribution(self, cmp: Comparison) -> str:
        """GPU or host (``attribution.py``) of the comparison that convicts, one rule for every rule that
        convicts: on host time (``host_stall``, or a rank without device samples) ``host_only_stall``; on device
        time, by the host excess its device excess does not explain, both against the comparable peers'
        median of the same kind (in a data-loader stage: the host's)."""
        group = self.se.group
        if cmp.measurement != DEVICE or cmp.host_stall:
            return attribute(convicted_on=HOST, group=group, device_excess_ms=None, host_excess_ms=None,
                             host_reference_ms=None, host_tolerance=0.0, host_floor_ms=0.0)
        dev = self.excess(DEVICE, cmp.peers)
        host = self.excess(HOST, cmp.peers)
        return attribute(convicted_on=DEVICE, group=group, device_excess_ms=dev[0] if dev is not None else None,
                         host_excess_ms=host[0] if host is not None else None,
                         host_reference_ms=host[1] if host is not None else None,
                         host_tolerance=self.se.tols.host, host_floor_ms=self.cfg.absolute_floor_ms)

    # --- evidence left for others -------------------------------------------------------------------------
    def record_deviation(self, cmp: Comparison) -> None:
        dev = cmp.deviation
        out = self.ev.out
        prev = out.rank_deviation.get(self.rank)
        if dev is not None and math.isfinite(dev) and (prev is None or dev > prev):
            out.rank_deviation[self.rank] = dev

    def record_excess(self, cmp: Comparison) -> None:
        """The rank's excess over its comparable peers' median in this stage (``WindowOutcome.stage_excess``):
        beyond when the window is slow or the per-step excess fires, and the gap clears the floor, or when its
        intermittent evidence fires (or holds its alert), at its cost per step."""
        if cmp.measurement is None:
            return
        x = self.excess(cmp.measurement, cmp.peers)
        if x is None or x[1] <= 0:
            return
        rel = x[0] / x[1]
        beyond = (cmp.slow or self.sequential_fires()) and x[0] >= self.ev.floor(cmp.measurement, x[1])
        im = self.intm
        if (im is not None and cmp.measurement == DEVICE and im.reference_ms > 0
                and (im.fires or (im.holds and self.st.alert is not None
                                  and self.st.alert.reason == INTERMITTENT_EXCESS))):
            rel, beyond = max(rel, im.cost_ms / im.reference_ms), True  # intermittent_excess: its cost per step
        self.ev.out.stage_excess[(self.rank, self.se.name)] = (rel, beyond)

    # --- acting: alerts and verdicts ----------------------------------------------------------------------
    def alert(self, v: Verdict, new: bool = False) -> None:
        """``v`` is the rank-stage's active alert (refreshed, or ``new``: emitted as well)."""
        self.states.set_active(self.key, self.st, v)
        self.ev.out.alerts[(self.rank, self.se.name)] = v
        if new:
            self.ev.out.verdicts.append(v)

    def clear_streak(self) -> None:
        st = self.st
        st.streak = 0
        st.last_slow_index = None

    def unusable(self, reason: str, cmp: Comparison, attribution: str = s.ATTRIBUTION_UNKNOWN) -> None:
        """Unusable evidence: the streak and the sequential history restart; an active alert holds (``hold``),
        else an uncertain verdict, rate-limited (``uncertain_rate_limit``)."""
        st = self.st
        self.clear_streak()
        sequential.reset(st)
        if st.alert is not None:
            return self.hold(cmp)
        # uncertain_rate_limit: on a change of reason, else once per uncertain_every_windows
        idx = self.ev.window.index
        if reason == st.last_uncertain_reason and st.last_uncertain_index is not None \
                and idx - st.last_uncertain_index < self.cfg.uncertain_every_windows:
            self.c["uncertain_suppressed"] += 1
            return None
        st.last_uncertain_reason = reason
        st.last_uncertain_index = idx
        if cmp.measurement is None:
            cmp.measurement = DEVICE
        self.ev.out.verdicts.append(self.emit(s.VERDICT_UNCERTAIN, reason, attribution, cmp))
        return None

    def hold(self, cmp: Comparison) -> None:
        """``hold``: an unusable window keeps an active alert (its metric series fresh) and says so once."""
        st = self.st
        alert = st.alert
        assert alert is not None
        st.par_windows = 0
        self.c["recovery_withheld_windows"] += 1
        self.ev.out.alerts[(self.rank, self.se.name)] = alert
        if st.held_reported:
            return
        st.held_reported = True
        if cmp.measurement is None:
            cmp.measurement = alert.measurement
        self.ev.out.verdicts.append(self.emit(s.VERDICT_UNCERTAIN, RECOVERY_EVIDENCE_INSUFFICIENT,
                                              alert.attribution, cmp))

    def count_par(self) -> int:
        """One more window at par: the consecutive windows at par so far (``recovery_windows`` ends an alert)."""
        st = self.st
        idx = self.ev.window.index
        st.par_windows = st.par_windows + 1 if st.last_par_index == idx - 1 else 1
        st.last_par_index = idx
        return st.par_windows

    def recover(self, cmp: Comparison) -> None:
        """``recovery``: par evidence (``hysteresis``) is positive evidence (the floor never blocks it); an
        active alert ends with ``recovered``."""
        st = self.st
        self.clear_streak()
        st.held_reported = False
        st.par_windows = 0
        if st.alert is None:
            return
        sequential.reset(st)
        intermittent.reset(st)  # the episodes before recovery never convict again
        v = self.emit(s.VERDICT_RECOVERED, WITHIN_TOLERANCE, st.alert.attribution, cmp)
        self.states.set_active(self.key, st, None)
        self.ev.out.alerts[(self.rank, self.se.name)] = None
        self.ev.out.verdicts.append(v)

    def emit(self, verdict: str, reason: str, attribution: str, cmp: Comparison) -> Verdict:
        """The verdict on this rank and stage, with the comparison it reports and its cost."""
        ev = self.ev
        info = ev.cohort.ranks.get(self.rank)
        value, ref_ms, dev = cmp.value, cmp.ref_ms, cmp.deviation
        lost = max(value - ref_ms, 0.0) if (value is not None and ref_ms is not None
                                              and verdict == s.VERDICT_STRAGGLER) else 0.0
        straggler = verdict == s.VERDICT_STRAGGLER
        alert = self.st.alert  # a refresh, hold or recovery stays with the step that convicted
        first_step, first_trace = (alert.first_step, alert.first_trace_id) if alert is not None \
            else (ev.step, ev.trace_of(self.rank))
        per_hour = impact(lost, ev.world_size, ev.period_ms)
        if ev.window.kind == KIND_STEP:
            window_s = (ev.period_ms or 0.0) / 1000.0 * (ev.window.end - ev.window.start + 1)
        else:
            window_s = self.cfg.wall_window_s
        return Verdict(
            job=ev.cohort.job, cohort=ev.cohort.key, rank=self.rank, host=info.host if info else "",
            gpu=info.gpu if info else "", stage=self.se.name, group=self.se.group, verdict=verdict, reason=reason,
            deviation=dev if (dev is None or math.isfinite(dev)) else None, value_ms=value,
            reference_rank=cmp.ref_rank, reference_ms=ref_ms,
            measurement=cmp.measurement or DEVICE, window_start=ev.window.start, window_end=ev.window.end,
            step=ev.step, attribution=attribution, step_time_lost_ms=lost,
            gpu_seconds_per_hour=per_hour, cohort_size=cmp.size,
            collective_evidence=collective.wait_evidence(ev, self.rank) if straggler else "",
            trace_id=ev.trace_of(self.rank), emitted_unix_ns=ev.now_ns, first_step=first_step,
            first_trace_id=first_trace, window_gpu_seconds=per_hour / 3600.0 * window_s,
            hint=self._hint(info, cmp.peers) if straggler and info is not None and info.gpu_hints else "",
            **self._intermittent_evidence(reason),
        )

    def _intermittent_evidence(self, reason: str) -> dict[str, object]:
        """An ``intermittent_excess`` verdict's period and episodes (``Verdict.period_steps``, ``episodes``)."""
        im = self.intm
        if reason != INTERMITTENT_EXCESS or im is None:
            return {}
        return {"period_steps": im.period_steps, "episodes": im.episodes}

    def _hint(self, info: RankInfo, peers: list[int] | None) -> str:
        """``hints.describe``: the rank's NVML sample against its comparable peers' (evidence only)."""
        ranks = self.ev.cohort.ranks
        others = self.se.others(self.rank) if peers is None else peers
        return hints.describe(info.gpu_hints, (ranks[p].gpu_hints for p in others if p in ranks))

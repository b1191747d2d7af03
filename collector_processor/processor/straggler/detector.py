"""Judgement of one closed window of one cohort: evidence in, verdicts out.

A verdict can be followed in this file from the window's samples to the event:

* ``Detector.judge`` gathers the window's evidence (``WindowEvidence``): which ranks are past ``warmup``, each
  warm rank's statistic per stage (``RankStat``), the ranks' work, the step period and the collective times.
  Per judged stage (``judged_groups``) it pools sampled device timing (``device_pooling``), sets the tolerances
  (``noise_tolerance``) and updates each rank's sequential evidence (``sequential_excess``), all in
  ``StageEvidence``.
* ``Judgement`` judges one rank on one stage: ``Judgement.run`` applies the rules in order, each a method of
  the same name, and the first that decides ends the judgement. ``Judgement.absent`` judges a rank that sent
  nothing for the stage (``missing_rank``).
* ``Judgement._emit`` builds every ``Verdict``; its reason is a constant of ``model.py`` named after the rule.

Rules, defaults and the reasons behind them: ``docs/detector.md`` (the same names).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import otel_straggler_schema as s
from collector_processor.processor.straggler import collective, collective_signal, hints, intermittent, pair, sequential
from collector_processor.processor.straggler.attribution import attribute, unexplained_host_excess
from collector_processor.processor.straggler.cohort import Cohort, RankInfo
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.evidence import DEVICE, HOST, RankStat, Tolerances, Views
from collector_processor.processor.straggler.impact import impact, step_period_ms
from collector_processor.processor.straggler.intermittent import IntParams, IntResult
from collector_processor.processor.straggler.model import (
    BELOW_ABSOLUTE_FLOOR,
    COHORT_BELOW_MIN_SIZE,
    COLLECTIVE_WAIT,
    HOST_CONTENTION,
    INTERMITTENT_EXCESS,
    MISSING_SAMPLES,
    NON_FINITE_SAMPLE,
    PAIR_AMBIGUOUS,
    PERSISTENT_EXCESS,
    RECOVERY_EVIDENCE_INSUFFICIENT,
    SLOWER_THAN_REFERENCE,
    WITHIN_TOLERANCE,
    WORKLOAD_INCOMPARABLE,
    Verdict,
)
from collector_processor.processor.straggler.per_unit import normalise
from collector_processor.processor.straggler.sequential import SeqParams, SeqResult, excess, smoothed_sigma, spread
from collector_processor.processor.straggler.state import RankStageState, StateKey, StateStore
from collector_processor.processor.straggler.statistics import (
    median,
    noise_raised_tolerance,
    pooled_relative_sigma,
    reference_of,
    relative_deviation,
    within_relative,
)
from collector_processor.processor.straggler.window import KIND_STEP, Window
from otel_straggler_schema.stages import MP_WAIT_ENCLOSING

_CONTENTION_SHARE = 0.25  # host_contention: the share of the rank's peers that spike on the host too
_CONTENTION_MIN_PEERS = 2  # and at least this many
_SPIKE = 1.5  # a host sample this many times its rank's median (and the host floor above it) is a spike
_PAR_SE = 2.0  # hysteresis: the recovery margin is at least this many standard errors of a window median


def _spikes(samples: list[float], floor_ms: float) -> bool:
    """Some sample is a spike: ``_SPIKE`` x the samples' median and ``floor_ms`` above it."""
    if len(samples) < 2:
        return False
    m = median(samples)
    return any(x > _SPIKE * m and x - m >= floor_ms for x in samples)


# --- evidence ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class WindowOutcome:
    verdicts: list[Verdict] = field(default_factory=list)
    # (rank, stage_group, measurement) -> seconds (sum of the group's stage statistics)
    rank_group_seconds: dict[tuple[int, str, str], float] = field(default_factory=dict)
    # rank -> worst deviation over judged stages
    rank_deviation: dict[int, float] = field(default_factory=dict)
    # alerts refreshed or cleared in this window: (rank, stage) -> alert or None
    alerts: dict[tuple[int, str], Verdict | None] = field(default_factory=dict)
    # (rank, stage) -> the rank's excess over its comparable peers' median, relative, and whether it is beyond
    # the stage's tolerance and floor (evidence for culprit.py: who is slow in a stage alone)
    stage_excess: dict[tuple[int, str], tuple[float, bool]] = field(default_factory=dict)
    # (rank, stage) where the rank waited in a model-parallel collective (mp_wait): evidence for culprit.py
    # that the rank waits for a member of its group, so it is not the group's culprit
    mp_waits: set[tuple[int, str]] = field(default_factory=set)
    # (collective stage, ring) -> (ms lost per step beyond the cohort's baseline, 0 within it; the rank the
    # evidence names or None): the collective signal (collective_signal.py)
    collective_lost: dict[tuple[str, str], tuple[float, int | None]] = field(default_factory=dict)


@dataclass(slots=True)
class WindowEvidence:
    """What every judgement of one closed window shares."""

    cohort: Cohort
    window: Window
    out: WindowOutcome
    step: int | None  # the window's last observed step (None: wall-clock window)
    period_ms: float | None
    world_size: int
    collectives: dict[str, dict[int, float]]  # collective group -> rank -> ms
    rank_tokens: dict[int, float]  # warm rank -> median tokens per step
    tok_median: float | None  # the cohort's median of rank_tokens
    uniform: bool  # every warm rank's work comparable with every other's
    now_ns: int
    stats: dict[str, dict[int, RankStat]] = field(default_factory=dict)  # every stage's warm ranks
    tolerances: dict[str, Tolerances] = field(default_factory=dict)  # stage -> its tolerances, once computed
    tokens_vary: bool = False  # some warm ranks' tokens differ or vary beyond workload_tolerance (per_unit)
    traces: dict[int, bytes] = field(default_factory=dict)  # trace block -> trace id of ``step``, once computed

    def trace_of(self, rank: int) -> bytes:
        """The trace of the window's last step that holds ``rank``'s spans (its block's: ``s.trace_block``); b""
        for a wall-clock window."""
        if self.step is None:
            return b""
        block = s.trace_block(rank)
        tid = self.traces.get(block)
        if tid is None:
            tid = s.trace_id_for_step(self.cohort.job, self.step, s.cohort_run(self.cohort.key), block).to_bytes(
                16, "big")
            self.traces[block] = tid
        return tid


class StageEvidence:
    """One judged stage in the window: every warm rank's statistic, the stage's tolerances, each rank's
    sequential evidence, and the values sorted for references (built once, on first use)."""

    __slots__ = ("_views", "group", "intm", "name", "pair", "per", "per_unit", "seq", "tols", "uniform")

    def __init__(self, name: str, group: str, per: dict[int, RankStat], uniform: bool, tols: Tolerances,
                 per_unit: bool = False) -> None:
        self.name = name
        self.per_unit = per_unit  # the samples are brought to the cohort's median tokens (per_unit.py)
        self.group = group
        self.per = per
        self.uniform = uniform  # every rank's work comparable with every other's
        self.tols = tols
        self.seq: dict[int, SeqResult] = {}
        self.intm: dict[int, IntResult] = {}  # each rank's intermittent evidence (intermittent.py)
        self.pair: pair.PairWindow | None = None  # a 2-rank cohort's comparison (pair.py)
        self._views: Views | None = None

    @property
    def views(self) -> Views:
        if self._views is None:
            self._views = Views(self.per)
        return self._views

    def others(self, rank: int) -> list[int]:
        return [p for p in self.per if p != rank]


@dataclass(slots=True)
class Comparison:
    """The rank's value against its reference, as a verdict reports it; the fields after ``size`` are what
    the rules decide on. A comparison that could not be made leaves the reference (or everything) None."""

    measurement: str | None = None  # DEVICE or HOST; None: nothing usable was compared
    value: float | None = None
    ref_rank: int | None = None
    ref_ms: float | None = None
    deviation: float | None = None  # (value - reference) / reference; inf against a zero reference
    size: int = 0  # effective cohort: the rank and its comparable peers with a sample of this kind
    gap: float = 0.0  # value - reference, ms
    tolerance: float = 0.0  # the deviation beyond which the window is slow
    host_stall: bool = False  # the host comparison replaced the device one (host_stall)
    peers: list[int] | None = None  # the comparable peers (None: every other rank)
    own: bool = False  # deviation, gap and tolerance are this comparison's own (pair), not the window medians'

    @property
    def slow(self) -> bool:
        return self.deviation is not None and self.deviation > self.tolerance


# --- the window -------------------------------------------------------------------------------------------
class Detector:
    def __init__(self, config: Config, states: StateStore, counters: dict[str, int],
                 cohorts: Iterable[Cohort] = ()) -> None:
        self.cfg = config
        self.states = states
        self.c = counters
        self.cohorts = cohorts  # every cohort held (pair: the job's other roles)
        self._judged = frozenset(config.judged_groups)
        self.seq_params = SeqParams(
            margin=config.sequential_margin, cap=config.sequential_step_cap,
            threshold=config.sequential_threshold, min_steps=config.window_steps + 1,
            history=config.sequential_history_steps, run_steps=config.window_steps,
            window_z=config.sequential_window_z, rest_z=config.sequential_rest_z)
        self.int_params = IntParams(
            history=config.intermittent_history_steps, min_episodes=config.intermittent_min_episodes,
            spike_z=config.intermittent_spike_z, min_spike=config.tolerance, margin=config.sequential_margin,
            floor_ms=config.device_floor_ms, recent_steps=2 * config.window_steps)
        # intermittent_excess is not judged where a rank's spikes are a wait for its model-parallel group
        self._no_intermittent = frozenset(config.mp_wait_stages) | (
            frozenset(MP_WAIT_ENCLOSING) if config.mp_wait_stages else frozenset())

    def judge(self, cohort: Cohort, window: Window, now_ns: int) -> WindowOutcome:
        """Every judged stage's warm ranks, each by a ``Judgement``; ranks of the cohort absent from a stage
        are judged absent."""
        ev, stats = self._evidence(cohort, window, now_ns)
        for stage, per in stats.items():
            group = cohort.stages.get(stage, "other")
            if group not in self._judged or not per or stage in cohort.collective:  # judged_groups, marked
                continue
            per_unit = ev.tokens_vary and \
                normalise(per, self.cfg.workload_tolerance, self.cfg.min_cohort_size) is not None
            self._device_pooling(cohort, stage, window.index, per)
            se = StageEvidence(stage, group, per, ev.uniform or per_unit, self._noise_tolerance(per), per_unit)
            ev.tolerances[stage] = se.tols
            se.seq, se.intm = self._step_excess(ev, se)
            se.pair = self._pair(ev, se)
            for r in sorted(per):
                Judgement(self, ev, se, r, self.states.get(self.key(cohort, r, stage))).run()
            for r in cohort.ranks:  # missing_rank
                if r in per:
                    continue
                st = self.states.peek(self.key(cohort, r, stage))
                if st is not None:
                    Judgement(self, ev, se, r, st).absent()
        collective_signal.judge(self, ev, cohort.rings)
        return ev.out

    def _evidence(self, cohort: Cohort, window: Window, now_ns: int
                  ) -> tuple[WindowEvidence, dict[str, dict[int, RankStat]]]:
        """The window's shared evidence and, per stage, every warm rank's statistic (``warmup``, ``statistic``);
        also the dashboard series of the outcome."""
        cfg = self.cfg
        out = WindowOutcome()
        present = window.ranks()
        # warmup: a rank's first windows with samples are neither judged nor anyone's reference
        warm: set[int] = set()
        for r in present:
            info = cohort.ranks.get(r)
            if info is None:
                continue
            if info.windows_seen >= cfg.warmup_windows:
                warm.add(r)
            else:
                self.c["warmup_excluded"] += 1
            info.windows_seen += 1

        stats: dict[str, dict[int, RankStat]] = {}
        tokens: dict[int, list[int]] = {}
        for stage, cells in window.cells.items():
            per: dict[int, RankStat] = {}
            for r, cell in cells.items():
                if cell.tokens:
                    tokens.setdefault(r, []).extend(cell.tokens)
                if r not in warm:
                    continue
                per[r] = RankStat(median(cell.dev) if cell.dev else None, cell.dev, cell.host,
                                  dev_steps=cell.dev_steps, tokens=cell.tokens)
            stats[stage] = per
        rank_tokens = {r: median(v) for r, v in tokens.items() if r in warm}
        tok_values = list(rank_tokens.values())
        tok_median = median(tok_values) if tok_values else None
        uniform = not tok_values or within_relative(min(tok_values), max(tok_values), cfg.workload_tolerance)
        # per_unit: the ranks' tokens differ, or vary from step to step (per-rank medians can agree by chance)
        tokens_vary = bool(tok_values) and cfg.per_unit and (not uniform or any(
            not within_relative(min(v), max(v), cfg.workload_tolerance) for r, v in tokens.items() if r in warm))

        # step period from rank-step spans, collective time per group, dashboard series
        rank_step = stats.get(s.SPAN_RANK_STEP, {})
        period = step_period_ms(
            [st.host for st in rank_step.values() if st.host is not None],
            window.end_ns - window.start_ns,
            (window.max_step - window.start + 1) if window.max_step is not None else 1,
        )
        collectives: dict[str, dict[int, float]] = {}
        for stage, per in stats.items():
            group = cohort.stages.get(stage, "other")
            all_dev = all(st.dev is not None for st in per.values())
            for r, st in per.items():
                v = st.dev if st.dev is not None else st.host
                if v is None:
                    continue
                meas = DEVICE if st.dev is not None else HOST
                key = (r, group, meas)
                out.rank_group_seconds[key] = out.rank_group_seconds.get(key, 0.0) + v / 1000.0
                if group in s.COLLECTIVE_GROUPS:
                    cv = st.dev if all_dev else st.host
                    if cv is not None:
                        g = collectives.setdefault(group, {})
                        g[r] = g.get(r, 0.0) + cv
        world_size = max((cohort.ranks[r].world_size for r in present if r in cohort.ranks), default=0)
        step = window.max_step if window.kind == KIND_STEP else None
        ev = WindowEvidence(cohort, window, out, step, period, world_size or len(cohort.ranks),
                            collectives, rank_tokens, tok_median, uniform, now_ns, stats, tokens_vary=tokens_vary)
        return ev, stats

    @staticmethod
    def key(cohort: Cohort, rank: int, stage: str) -> StateKey:
        return (cohort.job, cohort.key, rank, stage)

    def _device_pooling(self, cohort: Cohort, stage: str, idx: int, per: dict[int, RankStat]) -> None:
        """Median of each rank's latest ``window_steps`` device samples (this window first, then recent
        windows): sampled device timing leaves 1-2 samples per window, too few for a robust median."""
        k = self.cfg.window_steps
        oldest = idx - self.cfg.device_history_windows
        for r, rs in per.items():
            if not rs.dev_samples:
                continue
            st = self.states.get(self.key(cohort, r, stage))
            hist = st.dev_recent
            if hist is None:
                hist = st.dev_recent = deque(maxlen=k)
            while hist and hist[0][0] < oldest:
                hist.popleft()
            hist.extend((idx, v) for v in rs.dev_samples)
            if len(rs.dev_samples) < k and len(hist) > len(rs.dev_samples):
                rs.dev_used = [v for _, v in hist]
                rs.dev = median(rs.dev_used)
                rs.fresh = len(rs.dev_samples)

    def _noise_tolerance(self, per: dict[int, RankStat], need: int | None = None) -> Tolerances:
        """Device and host tolerance of this stage in this window: ``tolerance``, raised to ``noise_z`` standard
        errors of a rank's window median when the cohort's step-to-step noise is larger. The per-step sigma is
        estimated robustly within each rank (``pooled_relative_sigma``: spikes and a slow rank do not move
        it); the standard error of a median of k samples is 1.2533 sigma / sqrt(k). A +5 % fault is found
        wherever the measured noise allows it; a noisier timing never convicts on noise
        (docs/detection-defaults.md). ``need``: the ranks the sigma is measured on (``min_cohort_size``)."""
        cfg = self.cfg
        if cfg.noise_z <= 0:
            return Tolerances(cfg.tolerance, lambda: cfg.tolerance)
        need = cfg.min_cohort_size if need is None else need

        def raised(sigma: float | None) -> float:
            return noise_raised_tolerance(cfg.tolerance, cfg.noise_z, sigma, cfg.window_steps)

        return Tolerances(raised(pooled_relative_sigma((st.dev_used or st.dev_samples for st in per.values()), need)),
                          lambda: raised(pooled_relative_sigma((st.host_samples for st in per.values()), need)))

    def _step_excess(self, ev: WindowEvidence, se: StageEvidence
                     ) -> tuple[dict[int, SeqResult], dict[int, IntResult]]:
        """Every comparable rank's per-step device excess over its peers' per-step median added to its histories:
        ``sequential_excess`` (``sequential.py``) and ``intermittent_excess`` (``intermittent.py``). With unequal
        work in the cohort only ranks whose tokens are within the workload tolerance of the cohort's median take
        part (the others are uncertain by ``workload`` and nobody's reference)."""
        cfg = self.cfg
        window = ev.window
        intm_on = cfg.intermittent and se.name not in self._no_intermittent
        if not (cfg.sequential or intm_on) or window.kind != KIND_STEP:
            return {}, {}
        per = se.per
        dev: list[tuple[int, list[int], list[float]]] = []
        for r, rs in per.items():
            if not se.uniform and ev.tok_median is not None:
                tok = ev.rank_tokens.get(r)
                if tok is not None and not within_relative(tok, ev.tok_median, cfg.workload_tolerance):
                    continue
            if rs.dev_samples and rs.dev_steps:
                dev.append((r, rs.dev_steps, rs.dev_samples))
        if len(dev) < cfg.min_cohort_size:
            return {}, {}
        # a stage under device_min_stage_ms is launch-bound and keeps the host floor (absolute_floor): only a
        # slowdown of 5 ms or more could convict there, which window_excess finds on its own
        stat = [rs.dev for rs in per.values() if rs.dev is not None]
        if not stat or median(stat) < cfg.device_min_stage_ms:
            return {}, {}
        items = excess(dev, cfg.min_cohort_size)
        cohort = ev.cohort
        history = cohort.seq_sigma.get(se.name)
        if history is None:
            history = cohort.seq_sigma[se.name] = deque(maxlen=cfg.sequential_sigma_windows)
        sigma = smoothed_sigma(history, spread(items.values(), cfg.min_cohort_size), cfg.sequential_sigma_floor)
        if sigma is None:
            return {}, {}
        seq: dict[int, SeqResult] = {}
        intm: dict[int, IntResult] = {}
        for r, lst in items.items():
            st = self.states.get(self.key(cohort, r, se.name))
            if cfg.sequential:
                seq[r] = sequential.update(st, window.index, lst, sigma, self.seq_params)
            if intm_on:
                res = intermittent.update(st, lst, sigma, self.int_params)
                if res is not None:
                    intm[r] = res
        intermittent.against_peers(intm, list(items))
        return seq, intm

    def _pair(self, ev: WindowEvidence, se: StageEvidence) -> pair.PairWindow | None:
        """``pair``: a 2-rank cohort's comparison of this stage (``pair.py``), its noise measured on the two."""
        cfg = self.cfg
        if not cfg.pair or len(ev.cohort.ranks) != 2:
            return None
        tols = self._noise_tolerance(se.per, need=2)
        return pair.observe(name=se.name, per=se.per, cohort=ev.cohort, index=ev.window.index,
                            comparable=ev.uniform, tolerance_of=tols.of,
                            cohorts=self.cohorts, history=cfg.pair_history_windows, min_history=cfg.pair_min_history,
                            tolerance=cfg.tolerance, noise_z=cfg.noise_z, window_steps=cfg.window_steps)

    def tolerance(self, ev: WindowEvidence, stage: str, kind: str) -> float:
        """The noise tolerance of any stage of the window, of ``kind`` (computed once)."""
        tols = ev.tolerances.get(stage)
        if tols is None:
            tols = ev.tolerances[stage] = self._noise_tolerance(ev.stats.get(stage, {}))
        return tols.of(kind)

    def floor(self, kind: str, ref_ms: float) -> float:
        """Absolute gap floor of one comparison: the host floor, or for a device comparison of a stage of
        at least ``device_min_stage_ms`` (not launch-bound, precise) the device floor."""
        cfg = self.cfg
        if kind == DEVICE and ref_ms >= cfg.device_min_stage_ms:
            return cfg.device_floor_ms
        return cfg.absolute_floor_ms


# --- one rank, one stage ----------------------------------------------------------------------------------
class Judgement:
    """One rank's judgement of one stage at a window's close. ``run`` applies the rules in order; the first
    that decides ends it. Every verdict is built by ``_emit``; the rank-stage state (``state.py``) carries the
    persistence streak, the active alert and the uncertain rate limit from window to window."""

    __slots__ = ("c", "cfg", "det", "ev", "intm", "key", "mine", "rank", "se", "seq", "st")

    def __init__(self, det: Detector, ev: WindowEvidence, se: StageEvidence, rank: int, st: RankStageState) -> None:
        self.det = det
        self.cfg = det.cfg
        self.c = det.c
        self.ev = ev
        self.se = se
        self.rank = rank
        self.key = Detector.key(ev.cohort, rank, se.name)
        self.st = st
        self.mine = se.per.get(rank)
        self.seq = se.seq.get(rank)
        self.intm = se.intm.get(rank)

    # --- the rules, in order --------------------------------------------------------------------------
    def run(self) -> None:
        """The rules in order; the first that decides ends the judgement."""
        mine = self.mine
        assert mine is not None
        c = self.c
        if mine.dev is None and mine.host is None:  # non_finite
            c["non_finite_windows"] += 1
            return self._unusable(NON_FINITE_SAMPLE, Comparison())
        if mine.dev is None and self.device_samples_missing():
            c["device_samples_missing_windows"] += 1
            return self._unusable(MISSING_SAMPLES, Comparison())
        meas = DEVICE if mine.dev is not None else HOST  # statistic: device and host are never mixed
        value = mine.dev if mine.dev is not None else mine.host
        assert value is not None
        if not self.workload():
            c["workload_incomparable_windows"] += 1
            return self._unusable(WORKLOAD_INCOMPARABLE, Comparison(meas, value))
        cmp = self.reference(meas, value)
        if cmp.ref_ms is None and self.se.pair is not None:
            cmp, ambiguous = self.pair(cmp)
            if ambiguous:
                c["pair_ambiguous_windows"] += 1
                self._record_deviation(cmp)
                return self._unusable(PAIR_AMBIGUOUS, cmp)
        if cmp.ref_ms is None:  # min_cohort
            c["below_min_cohort_windows"] += 1
            return self._unusable(COHORT_BELOW_MIN_SIZE, Comparison(meas, value, size=cmp.size))
        cmp = self.host_stall(cmp)
        if self.absolute_floor(cmp):
            c["below_floor_windows"] += 1
            return self._unusable(BELOW_ABSOLUTE_FLOOR, cmp)
        if self.collective_wait(cmp):
            c["collective_wait_windows"] += 1
            return self._unusable(COLLECTIVE_WAIT, cmp)
        if self.mp_wait(cmp):
            c["mp_wait_windows"] += 1
            self.ev.out.mp_waits.add((self.rank, self.se.name))
            return self._unusable(COLLECTIVE_WAIT, cmp)
        if self.host_contention(cmp):
            c["host_contention_windows"] += 1
            return self._unusable(HOST_CONTENTION, cmp, s.ATTRIBUTION_HOST)
        self._record_deviation(cmp)
        self._record_excess(cmp)
        alert = self.st.alert
        if alert is not None and alert.reason == INTERMITTENT_EXCESS:
            return self.intermittent_hold(cmp)
        if self.intermittent_excess(cmp):
            return None
        if cmp.slow:
            return self.window_excess(cmp)
        seq = self.seq
        if self.st.alert is None and (seq is None or not seq.fires):  # neither of the next two can decide
            return self.recovery(cmp)
        if self.sequential_excess(cmp) or self.hysteresis(cmp):
            return None
        return self.recovery(cmp)

    def device_samples_missing(self) -> bool:
        """``device_samples_missing``: the rank, without a device sample of the stage in this window, sent some in
        the last ``device_history_windows`` windows: it times the stage on the device, and its host time is
        launch time, never compared as if it were the stage's duration. A rank that stopped timing it on the
        device longer ago is judged on host time against its peers' host times (its device history is
        dropped)."""
        recent = self.st.dev_recent
        if not recent:
            return False
        if recent[-1][0] >= self.ev.window.index - self.cfg.device_history_windows:
            return True
        self.st.dev_recent = None
        return False

    def workload(self) -> bool:
        """``workload``: the rank's tokens per step are within ``workload_tolerance`` of the cohort's median
        (ranks without tokens are comparable); in a stage judged per unit (``per_unit.py``) every rank is."""
        if self.se.uniform:  # per unit, or every warm rank's tokens within the tolerance of each other's, so of
            return True      # their median too: |a - b| / max(a, b) <= (hi - lo) / hi for a, b in [lo, hi]
        ev = self.ev
        tok = ev.rank_tokens.get(self.rank)
        return tok is None or ev.tok_median is None or len(ev.rank_tokens) <= 1 \
            or within_relative(tok, ev.tok_median, self.cfg.workload_tolerance)

    def reference(self, kind: str, value: float) -> Comparison:
        """``reference`` and ``min_cohort``: the rank's value against its reference peer among the comparable
        peers with a sample of the same kind (``ref_ms`` None when they are fewer than ``min_cohort_size``
        with the rank), with the deviation, the gap and the tolerance of that kind."""
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

    def pair(self, cmp: Comparison) -> tuple[Comparison, bool]:
        """``pair``: in a 2-rank cohort (``pair.py``) the rank against the other one (the deviation and tolerance
        of ``pair.py``, the gap at that deviation); True when this rank is the slower one and no evidence names
        it."""
        pw = self.se.pair
        assert pw is not None and cmp.value is not None
        if pw.kind != cmp.measurement or self.rank not in pw.values:
            return cmp, False
        peer = pw.other(self.rank)
        ref = pw.values[peer]
        dev = pw.deviation[self.rank]  # per step where both were timed on the same steps (pair.py)
        out = Comparison(cmp.measurement, cmp.value, peer, ref, dev, 2, ref * dev, pw.tolerance, own=True)
        return out, pw.slow == self.rank and not pw.named

    def collective_wait(self, cmp: Comparison) -> bool:
        """``collective_wait`` (``collective.py``): a window that would count against the rank (slow, or
        ``sequential_excess`` firing) whose excess is the wait for its reference's excess in another stage."""
        seq = self.seq
        counts = cmp.slow or (seq is not None and seq.fires and self._sequential_fires())
        if not counts or not self.cfg.collective_wait:
            return False
        return collective.waits(self.det, self.ev, self.se, self.rank, cmp)

    def mp_wait(self, cmp: Comparison) -> bool:
        """``mp_wait``: a window that would count against the rank in a stage whose time is an all-reduce over
        its model-parallel group (``mp_wait_stages``), or in a timer enclosing them whose excess their excess
        explains (by ``collective_wait_fraction``): the rank waits there for a member of its group. It is
        never the rank's conviction (nor its node's, nor a group's); ``culprit.py`` reads it as the rank's
        evidence of being a victim."""
        seq = self.seq
        counts = cmp.slow or (seq is not None and seq.fires and self._sequential_fires())
        waits = self.cfg.mp_wait_stages
        if not counts or not waits:
            return False
        name = self.se.name
        if name in waits:
            return True
        inner = MP_WAIT_ENCLOSING.get(name)
        if inner is None or cmp.measurement is None or cmp.gap <= 0.0:
            return False
        explained = 0.0
        for stage in inner:
            if stage not in waits:
                continue
            per = self.ev.stats.get(stage)
            mine = per.get(self.rank) if per else None
            v = mine.value(cmp.measurement) if mine is not None else None
            if v is None or per is None:
                continue
            peers = [x for p, st in per.items() if p != self.rank and (x := st.value(cmp.measurement)) is not None]
            if peers:
                explained += v - median(peers)
        return explained >= self.cfg.collective_wait_fraction * cmp.gap

    def host_contention(self, cmp: Comparison) -> bool:
        """``host_contention``: a slow window on host time, or on device time the host starved (attributed
        ``host_only_stall``), whose comparable peers all run on the rank's host while at least a quarter of them
        (and 2) spike on the host in the window too (a step 1.5 x their own median and ``absolute_floor_ms``
        above it): the ranks share the machine's starved CPUs, so the excess is attributed to the host and
        pages nobody. One rank slow on a machine whose other ranks run steadily is still judged."""
        if not self.cfg.host_contention or not cmp.slow:
            return False
        if cmp.measurement != HOST and self._attribution(cmp) != s.ATTRIBUTION_HOST:
            return False  # a GPU slow on its own (the device excess explains the host's)
        return self._shared_host_spikes(cmp)

    def _shared_host_spikes(self, cmp: Comparison, episodes: bool = False) -> bool:
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

    def host_stall(self, cmp: Comparison) -> Comparison:
        """``host_stall``: in a ``host_stall_groups`` stage whose device comparison does not fire (flat or
        sub-floor), the rank's host time beyond tolerance and the host floor against the peers' host times, and
        not explained by its device excess (``attribution.py``), is the comparison instead: a host stall (CPU
        contention, a stalled launch, waiting for data) with the GPU flat. While an alert convicted on host
        time is active, the host comparison stays the evidence (it holds or recovers on host time)."""
        mine = self.mine
        assert mine is not None
        if cmp.measurement != DEVICE or self.se.group not in self.cfg.host_stall_groups or mine.host is None:
            return cmp
        assert cmp.ref_ms is not None
        if cmp.slow and cmp.gap >= self.det.floor(DEVICE, cmp.ref_ms):
            return cmp
        alert = self.st.alert
        on_host = alert is not None and alert.measurement == HOST
        if not on_host:
            # no peer's host time is far enough below the rank's to clear the floor: nothing to compare (the
            # common case, decided without the host tolerance)
            lowest = self.se.views.host.lowest(self.rank)
            if lowest is None or mine.host - lowest < self.cfg.absolute_floor_ms:
                return cmp
        host = self.reference(HOST, mine.host)
        if host.ref_ms is None or host.ref_ms <= 0:
            return cmp
        if not on_host and not (host.slow and host.gap >= self.cfg.absolute_floor_ms
                                and self._host_unexplained(cmp.peers)):
            return cmp
        host.host_stall = True
        host.peers = cmp.peers
        return host

    def absolute_floor(self, cmp: Comparison) -> bool:
        """``absolute_floor``: True when the window looks slow but its gap is under the floor of its kind (no
        evidence either way: a 1 ms stage 50 % slower costs 0.5 ms, and host jitter alone gives such ratios)."""
        assert cmp.ref_ms is not None and cmp.measurement is not None
        return cmp.slow and cmp.gap < self.det.floor(cmp.measurement, cmp.ref_ms)

    def window_excess(self, cmp: Comparison) -> None:
        """``window_excess`` and ``persistence``: a slow window adds to the streak (counted in samples: the
        first slow window counts ``window_steps``, each following one its fresh samples, so pooled sparse
        device samples shared by consecutive windows are not counted twice); the verdict fires at
        ``persistence_windows`` x ``window_steps``, or when ``sequential_excess`` fires in this window. An
        active alert is refreshed."""
        cfg = self.cfg
        st = self.st
        mine = self.mine
        assert mine is not None
        k = cfg.window_steps
        idx = self.ev.window.index
        # a window missing one device sample (auto sampling's host-only probe step) still counts as full
        fresh = mine.fresh if (mine.fresh and cmp.measurement == DEVICE and mine.fresh < k - 1) else k
        st.streak = st.streak + fresh if st.last_slow_index == idx - 1 else k
        st.last_slow_index = idx
        st.held_reported = False
        st.par_windows = 0
        if st.alert is not None:
            return self._alert(self._emit(s.VERDICT_STRAGGLER, SLOWER_THAN_REFERENCE, st.alert.attribution, cmp))
        need = cfg.persistence_windows * k
        if st.streak < need and cmp.measurement == DEVICE and not cmp.host_stall and self._sequential_fires():
            st.streak = need
        if st.streak >= need:
            attribution = self._attribution(cmp)
            sequential.reset(st)
            self._alert(self._emit(s.VERDICT_STRAGGLER, SLOWER_THAN_REFERENCE, attribution, cmp), new=True)
        return None

    def sequential_excess(self, cmp: Comparison) -> bool:
        """``sequential_excess``: a window not slow on its own convicts when the per-step excess over the peers'
        per-step medians, accumulated over this and the previous window, fires (``sequential.py``). The
        verdict reports the lookback's value at its median excess against the peers' mean per-step median."""
        st = self.st
        if st.alert is not None or cmp.measurement != DEVICE or cmp.host_stall or not self._sequential_fires():
            return False
        seq = self.seq
        assert seq is not None and seq.value_ms is not None and seq.reference_ms is not None
        value, ref = seq.value_ms, seq.reference_ms
        dev = relative_deviation(value, ref)
        found = Comparison(DEVICE, value, None, ref, dev, cmp.size, value - ref, self.cfg.sequential_margin,
                           peers=cmp.peers)
        v = self._emit(s.VERDICT_STRAGGLER, PERSISTENT_EXCESS, self._attribution(found), found)
        st.streak = 0
        st.last_slow_index = None
        sequential.reset(st)
        self._alert(v, new=True)
        return True

    def intermittent_excess(self, cmp: Comparison) -> bool:
        """``intermittent_excess`` (``intermittent.py``): without an alert, the rank's recurring spikes over its
        peers' per-step median cost the job per step at least what the smallest steady straggler does, over the
        lookback and recently. The verdict reports the cost per step against the peers' mean per-step median,
        the period and the episodes."""
        im = self.intm
        if self.st.alert is not None or im is None or not im.fires or cmp.measurement != DEVICE or cmp.host_stall:
            return False
        found = self._intermittent_comparison(im, cmp)
        if self.cfg.host_contention and self._shared_host_spikes(found, episodes=True):
            self.c["host_contention_windows"] += 1  # the machine's other ranks spike on the host too
            self._unusable(HOST_CONTENTION, cmp, s.ATTRIBUTION_HOST)
            return True
        attribution = self._attribution(found)
        st = self.st
        st.streak = 0
        st.last_slow_index = None
        st.par_windows = 0
        sequential.reset(st)
        self.c["intermittent_verdicts"] += 1
        self._alert(self._emit(s.VERDICT_STRAGGLER, INTERMITTENT_EXCESS, attribution, found), new=True)
        return True

    def intermittent_hold(self, cmp: Comparison) -> None:
        """The hysteresis of an ``intermittent_excess`` alert: it holds (refreshed with the cost) while the recent
        cost stays at half the threshold or more; ``recovery_windows`` consecutive windows below that end it."""
        st = self.st
        alert = st.alert
        assert alert is not None
        im = self.intm
        if im is not None and im.holds:
            st.par_windows = 0
            self._alert(self._emit(s.VERDICT_STRAGGLER, INTERMITTENT_EXCESS, alert.attribution,
                                   self._intermittent_comparison(im, cmp)))
            return None
        idx = self.ev.window.index
        st.par_windows = st.par_windows + 1 if st.last_par_index == idx - 1 else 1
        st.last_par_index = idx
        if st.par_windows >= self.cfg.recovery_windows:
            return self.recovery(cmp)
        self._alert(alert)
        return None

    def hysteresis(self, cmp: Comparison) -> bool:
        """``hysteresis``: an active alert holds (refreshed, no verdict) until ``recovery_windows`` consecutive
        windows are at par (``_par``): within ``recovery_margin`` of the comparable peers' median (two standard
        errors of a window median where the measured noise is larger, at most the base ``tolerance``, never
        the noise-raised one) and, with sequential evidence, a mean per-step excess within half the sequential
        margin. A rank just above the margin, or one whose excess is still rising, does not recover on one
        noisy window and get convicted again."""
        st = self.st
        if st.alert is None:
            return False
        if self._par(cmp):
            idx = self.ev.window.index
            st.par_windows = st.par_windows + 1 if st.last_par_index == idx - 1 else 1
            st.last_par_index = idx
            if st.par_windows >= self.cfg.recovery_windows:
                return False
        else:
            st.par_windows = 0
        st.streak = 0
        st.last_slow_index = None
        self._alert(self._emit(s.VERDICT_STRAGGLER, SLOWER_THAN_REFERENCE, st.alert.attribution, cmp))
        return True

    def recovery(self, cmp: Comparison) -> None:
        """``recovery``: par evidence (``hysteresis``) is positive evidence (the floor never blocks it); an
        active alert ends with ``recovered``."""
        st = self.st
        st.streak = 0
        st.last_slow_index = None
        st.held_reported = False
        st.par_windows = 0
        if st.alert is None:
            return
        sequential.reset(st)
        intermittent.reset(st)  # the episodes before recovery never convict again
        v = self._emit(s.VERDICT_RECOVERED, WITHIN_TOLERANCE, st.alert.attribution, cmp)
        self.det.states.set_active(self.key, st, None)
        self.ev.out.alerts[(self.rank, self.se.name)] = None
        self.ev.out.verdicts.append(v)

    def absent(self) -> None:
        """``missing_rank``: the rank sent no sample of this stage in a window its cohort filled. Its streak and
        sequential history restart; an active alert holds (``hold``)."""
        st = self.st
        self.c["missing_windows"] += 1
        st.streak = 0
        st.last_slow_index = None
        st.par_windows = 0
        sequential.reset(st)
        if st.alert is not None:
            self._hold(Comparison())

    # --- unusable evidence: hold an alert, else a rate-limited uncertain verdict --------------------------
    def _unusable(self, reason: str, cmp: Comparison, attribution: str = s.ATTRIBUTION_UNKNOWN) -> None:
        st = self.st
        st.streak = 0
        st.last_slow_index = None
        sequential.reset(st)
        if st.alert is not None:
            return self._hold(cmp)
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
        self.ev.out.verdicts.append(self._emit(s.VERDICT_UNCERTAIN, reason, attribution, cmp))
        return None

    def _hold(self, cmp: Comparison) -> None:
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
        self.ev.out.verdicts.append(self._emit(s.VERDICT_UNCERTAIN, RECOVERY_EVIDENCE_INSUFFICIENT,
                                               alert.attribution, cmp))

    # --- helpers --------------------------------------------------------------------------------------
    def _sequential_fires(self) -> bool:
        """``sequential_excess`` fires and the gap at the lookback's median excess clears the device floor."""
        seq = self.seq
        if seq is None or not seq.fires or seq.value_ms is None or seq.reference_ms is None:
            return False
        return seq.value_ms - seq.reference_ms >= self.det.floor(DEVICE, seq.reference_ms)

    def _intermittent_comparison(self, im: IntResult, cmp: Comparison) -> Comparison:
        """The intermittent evidence as a comparison: the peers' mean per-step median plus the cost per step."""
        ref = im.reference_ms
        return Comparison(DEVICE, ref + im.cost_ms, None, ref, relative_deviation(ref + im.cost_ms, ref), cmp.size,
                          im.cost_ms, self.cfg.sequential_margin, peers=cmp.peers)

    def _record_deviation(self, cmp: Comparison) -> None:
        dev = cmp.deviation
        out = self.ev.out
        prev = out.rank_deviation.get(self.rank)
        if dev is not None and math.isfinite(dev) and (prev is None or dev > prev):
            out.rank_deviation[self.rank] = dev

    def _record_excess(self, cmp: Comparison) -> None:
        """The rank's excess over its comparable peers' median in this stage (``WindowOutcome.stage_excess``):
        beyond when the window is slow or the per-step excess fires, and the gap clears the floor, or when its
        intermittent evidence fires (or holds its alert), at its cost per step."""
        if cmp.measurement is None:
            return
        x = self._excess(cmp.measurement, cmp.peers)
        if x is None or x[1] <= 0:
            return
        rel = x[0] / x[1]
        beyond = (cmp.slow or self._sequential_fires()) and x[0] >= self.det.floor(cmp.measurement, x[1])
        im = self.intm
        if (im is not None and cmp.measurement == DEVICE and im.reference_ms > 0
                and (im.fires or (im.holds and self.st.alert is not None
                                  and self.st.alert.reason == INTERMITTENT_EXCESS))):
            rel, beyond = max(rel, im.cost_ms / im.reference_ms), True  # intermittent_excess: its cost per step
        self.ev.out.stage_excess[(self.rank, self.se.name)] = (rel, beyond)

    def _alert(self, v: Verdict, new: bool = False) -> None:
        """``v`` is the rank-stage's active alert (refreshed, or ``new``: emitted as well)."""
        st = self.st
        self.det.states.set_active(self.key, st, v)
        self.ev.out.alerts[(self.rank, self.se.name)] = v
        if new:
            self.ev.out.verdicts.append(v)

    def _excess(self, kind: str, peers: list[int] | None) -> tuple[float, float] | None:
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

    def _host_unexplained(self, peers: list[int] | None) -> bool:
        """The rank's host excess that its device excess does not explain is evidence of its own
        (``attribution.unexplained_host_excess``)."""
        host = self._excess(HOST, peers)
        if host is None:
            return False
        dev = self._excess(DEVICE, peers)
        return unexplained_host_excess(device_excess_ms=dev[0] if dev is not None else None,
                                       host_excess_ms=host[0], host_reference_ms=host[1],
                                       host_tolerance=self.se.tols.host, host_floor_ms=self.cfg.absolute_floor_ms)

    def _par(self, cmp: Comparison) -> bool:
        """The window is at par (``hysteresis``): the rank within the recovery margin of the comparable peers'
        median and, with sequential evidence, its mean per-step excess within half the sequential margin. The
        margin is ``recovery_margin``, or where the measured noise is larger two standard errors of a window
        median (the noise-raised tolerance is ``noise_z`` of them), never more than the base ``tolerance``:
        a noisy rank at par can show it, a rank beyond tolerance never does."""
        cfg = self.cfg
        seq = self.seq
        if cmp.measurement == DEVICE and seq is not None and seq.window_excess > cfg.sequential_margin / 2:
            return False
        x = self._excess(cmp.measurement or DEVICE, cmp.peers)
        if x is None or x[1] <= 0:
            return cmp.deviation is not None and cmp.deviation <= cfg.tolerance
        noise = _PAR_SE * cmp.tolerance / cfg.noise_z if cfg.noise_z > 0 else 0.0
        return x[0] <= min(cfg.tolerance, max(cfg.recovery_margin, noise)) * x[1]

    def _attribution(self, cmp: Comparison) -> str:
        """GPU or host (``attribution.py``) of the comparison that convicts, one rule for every rule that
        convicts: on host time (``host_stall``, or a rank without device samples) ``host_only_stall``; on device
        time, by the host excess its device excess does not explain, both against the comparable peers'
        median of the same kind (in a data-loader stage: the host's)."""
        group = self.se.group
        if cmp.measurement != DEVICE or cmp.host_stall:
            return attribute(convicted_on=HOST, group=group, device_excess_ms=None, host_excess_ms=None,
                             host_reference_ms=None, host_tolerance=0.0, host_floor_ms=0.0)
        dev = self._excess(DEVICE, cmp.peers)
        host = self._excess(HOST, cmp.peers)
        return attribute(convicted_on=DEVICE, group=group, device_excess_ms=dev[0] if dev is not None else None,
                         host_excess_ms=host[0] if host is not None else None,
                         host_reference_ms=host[1] if host is not None else None,
                         host_tolerance=self.se.tols.host, host_floor_ms=self.cfg.absolute_floor_ms)

    def _emit(self, verdict: str, reason: str, attribution: str, cmp: Comparison) -> Verdict:
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
            collective_evidence=collective.wait_evidence(self.det, ev, self.rank) if straggler else "",
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

"""Rules: one closed window of one cohort -> verdicts (see ``docs/detector.md`` for each rule and default).

Per stage and rank the window statistic is the median of the rank's per-step device times; host time is
used only when the rank has no device sample in the window, and then only against peers' host times
(device and host are never mixed in one comparison).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from collector_processor.processor.straggler import sequential
from collector_processor.processor.straggler.attribution import attribute, collective_evidence
from collector_processor.processor.straggler.cohort import Cohort
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.impact import impact, step_period_ms
from collector_processor.processor.straggler.model import Verdict
from collector_processor.processor.straggler.sequential import SeqParams, SeqResult, excess, smoothed_sigma, spread
from collector_processor.processor.straggler.state import RankStageState, StateStore
from collector_processor.processor.straggler.statistics import (
    SortedPeers,
    median,
    pooled_relative_sigma,
    reference_of,
    relative_deviation,
    within_relative,
)
from collector_processor.processor.straggler.window import KIND_STEP, Window
from otel_straggler import schema as s

DEVICE = s.MEASUREMENT_DEVICE
HOST = s.MEASUREMENT_HOST_ONLY
_MEDIAN_SE = 1.2533  # standard error of the median of n normal samples = 1.2533 sigma / sqrt(n)


@dataclass(slots=True)
class RankStat:
    dev: float | None
    dev_samples: list[float]
    host_samples: list[float]
    fresh: int = 0  # samples of this window behind the device statistic (0: all of them)
    dev_used: list[float] | None = None  # the samples behind the device statistic when pooled
    dev_steps: list[int] | None = None  # the step of each device sample (step windows)
    _host: float | None = None

    @property
    def host(self) -> float | None:
        """Median of the host samples (None without any), computed on first read: a rank with device times
        is judged on those, its host statistic is read only for a host-stall group or an attribution."""
        if self._host is None and self.host_samples:
            self._host = median(self.host_samples)
        return self._host


@dataclass(slots=True)
class WindowOutcome:
    verdicts: list[Verdict] = field(default_factory=list)
    # (rank, stage_group, measurement) -> seconds (sum of the group's stage statistics)
    rank_group_seconds: dict[tuple[int, str, str], float] = field(default_factory=dict)
    # rank -> worst deviation over judged stages
    rank_deviation: dict[int, float] = field(default_factory=dict)
    # alerts refreshed or cleared in this window: (rank, stage) -> alert or None
    alerts: dict[tuple[int, str], Verdict | None] = field(default_factory=dict)


class Tolerances:
    """Device and host tolerance of one stage in one window (``Detector._tolerances``). The host one is
    computed on first use: a stage whose ranks all have device times needs it only for a host-stall group
    or a slow rank's attribution, and its robust sigma costs as much as the device one."""

    __slots__ = ("_host", "_host_of", "device")

    def __init__(self, device: float, host_of: Callable[[], float]) -> None:
        self.device = device
        self._host: float | None = None
        self._host_of = host_of

    @property
    def host(self) -> float:
        if self._host is None:
            self._host = self._host_of()
        return self._host


class Views:
    """One stage's device values and host values (a rank without device samples is compared host-vs-host),
    each sorted once for every rank's reference; the host side on first use (see ``Tolerances``)."""

    __slots__ = ("_host", "_per", "device")

    def __init__(self, per: dict[int, RankStat]) -> None:
        self._per = per
        self.device = SortedPeers({r: st.dev for r, st in per.items() if st.dev is not None})
        self._host: SortedPeers | None = None

    @property
    def host(self) -> SortedPeers:
        if self._host is None:
            self._host = SortedPeers({r: st.host for r, st in self._per.items() if st.host is not None})
        return self._host


@dataclass(slots=True)
class _Ctx:
    cohort: Cohort
    window: Window
    step: int | None
    trace_id: bytes
    period_ms: float | None
    world_size: int
    collectives: dict[str, dict[int, float]]
    now_ns: int


class Detector:
    def __init__(self, config: Config, states: StateStore, counters: dict[str, int]) -> None:
        self.cfg = config
        self.states = states
        self.c = counters
        self._judged = frozenset(config.judged_groups)
        self._seq = SeqParams(margin=config.sequential_margin, cap=config.sequential_step_cap,
                              threshold=config.sequential_threshold, min_steps=config.window_steps + 1,
                              history=config.sequential_history_steps, run_steps=config.window_steps,
                              window_z=config.sequential_window_z, rest_z=config.sequential_rest_z)

    # --- window -------------------------------------------------------------------------------------
    def judge(self, cohort: Cohort, window: Window, now_ns: int) -> WindowOutcome:
        cfg = self.cfg
        out = WindowOutcome()
        present = window.ranks()
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
                                  dev_steps=cell.dev_steps)
            stats[stage] = per
        rank_tokens = {r: median(v) for r, v in tokens.items() if r in warm}
        tok_values = list(rank_tokens.values())
        tok_median = median(tok_values) if tok_values else None
        # every rank's work comparable with every other's: no per-rank peer filtering is needed
        uniform = not tok_values or within_relative(min(tok_values), max(tok_values), cfg.workload_tolerance)

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
        trace_id = s.trace_id_for_step(cohort.job, step).to_bytes(16, "big") if step is not None else b""
        ctx = _Ctx(cohort, window, step, trace_id, period, world_size or len(cohort.ranks), collectives, now_ns)

        for stage, per in stats.items():
            group = cohort.stages.get(stage, "other")
            if group not in self._judged or not per:
                continue
            self._pool_device(cohort, stage, window.index, per)
            views = Views(per) if uniform else None
            tols = self._tolerances(per)
            seq = self._sequential(cohort, stage, window, per, None if uniform else rank_tokens, tok_median)
            for r in sorted(per):
                self._judge_rank(ctx, out, stage, group, r, per, rank_tokens, tok_median, views, tols, seq.get(r))
            self._missing(ctx, out, stage, group, per)
        return out

    def _sequential(self, cohort: Cohort, stage: str, window: Window, per: dict[int, RankStat],
                    rank_tokens: dict[int, float] | None, tok_median: float | None) -> dict[int, SeqResult]:
        """Rule 11: every comparable rank's per-step device excess over its peers' per-step median added to its
        history (``sequential.py``). ``rank_tokens`` None: every rank's work is comparable; else only ranks whose
        tokens are within the workload tolerance of the cohort's median take part (the others are judged
        uncertain by rule 5 and are nobody's reference)."""
        cfg = self.cfg
        if not cfg.sequential or window.kind != KIND_STEP:
            return {}
        dev: list[tuple[int, list[int], list[float]]] = []
        for r, rs in per.items():
            if rank_tokens is not None and tok_median is not None:
                tok = rank_tokens.get(r)
                if tok is not None and not within_relative(tok, tok_median, cfg.workload_tolerance):
                    continue
            if rs.dev_samples and rs.dev_steps:
                dev.append((r, rs.dev_steps, rs.dev_samples))
        if len(dev) < cfg.min_cohort_size:
            return {}
        # a stage under device_min_stage_ms is launch-bound and keeps the host floor (rule 9): only a slowdown
        # of 5 ms or more could convict there, which the window rule finds on its own; not worth the per-step work
        stat = [rs.dev for rs in per.values() if rs.dev is not None]
        if not stat or median(stat) < cfg.device_min_stage_ms:
            return {}
        items = excess(dev, cfg.min_cohort_size)
        history = cohort.seq_sigma.get(stage)
        if history is None:
            history = cohort.seq_sigma[stage] = deque(maxlen=cfg.sequential_sigma_windows)
        sigma = smoothed_sigma(history, spread(items.values(), cfg.min_cohort_size), cfg.sequential_sigma_floor)
        if sigma is None:
            return {}
        out: dict[int, SeqResult] = {}
        for r, lst in items.items():
            st = self.states.get((cohort.job, cohort.key, r, stage))
            out[r] = sequential.update(st, window.index, lst, sigma, self._seq)
        return out

    def _pool_device(self, cohort: Cohort, stage: str, idx: int, per: dict[int, RankStat]) -> None:
        """Median of each rank's latest ``window_steps`` device samples (this window first, then recent
        windows): sampled device timing leaves 1-2 samples per window, too few for a robust median."""
        k = self.cfg.window_steps
        oldest = idx - self.cfg.device_history_windows
        for r, rs in per.items():
            if not rs.dev_samples:
                continue
            st = self.states.get((cohort.job, cohort.key, r, stage))
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

    def _tolerances(self, per: dict[int, RankStat]) -> Tolerances:
        """Device and host tolerance of this stage in this window: ``tolerance``, raised to ``noise_z`` standard
        errors of a rank's window median when the cohort's step-to-step noise is larger. The per-step sigma is
        estimated robustly within each rank (``pooled_relative_sigma``: spikes and a slow rank do not move
        it); the standard error of a median of k samples is 1.2533 sigma / sqrt(k). A +5 % fault is found
        wherever the measured noise allows it; a noisier timing never convicts on noise
        (docs/detection-defaults.md)."""
        cfg = self.cfg
        if cfg.noise_z <= 0:
            return Tolerances(cfg.tolerance, lambda: cfg.tolerance)
        need = cfg.min_cohort_size
        scale = cfg.noise_z * _MEDIAN_SE / math.sqrt(cfg.window_steps)

        def raised(sigma: float | None) -> float:
            return cfg.tolerance if sigma is None else max(cfg.tolerance, scale * sigma)

        return Tolerances(raised(pooled_relative_sigma((st.dev_used or st.dev_samples for st in per.values()), need)),
                          lambda: raised(pooled_relative_sigma((st.host_samples for st in per.values()), need)))

    # --- one rank, one stage ------------------------------------------------------------------------
    def _judge_rank(self, ctx: _Ctx, out: WindowOutcome, stage: str, group: str, r: int,
                    per: dict[int, RankStat], rank_tokens: dict[int, float], tok_median: float | None,
                    views: Views | None, tols: Tolerances,
                    seq: SeqResult | None = None) -> None:
        cfg = self.cfg
        key = (ctx.cohort.job, ctx.cohort.key, r, stage)
        st = self.states.get(key)
        mine = per[r]
        if mine.dev is None and mine.host is None:
            self.c["non_finite_windows"] += 1
            self._unusable(ctx, out, key, st, stage, group, r, "non_finite_sample", None)
            return
        if mine.dev is None and st.dev_recent:
            # a rank that times this stage on the device sent none in this window: its host time is launch
            # time, never compared as if it were the stage's duration
            self.c["device_samples_missing_windows"] += 1
            self._unusable(ctx, out, key, st, stage, group, r, "missing_samples", None)
            return
        meas = DEVICE if mine.dev is not None else HOST
        value = mine.dev if mine.dev is not None else mine.host
        assert value is not None
        tok = rank_tokens.get(r)
        if tok is not None and tok_median is not None and len(rank_tokens) > 1 \
                and not within_relative(tok, tok_median, cfg.workload_tolerance):
            self.c["workload_incomparable_windows"] += 1
            self._unusable(ctx, out, key, st, stage, group, r, "workload_incomparable", (meas, value))
            return
        ref, size, peers_all = self._reference(r, meas, per, views, tok, rank_tokens)
        if ref is None:
            self.c["below_min_cohort_windows"] += 1
            self._unusable(ctx, out, key, st, stage, group, r, "cohort_below_min_size", (meas, value), size)
            return
        ref_rank, ref_ms = ref
        dev = relative_deviation(value, ref_ms)
        if dev is None:
            dev = math.inf if value > 0 else 0.0
        gap = value - ref_ms
        host_stall = False
        tol = tols.device if meas == DEVICE else tols.host
        if meas == DEVICE and group in cfg.host_stall_groups and mine.host is not None \
                and not (dev > tol and gap >= self.floor(DEVICE, ref_ms)):
            # device flat (or sub-floor): is the host interval up against the peers' host times? A host
            # stall outside the device interval (e.g. waiting for data) still delays the step.
            href, hsize, _ = self._reference(r, HOST, per, views, tok, rank_tokens)
            if href is not None:
                hdev = relative_deviation(mine.host, href[1])
                if hdev is not None and hdev > tols.host and mine.host - href[1] >= cfg.absolute_floor_ms:
                    meas, value, (ref_rank, ref_ms), dev, gap, size = HOST, mine.host, href, hdev, \
                        mine.host - href[1], hsize
                    host_stall = True
                    tol = tols.host
        prev = out.rank_deviation.get(r)
        if math.isfinite(dev) and (prev is None or dev > prev):
            out.rank_deviation[r] = dev
        base = dict(measurement=meas, value=value, ref_rank=ref_rank, ref_ms=ref_ms, dev=dev, size=size)
        idx = ctx.window.index
        if dev > tol and gap < self.floor(meas, ref_ms):
            self.c["below_floor_windows"] += 1
            self._unusable(ctx, out, key, st, stage, group, r, "below_absolute_floor", (meas, value), size, base)
            return
        if dev > tol:
            # persistence is counted in samples: the first slow window counts its whole statistic (k), later
            # ones only their fresh samples, so pooled sparse device samples shared by consecutive windows
            # are not counted twice; with every step measured this is exactly N consecutive windows
            k = cfg.window_steps
            # a window missing one device sample (auto sampling's host-only probe step) still counts as full
            fresh = mine.fresh if (mine.fresh and meas == DEVICE and mine.fresh < k - 1) else k
            st.streak = st.streak + fresh if st.last_slow_index == idx - 1 else k
            st.last_slow_index = idx
            st.held_reported = False
            attribution = s.ATTRIBUTION_HOST if host_stall else self._attribution(
                meas, mine, r, per, peers_all if peers_all is not None else [p for p in per if p != r], tols)
            if st.alert is not None:
                st.alert = self._verdict(ctx, stage, group, r, s.VERDICT_STRAGGLER, "slower_than_reference",
                                         attribution=st.alert.attribution, **base)
                self.states.set_active(key, st, st.alert)
                out.alerts[(r, stage)] = st.alert
                return
            need = cfg.persistence_windows * k
            if st.streak < need and meas == DEVICE and not host_stall and self._seq_fires(seq):
                st.streak = need  # sequential evidence (rule 11) completes the persistence
            if st.streak >= need:
                v = self._verdict(ctx, stage, group, r, s.VERDICT_STRAGGLER, "slower_than_reference",
                                  attribution=attribution, **base)
                sequential.reset(st)
                self.states.set_active(key, st, v)
                out.alerts[(r, stage)] = v
                out.verdicts.append(v)
            return
        if st.alert is None and meas == DEVICE and not host_stall and seq is not None and self._seq_fires(seq):
            # the window is not slow on its own, but the per-step excess accumulated over this and the
            # previous window is (rule 11); the verdict reports the run's means against the peers' medians
            v = self._seq_verdict(ctx, stage, group, r, seq, per, peers_all, tols, size=base["size"])
            st.streak = 0
            st.last_slow_index = None
            sequential.reset(st)
            self.states.set_active(key, st, v)
            out.alerts[(r, stage)] = v
            out.verdicts.append(v)
            return
        if st.alert is not None and (dev > cfg.tolerance or (
                seq is not None and seq.window_excess > cfg.sequential_margin / 2)):
            # within the noise-raised tolerance but not back within the base tolerance, or still beyond half
            # the sequential margin over the peers' per-step medians (hysteresis: a rank just above the
            # margin must not recover on one noisy window and be convicted again): no evidence of par, so
            # the alert holds (refreshed, no verdict)
            st.streak = 0
            st.last_slow_index = None
            st.alert = self._verdict(ctx, stage, group, r, s.VERDICT_STRAGGLER, "slower_than_reference",
                                     attribution=st.alert.attribution, **base)
            self.states.set_active(key, st, st.alert)
            out.alerts[(r, stage)] = st.alert
            return
        # within tolerance: positive evidence of par (the floor never blocks recovery)
        st.streak = 0
        st.last_slow_index = None
        st.held_reported = False
        if st.alert is not None:
            sequential.reset(st)
            v = self._verdict(ctx, stage, group, r, s.VERDICT_RECOVERED, "within_tolerance",
                              attribution=st.alert.attribution, **base)
            self.states.set_active(key, st, None)
            out.alerts[(r, stage)] = None
            out.verdicts.append(v)

    def _seq_fires(self, seq: SeqResult | None) -> bool:
        """Rule 11 fires and the gap at the lookback's median excess clears the device floor."""
        if seq is None or not seq.fires or seq.value_ms is None or seq.reference_ms is None:
            return False
        return seq.value_ms - seq.reference_ms >= self.floor(DEVICE, seq.reference_ms)

    def _seq_verdict(self, ctx: _Ctx, stage: str, group: str, r: int, seq: SeqResult, per: dict[int, RankStat],
                     peers: list[int] | None, tols: Tolerances, size: int) -> Verdict:
        """A rule-11 straggler verdict: the lookback's value against the mean of the peers' per-step medians,
        attributed as rule 8 attributes (``_attribution``) with that device comparison and the margin as its
        tolerance."""
        value, ref = seq.value_ms, seq.reference_ms
        assert value is not None and ref is not None
        dev = relative_deviation(value, ref)
        attribution = self._attribution(DEVICE, per[r], r, per, peers if peers is not None else
                                        [p for p in per if p != r], tols,
                                        device=(dev, value - ref, ref, self.cfg.sequential_margin))
        return self._verdict(ctx, stage, group, r, s.VERDICT_STRAGGLER, "persistent_excess", attribution=attribution,
                             measurement=DEVICE, value=value, ref_rank=None, ref_ms=ref, dev=dev, size=size)

    def floor(self, kind: str, ref_ms: float) -> float:
        """Absolute gap floor of one comparison: the host floor, or for a device comparison of a stage of
        at least ``device_min_stage_ms`` (not launch-bound, precise) the device floor."""
        cfg = self.cfg
        if kind == DEVICE and ref_ms >= cfg.device_min_stage_ms:
            return cfg.device_floor_ms
        return cfg.absolute_floor_ms

    def _reference(self, r: int, kind: str, per: dict[int, RankStat],
                   views: Views | None, tok: float | None, rank_tokens: dict[int, float]
                   ) -> tuple[tuple[int, float] | None, int, list[int] | None]:
        """(reference peer and value, effective cohort size incl. the rank, comparable peers or None=all)."""
        cfg = self.cfg
        q = cfg.fastest_quantile
        if views is not None or tok is None:
            # common case: every peer's work is comparable; O(1) per rank against pre-sorted values
            views = views or Views(per)
            view = views.device if kind == DEVICE else views.host
            size = 1 + view.peers(r)
            return (view.reference(r, cfg.reference, q) if size >= cfg.min_cohort_size else None), size, None
        # unequal work in the cohort: the reference set is the rank's comparable class, O(n) per rank
        peers_all = [p for p in per if p != r and
                     (p not in rank_tokens or within_relative(tok, rank_tokens[p], cfg.workload_tolerance))]
        peer_vals: dict[int, float] = {}
        for p in peers_all:
            v = per[p].dev if kind == DEVICE else per[p].host
            if v is not None:
                peer_vals[p] = v
        size = 1 + len(peer_vals)
        return (reference_of(peer_vals, cfg.reference, q) if size >= cfg.min_cohort_size else None), size, peers_all

    def _attribution(self, meas: str, mine: RankStat, r: int, per: dict[int, RankStat], peers: list[int],
                     tols: Tolerances,
                     device: tuple[float | None, float, float, float] | None = None) -> str:
        """Device against the peers' device values and host against their host values (``attribution.py``).
        ``device``: (deviation, gap ms, reference ms, tolerance) of a comparison made elsewhere (rule 11)."""
        cfg = self.cfg
        dev_d = dev_g = host_d = host_g = ref_d = None
        dev_tol = tols.device
        if device is not None:
            dev_d, dev_g, ref_d, dev_tol = device
        elif mine.dev is not None:
            dev_vals = {p: v for p in peers if (v := per[p].dev) is not None}
            ref = reference_of(dev_vals, cfg.reference, cfg.fastest_quantile)
            if ref is not None:
                ref_d = ref[1]
                dev_d = relative_deviation(mine.dev, ref[1])
                dev_g = mine.dev - ref[1]
        if mine.host is not None:
            # host against the peers' host times (never against their device times)
            host_vals = {p: v for p in peers if (v := per[p].host) is not None}
            ref = reference_of(host_vals, cfg.reference, cfg.fastest_quantile)
            if ref is not None:
                host_d = relative_deviation(mine.host, ref[1])
                host_g = mine.host - ref[1]
        return attribute(measurement=meas, device_deviation=dev_d, device_gap_ms=dev_g, host_deviation=host_d,
                         host_gap_ms=host_g, tolerance=dev_tol, host_tolerance=tols.host,
                         floor_ms=self.floor(DEVICE, ref_d) if ref_d is not None else cfg.absolute_floor_ms,
                         host_floor_ms=cfg.absolute_floor_ms,
                         host_explains_fraction=cfg.host_explains_fraction,
                         host_ambiguous_fraction=cfg.host_ambiguous_fraction)

    def _missing(self, ctx: _Ctx, out: WindowOutcome, stage: str, group: str, per: dict[int, RankStat]) -> None:
        """Ranks with an active alert on this stage but no sample in the window: the alert holds."""
        for r in ctx.cohort.ranks:
            if r in per:
                continue
            st = self.states.peek((ctx.cohort.job, ctx.cohort.key, r, stage))
            if st is None:
                continue
            self.c["missing_windows"] += 1
            st.streak = 0
            st.last_slow_index = None
            sequential.reset(st)
            if st.alert is not None:
                self._hold(ctx, out, (ctx.cohort.job, ctx.cohort.key, r, stage), st, stage, group, r, None, 0, None)

    # --- unusable evidence: hold an alert, else (rate-limited) uncertain ------------------------------
    def _unusable(self, ctx: _Ctx, out: WindowOutcome, key: tuple[str, str, int, str], st: RankStageState,
                  stage: str, group: str, r: int, reason: str, mv: tuple[str, float] | None, size: int = 0,
                  base: dict | None = None) -> None:
        st.streak = 0
        st.last_slow_index = None
        sequential.reset(st)
        if st.alert is not None:
            self._hold(ctx, out, key, st, stage, group, r, mv, size, base)
            return
        idx = ctx.window.index
        if reason == st.last_uncertain_reason and st.last_uncertain_index is not None \
                and idx - st.last_uncertain_index < self.cfg.uncertain_every_windows:
            self.c["uncertain_suppressed"] += 1
            return
        st.last_uncertain_reason = reason
        st.last_uncertain_index = idx
        kw = base or {}
        if not kw:
            kw = dict(measurement=mv[0] if mv else DEVICE, value=mv[1] if mv else None, ref_rank=None,
                      ref_ms=None, dev=None, size=size)
        out.verdicts.append(self._verdict(ctx, stage, group, r, s.VERDICT_UNCERTAIN, reason,
                                          attribution=s.ATTRIBUTION_UNKNOWN, **kw))

    def _hold(self, ctx: _Ctx, out: WindowOutcome, key: tuple[str, str, int, str], st: RankStageState,
              stage: str, group: str, r: int, mv: tuple[str, float] | None, size: int, base: dict | None) -> None:
        self.c["recovery_withheld_windows"] += 1
        out.alerts[(r, stage)] = st.alert  # still active: keeps its metric series fresh
        if st.held_reported:
            return
        st.held_reported = True
        kw = base or dict(measurement=mv[0] if mv else st.alert.measurement,  # type: ignore[union-attr]
                          value=mv[1] if mv else None, ref_rank=None, ref_ms=None, dev=None, size=size)
        out.verdicts.append(self._verdict(ctx, stage, group, r, s.VERDICT_UNCERTAIN, "recovery_evidence_insufficient",
                                          attribution=st.alert.attribution, **kw))  # type: ignore[union-attr]

    # --- verdict construction -----------------------------------------------------------------------
    def _verdict(self, ctx: _Ctx, stage: str, group: str, r: int, verdict: str, reason: str, *, attribution: str,
                 measurement: str, value: float | None, ref_rank: int | None, ref_ms: float | None,
                 dev: float | None, size: int) -> Verdict:
        info = ctx.cohort.ranks.get(r)
        lost = max(value - ref_ms, 0.0) if (value is not None and ref_ms is not None
                                              and verdict == s.VERDICT_STRAGGLER) else 0.0
        return Verdict(
            job=ctx.cohort.job, cohort=ctx.cohort.key, rank=r, host=info.host if info else "",
            gpu=info.gpu if info else "", stage=stage, group=group, verdict=verdict, reason=reason,
            deviation=dev if (dev is None or math.isfinite(dev)) else None, value_ms=value,
            reference_rank=ref_rank, reference_ms=ref_ms, measurement=measurement,
            window_start=ctx.window.start, window_end=ctx.window.end, step=ctx.step, attribution=attribution,
            step_time_lost_ms=lost, gpu_seconds_per_hour=impact(lost, ctx.world_size, ctx.period_ms),
            cohort_size=size,
            collective_evidence=collective_evidence(r, ctx.collectives, self.cfg.tolerance)
            if verdict == s.VERDICT_STRAGGLER else "",
            trace_id=ctx.trace_id, emitted_unix_ns=ctx.now_ns,
        )

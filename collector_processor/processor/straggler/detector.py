"""Judgement of one closed window of one cohort: evidence in, verdicts out.

A verdict can be followed from the window's samples to the event:

* ``Detector.judge`` gathers the window's evidence (``WindowEvidence``, ``window_evidence.py``): which ranks are
  past ``warmup``, each warm rank's statistic per stage (``RankStat``), the ranks' work, the step period and the
  collective times. Per judged stage (``judged_groups``) it pools sampled device timing (``device_pooling``), sets
  the tolerances (``noise_tolerance``) and updates each rank's sequential and intermittent evidence, all in
  ``StageEvidence``.
* One ``Judgement`` (``judgement.py``) per warm rank and judged stage runs the rules of ``rules.RULES`` in order,
  one module each; the first that decides ends it. ``rules.ABSENT`` judges a rank that sent nothing for the stage
  (``missing_rank``). ``Judgement.emit`` builds every ``Verdict``; its reason is a constant of ``model.py`` named
  after the rule.
* Per window, the collective signal (``collective_signal.py``).

Rules, defaults and the reasons behind them: ``docs/detector.md`` (the same names).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import otel_straggler_schema as s
from collector_processor.processor.straggler import collective_signal, intermittent, pair, sequential
from collector_processor.processor.straggler.cohort import Cohort
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.evidence import DEVICE, HOST, RankStat
from collector_processor.processor.straggler.impact import step_period_ms
from collector_processor.processor.straggler.intermittent import IntParams, IntResult
from collector_processor.processor.straggler.judgement import Judgement, state_key
from collector_processor.processor.straggler.per_unit import normalise
from collector_processor.processor.straggler.rules import ABSENT, RULES
from collector_processor.processor.straggler.sequential import SeqParams, SeqResult, excess, smoothed_sigma, spread
from collector_processor.processor.straggler.state import StateKey, StateStore
from collector_processor.processor.straggler.statistics import median, within_relative
from collector_processor.processor.straggler.window import KIND_STEP, Window
from collector_processor.processor.straggler.window_evidence import (
    StageEvidence,
    WindowEvidence,
    WindowOutcome,
    noise_tolerance,
)
from otel_straggler_schema.stages import MP_WAIT_ENCLOSING


class Detector:
    def __init__(self, config: Config, states: StateStore, counters: dict[str, int],
                 cohorts: Iterable[Cohort] = ()) -> None:
        self.cfg = config
        self.states = states
        self.c = counters
        self.cohorts = cohorts  # every cohort held (pair: the job's other roles)
        self._judged = frozenset(config.judged_groups)
        self._judges = tuple(rule.judge for rule in RULES)  # the rules in order, looked up once
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
            se = StageEvidence(stage, group, per, ev.uniform or per_unit, noise_tolerance(self.cfg, per), per_unit)
            ev.tolerances[stage] = se.tols
            se.seq, se.intm = self._step_excess(ev, se)
            se.pair = self._pair(ev, se)
            self._judge_stage(ev, se)
        collective_signal.judge(ev, cohort.rings)
        return ev.out

    def _judge_stage(self, ev: WindowEvidence, se: StageEvidence) -> None:
        """Every warm rank of the stage through the rules in order (the first that decides ends its judgement),
        then every rank of the cohort with state for the stage but no sample (``missing_rank``)."""
        cfg, states, c = self.cfg, self.states, self.c
        cohort = ev.cohort
        per = se.per
        stage = se.name
        judges = self._judges
        for r in sorted(per):
            j = Judgement(cfg, states, c, ev, se, r, states.get(self.key(cohort, r, stage)))
            for judge in judges:
                if judge(j):
                    break
        for r in cohort.ranks:
            if r in per:
                continue
            st = states.peek(self.key(cohort, r, stage))
            if st is not None:
                ABSENT.judge(Judgement(cfg, states, c, ev, se, r, st))

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
        ev = WindowEvidence(cfg, cohort, window, out, step, period, world_size or len(cohort.ranks),
                            collectives, rank_tokens, tok_median, uniform, now_ns, stats, tokens_vary=tokens_vary)
        return ev, stats

    @staticmethod
    def key(cohort: Cohort, rank: int, stage: str) -> StateKey:
        return state_key(cohort, rank, stage)

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
        tols = noise_tolerance(cfg, se.per, need=2)
        return pair.observe(name=se.name, per=se.per, cohort=ev.cohort, index=ev.window.index,
                            comparable=ev.uniform, tolerance_of=tols.of,
                            cohorts=self.cohorts, history=cfg.pair_history_windows, min_history=cfg.pair_min_history,
                            tolerance=cfg.tolerance, noise_z=cfg.noise_z, window_steps=cfg.window_steps)

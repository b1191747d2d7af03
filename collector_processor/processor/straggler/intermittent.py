"""Intermittent evidence (``intermittent_excess`` in ``docs/detector.md``): per rank and judged stage, the episodes
in which the rank's step was far above its peers' median of the same step, how often they recur and what they
cost the job.

A rank much slower on every few steps (a periodic background job, a GPU throttled on some steps) keeps its
window medians at par, and ``sequential.py`` caps what one step adds: neither steady rule sees it, though every
peer waits for it at the next collective on each of those steps. Per step t of a closed window, against the
median m_t of the other comparable ranks' samples of step t (``sequential.excess``), while the rank's typical
step is at par (the median of ``x_t / m_t - 1`` over the lookback under ``margin``: a rank slow on most steps is a
steady straggler, the steady rules' to judge)::

    spike     x_t / m_t - 1 >= max(spike_z x sigma, tolerance) and x_t - m_t >= the device floor
              (sigma: the cohort's per-step spread, as ``sequential_excess`` measures it)
    episode   a run of spike steps one step apart: a burst of any length is one episode
    cost      (E - 1) / n x the median episode excess (ms): E the episodes in the lookback, n the steps observed
              from the first one's start to now; the rank's excess per step, which the job waits for
    period    the median gap between consecutive episodes' starts (steps)

A single spike or burst costs nothing (E - 1 = 0): one checkpoint step or GC pause never convicts, and the
median episode keeps one long pause from inflating the cost of small ones. It **fires** when the lookback
(``history`` steps) holds at least ``min_episodes`` episodes and the cost reaches the cost of the smallest steady
straggler the detector convicts (``margin`` of the peers' mean median: ``sequential_margin``) and the device
floor, over the whole lookback and over the recent steps (the last two periods, at least two windows: it still
happens), and when its peers spike far less often (``against_peers``: at their pooled rate, the rank's episodes
or more are rarer than ``RARE``). A spike of period P is thus found in the window holding its
``min_episodes``-th episode, ``min_episodes - 1`` periods after the first (later where the peers spike too), for
periods up to ``history / (min_episodes - 1)`` steps. An alert it convicted **holds** while the recent cost stays
at half that threshold or more.

History is kept only for a rank-stage with an episode in its lookback (``RankStageState.intm``): the steps
observed since the history began, their peers' medians and relative excesses (three flat arrays of at most
``history`` entries) and the episodes (a deque of at most ``history`` entries): ``state.IntHistory``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

from collector_processor.processor.straggler.sequential import StepExcess
from collector_processor.processor.straggler.state import IntHistory, RankStageState
from collector_processor.processor.straggler.statistics import median

RARE = 1e-6  # against_peers: the rank's episodes at its peers' rate are rarer than this


@dataclass(frozen=True, slots=True)
class IntParams:
    """``intermittent_excess``'s knobs, fixed per detector."""

    history: int  # lookback in steps (``intermittent_history_steps``)
    min_episodes: int  # episodes in the lookback that can fire (``intermittent_min_episodes``)
    spike_z: float  # a spike: this many of the cohort's per-step sigmas (``intermittent_spike_z``)
    min_spike: float  # and at least this relative excess (``tolerance``)
    margin: float  # the least cost relative to the peers' median (``sequential_margin``)
    floor_ms: float  # and in ms (``device_floor_ms``)
    recent_steps: int  # the shortest recent span (two windows)


@dataclass(slots=True)
class IntResult:
    """One rank's intermittent evidence after a window."""

    fires: bool  # enough episodes, costing enough over the lookback and recently
    holds: bool  # the recent cost is still at least half the threshold (an alert it convicted holds)
    cost_ms: float  # excess per step over the lookback
    recent_cost_ms: float  # excess per step over the recent span
    reference_ms: float  # the peers' mean per-step median over the lookback
    period_steps: float | None  # median gap between episodes' starts (None: one episode)
    episodes: int
    lookback: int  # steps observed in the lookback


def reset(st: RankStageState) -> None:
    st.intm = None


def update(st: RankStageState, items: list[StepExcess], sigma: float, p: IntParams) -> IntResult | None:
    """Add one window's steps (``items`` in step order: step, the rank's value, its peers' median) to the rank's
    history and evaluate it; None while the rank has no episode in its lookback (nothing is kept then)."""
    h = st.intm
    lim = max(p.spike_z * sigma, p.min_spike)
    spikes = [(t, x - m) for t, x, m in items if m > 0.0 and x / m - 1.0 >= lim and x - m >= p.floor_ms]
    if h is None:
        if not spikes:
            return None
        h = st.intm = IntHistory()
    for t, x, m in items:
        if h.steps and t <= h.steps[-1]:
            continue  # a step already counted (never expected: windows close in order)
        h.steps.append(t)
        h.refs.append(m)
        h.devs.append(x / m - 1.0 if m > 0.0 else 0.0)
    eps = h.episodes
    for t, ex in spikes:
        last = eps[-1] if eps else None
        if last is not None and t - last[1] <= 1:
            last[1] = float(t)
            last[2] += ex
        elif last is None or t > last[1]:
            eps.append([float(t), float(t), ex])
    if not h.steps:
        st.intm = None
        return None
    now = h.steps[-1]
    cut = now - p.history  # keep steps after it
    drop = 0
    while drop < len(h.steps) and h.steps[drop] <= cut:
        drop += 1
    if drop:
        del h.steps[:drop]
        del h.refs[:drop]
        del h.devs[:drop]
    while eps and eps[0][0] <= cut:
        eps.popleft()
    if not eps or not h.steps:
        st.intm = None
        return None
    n_eps = len(eps)
    size = median([e[2] for e in eps])
    first = eps[0][0]
    n = sum(1 for t in h.steps if t >= first)
    cost = (n_eps - 1) / n * size if n else 0.0
    ref = sum(h.refs) / len(h.refs)
    starts = [e[0] for e in eps]
    period = median([b - a for a, b in pairwise(starts)]) if n_eps > 1 else None
    span = max(p.recent_steps, round(2 * period) if period is not None else 0)
    recent_from = now - span + 1
    n_recent = sum(1 for t in h.steps if t >= recent_from)
    recent = sum(1 for e in eps if e[0] >= recent_from) / n_recent * size if n_recent else 0.0
    threshold = max(p.margin * ref, p.floor_ms)
    holds = recent >= threshold / 2.0
    # the rank's typical step at par: a rank slow on most steps is a steady straggler, the steady rules' to judge
    typical = median(list(h.devs)) < p.margin
    fires = n_eps >= p.min_episodes and cost >= threshold and recent >= threshold and typical
    return IntResult(fires, holds, cost, recent, ref, period, n_eps, len(h.steps))


def against_peers(results: dict[int, IntResult], ranks: list[int]) -> None:
    """A rank's episodes are its own only where its peers spike far less often: under the peers' pooled episode
    rate (their episodes per observed step; a peer without history counts the rank's lookback without one), the
    chance of the rank's episodes or more over its lookback (Poisson) must be under ``RARE``, else it does not
    fire. Heavy-tail noise spiking every rank alike never convicts the rank it happened to hit most."""
    total = sum(r.episodes for r in results.values())
    for r, res in results.items():
        if not res.fires:
            continue
        peers = [p for p in ranks if p != r]
        steps = sum(results[p].lookback if p in results else res.lookback for p in peers)
        if not steps:
            res.fires = False
            continue
        mu = (total - res.episodes) / steps * res.lookback
        if poisson_tail(res.episodes, mu) >= RARE:
            res.fires = False


def poisson_tail(k: int, mu: float) -> float:
    """P(X >= k) for X ~ Poisson(mu)."""
    if mu <= 0.0:
        return 0.0 if k > 0 else 1.0
    term = math.exp(-mu)
    below = 0.0
    for i in range(k):
        below += term
        term *= mu / (i + 1)
    return max(0.0, 1.0 - below)

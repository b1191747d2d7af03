"""Sequential evidence (``docs/detector.md`` rule 11): per rank and judged stage, the rank's recent per-step
excess over its comparable peers' per-step median, tested over every lookback that ends now.

Why: the window rule compares a rank's 5-step median with the fastest peer's. At 2 % per-step noise a +5 %
rank is only about two standard errors from a healthy one in such a comparison, so two windows in a row
rarely both clear a threshold that keeps healthy ranks quiet. Step by step, against the median of the other
ranks' samples of the same step, the same +5 % is about 2.3 standard deviations, and summed over the steps
since it began it is far beyond the noise: over 12 steps, 7.9 standard deviations.

For each step t of a closed window and each comparable rank with a device sample of t::

    d_t = x_t / m_t - 1             m_t: median of the other comparable ranks' samples of step t
    z_t = min(d_t / sigma, cap)     sigma: robust spread of d within the cohort's ranks, averaged over the
                                    cohort's last ``sigma_windows`` windows
    T   = max over n of (z_{t-n+1} + ... + z_t) / sqrt(n),  n from window_steps + 1 to the history kept

A rank is convicted at the close of a window when ``T`` reaches the threshold (a one-sided z-score: the
chance that a rank at par gets there is that of a normal variable beyond it, times the few lookbacks that are
nearly independent), the median excess over those n steps is at least ``margin`` (statistically certain but
tiny, e.g. +1 % on a very quiet stage, is no straggler), and the steps of this window and of the previous
window inside the lookback each have a median excess of at least ``margin``: the evidence spans two
consecutive windows, so one slow window (a burst, a flapping rank's slow half) never convicts on its own,
however large. ``cap`` bounds what one step adds, so a heavy-tail spike is one step's evidence, not a
verdict. Stages under ``device_min_stage_ms`` are skipped (their floor is the host's 5 ms, rule 9: only a
slowdown the window rule finds on its own could convict there).

History is kept per (rank, stage) in a flat ``array`` (3 doubles per step, at most ``history`` steps).
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from collector_processor.processor.straggler.state import RankStageState
from collector_processor.processor.straggler.statistics import median, pooled_relative_sigma

_MAD_SIGMA = 1.4826  # sigma of a normal distribution = 1.4826 x its median absolute deviation
MIN_SPREAD_SAMPLES = 8  # fewer excess values than this in a window: no spread estimate from it
_REC = 3  # doubles per step in the history: window index, d, peers' median ms

# (step, the rank's value, the peers' median of that step)
StepExcess = tuple[int, float, float]


def per_step(values: list[float], steps: list[int]) -> dict[int, float]:
    """One value per step: the step's sample, or the mean of its samples (stage spans in ``interval``
    detail give one per microbatch). Empty when the samples carry no steps (wall-clock windows)."""
    if len(steps) != len(values) or not values:
        return {}
    out = dict(zip(steps, values, strict=True))
    if len(out) == len(values):
        return out
    sums: dict[int, list[float]] = {}
    for t, v in zip(steps, values, strict=True):
        sums.setdefault(t, []).append(v)
    return {t: sum(vs) / len(vs) for t, vs in sums.items()}


def excess(samples: Iterable[tuple[int, list[int], list[float]]], min_size: int) -> dict[int, list[StepExcess]]:
    """Per rank, its steps in order with the median of the other ranks' values of the same step; a step
    with fewer than ``min_size`` ranks (the rank included) or a non-positive median is left out.
    ``samples``: (rank, steps, values) with one step per value; several values of one step are averaged
    (``per_step``). One sort per step: the median without the rank at sorted position p is one of three
    values (``_loo_medians``)."""
    by_step: dict[int, list[tuple[float, int]]] = {}
    for r, steps, values in samples:
        if len(steps) != len(values):
            continue
        pairs = per_step(values, steps).items() if len(set(steps)) != len(steps) else zip(steps, values)
        for t, x in pairs:
            col = by_step.get(t)
            if col is None:
                col = by_step[t] = []
            col.append((x, r))
    out: dict[int, list[StepExcess]] = {}
    for t in sorted(by_step):
        col = by_step[t]
        n = len(col)
        if n < min_size:
            continue
        col.sort()
        below, at, above, mid = _loo_medians(col)
        for p, (x, r) in enumerate(col):
            m = below if p < mid else (above if p > mid else at)
            if m <= 0.0:
                continue
            lst = out.get(r)
            if lst is None:
                lst = out[r] = []
            lst.append((t, x, m))
    return out


def _loo_medians(col: list[tuple[float, int]]) -> tuple[float, float, float, int]:
    """For a sorted column of n >= 2 values: the median of the other n - 1 values when the removed one sits
    below, at or above sorted position ``mid`` (returned last)."""
    n = len(col)
    if n % 2 == 0:  # n - 1 odd: one middle value, index k of the rest
        k = (n - 2) // 2
        return col[k + 1][0], col[k + 1][0], col[k][0], k  # removed at p <= k -> s[k + 1], above -> s[k]
    a = (n - 3) // 2  # n - 1 even: two middle values, at a and b = a + 1 of the rest
    b = a + 1
    return ((col[a + 1][0] + col[b + 1][0]) / 2.0, (col[a][0] + col[b + 1][0]) / 2.0,
            (col[a][0] + col[b][0]) / 2.0, b)


def spread(items: Iterable[list[StepExcess]], min_ranks: int) -> float | None:
    """Robust sigma of the relative excess d = x / m - 1: within each rank (every step's distance to the
    rank's own median, pooled: a rank slow as a whole and spikes do not move it), or, when too few ranks have
    3 steps in the window (sampled device timing), around the median of every d (1.4826 x MAD). None with
    fewer than ``MIN_SPREAD_SAMPLES`` values."""
    ratios = [[x / m for _, x, m in lst] for lst in items]
    within = pooled_relative_sigma(ratios, min_ranks)
    if within is not None:
        return within
    ds = [q for lst in ratios for q in lst]
    if len(ds) < MIN_SPREAD_SAMPLES:
        return None
    c = median(ds)
    return _MAD_SIGMA * median([abs(d - c) for d in ds])


def smoothed_sigma(history: deque[float], current: float | None, floor: float) -> float | None:
    """Mean of the latest per-window spreads (``current`` appended when known), at least ``floor``; None
    before any window gave one."""
    if current is not None:
        history.append(current)
    if not history:
        return None
    return max(floor, sum(history) / len(history))


@dataclass(slots=True)
class SeqResult:
    """One rank's sequential evidence after a window."""

    fires: bool
    score: float  # the largest standardised lookback sum (T)
    steps: int  # the lookback behind it
    window_excess: float  # mean d of this window's steps (evidence of par when <= margin)
    # over that lookback, when it reaches the threshold (else None): the peers' mean per-step median (ms) and
    # the rank's value at the median excess over it
    value_ms: float | None
    reference_ms: float | None


_ROOTS: tuple[float, ...] = tuple(math.sqrt(n) for n in range(65))


def _roots(n: int) -> tuple[float, ...]:
    """sqrt(0) .. sqrt(n) at least: the lookback scan divides by sqrt(n) for every n of every rank, so from a
    table. A longer history gets a new, longer table (never a change to one a caller may be reading)."""
    global _ROOTS
    if n >= len(_ROOTS):
        _ROOTS = tuple(math.sqrt(i) for i in range(2 * n + 1))
    return _ROOTS


def reset(st: RankStageState) -> None:
    st.seq_hist = None
    st.seq_index = -1


def update(st: RankStageState, index: int, items: list[StepExcess], sigma: float, margin: float, cap: float,
           threshold: float, min_steps: int, history: int) -> SeqResult:
    """Append one window's steps (``items`` in step order) to the rank's history and test every lookback of
    at least ``min_steps`` steps. A gap in window indices restarts the history."""
    hist = st.seq_hist
    if hist is None or st.seq_index != index - 1:
        hist = st.seq_hist = array("d")
    st.seq_index = index
    fi = float(index)
    wsum = 0.0
    for _, x, m in items:
        d = x / m - 1.0
        wsum += d
        hist.extend((fi, d, m))
    over = len(hist) - history * _REC
    if over > 0:
        del hist[:over]
    n_total = len(hist) // _REC
    roots = _roots(n_total)
    best = -math.inf
    best_n = 0
    zsum = 0.0
    n = 0
    for d in reversed(hist[1::_REC]):  # d of every kept step, newest first: lookbacks of n = 1, 2, ...
        n += 1
        z = d / sigma
        zsum += z if z < cap else cap
        if n >= min_steps:
            score = zsum / roots[n]
            if score > best:
                best, best_n = score, n
    window_excess = wsum / len(items) if items else 0.0
    if best < threshold:  # the common case: nothing more to compute
        return SeqResult(False, max(best, 0.0), best_n, window_excess, None, None)
    # over the best lookback: the median excess overall and in this and in the previous window's steps
    # (robust: a spike moves none of them); the reported value uses the median too
    ds: list[float] = []
    cur: list[float] = []
    prev: list[float] = []
    msum = 0.0
    for j in range(n_total - best_n, n_total):
        w, d, m = hist[j * _REC:(j + 1) * _REC]
        ds.append(d)
        msum += m
        if w == fi:
            cur.append(d)
        elif w == fi - 1.0:
            prev.append(d)
    d_med = median(ds)
    fires = (d_med >= margin and bool(cur) and bool(prev)
             and median(cur) >= margin and median(prev) >= margin)
    ref = msum / best_n
    return SeqResult(fires, best, best_n, window_excess, ref * (1.0 + d_med), ref)

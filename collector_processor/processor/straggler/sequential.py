"""Sequential evidence (``sequential_excess`` in ``docs/detector.md``): per rank and judged stage, the rank's
recent per-step excess over its comparable peers' per-step median, tested over every lookback that ends now.

Why: ``window_excess`` compares a rank's 5-step median with the fastest peer's. At 2 % per-step noise a +5 %
rank is only about two standard errors from a healthy one in such a comparison, so two windows in a row
rarely both clear a threshold that keeps healthy ranks quiet. Step by step, against the median of the other
ranks' samples of the same step, the same +5 % is about 2.3 standard deviations, and summed over the steps
since it began it is far beyond the noise: over 12 steps, 7.9 standard deviations.

For each step t of a closed window and each comparable rank with a device sample of t::

    d_t = x_t / m_t - 1             m_t: median of the other comparable ranks' samples of step t
    z_t = min(d_t / sigma, cap)     sigma: standard deviation of d within the cohort's ranks (spikes left
                                    out), averaged over the cohort's last ``sigma_windows`` windows
    T   = max over n of (z_{t-n+1} + ... + z_t) / sqrt(n),  n from window_steps + 1 to the history kept

A rank is convicted at the close of a window when, over the lookback of n samples that gives ``T``:

* ``T`` reaches the threshold (a one-sided z-score: the chance that a rank at par gets there is that of a
  normal variable beyond it, times the few lookbacks that are nearly independent);
* the median excess is at least ``margin`` (statistically certain but tiny, e.g. +1 % on a very quiet stage,
  is no straggler);
* its steps in this window and its steps in the previous window each carry evidence of their own,
  ``sum z / sqrt(k) >= window_z`` over their k steps (**two consecutive windows of evidence**: the rank is
  still slow now, and a rank slow in every other window, slow, par, slow, is not convicted on the windows at
  par);
* no run of ``run_steps`` (a window's) consecutive steps accounts for the evidence: without the samples of
  its strongest such run (1-2 samples when device time is sampled every 4th step), the rest of the lookback
  still reaches ``rest_z`` on its own. One slow window, or a burst as long however it straddles two windows
  and however large (``cap`` bounds each step), does not convict on its own: the rest of the lookback is at
  par then, and steps at par rarely reach ``rest_z`` (measured at 1 % and 2 % noise:
  ``bench/results/detection-alternatives.md``, "Window tests").

``cap`` bounds what one step adds, so a heavy-tail spike is one step's evidence, not a verdict. Stages under
``device_min_stage_ms`` are skipped (their floor is the host's 5 ms, ``absolute_floor``: only a slowdown
``window_excess`` finds on its own could convict there).

Why standardised sums per window and not ``margin`` on the median of this window's and of the previous
window's steps: at 2 % per-step noise a 5-step median is +-1.2 % around the rank's true excess, so a +5 %
rank often has one of the two under a 2.5 % margin; and the previous window's steps in the lookback can be
a single one, so a margin on its median lets one slow window convict whenever that healthy step is 1.1 sigma
high (``docs/detection-defaults.md``, ``bench/results/detection.md``).

History is kept per (rank, stage) in a flat ``array`` (4 doubles per step, at most ``history`` steps).
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
SPIKE_SIGMAS = 5.0  # a value this many robust sigmas from its rank's median is a spike, not spread
MIN_SPREAD_SAMPLES = 8  # fewer excess values than this in a window: no spread estimate from it
_REC = 4  # doubles per step in the history: window index, step, d, peers' median ms

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
    """Sigma of the relative excess d = x / m - 1: within each rank, pooled (a rank slow as a whole does not
    move it), or, when too few ranks have 3 steps in the window (sampled device timing), around the median of
    every d (1.4826 x MAD). None with fewer than ``MIN_SPREAD_SAMPLES`` values.

    Within ranks it is a standard deviation (``_pooled_sd``), the robust estimate (every step's distance to
    its rank's median, ``pooled_relative_sigma``) only setting which values are spikes: T sums z, and what
    scales a sum is the standard deviation; and from a window's ~32 degrees of freedom the standard deviation
    varies less window to window than the median distance (``bench/results/detection-alternatives.md``,
    "The spread"), so the few windows a cohort has when a fault begins early in a job give a steadier sigma (a
    high one hides a slow rank, a low one raises healthy T)."""
    ratios = [[x / m for _, x, m in lst] for lst in items]
    within = pooled_relative_sigma(ratios, min_ranks)
    if within is not None:
        return _pooled_sd(ratios, within)
    ds = [q for lst in ratios for q in lst]
    if len(ds) < MIN_SPREAD_SAMPLES:
        return None
    c = median(ds)
    return _MAD_SIGMA * median([abs(d - c) for d in ds])


def _pooled_sd(ratios: list[list[float]], robust: float) -> float:
    """Pooled within-rank standard deviation of the relative values, each rank's values around their own mean
    (n - 1 degrees of freedom each), leaving out values more than ``SPIKE_SIGMAS`` x ``robust`` from the rank's
    median (spikes); ``robust`` itself when fewer than ``MIN_SPREAD_SAMPLES`` degrees of freedom remain."""
    ss = 0.0
    dof = 0
    for vals in ratios:
        if len(vals) < 3:
            continue
        c = median(vals)
        lim = SPIKE_SIGMAS * robust * c
        kept = [v for v in vals if abs(v - c) <= lim]
        k = len(kept)
        if k < 2:
            continue
        mean = sum(kept) / k
        ss += sum((v - mean) * (v - mean) for v in kept) / (mean * mean)
        dof += k - 1
    if dof < MIN_SPREAD_SAMPLES:
        return robust
    # sqrt of an unbiased variance is low by the factor c4(dof) (1.3 % at a window's ~32 degrees of freedom)
    return math.sqrt(ss / dof) / (1.0 - 1.0 / (4.0 * dof) - 7.0 / (32.0 * dof * dof))


def smoothed_sigma(history: deque[float], current: float | None, floor: float) -> float | None:
    """Mean of the latest per-window spreads (``current`` appended when known), at least ``floor``; None
    before any window gave one."""
    if current is not None:
        history.append(current)
    if not history:
        return None
    return max(floor, sum(history) / len(history))


@dataclass(frozen=True, slots=True)
class SeqParams:
    """``sequential_excess``'s knobs (``Config.sequential_*``), fixed per detector."""

    margin: float  # least median excess over the lookback
    cap: float  # most one step adds, in sigmas
    threshold: float  # T that convicts
    min_steps: int  # shortest lookback (run_steps + 1)
    history: int  # longest lookback (steps kept)
    run_steps: int  # a window's steps: the longest run one burst may cover
    window_z: float  # least standardised evidence of this window's and of the previous window's steps, each
    rest_z: float  # least standardised evidence of the lookback without its strongest run of run_steps steps


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


def update(st: RankStageState, index: int, items: list[StepExcess], sigma: float, p: SeqParams) -> SeqResult:
    """Append one window's steps (``items`` in step order) to the rank's history and test every lookback of
    at least ``p.min_steps`` samples. A gap in window indices restarts the history."""
    hist = st.seq_hist
    if hist is None or st.seq_index != index - 1:
        hist = st.seq_hist = array("d")
    st.seq_index = index
    fi = float(index)
    wsum = 0.0
    for t, x, m in items:
        d = x / m - 1.0
        wsum += d
        hist.extend((fi, float(t), d, m))
    over = len(hist) - p.history * _REC
    if over > 0:
        del hist[:over]
    n_total = len(hist) // _REC
    cap = p.cap
    min_steps = p.min_steps
    roots = _roots(n_total)
    best = -math.inf
    best_n = 0
    zsum = 0.0
    n = 0
    for d in reversed(hist[2::_REC]):  # d of every kept step, newest first: lookbacks of n = 1, 2, ...
        n += 1
        z = d / sigma
        zsum += z if z < cap else cap
        if n >= min_steps:
            score = zsum / roots[n]
            if score > best:
                best, best_n = score, n
    window_excess = wsum / len(items) if items else 0.0
    if best < p.threshold:  # the common case: nothing more to compute
        return SeqResult(False, max(best, 0.0), best_n, window_excess, None, None)
    # over the best lookback: the median excess (robust: a spike does not move it; the reported value uses it
    # too), the evidence of this and of the previous window's steps, and the evidence left without the
    # strongest run of run_steps consecutive steps
    ds: list[float] = []
    steps: list[float] = []
    zs: list[float] = []
    cur_z = prev_z = 0.0
    cur_k = prev_k = 0
    msum = 0.0
    for j in range(n_total - best_n, n_total):
        w, t, d, m = hist[j * _REC:(j + 1) * _REC]
        z = min(d / sigma, cap)
        ds.append(d)
        steps.append(t)
        zs.append(z)
        msum += m
        if w == fi:
            cur_z += z
            cur_k += 1
        elif w == fi - 1.0:
            prev_z += z
            prev_k += 1
    d_med = median(ds)
    run_z, run_k = strongest_run(steps, zs, p.run_steps)
    fires = (d_med >= p.margin and cur_k > 0 and prev_k > 0 and best_n > run_k
             and cur_z / math.sqrt(cur_k) >= p.window_z and prev_z / math.sqrt(prev_k) >= p.window_z
             and (sum(zs) - run_z) / math.sqrt(best_n - run_k) >= p.rest_z)
    ref = msum / best_n
    return SeqResult(fires, best, best_n, window_excess, ref * (1.0 + d_med), ref)


def strongest_run(steps: list[float], zs: list[float], k: int) -> tuple[float, int]:
    """The largest sum of the values of ``k`` consecutive steps (``steps`` ascending, one value each; sampled
    device timing leaves fewer than ``k`` values in such a run) and how many values it holds."""
    top, top_k = -math.inf, 0
    run = 0.0
    j = 0
    for i, t in enumerate(steps):  # runs starting at each sample: values with step in [t, t + k)
        while j < len(steps) and steps[j] < t + k:
            run += zs[j]
            j += 1
        if run > top:
            top, top_k = run, j - i
        run -= zs[i]
    return top, top_k

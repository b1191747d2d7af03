"""``pair``: which rank of a 2-rank cohort (DP = 2) is slow, when the evidence says so.

Two ranks that differ beyond tolerance in one stage do not say which of them is slow: the slower one may be the
straggler, or the faster one may run on faster hardware, or (a stage that holds a collective wait) be the
straggler the other waits for. So the slower rank is named only on evidence from outside the window's own
comparison, and the pair is otherwise ``uncertain/pair_ambiguous``:

* **change_point**: each rank's baseline is the median of its own window statistic over the latest windows in
  which the pair agreed (within tolerance of each other; both ranks measured over the same steps, so a change
  common to both moves both baselines alike). The slower rank rose beyond tolerance against its baseline while
  the faster one stayed within tolerance of its own: the slower rank changed, its pair did not. A pair that
  differed from its first judged window has no such baseline.
* **other_roles**: the job's other 2-rank cohorts (other TP/CP/... positions, which run the same stage on the
  same steps) at the same window index (this one, else the previous one, so that cohorts closing the same
  window one after the other see each other): every rank of every other cohort within tolerance of the faster
  rank's level, and the slower rank beyond it. Every rank of the job but one agrees, the one is slow. Every
  other rank at the slower rank's level instead contradicts (the faster rank is the odd one), and roles whose
  levels match neither rank's do not compare (different work). Only cohorts held by the same collector
  instance are seen (sharded by cohort, a pair is judged on its change point alone).

Either names the slower rank unless the other contradicts it.

How far apart the two are is measured step by step where both timed the same steps on the device (at least
``MIN_STEPS`` of them in the window): the median over those steps of ``x_a / x_b``, so noise common to both
ranks' steps (the job's step time jitters with clocks, the network, storage) cancels, and the tolerance is
``noise_tolerance``'s with the spread of that ratio (robust, within the window, averaged over the pair's last
``SPREAD_WINDOWS`` windows) in place of one rank's spread: ``max(tolerance, noise_z x 1.2533 x sigma_ratio /
sqrt(2 window_steps))``, the same number of standard errors as a comparison of two ranks' window medians.
Otherwise (sparse device timing, host timing) the ratio of the two window statistics, against the stage's
``noise_tolerance`` measured on the two ranks.

Everything kept is bounded: per cohort and stage (``max_stages`` per cohort) ``pair_history_windows`` windows
at par, the latest ``RECENT_WINDOWS`` windows' levels and ``SPREAD_WINDOWS`` spreads; all go with the cohort
when it is evicted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from collector_processor.processor.straggler.evidence import DEVICE, RankStat, values_of_kind
from collector_processor.processor.straggler.sequential import per_step
from collector_processor.processor.straggler.statistics import median, noise_raised_tolerance, pooled_relative_sigma

RECENT_WINDOWS = 3  # levels kept per pair and stage for other cohorts to compare with at the same index
MIN_STEPS = 3  # steps both ranks timed on the device in a window, for the per-step ratio
SPREAD_WINDOWS = 16  # per-window spreads of the per-step ratio averaged (as sequential_sigma_windows)


@dataclass(slots=True)
class PairTrack:
    """One 2-rank cohort's levels of one stage: ``ranks`` ascending, values in that order."""

    ranks: tuple[int, int]
    par: deque[tuple[str, float, float]]  # (kind, value of ranks[0], of ranks[1]) of the latest windows at par
    recent: deque[tuple[int, str, float, float]] = field(
        default_factory=lambda: deque(maxlen=RECENT_WINDOWS))  # (window index, kind, v0, v1)
    spreads: deque[float] = field(default_factory=lambda: deque(maxlen=SPREAD_WINDOWS))  # of x_0 / x_1 per step

    def at(self, index: int) -> tuple[str, float, float] | None:
        for i, kind, v0, v1 in self.recent:
            if i == index:
                return kind, v0, v1
        return None


@dataclass(slots=True)
class PairWindow:
    """The pair's comparison of one stage in one window, shared by both ranks' judgements."""

    kind: str  # DEVICE or HOST: both ranks' statistic of that kind
    values: dict[int, float]
    tolerance: float
    deviation: dict[int, float]  # each rank's relative excess over the other (negative: faster)
    slow: int | None = None  # the slower rank when the two differ beyond tolerance
    named: bool = False  # the evidence (change point, other roles) names ``slow`` as the straggler

    def other(self, rank: int) -> int:
        return next(r for r in self.values if r != rank)


class _Cohort(Protocol):
    job: str
    ranks: dict
    pairs: dict[str, PairTrack]


def step_ratios(a: RankStat, b: RankStat) -> list[float]:
    """``x_a / x_b`` for every step both ranks timed on the device in the window (several samples of one step
    averaged); empty without steps (wall-clock windows)."""
    if not a.dev_samples or not b.dev_samples or not a.dev_steps or not b.dev_steps:
        return []
    xa = per_step(a.dev_samples, a.dev_steps)
    xb = per_step(b.dev_samples, b.dev_steps)
    return [x / xb[t] for t, x in xa.items() if xb.get(t, 0.0) > 0.0]


def observe(*, name: str, per: dict[int, RankStat], cohort: _Cohort, index: int, comparable: bool,
            tolerance_of: Callable[[str], float], cohorts: Iterable[_Cohort], history: int,
            min_history: int, tolerance: float, noise_z: float, window_steps: int) -> PairWindow | None:
    """The pair's window of stage ``name`` (None unless the cohort has exactly 2 ranks, both judged here with a
    statistic of the same kind and ``comparable`` work): records the levels, and when the two differ beyond
    tolerance, whether the evidence names the slower one. A window at par joins the baselines; a window apart is
    judged against the earlier ones and never joins them. ``tolerance_of(kind)``: the stage's tolerance on the
    two window statistics; ``tolerance``, ``noise_z``, ``window_steps``: the configuration's, for the per-step
    ratio."""
    if len(cohort.ranks) != 2 or len(per) != 2 or not comparable:
        return None
    (a, sa), (b, sb) = sorted(per.items())
    vals = values_of_kind(sa, sb)
    if vals is None:
        return None
    kind, va, vb = vals
    if va <= 0.0 or vb <= 0.0:
        return None
    track = cohort.pairs.get(name)
    if track is None or track.ranks != (a, b) or track.par.maxlen != history:
        track = cohort.pairs[name] = PairTrack((a, b), deque(maxlen=history))
    if track.recent and track.recent[-1][0] == index:
        track.recent.pop()
    track.recent.append((index, kind, va, vb))
    ratios = step_ratios(sa, sb) if kind == DEVICE else []
    if len(ratios) >= MIN_STEPS:
        ratio = median(ratios)
        spread = pooled_relative_sigma([ratios], min_groups=1)
        if spread is not None:
            track.spreads.append(spread)
        tol = tolerance
        if noise_z > 0 and track.spreads:
            sigma = sum(track.spreads) / len(track.spreads)
            tol = noise_raised_tolerance(tolerance, noise_z, sigma, 2.0 * window_steps)
    else:
        ratio = va / vb
        tol = tolerance_of(kind)
    pw = PairWindow(kind, {a: va, b: vb}, tol, {a: ratio - 1.0, b: 1.0 / ratio - 1.0})
    if pw.deviation[a] <= tol and pw.deviation[b] <= tol:
        track.par.append((kind, va, vb))
        return pw
    slow_i = 0 if pw.deviation[a] > tol else 1
    pw.slow = (a, b)[slow_i]
    changed = change_point(track, kind, slow_i, (va, vb), tol, min_history)
    roles = other_roles(track, cohort, name, index, slow_i, tol, cohorts)
    pw.named = (changed or roles > 0) and roles >= 0
    return pw


def change_point(track: PairTrack, kind: str, slow_i: int, values: tuple[float, float], tol: float,
                 min_history: int) -> bool:
    """``change_point``: the slower rank rose beyond ``tol`` against its baseline (its median over the windows at
    par of this kind), the faster one stayed within ``tol`` of its own; False with fewer than ``min_history``
    such windows."""
    hist = [(v0, v1) for k, v0, v1 in track.par if k == kind]
    if len(hist) < min_history:
        return False
    fast_i = 1 - slow_i
    base_slow = median([h[slow_i] for h in hist])
    base_fast = median([h[fast_i] for h in hist])
    if base_slow <= 0.0 or base_fast <= 0.0:
        return False
    rise_slow = values[slow_i] / base_slow - 1.0
    rise_fast = values[fast_i] / base_fast - 1.0
    return rise_slow > tol and abs(rise_fast) <= tol


def other_roles(track: PairTrack, cohort: _Cohort, name: str, index: int, slow_i: int, tol: float,
                cohorts: Iterable[_Cohort]) -> int:
    """``other_roles``: 1 when every rank of the job's other 2-rank cohorts sits within ``tol`` of the faster
    rank's level at the same window index while the slower one is beyond it, -1 when every one sits at the
    slower rank's level, 0 without such evidence (no other cohort, no common index, levels that match neither)."""
    others = [c.pairs[name] for c in cohorts if c is not cohort and c.job == cohort.job and name in c.pairs]
    if not others:
        return 0
    for i in (index, index - 1):
        mine = track.at(i)
        if mine is None:
            continue
        theirs = [t.at(i) for t in others]
        if any(t is None for t in theirs):
            continue
        kind, v0, v1 = mine
        v_slow, v_fast = (v0, v1) if slow_i == 0 else (v1, v0)
        if v_slow / v_fast - 1.0 <= tol:
            return 0  # the pair was not apart at that index: nothing to compare there
        values = [v for t in theirs if t is not None and t[0] == kind for v in t[1:]]
        if len(values) < 2 * len(theirs):
            return 0
        if all(abs(v / v_fast - 1.0) <= tol for v in values):
            return 1
        if all(abs(v / v_slow - 1.0) <= tol for v in values):
            return -1
        return 0
    return 0

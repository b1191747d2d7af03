"""Robust statistics for window judgement (pure functions, no numpy on the hot path)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

_MEDIAN_SE = 1.2533  # standard error of the median of n normal samples = 1.2533 sigma / sqrt(n)


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (mean of the two middle values for an even count)."""
    n = len(values)
    if n == 0:
        raise ValueError("median of an empty sequence")
    if n == 1:
        return float(values[0])
    ordered = sorted(values)
    mid = n // 2
    if n % 2:
        return float(ordered[mid])
    return (ordered[mid - 1] + ordered[mid]) / 2.0


# Median of |x - sample median| over samples of n standard normals, the sample median's own zero deviation
# left out for odd n (computed by simulation): divides a pooled median deviation into a sigma estimate.
_SPREAD_CONSISTENCY = {3: 0.697, 4: 0.483, 5: 0.690, 6: 0.527, 7: 0.680, 8: 0.564, 9: 0.678, 10: 0.587,
                       11: 0.678, 12: 0.607}


def pooled_relative_sigma(groups: Iterable[Sequence[float]], min_groups: int = 3) -> float | None:
    """Robust estimate of the relative per-sample sigma shared by several groups (one rank's samples of one
    stage each): every sample's distance to its group's median, relative to that median and scaled to a
    sigma for the group's size, pooled, then the median. Spikes and a group that is offset as a whole (a
    slow rank) do not move it. None with fewer than ``min_groups`` groups of at least 3 positive samples."""
    pooled: list[float] = []
    groups_used = 0
    for vals in groups:
        n = len(vals)
        if n < 3:
            continue
        ordered = sorted(vals)
        mid = n // 2
        m = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0
        if m <= 0.0:
            continue
        c = _SPREAD_CONSISTENCY.get(n, 0.65) * m
        devs = [abs(v - m) / c for v in ordered]
        if n % 2:
            del devs[mid]
        pooled.extend(devs)
        groups_used += 1
    if groups_used < min_groups:
        return None
    return median(pooled)


def noise_raised_tolerance(tolerance: float, noise_z: float, sigma: float | None, samples: float) -> float:
    """``tolerance``, raised to ``noise_z`` standard errors of a median of ``samples`` samples of relative sigma
    ``sigma``: ``max(tolerance, noise_z x 1.2533 x sigma / sqrt(samples))``; ``tolerance`` when ``sigma`` is
    None (no noise measured)."""
    if sigma is None:
        return tolerance
    return max(tolerance, noise_z * _MEDIAN_SE / math.sqrt(samples) * sigma)


def relative_deviation(value: float, reference: float) -> float | None:
    """(value - reference) / reference, None when the reference is not positive."""
    if reference <= 0.0:
        return None
    return (value - reference) / reference


def reference_of(values: dict[int, float], mode: str, quantile: float = 0.0) -> tuple[int, float] | None:
    """The reference peer and its value: the fastest (lowest; with ``quantile`` > 0 the peer at that low
    quantile, so a large cohort's extreme-value noise does not set the bar), or the peer at the median."""
    if not values:
        return None
    items = sorted(values.items(), key=lambda kv: (kv[1], kv[0]))
    if mode == "fastest":
        return items[int(quantile * (len(items) - 1))]
    mid = median([v for _, v in items])
    rank, _ = min(items, key=lambda kv: (abs(kv[1] - mid), kv[0]))
    return rank, mid


def within_relative(a: float, b: float, tolerance: float) -> bool:
    """|a - b| / max(a, b) <= tolerance (symmetric, defined for zeros)."""
    hi = max(abs(a), abs(b))
    if hi == 0.0:
        return True
    return abs(a - b) / hi <= tolerance


class SortedPeers:
    """Values of one stage in one window, sorted once, answering "reference among everyone but rank r" in
    O(1) (fastest) or O(1) after an O(n log n) sort (median): judging n ranks costs O(n log n), not O(n^2)."""

    __slots__ = ("_pos", "_ranks", "_vals")

    def __init__(self, values: dict[int, float]) -> None:
        items = sorted(values.items(), key=lambda kv: (kv[1], kv[0]))
        self._ranks = [r for r, _ in items]
        self._vals = [v for _, v in items]
        self._pos = {r: i for i, r in enumerate(self._ranks)}

    def peers(self, rank: int) -> int:
        return len(self._vals) - (1 if rank in self._pos else 0)

    def lowest(self, rank: int) -> float | None:
        """The smallest value among everyone but ``rank`` (None without one): a bound under any reference."""
        vals = self._vals
        if not vals:
            return None
        if self._pos.get(rank) != 0:
            return vals[0]
        return vals[1] if len(vals) > 1 else None

    def _at(self, k: int, skip: int) -> int:
        return k if (skip < 0 or k < skip) else k + 1

    def reference(self, rank: int, mode: str, quantile: float = 0.0) -> tuple[int, float] | None:
        skip = self._pos.get(rank, -1)
        n = self.peers(rank)
        if n <= 0:
            return None
        if mode == "fastest":
            i = self._at(int(quantile * (n - 1)), skip)
            return self._ranks[i], self._vals[i]
        lo = self._at((n - 1) // 2, skip)
        hi = self._at(n // 2, skip)
        return self._ranks[lo], (self._vals[lo] + self._vals[hi]) / 2.0

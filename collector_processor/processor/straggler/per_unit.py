"""``per_unit``: ranks whose work varies step to step (MoE routing, packed sequences) compared per unit of work.

Where every rank publishes its tokens per step and the cohort's tokens spread beyond ``workload_tolerance``
from step to step, one stage's time over the window's samples is a fixed cost plus a cost per token,
``time = a + b * tokens``. ``b`` is each rank's Theil-Sen slope, then the median over ranks (``slope``: neither
a spike nor one slow rank among its peers moves it); ``a`` needs no estimate of its own. Each sample is then
brought to the cohort's median tokens, ``time - b * (tokens - median)``: the time the rank would have taken on
the median workload. The rules then judge those values as any other (``rules/``): a rank whose time per
token is 10 % over its peers' is 10 % slower at the median workload, the token spread no longer counts as
noise, and the cost stays in milliseconds of the step.

Where the tokens do not spread (every step's work alike, or one rank's work constantly different: its time
cannot be told from its work with no spread of its own) nothing is fitted and the ``workload`` rule decides
as before; so does a stage where a rank's tokens cannot be paired sample by sample with its times.
"""

from __future__ import annotations

from collections.abc import Sequence

from collector_processor.processor.straggler.evidence import RankStat
from collector_processor.processor.straggler.statistics import median


def spread(tokens: Sequence[float]) -> float:
    """Interquartile range of ``tokens`` over their median (0 when the median is not positive)."""
    xs = sorted(tokens)
    n = len(xs)
    mid = median(xs)
    if n < 4 or mid <= 0:
        return 0.0
    return (xs[(3 * n) // 4] - xs[n // 4]) / mid


def slope(series: list[tuple[Sequence[float], Sequence[float]]], min_ranks: int) -> float | None:
    """Cost per token of one stage: each rank's Theil-Sen slope (the median of its samples' pairwise slopes,
    so one spike does not move it), then the median over ranks (so one slow rank does not). ``series``: per
    rank, (tokens, times) paired sample by sample. None with fewer than ``min_ranks`` ranks with two samples
    of different tokens."""
    per_rank: list[float] = []
    for toks, ys in series:
        n = len(ys)
        pair_slopes = [(ys[j] - ys[i]) / (toks[j] - toks[i])
                       for i in range(n) for j in range(i + 1, n) if toks[j] != toks[i]]
        if pair_slopes:
            per_rank.append(median(pair_slopes))
    if len(per_rank) < min_ranks:
        return None
    return median(per_rank)


def _aligned(per: dict[int, RankStat], kind_dev: bool) -> bool:
    for st in per.values():
        samples = st.dev_samples if kind_dev else st.host_samples
        if samples and (st.tokens is None or len(st.tokens) != len(samples)):
            return False
    return True


def normalise(per: dict[int, RankStat], tolerance: float, min_ranks: int) -> float | None:
    """Bring every rank's samples of one stage to the cohort's median tokens, in place (each ``RankStat`` of
    ``per`` replaced); returns that median, or None when the stage is not judged per unit (too few ranks with
    tokens, tokens within ``tolerance`` of each other, a rank whose tokens cannot be paired with its samples,
    or no fit). Device samples pooled from earlier windows are not this window's and keep the stage out."""
    if len(per) < min_ranks:
        return None
    pooled: list[float] = []
    for st in per.values():
        if not st.tokens:
            return None
        pooled.extend(st.tokens)
    if spread(pooled) <= tolerance:
        return None
    has_dev = any(st.dev_samples for st in per.values())
    has_host = any(st.host_samples for st in per.values())
    if (has_dev and not _aligned(per, True)) or (has_host and not _aligned(per, False)):
        return None
    ref = median(pooled)
    b_dev = slope([(st.tokens or (), st.dev_samples) for st in per.values() if st.dev_samples], min_ranks) \
        if has_dev else None
    b_host = slope([(st.tokens or (), st.host_samples) for st in per.values() if st.host_samples], min_ranks) \
        if has_host else None
    if (has_dev and b_dev is None) or (has_host and b_host is None):
        return None
    for r, st in per.items():
        toks = st.tokens or []
        dev = [y - b_dev * (t - ref) for t, y in zip(toks, st.dev_samples, strict=True)] \
            if b_dev is not None and st.dev_samples else []
        host = [y - b_host * (t - ref) for t, y in zip(toks, st.host_samples, strict=True)] \
            if b_host is not None and st.host_samples else []
        per[r] = RankStat(median(dev) if dev else None, dev, host, dev_steps=st.dev_steps, tokens=st.tokens)
    return ref

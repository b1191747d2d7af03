"""Unit tests of rule 11's arithmetic (``sequential.py``): the per-step leave-one-out median, the spread and
the lookback statistic. The rule's behaviour in the detector is tested in ``test_straggler_rules.py``."""

from __future__ import annotations

import math
import random
import statistics

from collector_processor.processor.straggler import sequential as q
from collector_processor.processor.straggler.state import RankStageState


def _samples(series: dict[int, dict[int, float]]) -> list[tuple[int, list[int], list[float]]]:
    return [(r, list(s), list(s.values())) for r, s in series.items()]


def test_excess_uses_the_median_of_the_other_ranks_of_the_same_step() -> None:
    rng = random.Random(3)
    for n in range(2, 12):
        series = {r: {t: rng.choice([10.0, 11.0, rng.uniform(5, 15)]) for t in range(5) if rng.random() < 0.9}
                  for r in range(n)}
        got = q.excess(_samples(series), 2)
        for r, items in got.items():
            for t, x, m in items:
                others = [series[p][t] for p in series if p != r and t in series[p]]
                assert x == series[r][t]
                assert math.isclose(m, statistics.median(others)), (n, r, t)
        # every step with >= 2 ranks is there, in step order
        for r in series:
            steps = [t for t in sorted(series[r]) if sum(1 for p in series if t in series[p]) >= 2]
            assert [t for t, _, _ in got.get(r, [])] == steps


def test_excess_averages_several_samples_of_one_step() -> None:
    """Stage spans in interval detail: one sample per microbatch; the step's value is their mean."""
    got = q.excess([(0, [1, 1, 2], [10.0, 12.0, 10.0]), (1, [1, 2], [10.0, 10.0]), (2, [1, 2], [10.0, 10.0])], 3)
    assert got[0] == [(1, 11.0, 10.0), (2, 10.0, 10.0)]


def test_excess_leaves_out_steps_with_too_few_ranks() -> None:
    series = {0: {1: 10.0, 2: 10.0}, 1: {1: 11.0, 2: 10.0}, 2: {1: 12.0}}
    got = q.excess(_samples(series), 3)
    assert {r: [t for t, _, _ in v] for r, v in got.items()} == {0: [1], 1: [1], 2: [1]}


def test_spread_is_the_per_step_sigma_and_ignores_a_slow_rank() -> None:
    rng = random.Random(5)
    series = {r: {t: 20.0 * (1.0 + rng.gauss(0, 0.02)) * (1.3 if r == 0 else 1.0) for t in range(200)}
              for r in range(8)}
    sigma = q.spread(q.excess(_samples(series), 3).values(), 3)
    assert sigma is not None and 0.019 < sigma < 0.026  # 2 % x 1.106 (the peers' median noise)


def _feed(st: RankStageState, index: int, ds: list[float], sigma: float = 0.02) -> q.SeqResult:
    items = [(index * 5 + i, 100.0 * (1.0 + d), 100.0) for i, d in enumerate(ds)]
    return q.update(st, index, items, sigma, 0.025, 3.0, 5.5, 6, 20)


def test_lookback_statistic_fires_on_two_windows_of_evidence_only() -> None:
    st = RankStageState()
    r = _feed(st, 0, [0.05] * 5)  # one window at +5 %: 2.5 sigma per step, but one window only
    assert not r.fires and r.steps == 0
    r = _feed(st, 1, [0.05] * 5)  # ten steps: 2.5 x sqrt(10) = 7.9 >= 5.5, both windows slow
    assert r.fires and r.steps == 10 and math.isclose(r.score, 2.5 * math.sqrt(10))
    assert r.reference_ms is not None and r.value_ms is not None and math.isclose(r.value_ms / r.reference_ms, 1.05)
    st = RankStageState()
    _feed(st, 0, [0.3] * 5)  # a +30 % window (capped at 3 sigma per step), then par
    r = _feed(st, 1, [0.0] * 5)
    assert not r.fires  # this window's median excess is 0: no conviction, however large the sum
    st = RankStageState()
    _feed(st, 0, [0.05] * 5)
    r = _feed(st, 2, [0.05] * 5)  # window 1 missing: the history restarts
    assert not r.fires and r.steps == 0


def test_lookback_statistic_needs_the_margin_not_just_significance() -> None:
    st = RankStageState()
    _feed(st, 0, [0.01] * 5, sigma=0.001)  # +1 % on a very quiet stage: 10 sigma per step, under the margin
    r = _feed(st, 1, [0.01] * 5, sigma=0.001)
    assert r.score > 5.5 and not r.fires


def test_history_is_bounded() -> None:
    st = RankStageState()
    for i in range(50):
        _feed(st, i, [0.0] * 5)
    assert st.seq_hist is not None and len(st.seq_hist) == 20 * 3

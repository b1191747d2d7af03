"""Unit tests of sequential_excess's arithmetic (``sequential.py``): the per-step leave-one-out median, the spread and
the lookback statistic. The rule's behaviour in the detector is tested in ``test_straggler_rules.py``."""

from __future__ import annotations

import math
import random
import statistics

from collector_processor.processor.straggler import sequential as q
from collector_processor.processor.straggler.state import RankStageState
from collector_processor.processor.straggler.statistics import pooled_relative_sigma


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


_PARAMS = q.SeqParams(margin=0.025, cap=3.0, threshold=5.5, min_steps=6, history=20, run_steps=5, window_z=2.0,
                      rest_z=3.0)


def _feed(st: RankStageState, index: int, ds: list[float], sigma: float = 0.02) -> q.SeqResult:
    items = [(index * 5 + i, 100.0 * (1.0 + d), 100.0) for i, d in enumerate(ds)]
    return q.update(st, index, items, sigma, _PARAMS)


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


def test_one_window_of_evidence_never_convicts_however_it_straddles_two_windows() -> None:
    """Five +30 % steps (capped at 3 sigma each), the first at the end of window 1 and four in window 2, then
    par: over the last 6 steps T = 15 / sqrt(6) = 6.1 and both windows' steps are slow (a margin on each
    window's median would convict here). Without the strongest run of 5 steps nothing is left:
    no conviction. One more slow step (six in a row) is evidence beyond one window's run and convicts."""
    st = RankStageState()
    _feed(st, 0, [0.0] * 5)
    _feed(st, 1, [0.0, 0.0, 0.0, 0.0, 0.3])
    r = _feed(st, 2, [0.3, 0.3, 0.3, 0.3, 0.0])
    assert r.score > 5.5 and r.steps == 6 and not r.fires
    st = RankStageState()
    _feed(st, 0, [0.0] * 5)
    _feed(st, 1, [0.0, 0.0, 0.0, 0.0, 0.3])
    r = _feed(st, 2, [0.3] * 5)
    assert r.fires and r.steps == 6  # the 6th step alone reaches 3 sigma (the cap)


def test_two_windows_of_evidence_with_one_window_median_under_the_margin_convict() -> None:
    """+5 % then a window at +6, +6, +2, +2, +2 %: its median (+2 %) is under the 2.5 % margin, which would
    stop a margin on each window's median; its steps still carry 4 sigma of evidence of their own and the
    lookback's median is +5 %: convicted."""
    st = RankStageState()
    _feed(st, 0, [0.05] * 5)
    r = _feed(st, 1, [0.06, 0.06, 0.02, 0.02, 0.02])
    assert r.fires and r.steps == 10


def test_a_rank_slow_in_every_other_window_is_not_convicted_on_the_windows_at_par() -> None:
    """Slow, par, slow: the lookback over all three is far beyond the threshold and its median beyond the
    margin, but the previous window's steps carry no evidence (and at the par window's close this window's
    steps carry none): no conviction."""
    st = RankStageState()
    for i in range(8):
        r = _feed(st, i, [0.3 if i % 2 == 0 else 0.0] * 5)
        assert not r.fires, i
    assert r.score > 5.5


def test_strongest_run_is_over_consecutive_steps_not_samples() -> None:
    """Every step sampled: the run of k values; sampled device timing (steps 0, 4, 8, ...): a run of 5 steps
    holds 1-2 samples."""
    assert q.strongest_run([0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 3.0, 0.0, 2.0], 2) == (6.0, 2)
    assert q.strongest_run([0.0, 1.0, 2.0], [1.0, -1.0, 2.0], 3) == (2.0, 3)
    assert q.strongest_run([0.0, 1.0], [1.0, 2.0], 5) == (3.0, 2)
    assert q.strongest_run([0.0, 4.0, 8.0, 12.0], [3.0, 3.0, 3.0, 1.0], 5) == (6.0, 2)
    assert q.strongest_run([0.0, 4.0, 9.0, 12.0], [3.0, 1.0, 3.0, 3.0], 5) == (6.0, 2)
    assert q.strongest_run([0.0, 5.0, 10.0], [1.0, 3.0, 2.0], 5) == (3.0, 1)


def test_lookback_statistic_needs_the_margin_not_just_significance() -> None:
    st = RankStageState()
    _feed(st, 0, [0.01] * 5, sigma=0.001)  # +1 % on a very quiet stage: 10 sigma per step, under the margin
    r = _feed(st, 1, [0.01] * 5, sigma=0.001)
    assert r.score > 5.5 and not r.fires


def test_history_is_bounded() -> None:
    st = RankStageState()
    for i in range(50):
        _feed(st, i, [0.0] * 5)
    assert st.seq_hist is not None and len(st.seq_hist) == 20 * 4



def _gaussian_window(rng: random.Random, noise: float) -> dict[int, dict[int, float]]:
    return {r: {t: 20.0 * (1.0 + rng.gauss(0, noise)) for t in range(5)} for r in range(8)}


def test_spread_is_an_unbiased_standard_deviation_steadier_than_the_median_distance() -> None:
    rng = random.Random(11)
    sds: list[float] = []
    robust: list[float] = []
    ds: list[float] = []
    for _ in range(1500):
        items = list(q.excess(_samples(_gaussian_window(rng, 0.02)), 3).values())
        s = q.spread(items, 3)
        assert s is not None
        sds.append(s)
        robust.append(pooled_relative_sigma([[x / m for _, x, m in lst] for lst in items], 3) or 0.0)
        ds.extend(x / m - 1.0 for lst in items for _, x, m in lst)
    # c4-corrected: the square root of a pooled variance alone reads ~1.3 % low
    assert abs(statistics.mean(sds) / statistics.pstdev(ds) - 1.0) < 0.008
    rel_sd = statistics.pstdev(sds) / statistics.mean(sds)
    rel_robust = statistics.pstdev(robust) / statistics.mean(robust)
    assert rel_sd < 0.17 < 0.2 < rel_robust


def test_spread_leaves_spikes_out() -> None:
    rng = random.Random(3)
    ratios: list[float] = []
    for _ in range(300):
        series = _gaussian_window(rng, 0.02)
        clean = q.spread(q.excess(_samples(series), 3).values(), 3)
        for r in rng.sample(range(8), 2):  # two of the window's 40 samples x1.3-3
            series[r][rng.randrange(5)] *= rng.uniform(1.3, 3.0)
        spiky = q.spread(q.excess(_samples(series), 3).values(), 3)
        assert clean is not None and spiky is not None
        ratios.append(spiky / clean)
    # a spike kept would multiply the spread several times (one +30 % sample among 40 at 2 % noise: ~2.4x);
    # left out, what remains is its move of the other ranks' per-step medians (d is relative to them)
    assert 0.95 < statistics.mean(ratios) < 1.05 and max(ratios) < 1.5

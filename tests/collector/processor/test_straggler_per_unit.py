"""Per-unit comparison (``per_unit.py``): a cohort whose tokens vary +-30 % per rank and step, with compute
proportional to tokens, is judged at the cohort's median workload instead of being set aside."""

from __future__ import annotations

import random

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory
from collector_processor.processor.straggler.evidence import RankStat
from collector_processor.processor.straggler.model import Verdict
from collector_processor.processor.straggler.per_unit import normalise, slope
from collector_processor.telemetry import Telemetry
from jobsim.faults import COMPUTE_STAGES, Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, SimConfig

SLOW = 5  # rank 5 (cohort tp=1 of DP 8 x TP 2)


def _run(fault: Fault | None, seed: int, **overrides: object) -> list[Verdict]:
    verdicts: list[Verdict] = []
    cfg = factory.create_default_config().model_copy(update=overrides)
    proc = factory.create_processor(cfg, Telemetry(), verdicts.extend)
    proc.start()
    sim = SimConfig(layout=Layout(tp=2, dp=8), steps=120, token_spread=0.3, seed=seed)
    for _step, req in JobStream(sim, [fault] if fault else []):
        proc.process_traces(req)
        proc.tick(0.0)
    proc.shutdown(5.0)
    return verdicts


def _stragglers(verdicts: list[Verdict]) -> set[int]:
    return {v.rank for v in verdicts if v.verdict == s.VERDICT_STRAGGLER}


def test_a_rank_10_percent_slower_per_token_is_convicted_under_moe_token_spread() -> None:
    fault = Fault("device", SLOW, COMPUTE_STAGES, 0.10, 40)
    for seed in (1, 2, 3):
        verdicts = _run(fault, seed)
        assert _stragglers(verdicts) == {SLOW}, seed
        first = min((v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER), key=lambda v: v.window_end)
        assert first.window_end - 40 <= 15  # within the 15-step bound
        fwd = [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER and v.stage == "forward-compute"]
        for v in fwd:  # the cost is milliseconds of a step at the cohort's median workload: ~10 % of 48 ms
            assert 2.5 < v.step_time_lost_ms < 8.0
            assert v.attribution == s.ATTRIBUTION_GPU


def test_healthy_ranks_under_moe_token_spread_are_not_convicted() -> None:
    for seed in (4, 5, 6):
        assert _stragglers(_run(None, seed)) == set(), seed


def test_without_per_unit_the_token_spread_sets_the_cohort_aside() -> None:
    verdicts = _run(Fault("device", SLOW, COMPUTE_STAGES, 0.10, 40), 1, per_unit=False)
    assert _stragglers(verdicts) == set()


def _stat(tokens: list[int], times: list[float]) -> RankStat:
    return RankStat(sorted(times)[len(times) // 2], times, [t * 0.3 for t in times], tokens=tokens)


def test_the_slope_is_resistant_to_one_slow_rank() -> None:
    rng = random.Random(7)
    series = []
    for r in range(8):
        toks = [rng.uniform(0.7, 1.3) * 1000 for _ in range(5)]
        times = [(2.0 + 0.05 * t) * (1.5 if r == 3 else 1.0) * rng.gauss(1.0, 0.01) for t in toks]
        if r == 5:
            times[2] *= 3.0  # a spike
        series.append((toks, times))
    b = slope(series, 3)
    assert b is not None and abs(b - 0.05) < 0.004
    assert slope(series[:2], 3) is None


def test_uniform_or_constant_work_is_left_to_the_workload_rule() -> None:
    same = {r: _stat([1000] * 5, [50.0 + r * 0.1] * 5) for r in range(8)}
    assert normalise(dict(same), 0.05, 3) is None
    # one rank's work constantly 20 % higher: no spread of its own, nothing to fit
    odd = dict(same)
    odd[7] = _stat([1200] * 5, [60.0] * 5)
    assert normalise(odd, 0.05, 3) is None
    # a rank whose tokens cannot be paired with its samples keeps the stage out
    rng = random.Random(1)
    spread = {r: _stat([int(rng.uniform(700, 1300)) for _ in range(5)], [50.0] * 5) for r in range(8)}
    spread[2] = _stat([1000] * 4, [50.0] * 5)
    assert normalise(spread, 0.05, 3) is None


def test_samples_are_brought_to_the_median_workload() -> None:
    rng = random.Random(3)
    per = {}
    for r in range(8):
        toks = [int(rng.uniform(700, 1300)) for _ in range(5)]
        per[r] = _stat(toks, [0.05 * t * (1.1 if r == 0 else 1.0) for t in toks])
    ref = normalise(per, 0.05, 3)
    assert ref is not None
    for r, st in per.items():
        assert st.dev is not None
        want = 0.05 * ref * (1.1 if r == 0 else 1.0)
        assert abs(st.dev - want) / want < (0.04 if r == 0 else 0.01)


def test_tokens_varying_per_step_are_judged_per_unit_even_when_the_ranks_medians_agree() -> None:
    """Every rank runs the same cycle of tokens, shifted by rank: each rank's median tokens per window is the
    same (the cohort looks uniform), yet every step's time follows its tokens. Per unit, rank 2 at +10 % per
    token is convicted; without it the spread raises the noise tolerance past the fault."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from straggler_sim import Sim, make_processor, run

    cycle = (700, 1000, 1300, 850, 1150)

    def tokens(rank: int, step: int) -> int:
        return cycle[(step + rank) % len(cycle)]

    def device(rank: int, stage: str, step: int) -> float:
        if stage not in ("forward-compute", "backward-compute"):
            return 1.0
        return tokens(rank, step) / 1000 * (1.10 if rank == 2 and step >= 20 else 1.0)

    got = {}
    for per_unit in (True, False):
        cfg = factory.create_default_config().model_copy(update={"per_unit": per_unit})
        proc, emitted, _ = make_processor(cfg)
        run(proc, Sim(ranks=6, noise=0.01, tokens=tokens, device_factor=device, stage_tokens=True), range(1, 61))
        proc.shutdown(5.0)
        got[per_unit] = {v.rank for v in emitted if v.verdict == s.VERDICT_STRAGGLER}
    assert got[True] == {2}
    assert got[False] == set()

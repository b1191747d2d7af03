"""``pair``: who is slow in a 2-rank cohort (DP = 2), on hand-built requests with exact values and on the
simulator. Each test also shows what the same data gives without the rule, or without the evidence it uses."""

from __future__ import annotations

from straggler_build import request, span
from straggler_sim import Sim, make_processor, run

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory
from collector_processor.processor.straggler.config import Config
from collector_processor.telemetry import Telemetry
from jobsim.faults import Fault
from jobsim.job import Layout
from jobsim.score import score_run
from jobsim.stream import JobStream, SimConfig

PAR = 60.0
STAGE = "forward-compute"


def feed(proc, steps, value_of, cohorts=("A",)):  # type: ignore[no-untyped-def]
    """value_of(cohort, rank, step) -> device ms or None; ranks 0, 1 in each cohort (global rank 2 c + r)."""
    for st in steps:
        per: dict[tuple[str, int], list] = {}
        for ci, c in enumerate(cohorts):
            for r in (0, 1):
                v = value_of(c, r, st)
                if v is not None:
                    per[(c, 2 * ci + r)] = [span(STAGE, st, v, 10.0)]
        for c in cohorts:
            part = {rank: spans for (cc, rank), spans in per.items() if cc == c}
            if part:
                proc.process_traces(request(part, cohort=c, world=2 * len(cohorts)))


def verdicts(emitted, rank=None):  # type: ignore[no-untyped-def]
    for v in emitted:
        assert v.verdict in s.VERDICTS and v.reason in s.REASONS
    return [(v.verdict, v.reason) for v in emitted if rank is None or v.rank == rank]


def stragglers(emitted):  # type: ignore[no-untyped-def]
    return [(v.rank, v.stage, v.reason, v.reference_rank) for v in emitted if v.verdict == s.VERDICT_STRAGGLER]


def test_change_point_names_the_rank_that_rose_against_its_own_history() -> None:
    """At par for 40 steps, then rank 1 +20 %: rank 1 rose against its baseline, rank 0 did not."""
    def val(c, r, st):  # type: ignore[no-untyped-def]
        return PAR * 1.2 if (r == 1 and 40 <= st < 80) else PAR

    proc, emitted, _ = make_processor()
    feed(proc, range(0, 100), val)
    assert stragglers(emitted) == [(1, STAGE, "slower_than_reference", 0)]
    v = next(v for v in emitted if v.verdict == s.VERDICT_STRAGGLER)
    assert v.step is not None and 40 <= v.step <= 55 and v.cohort_size == 2
    assert abs((v.deviation or 0) - 0.2) < 1e-9
    assert (s.VERDICT_RECOVERED, "within_tolerance") in verdicts(emitted, rank=1)
    assert not [x for x in emitted if x.rank == 0 and x.verdict != s.VERDICT_UNCERTAIN]
    # without the rule a 2-rank cohort is never judged
    proc0, emitted0, _ = make_processor(Config(pair=False))
    feed(proc0, range(0, 100), val)
    assert stragglers(emitted0) == []
    assert (s.VERDICT_UNCERTAIN, "cohort_below_min_size") in verdicts(emitted0, rank=1)


def test_a_pair_whose_faster_rank_changed_stays_uncertain() -> None:
    """Rank 0 becomes 20 % faster (rank 1 is now the slower one without having changed), or both slow down
    by different amounts: no rank is named, the slower one is uncertain/pair_ambiguous."""
    for fast, slow in ((0.8, 1.0), (1.1, 1.3)):
        def val(c, r, st, fast=fast, slow=slow):  # type: ignore[no-untyped-def]
            if st < 40:
                return PAR
            return PAR * (fast if r == 0 else slow)

        proc, emitted, _ = make_processor()
        feed(proc, range(0, 80), val)
        assert stragglers(emitted) == [], (fast, slow)
        assert verdicts(emitted, rank=1) == [(s.VERDICT_UNCERTAIN, "pair_ambiguous")]
        assert proc.stats()["pair_ambiguous_windows"] >= 7


def test_other_roles_name_a_rank_slow_from_its_first_step() -> None:
    """Cohort A's rank 1 is +20 % from step 0 (no history at par); cohort B (another TP position, same work)
    runs at rank 0's level: every other rank of the job agrees with rank 0. Alone, or with a cohort B whose
    ranks sit at rank 1's level or at neither level, the pair stays uncertain."""
    def job(b_level: float | None):  # type: ignore[no-untyped-def]
        def val(c, r, st):  # type: ignore[no-untyped-def]
            if c == "A":
                return PAR * 1.2 if r == 1 else PAR
            return b_level

        proc, emitted, _ = make_processor()
        feed(proc, range(0, 60), val, cohorts=("A", "B") if b_level is not None else ("A",))
        return emitted

    assert stragglers(job(PAR)) == [(1, STAGE, "slower_than_reference", 0)]
    for b_level in (None, PAR * 1.2, PAR * 1.5):
        emitted = job(b_level)
        assert stragglers(emitted) == [], b_level
        assert (s.VERDICT_UNCERTAIN, "pair_ambiguous") in verdicts(emitted, rank=1)


def test_a_change_point_contradicted_by_the_other_roles_stays_uncertain() -> None:
    """Rank 1 of cohort A rose, but so did both ranks of cohort B at the same steps (every other rank of the
    job is at rank 1's level: rank 0 is the odd one): no rank is named."""
    def val(c, r, st):  # type: ignore[no-untyped-def]
        late = st >= 40
        if c == "A":
            return PAR * 1.2 if (r == 1 and late) else PAR
        return PAR * 1.2 if late else PAR

    proc, emitted, _ = make_processor()
    feed(proc, range(0, 80), val, cohorts=("A", "B"))
    assert stragglers(emitted) == []
    assert (s.VERDICT_UNCERTAIN, "pair_ambiguous") in verdicts(emitted, rank=1)


def test_healthy_noisy_pair_is_judged_and_never_convicted() -> None:
    """Two ranks at 2 % noise with heavy-tail spikes for 400 steps: judged every window (no min_cohort
    uncertainty after warmup), no verdict."""
    proc, emitted, _ = make_processor()
    run(proc, Sim(ranks=2, noise=0.02, spike_prob=0.01, seed=5), range(0, 400))
    assert stragglers(emitted) == []
    assert proc.stats()["below_min_cohort_windows"] == 0


def test_dp2_job_in_the_simulator_finds_the_slow_rank_without_false_alarms() -> None:
    """DP 2 x TP 2 (two 2-rank cohorts), noise, warmup skew, a late rank and spikes: +10 % on one rank's
    forward-compute from step 50 is found on that rank within 15 steps; the healthy job gives no verdict."""
    def run_job(fault: Fault | None, seed: int) -> tuple:  # type: ignore[type-arg]
        verdicts_: list = []
        proc = factory.create_processor(factory.create_default_config(), Telemetry(), verdicts_.extend)
        proc.start()
        stream = JobStream(SimConfig(layout=Layout(tp=2, dp=2), steps=150, seed=seed), [fault] if fault else [])
        for _step, req in stream:
            proc.process_traces(req)
        proc.shutdown(5.0)
        return score_run(fault, verdicts_, stream.healthy_rank_steps), verdicts_

    fault = Fault("device", 3, (STAGE,), 0.10, 50, 110)
    score, found = run_job(fault, 11)
    assert score.detected and score.false_alarms == 0 and score.stage_correct
    assert score.steps_to_detect is not None and score.steps_to_detect <= 15
    assert score.recovered_after is not None
    healthy, found = run_job(None, 12)
    assert healthy.false_alarms == 0 and not [v for v in found if v.verdict == s.VERDICT_STRAGGLER]


def test_noise_common_to_both_ranks_cancels_in_the_per_step_ratio() -> None:
    """The job's step time jitters by 3 % on both ranks alike (0.5 % of their own): rank 1's +10 % from step 40
    is named within 15 steps, because the pair is compared step by step (x_1 / x_0 on the same steps), not by
    two window medians each carrying the common noise (whose within-rank spread would raise the tolerance to
    about +13 %); the healthy run gives no verdict."""
    import random

    def job(slow: float) -> list:  # type: ignore[type-arg]
        rng = random.Random(7)
        common = {st: 1.0 + rng.gauss(0.0, 0.03) for st in range(0, 120)}
        own = {(r, st): 1.0 + rng.gauss(0.0, 0.005) for r in (0, 1) for st in range(0, 120)}

        def val(c, r, st):  # type: ignore[no-untyped-def]
            f = slow if (r == 1 and st >= 40) else 1.0
            return PAR * common[st] * own[(r, st)] * f

        proc, emitted, _ = make_processor()
        feed(proc, range(0, 120), val)
        return emitted

    found = [v for v in job(1.10) if v.verdict == s.VERDICT_STRAGGLER]
    assert [(v.rank, v.reference_rank) for v in found] == [(1, 0)]
    assert found[0].step is not None and found[0].step <= 40 + 15
    assert stragglers(job(1.0)) == []

"""A re-run under the same job id is a new run: the collector judges it as it judged the first, in cohorts of its
own (``straggler.run.id``), and its verdict points at the re-run's own step trace. Without a run id the second run's
steps fall behind the first run's closed windows: rejected as late, and the warning says it is a re-run and how to
tell runs apart, not that delivery is slow."""

from __future__ import annotations

import logging

import pytest
from straggler_sim import Sim, make_processor, run

import otel_straggler_schema as s
from jobsim.arrival import SimClock


def _slow(rank: int, stage: str, step: int) -> float:
    return 1.3 if rank == 3 and stage == "forward-compute" and step >= 20 else 1.0


def _two_runs(first_run: str, second_run: str):  # type: ignore[no-untyped-def]
    clock = SimClock()
    proc, verdicts, _ = make_processor(clock=clock)
    run(proc, Sim(job="pretrain", run=first_run, seed=1), range(0, 160), clock=clock)
    first = len(verdicts)
    run(proc, Sim(job="pretrain", run=second_run, seed=2, device_factor=_slow), range(0, 160), clock=clock)
    proc.shutdown(5.0)
    return proc, verdicts[:first], verdicts[first:]


def test_a_re_run_with_its_own_run_id_is_judged_as_the_first_run_was() -> None:
    proc, first, second = _two_runs("a1b2c3", "d4e5f6")
    assert proc.stats()["rejected_late"] == 0
    assert not [v for v in first if v.verdict == s.VERDICT_STRAGGLER]
    slow = [v for v in second if v.verdict == s.VERDICT_STRAGGLER]
    assert {(v.job, v.rank, v.stage) for v in slow} == {("pretrain", 3, "forward-compute")}
    v = slow[0]
    assert s.cohort_run(v.cohort) == "d4e5f6"
    # the verdict points at the re-run's step trace, which the first run's step of that number does not share
    assert v.trace_id == s.trace_id_for_step("pretrain", v.step, "d4e5f6").to_bytes(16, "big")
    assert v.trace_id != s.trace_id_for_step("pretrain", v.step, "a1b2c3").to_bytes(16, "big")


def test_without_run_ids_the_re_run_is_late_and_the_warning_says_it_is_a_re_run(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="collector_processor.processor.straggler.processor")
    proc, _, second = _two_runs("", "")
    assert proc.stats()["rejected_late"] > 0
    assert not [v for v in second if v.verdict == s.VERDICT_STRAGGLER]  # what a run id prevents
    warnings = [r.getMessage() for r in caplog.records if "rejected as late" in r.getMessage()]
    assert warnings and "re-run" in warnings[0] and "'pretrain'" in warnings[0]
    assert "OTEL_STRAGGLER_RUN_ID" in warnings[0] and "OTEL_BSP_SCHEDULE_DELAY" not in warnings[0]


def test_slow_delivery_still_gets_the_arrival_lag_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Late samples a little behind (one rank's batches delivered many windows after its peers') are not a
    re-run: the warning names the measured lag."""
    caplog.set_level(logging.WARNING, logger="collector_processor.processor.straggler.processor")
    clock = SimClock()
    proc, _, _ = make_processor(clock=clock)
    sim = Sim(job="lagging", run="r1")
    for step in range(0, 120):
        proc.process_traces(sim.request([step], ranks=list(range(1, 8))))
        clock.t += 0.3
        if step % 12 == 11:  # rank 0 delivers 12 steps at once, late
            proc.process_traces(sim.request(list(range(step - 11, step + 1)), ranks=[0]))
            clock.t += 30.0
    proc.shutdown(5.0)
    late = [r.getMessage() for r in caplog.records if "rejected as late" in r.getMessage()]
    if proc.stats()["rejected_late"] >= 20:
        assert late and "re-run" not in late[0] and "Arrival lag measured" in late[0]

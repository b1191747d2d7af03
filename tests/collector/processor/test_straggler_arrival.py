"""Fast loops whose ranks export in SDK batches: ~70 ms steps, each rank's spans reaching the collector as the
OTel SDK's BatchSpanProcessor sends them (``jobsim/arrival.py``): up to the schedule delay after the step,
ranks seconds apart. The window closing must keep their data (open windows, grace adapting to the measured
arrival lag) and a collector that still rejects late data at a high rate says so once, with the fix."""

from __future__ import annotations

import logging

import pytest

import otel_straggler_schema as s
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.processor import StragglerProcessor
from collector_processor.telemetry import Telemetry
from jobsim.arrival import Batching, SimClock, batched, drive
from jobsim.faults import Fault
from jobsim.job import Layout, StepModel
from jobsim.stream import JobStream, SimConfig

SLOW_RANK = 5
ONSET = 100


def _run(config: Config, batching: Batching, steps: int = 300) -> tuple[StragglerProcessor, list, dict[str, int]]:
    """8 ranks, forward-compute 12 ms (~72 ms steps), rank 5 +10 % on the GPU from step 100; returns the
    processor, its verdicts and the late rejections seen before and after the job's midpoint."""
    cfg = SimConfig(layout=Layout(tp=1, dp=8), steps=steps, step_model=StepModel.with_forward_ms(12.0), seed=3)
    fault = Fault("device", SLOW_RANK, ("forward-compute",), 0.10, ONSET)
    verdicts: list = []
    clock = SimClock()
    proc = StragglerProcessor(config, Telemetry(), verdicts.extend, clock=clock)
    half = clock.t + steps * batching.step_s / 2
    late = {"first_half": 0, "second_half": 0, "rank_steps": 0}

    def process(req):  # type: ignore[no-untyped-def]
        before = proc.stats()["rejected_late"]
        proc.process_traces(req)
        late["first_half" if clock.t < half else "second_half"] += proc.stats()["rejected_late"] - before
        late["rank_steps"] += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans
                                  if ss.scope.name == s.SCOPE_STEP_NAME)

    drive(batched(JobStream(cfg, [fault]), batching, seed=3), process, proc.tick, clock)
    proc.shutdown(5.0)
    return proc, verdicts, late


def _convicted(verdicts: list) -> list[tuple[int, str]]:
    return [(v.rank, v.stage) for v in verdicts if v.verdict == s.VERDICT_STRAGGLER]


def _late_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "late" in r.getMessage()]


def test_70ms_steps_with_the_sdk_batch_defaults_keep_their_data(caplog: pytest.LogCaptureFixture) -> None:
    """SDK defaults (5 s schedule delay, 512 spans a batch): a rank's batch opens ~13 windows at once and its
    peers' batches arrive seconds later. Nothing is closed early or rejected late, the slow rank is found, and
    nothing is logged about late data. With the previous bound of 8 open windows a quarter of the step
    samples were rejected late."""
    caplog.set_level(logging.WARNING)
    proc, verdicts, late = _run(Config(), Batching())
    st = proc.stats()
    assert st["windows_closed_early"] == 0
    assert late["first_half"] + late["second_half"] <= 0.005 * late["rank_steps"]
    assert _convicted(verdicts) == [(SLOW_RANK, "forward-compute")]
    assert _late_warnings(caplog) == []

    caplog.clear()
    proc, verdicts, late = _run(Config(max_open_windows=8), Batching())
    assert proc.stats()["windows_closed_early"] > 0
    assert late["first_half"] + late["second_half"] > 0.1 * late["rank_steps"]
    assert len(_late_warnings(caplog)) == 1  # said once, rate-limited


def test_grace_adapts_to_the_arrival_lag_and_a_high_late_rate_is_said_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """A 10 s schedule delay (batches of up to 2048 spans): ranks arrive up to ~10 s apart, beyond the 5 s
    grace. The grace adapts to the measured lag: after the first batches nothing more is late, and the slow
    rank is found. With the grace fixed at 5 s (grace_max_s = grace_s) data keeps arriving late all job long,
    and the collector says so once, naming the settings that fix it."""
    caplog.set_level(logging.WARNING)
    batching = Batching(schedule_delay_s=10.0, max_batch=2048)
    proc, verdicts, late = _run(Config(), batching)
    assert late["second_half"] == 0
    assert late["first_half"] <= 0.05 * late["rank_steps"]
    assert _convicted(verdicts) == [(SLOW_RANK, "forward-compute")]
    assert proc.stats()["windows_closed_by_grace"] > 0  # the grace did close windows: it was not just long

    caplog.clear()
    proc, verdicts, late = _run(Config(grace_max_s=5.0), batching)
    assert late["second_half"] > 0.05 * late["rank_steps"]
    warned = _late_warnings(caplog)
    assert len(warned) == 1
    assert "OTEL_BSP_SCHEDULE_DELAY" in warned[0] and "grace_max_s" in warned[0]

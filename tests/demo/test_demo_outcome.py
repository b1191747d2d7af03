"""What the demo concludes from its evidence (no processes): which straggler verdicts are the injected rank and
which are false alarms, why a missed rank was missed, in the detector's words and in plain ones; option
checks that need no run (a 2-rank job, the floor)."""

from __future__ import annotations

import random
import re

import pytest

import otel_straggler_schema as s
from otel_straggler_demo.options import (
    DemoOptions,
    OptionError,
    check_options,
    default_inject_rank,
    inject_gap_ms,
)
from otel_straggler_demo.outcome import (
    REASON_TEXT,
    explain,
    problems,
    stage_series,
    summarise,
    window_deviations,
)
from otel_straggler_demo.run import collector_config, detector_settings
from otel_straggler_demo.tap import StagePoint

DET = {"window_steps": 5, "absolute_floor_ms": 5.0, "tolerance": 0.04, "fastest_quantile": 0.1}


def _v(rank: int, stage: str, verdict: str, step: int, reason: str = "slower_than_reference", **kw) -> dict:
    return {"rank": rank, "stage": stage, "verdict": verdict, "reason": reason, "step": step, "deviation": 0.1,
            "attribution": "host_only_stall", "reference_rank": 0, **kw}


def _points(slow_rank: int | None, extra_ms: float, ranks: int = 4, steps: int = 60, base: float = 100.0,
            onset: int = 20) -> list[StagePoint]:
    rng = random.Random(3)
    out = []
    for r in range(ranks):
        for st in range(steps):
            ms = base * (1 + rng.gauss(0, 0.005)) + (extra_ms if r == slow_rank and st >= onset else 0.0)
            out.append(StagePoint(r, "forward-compute", "forward", st, ms, None))
    return out


def _measured(line: str) -> float:
    m = re.search(r"measured ([+-][0-9.]+)% against the fastest peer", line)
    assert m, line
    return float(m.group(1))


def test_injected_detection_and_false_alarms_are_told_apart() -> None:
    opts = DemoOptions(ranks=4, inject_rank=1, inject_from=20)
    verdicts = [
        _v(1, "forward-compute", s.VERDICT_STRAGGLER, 15),  # the slowed rank, before its slowdown began
        _v(1, "forward-compute", s.VERDICT_STRAGGLER, 29),  # repeated: only the first per (rank, stage) counts
        _v(2, "backward-compute", s.VERDICT_STRAGGLER, 40),  # a rank nobody slowed
        _v(1, "forward-compute", s.VERDICT_RECOVERED, 55, "within_tolerance"),
    ]
    detections, false_alarms = summarise(verdicts, opts)
    assert false_alarms == 2
    assert [(d.rank, d.stage, d.step, d.steps_to_detect) for d in detections] == [
        (1, "forward-compute", 15, None), (2, "backward-compute", 40, None)]
    assert not any(d.injected for d in detections)
    found = problems(verdicts, detections, opts, [], **DET)
    assert found[0].startswith("not detected: rank 1 forward-compute")
    assert any("false alarm: rank 1 forward-compute convicted at step 15" in p and "before its slowdown" in p
               for p in found)
    assert any("false alarm: rank 2 backward-compute" in p and "did not slow" in p for p in found)


def test_a_hit_has_steps_to_detect_and_no_problem() -> None:
    opts = DemoOptions(ranks=4, inject_rank=3, inject_from=50, inject_stage="optimizer-inner-step")
    verdicts = [_v(3, "optimizer", s.VERDICT_STRAGGLER, 59), _v(3, "optimizer", s.VERDICT_RECOVERED, 95)]
    detections, false_alarms = summarise(verdicts, opts)
    assert false_alarms == 0 and detections[0].steps_to_detect == 9 and detections[0].recovered_step == 95
    assert detections[0].injected
    assert problems(verdicts, detections, opts, [], **DET) == []


def test_missed_under_the_floor_says_so_in_plain_words() -> None:
    """The issue's first run: every verdict of the slowed rank uncertain/below_absolute_floor."""
    opts = DemoOptions(ranks=4, inject_rank=2, inject_from=20)
    verdicts = [_v(2, "forward-compute", s.VERDICT_UNCERTAIN, st, "below_absolute_floor") for st in (24, 29, 34)]
    points = _points(2, extra_ms=4.0)
    (line,) = problems(verdicts, summarise(verdicts, opts)[0], opts, points, **DET)
    assert line.startswith("not detected: rank 2 forward-compute")
    assert "3 x uncertain/below_absolute_floor" in line and "absolute floor" in line
    assert 3.0 < _measured(line) < 5.0 and "against the fastest peer" in line


def test_missed_without_any_verdict_reports_the_measured_deviation() -> None:
    opts = DemoOptions(ranks=4, inject_rank=0, inject_from=20)
    (line,) = problems([], [], opts, _points(0, extra_ms=2.0), **DET)
    assert "no window of it was beyond the detector's tolerance (4% at least" in line and "5 ms floor" in line
    assert 1.0 < _measured(line) < 3.0
    (nothing,) = problems([], [], opts, _points(None, 0.0, ranks=3)[:0], **DET)
    assert "no timing of that stage arrived from rank 0" in nothing


def test_no_injection_and_no_verdict_is_fine() -> None:
    opts = DemoOptions(ranks=4, inject_rank=None)
    assert problems([], [], opts, _points(None, 0.0), **DET) == []


def test_every_reason_has_plain_words() -> None:
    assert set(REASON_TEXT) == set(s.REASONS)
    assert "floor" in explain("below_absolute_floor") and explain("no_such_reason") == "no_such_reason"


def test_window_deviation_is_against_the_fastest_other_rank() -> None:
    pts = [StagePoint(r, "forward-compute", "forward", st, ms, None)
           for r, ms in ((0, 100.0), (1, 102.0), (2, 110.0)) for st in range(10)]
    devs = window_deviations(pts, "forward-compute", 5, fastest_quantile=0.1)
    assert devs[2][0] == pytest.approx(0.10)  # vs rank 0 (fastest), not the median 102
    assert devs[0][1] == pytest.approx(100 / 102 - 1)


def test_two_ranks_pick_a_valid_inject_rank_and_compare_with_one_peer() -> None:
    assert default_inject_rank(2) == 1 and default_inject_rank(8) == 3 and default_inject_rank(4) == 3
    det = detector_settings(2)
    assert det.min_cohort_size == 2 and detector_settings(8).min_cohort_size == 3
    opts = DemoOptions(ranks=2, inject_rank=default_inject_rank(2))
    check_options(opts, det)
    cfg = collector_config(grpc_port=1, http_port=2, metrics_port=3, tap_port=4, evidence=__import__("pathlib")
                           .Path("/tmp/x"), ranks=2)
    assert cfg["processors"]["straggler"] == {"min_cohort_size": 2}


def test_the_default_slowdown_stands_clear_of_the_floor() -> None:
    """+10 % of the default forward-compute is at least twice the detector's absolute floor."""
    det = detector_settings()
    assert inject_gap_ms(DemoOptions()) >= 2 * det.absolute_floor_ms
    with pytest.raises(OptionError, match="absolute floor"):
        check_options(DemoOptions(microbatches=1), det)


def test_device_and_host_times_are_never_mixed_in_one_series() -> None:
    """Device timing sampled on 3 steps of 4: the series is device time, the host-only steps left out."""
    pts = [StagePoint(0, "forward-compute", "forward", st, 120.0, None if st % 4 == 3 else 100.0)
           for st in range(8)]
    assert stage_series(pts, "forward-compute")[0] == {st: 100.0 for st in range(8) if st % 4 != 3}
    host_only = [StagePoint(0, "forward-compute", "forward", st, 120.0, None) for st in range(4)]
    assert stage_series(host_only, "forward-compute")[0] == dict.fromkeys(range(4), 120.0)

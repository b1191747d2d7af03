"""Per-step aggregation of intervals into span records (pure logic, no OTel)."""

from __future__ import annotations

import pytest

import otel_straggler_schema as schema
from otel_straggler.config import EmitterConfig
from otel_straggler.export.aggregate import KIND_JOB_STEP, KIND_RANK_STEP, KIND_STAGE, StepAggregator
from otel_straggler.interval import Interval


def iv(
    name: str,
    step: int,
    repeat: int,
    start_ms: float,
    dur_ms: float,
    *,
    device: float | None = None,
    degraded: str | None = None,
    tokens: int | None = None,
    injected: bool = False,
    group: str = "forward",
    level: int = 1,
) -> Interval:
    start = int(start_ms * 1e6)
    return Interval(
        name,
        level,
        group,
        step,
        repeat,
        start,
        start + int(dur_ms * 1e6),
        device,
        degraded if device is None else None,
        tokens,
        None if tokens is None else tokens // 512,
        None if tokens is None else repeat + 1,
        injected,
    )


def by_kind(records, kind):
    return [r for r in records if r.kind == kind]


def test_step_detail_sums_counts_and_device_rules() -> None:
    agg = StepAggregator(rank=0)
    out: list = []
    agg.add(
        [
            iv("fwd", 5, 0, 0, 2, device=1.5, tokens=1024),
            iv("bwd", 5, 0, 3, 4, device=None, degraded="sampled_out", tokens=1024),
            iv("fwd", 5, 1, 8, 3, device=2.5, tokens=2048, injected=True),
            iv("bwd", 5, 1, 12, 5, device=None, degraded="readout_timeout", tokens=2048),
            iv("bwd", 5, 2, 18, 1, device=0.7, tokens=3072),
        ],
        0,
        out,
    )
    assert out == []  # step still open
    agg.add([iv("fwd", 6, 0, 1000, 1, device=1.0)], 1, out)
    stages = {r.name: r for r in by_kind(out, KIND_STAGE)}
    fwd, bwd = stages["fwd"].attributes, stages["bwd"].attributes
    assert fwd[schema.ATTR_COUNT] == 2 and bwd[schema.ATTR_COUNT] == 3
    assert fwd[schema.ATTR_HOST_MS] == pytest.approx(5.0)
    assert fwd[schema.ATTR_DEVICE_MS] == pytest.approx(4.0)
    assert fwd[schema.ATTR_MEASUREMENT] == schema.MEASUREMENT_DEVICE
    assert schema.ATTR_DEGRADED_REASON not in fwd
    assert fwd[schema.ATTR_INJECTED] is True and schema.ATTR_INJECTED not in bwd
    assert bwd[schema.ATTR_HOST_MS] == pytest.approx(10.0)
    assert schema.ATTR_DEVICE_MS not in bwd  # one repeat lost its device time (not by sampling)
    assert bwd[schema.ATTR_MEASUREMENT] == schema.MEASUREMENT_HOST_ONLY
    assert bwd[schema.ATTR_DEGRADED_REASON] == "readout_timeout"  # the first repeat degraded by a fault
    # span covers first start .. last stop; workload from the step's latest interval
    assert stages["bwd"].start_ns == int(3e6) and stages["bwd"].end_ns == int(19e6)
    assert fwd[schema.ATTR_WORKLOAD_TOKENS] == 3072 and bwd[schema.ATTR_WORKLOAD_MICROBATCHES] == 3
    assert fwd[schema.ATTR_DETAIL] == schema.DETAIL_STEP and fwd[schema.ATTR_ITERATION] == 5
    (rank_step,) = by_kind(out, KIND_RANK_STEP)
    (job_step,) = by_kind(out, KIND_JOB_STEP)
    assert (rank_step.start_ns, rank_step.end_ns) == (0, int(19e6))
    assert rank_step.attributes[schema.ATTR_HOST_MS] == pytest.approx(19.0)
    assert rank_step.attributes[schema.ATTR_STAGE] == schema.SPAN_RANK_STEP
    assert (job_step.start_ns, job_step.end_ns) == (rank_step.start_ns, rank_step.end_ns)
    assert job_step.attributes == {schema.ATTR_ITERATION: 5, schema.ATTR_STAGE_GROUP: "step",
                                   schema.ATTR_TRACE_BLOCK: 0}


def test_step_detail_scales_a_sampled_repeat_to_the_step() -> None:
    """device_repeats=middle: one repeat measured, the others sampled out -> its device time x the repeats."""
    agg = StepAggregator(rank=0)
    out: list = []
    agg.add(
        [
            iv("fwd", 5, 0, 0, 2, device=None, degraded="sampled_out"),
            iv("fwd", 5, 1, 3, 2, device=None, degraded="sampled_out"),
            iv("fwd", 5, 2, 6, 2, device=1.5),
            iv("fwd", 5, 3, 9, 2, device=None, degraded="sampled_out"),
            iv("bwd", 5, 0, 12, 3, device=None, degraded="sampled_out"),  # a host-only step: no repeat measured
            iv("bwd", 5, 1, 16, 3, device=None, degraded="sampled_out"),
            iv("opt", 5, 0, 20, 1, device=0.8),
        ],
        0,
        out,
    )
    agg.close_all(out)
    stages = {r.name: r.attributes for r in by_kind(out, KIND_STAGE)}
    fwd, bwd, opt = stages["fwd"], stages["bwd"], stages["opt"]
    assert fwd[schema.ATTR_DEVICE_MS] == pytest.approx(6.0) and fwd[schema.ATTR_DEVICE_REPEATS] == 1
    assert fwd[schema.ATTR_MEASUREMENT] == schema.MEASUREMENT_DEVICE and fwd[schema.ATTR_COUNT] == 4
    assert schema.ATTR_DEGRADED_REASON not in fwd
    assert schema.ATTR_DEVICE_MS not in bwd and bwd[schema.ATTR_DEGRADED_REASON] == "sampled_out"
    assert schema.ATTR_DEVICE_REPEATS not in bwd
    assert opt[schema.ATTR_DEVICE_MS] == pytest.approx(0.8) and schema.ATTR_DEVICE_REPEATS not in opt  # all measured
    (rank_step,) = by_kind(out, KIND_RANK_STEP)
    a = rank_step.attributes
    assert dict(zip(a[schema.ATTR_SUMMARY_STAGES], a[schema.ATTR_SUMMARY_DEVICE_MS], strict=True)) == pytest.approx(
        {"fwd": 6.0, "bwd": schema.SUMMARY_NOT_MEASURED, "opt": 0.8})


def test_only_rank_zero_emits_train_step_and_interval_detail_is_per_interval() -> None:
    agg = StepAggregator(rank=3, config=EmitterConfig(detail=schema.DETAIL_INTERVAL))
    out: list = []
    agg.add([iv("fwd", 1, 0, 0, 1, device=0.5), iv("fwd", 1, 1, 2, 1)], 0, out)
    assert [r.attributes[schema.ATTR_MICROBATCH_ID] for r in out] == [0, 1]  # emitted at once
    assert all(r.attributes[schema.ATTR_COUNT] == 1 for r in out)
    assert out[1].attributes[schema.ATTR_MEASUREMENT] == schema.MEASUREMENT_HOST_ONLY
    agg.close_all(out)
    assert not by_kind(out, KIND_JOB_STEP)
    assert len(by_kind(out, KIND_RANK_STEP)) == 1


def test_idle_close_late_drop_and_caps() -> None:
    counts: dict[str, int] = {}
    cfg = EmitterConfig(step_close_s=2.0, max_open_steps=2, step_close_lag=5, max_timers_per_step=2)
    agg = StepAggregator(rank=0, config=cfg, counters=counts)
    out: list = []
    agg.add([iv("a", 1, 0, 0, 1)], 0, out)
    agg.tick(int(1.9e9), out)
    assert out == []
    agg.tick(int(2.0e9), out)
    assert len(by_kind(out, KIND_RANK_STEP)) == 1 and agg.open_steps == 0
    agg.add([iv("a", 1, 1, 5, 1)], int(3e9), out)  # step 1 already closed
    assert counts["dropped_late"] == 1
    out.clear()
    agg.add([iv("a", 2, 0, 0, 1), iv("b", 2, 0, 0, 1), iv("c", 2, 0, 0, 1)], int(3e9), out)
    assert counts["dropped_overflow"] == 1
    agg.add([iv("a", 3, 0, 0, 1), iv("a", 4, 0, 0, 1)], int(3e9), out)  # lag window keeps 2..4 open: cap 2
    assert counts["steps_evicted"] == 1 and agg.open_steps == 2
    assert [r.step for r in by_kind(out, KIND_RANK_STEP)] == [2]


def test_later_step_closes_earlier_ones_by_default() -> None:
    agg = StepAggregator(rank=0)
    out: list = []
    for step in range(10):
        agg.add([iv("a", step, 0, step * 10, 1)], step, out)
        assert agg.open_steps == 1
    assert [r.step for r in by_kind(out, KIND_RANK_STEP)] == list(range(9))

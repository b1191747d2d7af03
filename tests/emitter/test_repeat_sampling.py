"""``device_repeats``: on a device-sampled step each timer's middle repeat (microbatch) gets CUDA events and its
other repeats are timed on the host; the export side scales the measured repeat to the step (fake CUDA events:
CUDA cannot run on the CI machines, see conftest)."""

from __future__ import annotations

import pytest
from fake_cuda import FakeDevice

import otel_straggler_schema as schema
from otel_straggler.config import EmitterConfig
from otel_straggler.counters import SAMPLED_OUT
from otel_straggler.export.aggregate import KIND_RANK_STEP, KIND_STAGE, StepAggregator

MICRO = ("forward-compute", "batch-generator", "backward-compute")


def megatron_step(t, dev: FakeDevice, step: int, microbatches: int, ms: float = 1.0) -> None:  # type: ignore[no-untyped-def]
    """Megatron's order without pipelining; microbatch k's forward and backward each run ``ms * (k + 1)`` of GPU
    work, so which repeat was measured shows in its device time."""
    t.set_step(step)
    t("forward-backward", 1).start()
    for k in range(microbatches):
        t("forward-compute", 2).start()
        t("batch-generator", 2).start()
        dev.work(0.1)
        t("batch-generator").stop()
        dev.work(ms * (k + 1))
        t("forward-compute").stop()
        t("backward-compute", 2).start()
        dev.work(2 * ms * (k + 1))
        t("backward-compute").stop()
    t("forward-backward").stop()
    t("optimizer", 1).start()
    dev.work(0.5)
    t("optimizer").stop()


def by_step(intervals):  # type: ignore[no-untyped-def]
    out: dict[int, dict[str, list]] = {}
    for iv in intervals:
        out.setdefault(iv.step, {}).setdefault(iv.name, []).append(iv)
    return out


def test_the_middle_repeat_of_the_previous_step_gets_device_time(make_timers, sink, device) -> None:
    t = make_timers(device_repeats="middle", pool_size=64)
    counts = [4, 4, 3, 1, 2]
    for step, n in enumerate(counts):
        megatron_step(t, device, step, n)
    t.readout.drain()
    steps = by_step(sink.intervals)
    # step 0: no previous count, the first repeat; then the middle of the previous step's count (its n // 2)
    expected_pick = [0, 2, 2, 1, 0]
    for step, n in enumerate(counts):
        pick = expected_pick[step]
        for name in MICRO:
            ivs = steps[step][name]
            assert [iv.repeat for iv in ivs] == list(range(n))
            for iv in ivs:
                if iv.repeat == pick:
                    assert iv.device_ms is not None and iv.degraded is None, (step, name)
                else:
                    assert iv.device_ms is None and iv.degraded == SAMPLED_OUT, (step, name)
        if pick < n:
            fc = steps[step]["forward-compute"][pick]
            assert fc.device_ms == pytest.approx(0.1 + 1.0 * (pick + 1))  # that repeat's own work
        else:  # fewer repeats than the previous step's middle: none measured in this step
            assert all(iv.device_ms is None for name in MICRO for iv in steps[step][name])
        for name in ("forward-backward", "optimizer"):  # once per step: always measured
            (iv,) = steps[step][name]
            assert iv.device_ms is not None
    assert t.counters.faults_training == 0 and t.counters.faults_readout == 0


def test_fewer_records_and_the_step_device_time_scaled_from_the_measured_repeat(make_timers, sink, device) -> None:
    totals = {}
    for repeats in ("all", "middle"):
        sink.intervals.clear()
        dev = FakeDevice()
        t = make_timers(device_repeats=repeats, pool_size=128, fake=dev)
        for step in range(3):
            megatron_step(t, dev, step, 4)
        t.readout.drain()
        totals[repeats] = t.share.records
        agg = StepAggregator(rank=0, config=EmitterConfig())
        out: list = []
        agg.add(sink.intervals, 0, out)
        agg.close_all(out)
        stage = {(r.step, r.name): r.attributes for r in out if r.kind == KIND_STAGE}
        bwd = stage[(2, "backward-compute")]
        assert bwd[schema.ATTR_COUNT] == 4 and bwd[schema.ATTR_MEASUREMENT] == schema.MEASUREMENT_DEVICE
        if repeats == "all":
            assert bwd[schema.ATTR_DEVICE_MS] == pytest.approx(2.0 * (1 + 2 + 3 + 4))
            assert schema.ATTR_DEVICE_REPEATS not in bwd
        else:  # repeat 2 of 4 (6 ms) x 4
            assert bwd[schema.ATTR_DEVICE_MS] == pytest.approx(4 * 2.0 * 3)
            assert bwd[schema.ATTR_DEVICE_REPEATS] == 1
        (rs,) = [r for r in out if r.kind == KIND_RANK_STEP and r.step == 2]
        summary = dict(zip(rs.attributes[schema.ATTR_SUMMARY_STAGES], rs.attributes[schema.ATTR_SUMMARY_DEVICE_MS],
                           strict=True))
        assert summary["backward-compute"] == pytest.approx(bwd[schema.ATTR_DEVICE_MS])
    # per step: 1 + 3 x 4 + 1 intervals, 2 records each with every repeat; 1 + 3 + 1 with one repeat
    assert totals == {"all": 3 * 2 * 14, "middle": 3 * 2 * 5}


def test_host_only_steps_and_all_repeats_are_unchanged(make_timers, sink, device) -> None:
    t = make_timers(device_repeats="middle", device_every=2, pool_size=64)
    for step in range(4):
        megatron_step(t, device, step, 4)
    t.readout.drain()
    steps = by_step(sink.intervals)
    for step in (1, 3):  # host-only steps: every interval sampled out, no record
        assert all(iv.device_ms is None for ivs in steps[step].values() for iv in ivs)
    assert sum(iv.device_ms is not None for iv in steps[2]["forward-compute"]) == 1
    assert t.share.records == 2 * 2 * 5


def test_device_repeats_setting_parses_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EmitterConfig().device_repeats == "middle"
    assert EmitterConfig.from_env({"OTEL_STRAGGLER_DEVICE_REPEATS": "ALL"}).device_repeats == "all"
    bad = EmitterConfig.from_env({"OTEL_STRAGGLER_DEVICE_REPEATS": "some"})
    assert bad.device_repeats == "middle" and "device_repeats" in bad.config_errors


def test_a_timer_restarted_by_elapsed_keeps_its_repeat(make_timers, sink, device) -> None:
    """Megatron's ``training_log`` reads ``interval-time`` with ``elapsed()``, a stop and restart of the running
    timer; a stage read while running is one repeat too: both halves are measured or neither, so the step's device
    time is the whole interval's, not half of it scaled."""
    t = make_timers(device_repeats="middle", pool_size=64)
    t.set_step(0)
    t("interval-time", 0).start()
    for step in range(1, 9):
        t.set_step(step)
        x = t("optimizer", 1)
        x.start()
        device.work(1.0)
        x.elapsed(reset=False)
        device.work(3.0)
        x.stop()
        if step % 2 == 0:
            t("interval-time").elapsed(barrier=True)
    t.readout.drain()
    agg = StepAggregator(rank=0, config=EmitterConfig())
    out: list = []
    agg.add(sink.intervals, 0, out)
    agg.close_all(out)
    opt = {r.step: r.attributes for r in out if r.kind == KIND_STAGE and r.name == "optimizer"}
    assert sorted(opt) == list(range(1, 9))
    for a in opt.values():
        assert a[schema.ATTR_DEVICE_MS] == pytest.approx(4.0) and a[schema.ATTR_COUNT] == 2
        assert schema.ATTR_DEVICE_REPEATS not in a
    assert all(iv.device_ms is not None for iv in sink.intervals if iv.name == "interval-time")


def test_a_timer_that_straddles_the_step_change_is_measured(make_timers, sink, device) -> None:
    """Started before ``set_step`` and stopped after it (bound to the new step): repeats are counted by the step
    of their start, so the timer keeps device time once its count settled (the first two steps count the start
    made before the first ``set_step`` of the loop)."""
    t = make_timers(device_repeats="middle", pool_size=64)
    for step in range(8):
        t("batch-generator", 2).start()
        t.set_step(step)
        device.work(1.0)
        t("batch-generator").stop()
        t("forward-backward", 1).start()
        device.work(1.0)
        t("forward-backward").stop()
    t.readout.drain()
    got = [iv for iv in sink.intervals if iv.name == "batch-generator"]
    assert [iv.step for iv in got] == list(range(8))
    assert all(iv.device_ms == pytest.approx(1.0) for iv in got[3:])

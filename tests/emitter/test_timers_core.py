"""Timer behaviour through the real ring and readout (device side on the fake event backend: CUDA
cannot run on the CI machines, see conftest)."""

from __future__ import annotations

import copy
import pickle
import time

import pytest
from fake_cuda import FakeDevice

import otel_straggler_schema as schema
from otel_straggler.counters import EmitterCounters
from otel_straggler.inject import Injector
from otel_straggler.timers import Timer, Timers


def test_slots_no_instance_dict(make_timers) -> None:
    t = make_timers()
    timer = t("forward-compute")
    for obj in (timer, t.ctx, t.ring, t.counters, t.pool):
        assert not hasattr(obj, "__dict__"), type(obj)
    # the timers object's own dict holds at most its ``__call__`` with Megatron's signature (timers.py _TimersType)
    assert set(getattr(t, "__dict__", {})) <= {"__call__"}
    with pytest.raises(AttributeError):
        timer.some_new_attribute = 1


def test_deepcopy_returns_self_and_pickle_gives_inert_working_copy(make_timers, sink) -> None:
    t = make_timers()
    fc = t("forward-compute", 2)
    t("optimizer", 1)
    assert copy.deepcopy(t) is t
    assert copy.copy(t) is t
    assert copy.deepcopy(fc) is fc
    assert copy.deepcopy({"timers": t})["timers"] is t
    clone = pickle.loads(pickle.dumps(t))
    assert clone is not t
    assert clone.readout is None and clone.sink is None and clone.pool.cuda is False
    assert clone._log_levels == {"forward-compute": 2, "optimizer": 1}
    with pytest.raises(AssertionError):
        clone("optimizer", 2)  # levels survived the pickle
    c = clone("forward-compute")
    c.start()
    time.sleep(0.001)
    c.stop()
    assert c.elapsed() > 0.0
    assert clone.counters.faults == 0
    # the clone has no consumer: its interval was dropped and counted, nothing reached the live sink
    assert clone.counters.dropped_ring_full == 1
    t.readout.drain()
    assert sink.intervals == []
    lone = pickle.loads(pickle.dumps(fc))
    assert isinstance(lone, Timer) and lone is not fc
    lone.start()
    lone.stop()
    assert lone.elapsed() >= 0.0


def test_barrier_accepted_never_executed_and_counted(make_timers, monkeypatch) -> None:
    import torch

    def forbidden(*a, **k):
        raise AssertionError("barrier executed")

    monkeypatch.setattr(torch.distributed, "barrier", forbidden)
    t = make_timers()
    x = t("interval-time", 0)
    x.start(barrier=True)
    x.stop(barrier=True)
    x.elapsed(barrier=True)
    t.get_all_timers_string(["interval-time"], barrier=True)
    assert t.counters.barriers_skipped == 3
    assert t.counters.faults == 0


def test_misuse_raises_before_anything_changes_and_is_counted(make_timers, sink) -> None:
    t = make_timers()
    x = t("forward-compute")
    with pytest.raises(AssertionError, match="timer is not started"):
        x.stop()  # stop without start: nothing recorded
    x.start()
    free = len(t.pool.free)
    with pytest.raises(AssertionError, match="timer has already been started"):
        x.start()  # the first start stays, no event is taken
    assert len(t.pool.free) == free
    x.stop()
    t.readout.drain()
    assert t.counters.unbalanced == 2
    assert len(sink.intervals) == 1
    assert sink.intervals[0].degraded != "unbalanced"  # the refused call left no mark on the interval
    assert t.counters.snapshot().get("degraded_unbalanced", 0) == 0
    # the pool got the start event back once it completed
    assert len(t.pool.free) == t.pool.capacity


def test_auto_step_from_step_timer_and_sampling(make_timers, sink) -> None:
    t = make_timers(device_every=2)
    t("model-and-optimizer-setup", 0).start()
    t("model-and-optimizer-setup").stop()
    for _ in range(4):
        fb = t("forward-backward", 1)
        fb.start()
        t("forward-compute", 2).start()
        t("forward-compute").stop()
        fb.stop()
        # a restart inside elapsed() is not a new step
        t("forward-backward").start()
        t("forward-backward").elapsed()
        t("forward-backward").stop()
    t.readout.drain()
    steps = [(iv.name, iv.step) for iv in sink.intervals]
    assert steps[0] == ("model-and-optimizer-setup", 0)
    fc = [iv for iv in sink.intervals if iv.name == "forward-compute"]
    assert [iv.step for iv in fc] == [1, 3, 5, 7]
    # device on every 2nd step: steps 0, 2, 4.. sampled; odd steps host-only "sampled_out"
    assert all(iv.degraded == "sampled_out" and iv.device_ms is None for iv in fc)
    setup = sink.intervals[0]
    assert setup.device_ms is not None and setup.degraded is None


def test_explicit_step_binds_at_stop_with_workload_and_repeats(make_timers, sink, device) -> None:
    t = make_timers(device_every=1)
    t.set_step(10, tokens=4096, sequences=8, microbatches=4)
    for _ in range(4):
        t("forward-compute").start()
        device.work(2.0)
        t("forward-compute").stop()
    x = t("optimizer", 1)
    x.start()
    device.work(1.0)
    t.set_step(11, tokens=2048)  # the step changes while optimizer runs: it binds at stop -> 11
    x.stop()
    t.set_step(12)  # before readout: already-stopped intervals keep their step
    t.readout.drain()
    fc = [iv for iv in sink.intervals if iv.name == "forward-compute"]
    assert [iv.repeat for iv in fc] == [0, 1, 2, 3]
    assert {(iv.step, iv.tokens, iv.sequences, iv.microbatches) for iv in fc} == {(10, 4096, 8, 4)}
    assert [iv.device_ms for iv in fc] == [2.0, 2.0, 2.0, 2.0]
    opt = sink.intervals[-1]
    assert (opt.name, opt.step, opt.tokens, opt.repeat, opt.group, opt.level) == (
        "optimizer",
        11,
        2048,
        0,
        "optimizer",
        1,
    )
    assert opt.device_ms == 1.0


def test_nested_timers_enter_in_completion_order(make_timers, sink, device) -> None:
    t = make_timers()
    t.set_step(0)
    fb = t("forward-backward", 1)
    fb.start()
    for _ in range(2):
        t("forward-compute").start()
        t("batch-generator").start()
        device.work(0.5)
        t("batch-generator").stop()
        device.work(1.0)
        t("forward-compute").stop()
        t("backward-compute").start()
        device.work(2.0)
        t("backward-compute").stop()
    fb.stop()
    t.readout.drain()
    assert sink.names() == [
        "batch-generator",
        "forward-compute",
        "backward-compute",
        "batch-generator",
        "forward-compute",
        "backward-compute",
        "forward-backward",
    ]
    fbi = sink.intervals[-1]
    assert fbi.device_ms == pytest.approx(7.0)
    assert fbi.host_start_ns <= sink.intervals[0].host_start_ns
    assert fbi.host_end_ns >= sink.intervals[-2].host_end_ns
    assert [iv.repeat for iv in sink.intervals if iv.name == "backward-compute"] == [0, 1]


def test_wall_clock_from_monotonic_anchor(make_timers, sink) -> None:
    t = make_timers()
    before = time.time_ns()
    x = t("forward-compute")
    x.start()
    time.sleep(0.002)
    x.stop()
    after = time.time_ns()
    t.readout.drain()
    iv = sink.intervals[0]
    assert before - 5_000_000 <= iv.host_start_ns < iv.host_end_ns <= after + 5_000_000
    assert iv.host_end_ns - iv.host_start_ns >= 2_000_000


def test_no_cuda_pool_is_host_only(sink) -> None:
    t = Timers(2, "minmax", sink=sink)  # default HostOnlyPool
    for s in range(3):
        t.set_step(s)
        t("forward-compute").start()
        t("forward-compute").stop()
    t.readout.drain()
    assert [iv.degraded for iv in sink.intervals] == ["no_cuda"] * 3
    assert t.counters.snapshot()["degraded_no_cuda"] == 3
    t.shutdown(1.0)


def test_injection_inside_interval_only_on_target(make_timers, sink) -> None:
    inj = Injector("forward-compute", host_ms=3.0, from_step=2, until_step=3)
    inj.calibrate(cuda=False)
    t = make_timers(injector=inj)
    for s in range(1, 5):
        t.set_step(s)
        t("forward-compute").start()
        t("forward-compute").stop()
        t("backward-compute").start()
        t("backward-compute").stop()
    t.readout.drain()
    fc = [iv for iv in sink.intervals if iv.name == "forward-compute"]
    assert [iv.injected for iv in fc] == [False, True, True, False]
    assert all((iv.host_end_ns - iv.host_start_ns) >= 3_000_000 for iv in fc if iv.injected)
    assert not any(iv.injected for iv in sink.intervals if iv.name == "backward-compute")


def test_device_ms_injection_degrades_to_host_sleep_without_cuda() -> None:
    inj = Injector("x", device_ms=2.0)
    inj.calibrate(cuda=False)
    t0 = time.perf_counter()
    assert inj.apply(0) is True
    assert time.perf_counter() - t0 >= 0.002


def test_internal_fault_counted_never_raised() -> None:
    counters = EmitterCounters()
    t = Timers(2, "minmax", counters=counters)
    x = t("forward-compute")
    x._ctx = None  # breaks the hot path on purpose
    x.start()
    x._started = True
    x.stop()
    assert counters.faults_training == 2
    assert counters.snapshot()["faults"] == 2


def test_counters_snapshot_keys() -> None:
    snap = EmitterCounters(config_errors=1).snapshot()
    for key in (
        "intervals",
        "dropped_ring_full",
        "barriers_skipped",
        "unbalanced",
        "faults",
        "pool_high_water",
        "readout_lag_ms",
        "quarantined",
    ):
        assert key in snap
    for reason in schema.DEGRADED_REASONS:
        assert snap[f"degraded_{reason}"] == 0
    assert snap["faults"] == 1
    assert all(isinstance(v, int) for v in snap.values())


def test_name_table_is_capped(monkeypatch) -> None:
    import otel_straggler.timers as tm

    monkeypatch.setattr(tm, "MAX_TIMER_NAMES", 3)
    t = Timers(2, "minmax")
    for i in range(5):
        t(f"t{i}")
    assert len(t._timers) == 3 and t.names_dropped == 2
    assert t("t4") is t._dummy_timer


def test_fake_device_head_of_line_helper() -> None:
    dev = FakeDevice(auto_complete=False)
    ev = dev.factory()
    dev.work(1.0)
    ev.record()
    assert ev.query() is False
    dev.complete_all()
    assert ev.query() is True

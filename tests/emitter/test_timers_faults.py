"""Fault injection: every failure is absorbed and counted, training calls return normally.
CUDA events are the fake backend (CUDA cannot run on the CI machines)."""

from __future__ import annotations

import pytest
from fake_cuda import FakeDevice


def _steps(t, n: int, names=("forward-compute", "backward-compute"), device: FakeDevice | None = None) -> None:
    for s in range(n):
        t.set_step(s)
        for name in names:
            t(name).start()
            if device is not None:
                device.work(1.0)
            assert t(name).stop() is None


def test_record_raising(make_timers, sink, device) -> None:
    t = make_timers()
    device.raise_on_record = True
    _steps(t, 3)
    t.readout.drain()
    assert len(sink.intervals) == 6
    assert {iv.degraded for iv in sink.intervals} == {"cuda_error"}
    assert t.counters.snapshot()["degraded_cuda_error"] == 6
    assert t.counters.faults_training == 0
    device.raise_on_record = False
    _steps(t, 1)
    t.readout.drain()
    assert sink.intervals[-1].device_ms is not None


def test_end_record_raising_only(make_timers, sink, device) -> None:
    t = make_timers()
    x = t("optimizer", 1)
    x.start()
    device.raise_on_record = True
    x.stop()
    device.raise_on_record = False
    t.readout.drain()
    assert sink.intervals[0].degraded == "cuda_error"


def test_query_raising_quarantines_then_releases(make_timers, sink, device) -> None:
    t = make_timers()
    _steps(t, 2)
    device.raise_on_query = True
    t.readout.drain()
    assert {iv.degraded for iv in sink.intervals} == {"cuda_error"}
    assert t.counters.quarantined == 4
    assert len(t.pool.free) == t.pool.capacity - 8  # not reused while their state is unknown
    device.raise_on_query = False
    t.readout.drain()
    assert t.counters.quarantine_released == 4
    assert len(t.pool.free) == t.pool.capacity


def test_elapsed_time_raising(make_timers, sink, device) -> None:
    t = make_timers()
    device.raise_on_elapsed = True
    _steps(t, 2, device=device)
    t.readout.drain()
    assert {iv.degraded for iv in sink.intervals} == {"cuda_error"}
    # a failed elapsed time does not say whether the pair finished: quarantined, back once query() is True
    assert t.counters.quarantined == 4 and len(t.pool.free) < t.pool.capacity  # 2 steps x 2 timers
    t.readout.drain()
    assert len(t.pool.free) == t.pool.capacity


def test_sink_raising_is_counted(make_timers, sink) -> None:
    t = make_timers()
    sink.raise_on_submit = True
    sink.raise_on_stats = True
    _steps(t, 2)
    t.readout.drain()
    t.readout._publish()
    assert t.counters.sink_errors == 2
    assert t.counters.snapshot()["faults"] == 2
    sink.raise_on_submit = False
    _steps(t, 1)
    t.readout.drain()
    assert len(sink.intervals) == 2  # the readout kept going


def test_pool_exhaustion_degrades(make_timers, sink, device) -> None:
    t = make_timers(pool_size=4)
    t.set_step(0)
    for _ in range(3):  # 3 intervals need 6 events; only 4 exist and none is returned before readout
        t("forward-compute").start()
        device.work(1.0)
        t("forward-compute").stop()
    t.readout.drain()
    reasons = [iv.degraded for iv in sink.intervals]
    assert reasons == [None, None, "pool_exhausted"]
    assert t.counters.pool_high_water == 4
    assert t.counters.snapshot()["degraded_pool_exhausted"] == 1
    assert len(t.pool.free) == 4


def test_pool_high_water_is_sampled_by_the_readout_before_it_returns_events(make_timers, sink, device) -> None:
    t = make_timers(pool_size=8)
    t.set_step(0)
    t("forward-compute").start()
    device.work(1.0)
    t("forward-compute").stop()
    t("backward-compute").start()  # still open at the drain: its start event is in flight too
    assert t.counters.pool_high_water == 0  # the training thread does not write it
    t.readout.drain()
    assert t.counters.pool_high_water == 3
    assert len(t.pool.free) == 7  # the finished pair is back, the open start event is not
    t("backward-compute").stop()
    t.readout.drain()
    assert t.counters.pool_high_water == 3  # a maximum: two in flight at this drain
    assert len(t.pool.free) == 8


def test_pool_exhausted_at_stop_releases_start_event(make_timers, sink, device) -> None:
    t = make_timers(pool_size=2)
    a, b = t("forward-backward", 1), t("forward-compute")
    a.start()  # takes event 1
    b.start()  # takes event 2
    b.stop()  # no event for the end -> pool_exhausted, start event goes through the ring
    a.stop()
    t.readout.drain()
    assert [iv.degraded for iv in sink.intervals] == ["pool_exhausted", "pool_exhausted"]
    assert len(t.pool.free) == 2


def test_ring_full_drops_and_counts(make_timers, sink, device) -> None:
    t = make_timers(ring_size=4, pool_size=32)
    _steps(t, 3)  # 6 intervals into 4 slots
    assert t.counters.dropped_ring_full == 2
    t.readout.drain()
    assert len(sink.intervals) == 4
    # the dropped intervals' recorded events were quarantined and come back once complete
    t.readout.drain()
    assert len(t.pool.free) == t.pool.capacity
    _steps(t, 1)
    t.readout.drain()
    assert len(sink.intervals) == 6


def test_readout_timeout(make_timers, sink) -> None:
    dev = FakeDevice(auto_complete=False)
    t = make_timers(fake=dev, readout_timeout_s=0.3)
    x = t("forward-compute")
    x.start()
    dev.work(5.0)
    x.stop()
    t.readout.drain()
    assert sink.intervals == []  # not finished, not timed out yet: wait
    import time

    time.sleep(0.35)
    t.readout.drain()
    assert [iv.degraded for iv in sink.intervals] == ["readout_timeout"]
    assert t.counters.quarantined == 1
    assert len(t.pool.free) == t.pool.capacity - 2  # never re-recorded while unfinished
    dev.complete_all()
    t.readout.drain()
    assert len(t.pool.free) == t.pool.capacity


@pytest.mark.parametrize("bad", ["record", "query", "elapsed"])
def test_readout_thread_survives_cuda_errors(make_timers, sink, device, bad) -> None:
    t = make_timers(start_readout=True)
    setattr(device, f"raise_on_{bad}", True)
    _steps(t, 5, device=device)
    assert t.flush(2.0)
    setattr(device, f"raise_on_{bad}", False)
    _steps(t, 1, device=device)
    assert t.flush(2.0)
    assert len(sink.intervals) == 12
    assert sink.intervals[-1].device_ms == 1.0
    assert t.counters.faults_readout == 0

"""Readout thread: order, head-of-line, flush/stop bounds, stats. Fake CUDA events (see conftest)."""

from __future__ import annotations

import threading
import time

from fake_cuda import FakeDevice


def test_head_of_line_holds_later_intervals_until_complete(make_timers, sink) -> None:
    dev = FakeDevice(auto_complete=False)
    t = make_timers(fake=dev)
    a = t("forward-compute")
    a.start()
    dev.work(3.0)
    a.stop()  # unfinished on the "device"
    b = t("optimizer", 1)
    b.start()
    b.stop()  # its events sit behind a's on the same stream; completion order must hold
    t.set_step(1)  # host-only/device-free later slots are also held
    assert t.readout.drain() == 0
    assert sink.intervals == []
    dev.complete_all()
    assert t.readout.drain() == 2
    assert sink.names() == ["forward-compute", "optimizer"]
    assert sink.intervals[0].device_ms == 3.0


def test_head_of_line_released_by_timeout(make_timers, sink) -> None:
    dev = FakeDevice(auto_complete=False)
    t = make_timers(fake=dev, readout_timeout_s=0.3)
    a = t("forward-compute")
    a.start()
    dev.work(3.0)
    a.stop()
    b = t("backward-compute")
    b.start()
    b.stop()
    t.readout.drain()
    assert sink.intervals == []
    time.sleep(0.35)
    t.readout.drain()  # both timed out, order kept
    assert sink.names() == ["forward-compute", "backward-compute"]
    assert [iv.degraded for iv in sink.intervals] == ["readout_timeout", "readout_timeout"]


def test_thread_drains_in_order_while_training_runs(make_timers, sink, device) -> None:
    t = make_timers(start_readout=True, ring_size=256, pool_size=64)
    expected = []
    for s in range(200):
        t.set_step(s, tokens=s * 10)
        for name in ("forward-compute", "backward-compute"):
            t(name).start()
            device.work(0.1)
            t(name).stop()
            expected.append((name, s))
        if s % 50 == 0:
            time.sleep(0.02)  # let the thread run mid-stream
    assert t.flush(3.0)
    got = [(iv.name, iv.step) for iv in sink.intervals]
    assert got == expected[: len(got)]
    assert len(got) + t.counters.dropped_ring_full == len(expected)
    assert sink.submit_threads == {"otel-straggler-readout"}
    assert all(iv.tokens == iv.step * 10 for iv in sink.intervals)


def test_stats_published_and_lag_tracked(make_timers, sink, monkeypatch) -> None:
    import otel_straggler.readout as ro

    monkeypatch.setattr(ro, "STATS_PERIOD_NS", 10_000_000)
    t = make_timers(start_readout=True)
    x = t("forward-compute")
    x.start()
    x.stop()
    # the thread may publish once before it has drained the interval: wait for a snapshot that counts it
    deadline = time.monotonic() + 30.0
    while not (sink.stats and sink.stats[-1]["intervals"] == 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.stats, "publish_stats never called"
    last = sink.stats[-1]
    assert last["intervals"] == 1 and "readout_lag_ms" in last
    assert 0 <= last["readout_lag_ms"] < 60_000  # tracked and finite (its size depends on the machine's load)


def test_shutdown_is_bounded_idempotent_and_flushes(make_timers, sink) -> None:
    dev = FakeDevice(auto_complete=False)
    t = make_timers(fake=dev, start_readout=True, readout_timeout_s=60.0)
    x = t("forward-compute")
    x.start()
    dev.work(1.0)
    x.stop()  # never completes
    t0 = time.monotonic()
    t.shutdown(0.5)
    assert time.monotonic() - t0 < 0.5 + 15  # bounded: the readout timeout would hold it 60 s
    assert [iv.degraded for iv in sink.intervals] == ["readout_timeout"]
    assert sink.flushed == 1 and sink.shut == 1
    assert not t.readout.alive
    assert len(t.pool.free) == t.pool.capacity  # quarantine released at shutdown
    t.shutdown(0.5)
    assert sink.shut == 1
    # training calls after shutdown still return normally
    x.start()
    x.stop()


def test_flush_without_thread_and_with_concurrent_caller(make_timers, sink, device) -> None:
    t = make_timers(start_readout=True)
    for s in range(10):
        t.set_step(s)
        t("forward-compute").start()
        t("forward-compute").stop()
    results = []
    threads = [threading.Thread(target=lambda: results.append(t.flush(2.0))) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(5)
    assert results == [True, True, True]
    assert len(sink.intervals) == 10


def test_a_backlog_goes_out_in_bounded_batches_in_order(make_timers, sink, monkeypatch) -> None:
    """A drain hands at most MAX_BATCH intervals to one ``submit``; a backlog goes out as several batches, in
    completion order, with every slot freed, the interval count and the lag of the oldest slot booked."""
    import otel_straggler.readout as ro

    monkeypatch.setattr(ro, "MAX_BATCH", 3)
    t = make_timers(ring_size=16)
    for step in range(8):
        t.set_step(step)
        t("forward-compute").start()
        t("forward-compute").stop()
    assert t.readout.drain() == 8
    assert sink.batches == 3  # 3 + 3 + 2
    assert [iv.step for iv in sink.intervals] == list(range(8))
    assert all(iv.device_ms is not None and iv.degraded is None for iv in sink.intervals)
    assert len(t.ring) == 0 and t.counters.intervals == 8
    assert len(t.pool.free) == t.pool.capacity
    assert t.readout._lag_max_ns > 0

"""What a readout wake costs the training thread in GIL hand-offs, by structure and by behaviour.

A wake of the readout thread takes the GIL from the training thread; every call inside the wake that releases
the GIL lets the training thread take it back and costs another round trip (``bench/results/gpu-h200.md``
section 3, ``bench/results/cpu-gil-handoff.md``). So: one pipe write per batch, carrying the stats; no call in
a wake that releases the GIL; a pool and ring that hold what the (long) default period leaves in flight.
CUDA cannot run here: device timing goes through the fake event backend (``fake_cuda.py``).
"""

from __future__ import annotations

import ctypes
import math
import os
import resource
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from export_rank_driver import identity, make_intervals
from fake_cuda import FakeDevice

import otel_straggler.readout as readout_mod
from otel_straggler.config import DEFAULTS
from otel_straggler.event_pool import EventPool
from otel_straggler.export import process_sink, wire
from otel_straggler.export.process_sink import ProcessSink, write_nonblocking
from otel_straggler.timers import Timers

pytestmark = pytest.mark.slow

MICROBATCHES = 8  # a Megatron-like step: forward-backward around 8 x 3 stages, then the optimizer: 26 intervals


def copier(path: Path) -> list[str]:
    """An export child stand-in that writes everything it reads to ``path``."""
    code = "import shutil, sys; shutil.copyfileobj(sys.stdin.buffer, open(sys.argv[1], 'wb'), 1 << 16)"
    return [sys.executable, "-c", code, str(path)]


def megatron_step(t: Timers, dev: FakeDevice) -> None:
    fb = t("forward-backward")
    fb.start()
    for _ in range(MICROBATCHES):
        for name in ("batch-generator", "forward-compute", "backward-compute"):
            t(name).start()
            dev.work(0.5)
            t(name).stop()
    fb.stop()
    t("optimizer").start()
    dev.work(0.5)
    t("optimizer").stop()


def test_one_pipe_write_per_batch_and_the_stats_ride_in_it(tmp_path: Path) -> None:
    """Each batch is one write that carries the latest stats when they changed; published stats wait for the
    next batch, and go out on their own only when a whole publish period passed without one. The child reads
    the same stream, in order."""
    out = tmp_path / "stream.bin"
    sink = ProcessSink(identity(0, 1, "one-write").resource_attributes(), rank=0, job_id="one-write",
                       config=DEFAULTS, command=copier(out))
    sink.submit(make_intervals(0, 0))  # starts the child
    assert sink.child_pid is not None and sink._write_fn is write_nonblocking
    writes: list[bytes] = []
    real = sink._write_fn

    def spy(fd: int, data: bytes) -> int:
        writes.append(bytes(data))
        return real(fd, data)

    sink._write_fn = spy
    dec = wire.WireDecoder()
    seen = [0]

    def new_writes() -> list[list[tuple[int, object]]]:
        """Each write since the last call, decoded (name frames decode to nothing)."""
        got = [dec.feed(data) for data in writes[seen[0]:]]
        seen[0] = len(writes)
        return got

    sink.publish_stats({"intervals": 7})
    assert new_writes() == []  # kept for the next batch
    sink.submit(make_intervals(0, 1))
    [got] = new_writes()
    assert [k for k, _ in got] == [wire.T_INTERVALS, wire.T_STATS] and got[1][1] == {"intervals": 7}
    sink.submit(make_intervals(0, 2))
    [got] = new_writes()
    assert [k for k, _ in got] == [wire.T_INTERVALS]  # stats unchanged: not repeated
    sink.publish_stats({"intervals": 21})
    assert new_writes() == []
    sink.publish_stats({"intervals": 28})  # the previous ones waited a whole period: out now, the newest
    assert new_writes() == [[(wire.T_STATS, {"intervals": 28})]]
    sink.publish_stats({"intervals": 35})
    assert new_writes() == []
    sink.submit(make_intervals(0, 3))
    [got] = new_writes()
    assert [k for k, _ in got] == [wire.T_INTERVALS, wire.T_STATS] and got[1][1] == {"intervals": 35}
    sink.shutdown(3.0)
    stream = out.read_bytes()
    header, _, body = stream.partition(b"\n")
    assert b'"job_id": "one-write"' in header
    assert body.endswith(b"".join(writes))  # the child saw every write whole, in order
    steps = [iv.step for kind, value in wire.WireDecoder().feed(body) if kind == wire.T_INTERVALS
             for iv in value]
    assert steps == [s for s in range(4) for _ in make_intervals(0, s)]
    assert sink.counters.snapshot() == {}  # nothing dropped, no fault


def test_a_readout_wake_never_releases_the_gil(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside a Python thread that always wants the GIL, a wake (drain, a batch written to a real export child's
    pipe, stats published) never blocks its thread: a call that released the GIL would let the busy thread take
    it, and the wake would then wait for it back (a voluntary context switch, counted by the kernel). A long
    switch interval keeps the busy thread from forcing a switch inside a wake."""
    monkeypatch.setattr(readout_mod, "STATS_PERIOD_NS", 0)  # every wake publishes the stats too
    dev = FakeDevice(auto_complete=True)
    cfg = replace(DEFAULTS, enabled=True, device_every=1, pool_size=256, ring_size=512)
    sink = ProcessSink(identity(0, 1, "gil").resource_attributes(), rank=0, job_id="gil", config=cfg,
                       command=copier(tmp_path / "stream.bin"))
    t = Timers(2, "minmax", config=cfg, pool=EventPool(cfg.pool_size, dev.factory, synchronize=None), sink=sink)
    t.set_step(0)
    megatron_step(t, dev)
    t.readout.wake()  # the first batch starts the export child (which releases the GIL): not measured
    assert sink.child_pid is not None and t.counters.intervals == 26
    stop = threading.Event()

    def busy() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    old = sys.getswitchinterval()
    switches = []
    th = threading.Thread(target=busy, daemon=True)
    sys.setswitchinterval(0.25)
    th.start()
    try:
        for step in range(1, 7):
            t.set_step(step)
            megatron_step(t, dev)
            time.sleep(0)  # hand the GIL over and back: the busy thread's next forced switch is >= 0.25 s away
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw  # keeps the GIL
            t.readout.wake()
            switches.append(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before)
    finally:
        sys.setswitchinterval(old)
        stop.set()
        th.join()
    t.readout.stop(1.0)
    sink.shutdown(3.0)
    assert switches == [0] * 6
    assert t.counters.intervals == 7 * 26 and sink.counters.snapshot() == {}


def test_default_pool_and_ring_hold_a_readout_period_of_device_timed_steps(sink) -> None:  # type: ignore[no-untyped-def]
    """Device time on every step, 26 intervals per 20 ms step (the launch-bound H200 model's stages at a short
    step), the device finishing each step while the host runs the next, drained once per default readout
    period: no interval loses its device time or its ring slot, and half of the pool and most of the ring are
    left. Every boundary of every repeat records its own event here (``share_gap_us=0``, ``device_repeats=all``),
    the most a step can hold in flight."""
    dev = FakeDevice(auto_complete=False)
    cfg = replace(DEFAULTS, enabled=True, device_every=1, share_gap_us=0.0, device_repeats="all")
    t = Timers(2, "minmax", config=cfg, pool=EventPool(cfg.pool_size, dev.factory, synchronize=None), sink=sink)
    steps_per_period = math.ceil(cfg.readout_interval_ms / 20.0)
    ring_peak = 0
    done_ms = 0.0
    for step in range(3 * steps_per_period):
        t.set_step(step)
        megatron_step(t, dev)
        dev.completed_ms, done_ms = done_ms, dev.queued_ms  # the previous step is complete now
        if (step + 1) % steps_per_period == 0:
            ring_peak = max(ring_peak, len(t.ring))
            t.readout.drain()
    c = t.counters
    assert c.intervals == (3 * steps_per_period - 1) * 26  # the last step was still running on the device
    assert c.degraded.get("pool_exhausted", 0) == 0 and c.dropped_ring_full == 0
    assert all(iv.device_ms is not None for iv in sink.intervals)
    assert steps_per_period * 2 * 26 <= c.pool_high_water <= cfg.pool_size // 2
    assert steps_per_period * 26 <= ring_peak <= t.ring.cap // 4


def test_lone_events_are_read_through_the_pool_query(make_timers, sink) -> None:  # type: ignore[no-untyped-def]
    """An interval whose end event could not be had (pool exhausted at stop) waits for its start event through
    ``pool.query`` (the driver's ``cuEventQuery`` on CUDA, which keeps the GIL), then goes out host-only and
    the event returns to the pool."""
    dev = FakeDevice(auto_complete=False)
    t = make_timers(fake=dev, pool_size=1)
    asked = []
    query = t.pool.query

    def spy(ev: object) -> bool:
        asked.append(ev)
        return query(ev)

    t.pool.query = spy
    x = t("forward-compute")
    dev.work(1.0)  # the stream is busy: the event recorded next is unfinished
    x.start()  # takes the only event
    x.stop()  # none left for the end
    ev = 0  # the only event's id
    assert t.readout.drain() == 0 and asked == [ev]  # unfinished: held
    dev.complete_all()
    assert t.readout.drain() == 1 and asked == [ev, ev]
    assert [iv.degraded for iv in sink.intervals] == ["pool_exhausted"]
    assert list(t.pool.free) == [ev]


def test_the_gil_keeping_write_reports_like_os_write() -> None:
    """``write_nonblocking`` is C's ``write`` called through ``ctypes.PyDLL`` (the GIL kept), writes what fits and
    raises as ``os.write`` does: ``BlockingIOError`` on a full pipe, ``BrokenPipeError`` once the reader is
    gone."""
    assert process_sink._WRITE is not None and process_sink._WRITE._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        assert write_nonblocking(w, b"abc") == 3 and os.read(r, 3) == b"abc"
        chunk = b"x" * 65536
        with pytest.raises(BlockingIOError):
            while True:
                write_nonblocking(w, chunk)
        os.close(r)
        r = -1
        with pytest.raises(BrokenPipeError):
            write_nonblocking(w, b"y")
    finally:
        os.close(w)
        if r >= 0:
            os.close(r)

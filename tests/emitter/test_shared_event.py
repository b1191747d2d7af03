"""Event reuse at adjacent boundaries (``shared_event.py``), on the fake device with a fake host clock.

The host clock is the timers' ``_clock`` replaced by a counter the test advances, so which boundaries are
"adjacent" (less than ``share_gap_us`` apart) is exact whatever the machine's load.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from fake_cuda import FakeDevice
from recording_sink import RecordingSink

import otel_straggler._hotpath_py as hot_path_py
import otel_straggler.readout as readout_mod
import otel_straggler.timers as timers_mod
from otel_straggler.config import EmitterConfig
from otel_straggler.event_pool import EventPool
from otel_straggler.ring import NO_EVENT, record_at
from otel_straggler.timers import Timers

GAP_US = 50.0


class HostClock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def __call__(self) -> int:
        return self.ns

    def advance_us(self, us: float) -> None:
        self.ns += int(us * 1000)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> HostClock:
    c = HostClock()
    monkeypatch.setattr(timers_mod, "_clock", c)
    monkeypatch.setattr(hot_path_py, "_clock", c)  # the Python start/stop's (the C one reads the timers')
    monkeypatch.setattr(readout_mod, "_clock", c)  # the readout's timeout reads the same clock
    return c


def build(dev: FakeDevice, sink: RecordingSink, *, gap_us: float, pool_size: int = 256, ring_size: int = 256,
          device_every: int = 1, device_repeats: str = "all") -> Timers:
    cfg = EmitterConfig(enabled=True, device_every=device_every, pool_size=pool_size, ring_size=ring_size,
                        share_gap_us=gap_us, device_repeats=device_repeats)
    pool = EventPool(pool_size, dev.factory, synchronize=None, stream=lambda: dev.stream)
    return Timers(2, "minmax", config=cfg, pool=pool, sink=sink)


def megatron_step(t: Timers, dev: FakeDevice, clock: HostClock, microbatches: int = 4) -> None:
    """Megatron's no-pipelining order: glue of 5 us between timers, 1 ms of host and device work inside the
    compute stages, a 20 us data fetch, the gradient all-reduce launched in 20 us of host time."""

    def glue() -> None:
        clock.advance_us(5)

    def work(host_us: float, dev_ms: float) -> None:
        clock.advance_us(host_us)
        dev.work(dev_ms)

    t("forward-backward", 1).start()
    for _ in range(microbatches):
        glue()
        t("forward-compute", 2).start()
        glue()
        t("batch-generator", 2).start()
        work(20, 0.0)
        t("batch-generator").stop()
        work(1000, 1.0)
        t("forward-compute").stop()
        glue()
        t("backward-compute", 2).start()
        work(1000, 2.0)
        t("backward-compute").stop()
    glue()
    t("all-grads-sync", 1).start()
    work(20, 3.0)  # one collective: launched in microseconds, long on the stream
    t("all-grads-sync").stop()
    glue()
    t("forward-backward").stop()
    glue()
    t("optimizer", 1).start()
    for name in ("optimizer-copy-to-main-grad", "optimizer-inner-step"):
        glue()
        t(name, 1).start()
        work(200, 0.5)
        t(name).stop()
    glue()
    t("optimizer").stop()
    clock.advance_us(3000)  # the step's end: logging, the next batch


def busy(dev: FakeDevice, clock: HostClock, ms: float, us: float) -> None:
    """``ms`` of GPU work launched over ``us`` of host time."""
    dev.work(ms)
    clock.advance_us(us)


def run(clock: HostClock, gap_us: float, steps: int = 3) -> tuple[Timers, RecordingSink, FakeDevice]:
    dev = FakeDevice(auto_complete=True)
    sink = RecordingSink()
    t = build(dev, sink, gap_us=gap_us)
    for s in range(steps):
        t.set_step(s)
        megatron_step(t, dev, clock)
    t.readout.drain()
    return t, sink, dev


def timeline(sink: RecordingSink) -> list[tuple[Any, ...]]:
    return [(iv.name, iv.step, iv.repeat, iv.device_ms, iv.degraded) for iv in sink.intervals]


def test_adjacent_boundaries_reuse_events_and_every_device_time_is_unchanged(clock: HostClock) -> None:
    """The same step with every boundary recording its own event and with reuse: identical device time for every
    interval (no GPU work in the glue), 16 records per step instead of 34."""
    own, own_sink, _ = run(clock, gap_us=0.0)
    shared, shared_sink, _ = run(clock, gap_us=GAP_US)
    assert timeline(shared_sink) == timeline(own_sink)
    assert len(shared_sink.intervals) == 3 * 17
    assert all(iv.device_ms is not None for iv in shared_sink.intervals)
    # per step: forward-backward's start, then per microbatch batch-generator's, forward-compute's and
    # backward-compute's stops, all-grads-sync's stop, the two optimizer stages' stops
    assert shared.share.records == 3 * (1 + 3 * 4 + 1 + 2)
    assert own.share.records == 3 * 2 * 17
    by = {(iv.name, iv.step, iv.repeat): iv.device_ms for iv in shared_sink.intervals}
    assert by[("all-grads-sync", 1, 0)] == pytest.approx(3.0)  # its own two records: launched in 20 us
    assert by[("batch-generator", 0, 0)] == pytest.approx(0.0)
    assert by[("forward-backward", 2, 0)] == pytest.approx(4 * 3.0 + 3.0)
    for t in (own, shared):
        t.shutdown(1.0)
        assert len(t.pool.free) == t.pool.capacity and len(set(t.pool.free)) == t.pool.capacity
        assert t.counters.quarantined == 0


def test_gpu_work_in_a_short_gap_counts_to_the_later_interval(clock: HostClock) -> None:
    dev = FakeDevice()
    sink = RecordingSink()
    t = build(dev, sink, gap_us=GAP_US)
    a, b = t("forward-compute"), t("backward-compute")
    a.start()
    busy(dev, clock, 1.0, 100)
    a.stop()
    busy(dev, clock, 0.25, 10)  # launched in the 10 us between the two timers
    b.start()
    busy(dev, clock, 2.0, 100)
    b.stop()
    busy(dev, clock, 0.5, GAP_US + 1)  # not adjacent: its own record
    a.start()
    busy(dev, clock, 1.0, 100)
    a.stop()
    t.readout.drain()
    assert [iv.device_ms for iv in sink.intervals] == pytest.approx([1.0, 2.25, 1.0])
    assert t.share.records == 5


def test_a_stop_never_reuses_its_own_start_nor_an_event_recorded_by_a_start(clock: HostClock) -> None:
    """A stage launched in 1 us (one kernel) keeps its device time; a stop right after an inner START records."""
    dev = FakeDevice()
    sink = RecordingSink()
    t = build(dev, sink, gap_us=GAP_US)
    outer, inner = t("optimizer"), t("optimizer-inner-step")
    outer.start()
    clock.advance_us(1)
    inner.start()  # reuses outer's start event
    busy(dev, clock, 4.0, 1)
    inner.stop()  # must record: the only other event is its own start
    clock.advance_us(1)
    outer.stop()  # reuses inner's stop
    t.readout.drain()
    assert [(iv.name, iv.device_ms) for iv in sink.intervals] == [("optimizer-inner-step", 4.0), ("optimizer", 4.0)]
    assert t.share.records == 2


def test_a_new_stream_gets_its_own_record(clock: HostClock) -> None:
    dev = FakeDevice()
    sink = RecordingSink()
    t = build(dev, sink, gap_us=GAP_US)
    dev.stream = "s1"
    a, b = t("forward-compute"), t("backward-compute")
    a.start()
    busy(dev, clock, 1.0, 100)
    a.stop()
    dev.stream = "s2"  # e.g. a side stream's context
    clock.advance_us(1)
    b.start()
    busy(dev, clock, 1.0, 100)
    b.stop()
    t.readout.drain()
    assert t.share.records == 4
    assert [iv.device_ms for iv in sink.intervals] == pytest.approx([1.0, 1.0])


def test_sharing_off_for_a_pool_that_cannot_name_its_stream() -> None:
    dev = FakeDevice()
    pool = EventPool(8, dev.factory, synchronize=None)
    pool.stream = None  # torch's own record API
    t = Timers(2, "minmax", config=EmitterConfig(enabled=True, device_every=1, pool_size=8), pool=pool,
               sink=RecordingSink())
    assert t.share.gap_ns == 0


# ---- random programs: the ownership rules never return an event that is still to be read ------------------------

NAMES = ("forward-backward", "forward-compute", "backward-compute", "batch-generator", "optimizer", "x-a", "x-b")


def random_program(rng: random.Random, n_ops: int) -> list[tuple[str, Any]]:
    """Starts and stops of random (not always nested, sometimes unbalanced) timers, with host gaps around the
    share gap, device work while a timer is open, resets, step changes and drains."""
    ops: list[tuple[str, Any]] = []
    open_: list[str] = []
    step = 0
    for _ in range(n_ops):
        r = rng.random()
        ops.append(("gap", rng.choice((1, 5, 30, 49, 51, 200, 2000))))
        if r < 0.35 or not open_:
            name = rng.choice(NAMES)
            ops.append(("start", name))
            if name not in open_:
                open_.append(name)
        elif r < 0.75:
            name = open_.pop(rng.randrange(len(open_))) if rng.random() < 0.3 else open_.pop()
            ops.append(("stop", name))
        elif r < 0.8:
            name = open_.pop(rng.randrange(len(open_)))
            ops.append(("reset", name))
        elif r < 0.9:
            ops.append(("drain", rng.random() < 0.5))
        elif r < 0.95:
            step += 1
            ops.append(("step", step))
        else:
            ops.append(("stop", rng.choice(NAMES)))  # maybe a stop without start
        if open_:
            ops.append(("work", rng.choice((0.0, 0.1, 1.0))))
    for name in reversed(open_):
        ops.append(("stop", name))
    return ops


def play(ops: list[tuple[str, Any]], clock: HostClock, *, gap_us: float, pool_size: int, ring_size: int,
         device_every: int, check: Callable[[Timers], None] | None = None,
         device_repeats: str = "all") -> tuple[Timers, RecordingSink]:
    dev = FakeDevice(auto_complete=False)
    sink = RecordingSink()
    t = build(dev, sink, gap_us=gap_us, pool_size=pool_size, ring_size=ring_size, device_every=device_every,
              device_repeats=device_repeats)
    for op, arg in ops:
        if op == "gap":
            clock.advance_us(arg)
        elif op == "work":
            dev.work(arg)
            if arg:
                clock.advance_us(GAP_US + 1)  # launching GPU work takes host time: no reuse across it
        elif op in ("start", "stop"):
            timer = t(arg)
            misuse = timer._started == (op == "start")  # a start of a started timer, a stop of a stopped one
            try:
                getattr(timer, op)()
            except AssertionError:
                assert misuse, (op, arg)
            else:
                assert not misuse, (op, arg)
        elif op == "reset":
            t(arg).reset()
        elif op == "step":
            t.set_step(arg)
        elif op == "drain":
            if arg:
                dev.complete_all()
            else:
                dev.completed_ms = (dev.completed_ms + dev.queued_ms) / 2
            if check is not None:
                check(t)
            t.readout.drain()
            if check is not None:
                check(t)
    dev.complete_all()
    t.readout.drain()
    return t, sink


def in_use(t: Timers) -> set[int]:
    """Events an unread record, an open timer or the latest boundary still refers to."""
    r = t.ring
    used = set()
    for idx in range(r.tail, r.head):
        rec = record_at(r, idx)
        used.update(ev for ev in (rec.start_ev, rec.end_ev) if ev != NO_EVENT)
    used.update(timer._sev for timer in t._timers.values() if timer._sev != NO_EVENT)
    if t.share.ev != NO_EVENT:
        used.add(t.share.ev)
    return used


def check_free(t: Timers) -> None:
    free = list(t.pool.free)
    assert len(free) == len(set(free)), "an event is twice in the free list"
    assert not (set(free) & in_use(t)), "an event in the free list is still referred to"


@pytest.mark.parametrize("seed", range(12))
def test_random_programs_never_free_an_event_in_use_and_return_every_event(clock: HostClock, seed: int) -> None:
    rng = random.Random(seed)
    ops = random_program(rng, 400)
    small = seed % 3 == 0  # a small pool and ring: exhaustion and ring-full drops on the way
    repeats = "middle" if seed % 4 >= 2 else "all"  # middle: repeats other than a step's middle one record nothing
    t, sink = play(ops, clock, gap_us=GAP_US, pool_size=6 if small else 512, ring_size=8 if small else 1024,
                   device_every=1 + seed % 2, check=check_free, device_repeats=repeats)
    check_free(t)
    t.shutdown(1.0)
    if repeats == "middle":  # repeats of device-sampled steps went host-only
        assert any(iv.degraded == "sampled_out" and iv.step % (1 + seed % 2) == 0 for iv in sink.intervals)
    assert len(t.pool.free) == t.pool.capacity
    assert len(set(t.pool.free)) == t.pool.capacity
    assert all(t.pool.table.refs[ev] == 0 for ev in t.pool.free)
    assert t.counters.faults_training == 0 and t.counters.faults_readout == 0
    if not small:
        # GPU work is launched over more than the gap: reuse changes no device time, only the records
        t0, sink0 = play(ops, clock, gap_us=0.0, pool_size=512, ring_size=1024, device_every=1 + seed % 2,
                         device_repeats=repeats)
        assert timeline(sink) == timeline(sink0)
        assert t.share.records < t0.share.records
        t0.shutdown(1.0)


def test_a_released_event_waits_for_the_records_before_it(clock: HostClock) -> None:
    """An event released when a later record replaced it returns to the pool only once every record published
    before the release was read, even when it completed long before (another stream's unfinished interval holds
    the readout at an earlier slot)."""
    dev = FakeDevice()
    sink = RecordingSink()
    t = build(dev, sink, gap_us=GAP_US)
    x, a, c = t("x-other-stream"), t("forward-compute"), t("backward-compute")
    x.start()
    clock.advance_us(100)
    x.stop()
    x_end = record_at(t.ring, 0).end_ev
    t.pool.events[x_end].recorded_at = 1e9  # still running (on another stream)
    clock.advance_us(100)
    a.start()
    busy(dev, clock, 1.0, 100)
    a.stop()  # its end event stays the latest boundary's: no slot owns it
    a_end = t.share.ev
    clock.advance_us(GAP_US + 1)
    c.start()  # records: a's end event is released behind a's slot
    assert list(t.pool.orphans) == [x_end, a_end] and t.pool.table.tag[a_end] == t.ring.head == 2  # x's too
    t.readout.drain()
    check_free(t)
    assert a_end not in t.pool.free and len(t.ring) == 2  # x holds the readout, a's slot is unread
    t.pool.events[x_end].recorded_at = dev.queued_ms
    t.readout.drain()
    assert a_end in t.pool.free and len(t.ring) == 0
    assert [iv.name for iv in sink.intervals] == ["x-other-stream", "forward-compute"]


def test_a_released_event_needs_no_query_unless_a_slot_could_not_read_it(clock: HostClock) -> None:
    dev = FakeDevice(auto_complete=False)
    sink = RecordingSink()
    t = build(dev, sink, gap_us=GAP_US)
    asked: list[Any] = []
    query = t.pool.query

    def spy(ev: Any) -> bool:
        asked.append(ev)
        return query(ev)

    t.pool.query = spy
    a, b = t("forward-compute"), t("backward-compute")
    a.start()
    busy(dev, clock, 1.0, 100)
    a.stop()
    first_end = t.share.ev
    clock.advance_us(GAP_US + 1)
    b.start()  # records: a's end event is released behind a's slot
    dev.complete_all()
    t.readout.drain()
    assert first_end in t.pool.free and asked == [] and t.counters.quarantined == 0  # a's slot read it complete
    busy(dev, clock, 1.0, 100)
    b.stop()  # its end is unfinished (the device is behind) ...
    clock.advance_us(t.readout.timeout_ns / 1000 + 1)
    t.readout.drain()  # ... past the readout timeout: b goes out host-only, its end event's state unknown
    assert sink.intervals[-1].degraded == "readout_timeout"
    second_end = t.share.ev
    clock.advance_us(GAP_US + 1)
    a.start()  # releases b's end event, tainted
    t.readout.drain()
    assert second_end not in t.pool.free and t.counters.quarantined == 2  # b's start (its slot's) and its end
    dev.complete_all()
    t.readout.drain()
    assert second_end in t.pool.free and second_end in asked


def test_a_stream_lookup_that_raises_means_no_reuse_and_leaves_no_reference(clock: HostClock) -> None:
    dev = FakeDevice()
    boom = [False]

    def stream() -> Any:
        if boom[0]:
            raise RuntimeError("CUDA error")
        return dev.stream

    sink = RecordingSink()
    cfg = EmitterConfig(enabled=True, device_every=1, pool_size=8, ring_size=8, share_gap_us=GAP_US,
                        device_repeats="all")
    t = Timers(2, "minmax", config=cfg, pool=EventPool(8, dev.factory, synchronize=None, stream=stream), sink=sink)
    outer, inner, nxt = t("forward-backward"), t("forward-compute"), t("backward-compute")
    outer.start()
    clock.advance_us(100)
    inner.start()
    busy(dev, clock, 1.0, 100)
    inner.stop()
    clock.advance_us(1)
    boom[0] = True
    outer.stop()  # would reuse inner's stop event: the lookup raises, so it records its own
    clock.advance_us(1)
    nxt.start()  # the same for a start
    boom[0] = False
    busy(dev, clock, 1.0, 100)
    nxt.stop()
    assert t.counters.faults_training == 0 and t.share.records == 6
    t.readout.drain()
    assert [iv.device_ms for iv in sink.intervals] == pytest.approx([1.0, 1.0, 1.0])
    t.shutdown(1.0)
    assert len(t.pool.free) == t.pool.capacity and all(t.pool.table.refs[ev] == 0 for ev in t.pool.free)


def test_an_outer_stop_that_reuses_ends_where_its_inner_one_did(clock: HostClock) -> None:
    """As documented (``shared_event.py``): work launched in the gap before a reused stop is in no interval."""
    dev = FakeDevice()
    sink = RecordingSink()
    t = build(dev, sink, gap_us=GAP_US)
    outer, inner = t("forward-backward"), t("forward-compute")
    outer.start()
    clock.advance_us(100)
    inner.start()
    busy(dev, clock, 1.0, 100)
    inner.stop()
    busy(dev, clock, 0.25, 10)  # launched 10 us after the inner stop
    outer.stop()
    t.readout.drain()
    assert [(iv.name, iv.device_ms) for iv in sink.intervals] == [("forward-compute", 1.0), ("forward-backward", 1.0)]


def test_a_failed_record_at_stop_returns_the_start_event_only_once_it_completed(clock: HostClock) -> None:
    dev = FakeDevice(auto_complete=False)
    sink = RecordingSink()
    t = build(dev, sink, gap_us=GAP_US, pool_size=4)
    a = t("forward-compute")
    dev.work(1.0)
    a.start()
    started = a._sev
    busy(dev, clock, 1.0, 100)
    dev.raise_on_record = True
    a.stop()  # its end event was never recorded: cuda_error
    dev.raise_on_record = False
    t.readout.drain()
    assert started not in t.pool.free and sink.intervals == []  # the start event is still running
    dev.complete_all()
    t.readout.drain()
    assert [iv.degraded for iv in sink.intervals] == ["cuda_error"]
    clock.advance_us(GAP_US + 1)
    t("backward-compute").start()  # the latest boundary's event until now: released
    t.readout.drain()
    assert started in t.pool.free


def test_a_taint_ends_with_the_life_of_the_event(clock: HostClock) -> None:
    """A reference that timed out taints the shared event; once its owner reads it complete the taint is gone, so
    its next life, ended by a release, returns it without a query."""
    dev = FakeDevice(auto_complete=False)
    sink = RecordingSink()
    t = build(dev, sink, gap_us=GAP_US, pool_size=3)
    outer, inner = t("optimizer"), t("optimizer-inner-step")
    outer.start()
    shared = outer._sev
    clock.advance_us(5)
    inner.start()  # reuses outer's start event
    busy(dev, clock, 1.0, 100)
    inner.stop()
    clock.advance_us(t.readout.timeout_ns / 1000 + 1)
    t.readout.drain()  # inner's slot times out: the shared event, which outer's slot owns, is tainted
    assert t.pool.table.tainted[shared]
    outer.stop()
    dev.complete_all()
    t.readout.drain()
    assert shared in t.pool.free and not t.pool.table.tainted[shared]



@pytest.mark.parametrize("repeats", ["middle", "all"])
def test_work_of_a_boundary_that_records_nothing_is_never_taken_into_a_reused_event(clock: HostClock,
                                                                                  repeats: str) -> None:
    """Microbatches launched in microseconds (a CUDA graph, one big kernel each): with one repeat per step on the
    device, the sampled-out repeats' boundaries record nothing, and the measured repeat must not reuse an event
    recorded before their work (found on the H200: repeat 2 read 58 ms, the work of three repeats, for its 18)."""
    dev = FakeDevice()
    sink = RecordingSink()
    t = build(dev, sink, gap_us=GAP_US, device_repeats=repeats)
    work = [2.0, 8.0, 18.0, 32.0]
    for step in range(3):
        t.set_step(step)
        for ms in work:
            t("forward-compute").start()
            busy(dev, clock, ms, 5)  # launched in 5 us of host time
            t("forward-compute").stop()
            clock.advance_us(5)
    t.readout.drain()
    for iv in sink.intervals:
        if iv.device_ms is not None:
            assert iv.device_ms == pytest.approx(work[iv.repeat]), (iv.step, iv.repeat, iv.device_ms)
    measured = [(iv.step, iv.repeat) for iv in sink.intervals if iv.device_ms is not None]
    if repeats == "middle":
        assert measured == [(0, 0), (1, 2), (2, 2)]
    else:
        assert len(measured) == 12
    check_free(t)


@pytest.mark.parametrize("failure", ["record_error", "pool_exhausted"])
def test_a_stop_that_could_not_record_ends_the_adjacency(clock: HostClock, failure: str) -> None:
    """A stop whose record failed leaves the interval's GPU work after the last record; the next start, even within
    the gap, records its own event instead of reusing the failed interval's start event (which would take that
    work: 11 ms for its 1)."""
    dev = FakeDevice()
    sink = RecordingSink()
    t = build(dev, sink, gap_us=GAP_US, pool_size=3)
    t.set_step(0)
    c, a, b = t("optimizer"), t("forward-compute"), t("backward-compute")
    clock.advance_us(1000)
    c.start()
    busy(dev, clock, 1.0, 200)
    c.stop()
    clock.advance_us(1000)
    a.start()  # the pool's last event
    busy(dev, clock, 10.0, 5)  # A's 10 ms launched in 5 us
    dev.raise_on_record = failure == "record_error"
    a.stop()  # records nothing: the driver raised, or the pool is empty
    dev.raise_on_record = False
    t.readout.drain()  # returns c's events: b can record
    clock.advance_us(5)
    b.start()
    busy(dev, clock, 1.0, 200)
    b.stop()
    t.readout.drain()
    got = {iv.name: (iv.device_ms, iv.degraded) for iv in sink.intervals}
    assert got["forward-compute"][0] is None
    assert got["backward-compute"][0] == pytest.approx(1.0), got
    check_free(t)

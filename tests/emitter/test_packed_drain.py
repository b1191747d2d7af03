"""The readout's drain packed in C (``_hotpath.pack_slots`` through ``wire.RecordBatch``) against its drain into
``Interval`` objects that the wire encoder then packs: the same bytes on the pipe, and the same state after.

Each seed fills a C ring with a random mix of slots: read device-timed ones (``pre`` set), host-only ones without
events, and the kinds the C drain leaves to readout.py (no ``pre`` yet, host-only with events, unfinished events
that stop the drain, strings without an id yet, a timer that is not the C type). The two drains run
on identical copies. CUDA cannot run here: the events are plain objects with the attributes the readout touches,
and the pool's ``elapsed``/``query`` answer from them (the real driver path is in ``tests/gpu``).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest

from otel_straggler import hot_path
from otel_straggler import readout as readout_mod
from otel_straggler.counters import READOUT_TIMEOUT, EmitterCounters
from otel_straggler.export import wire
from otel_straggler.interval import Interval
from otel_straggler.readout import Readout
from otel_straggler.ring import Ring

native = pytest.mark.skipif(not wire.RecordBatch.packs, reason=f"the C hot path is not in use ({hot_path.REASON})")

REASONS = ("sampled_out", "no_cuda", "unbalanced", "pool_exhausted")
NAMES = [("forward-compute", "compute"), ("backward-compute", "compute"), ("all-grads-sync", "collective"),
         ("optimizer", "optimizer"), ("batch-generator", "data"), ("new-timer", "new-group")]


class Ev:
    __slots__ = ("done", "idx", "tainted")

    def __init__(self, idx: int, done: bool) -> None:
        self.idx = idx
        self.done = done
        self.tainted = True


class Pool:
    def __init__(self) -> None:
        self.capacity = 64
        self.free: deque[Any] = deque()
        self.orphans: deque[Any] = deque()
        self.elapsed_many = None

    @staticmethod
    def elapsed(a: Ev, b: Ev) -> float | None:
        return (b.idx - a.idx) * 0.25 if a.done and b.done else None

    @staticmethod
    def query(ev: Ev) -> bool:
        return ev.done


class PyTimer:
    """A timer that is not the C type (a test's stand-in): the C drain leaves its slots to readout.py."""

    def __init__(self, name: str, group: str) -> None:
        self.name, self._group, self._level, self.collective = name, group, 1, False
        self.label = name


class ListSink:
    """The slot-by-slot path: the readout reads every slot into an ``Interval`` that ``RecordBatch.add`` packs
    (``PyRecordBatch``: the C drain never runs on it), as it does without the C module."""

    def __init__(self, enc: wire.WireEncoder) -> None:
        self.enc, self.data = enc, b""

    def new_batch(self, capacity: int) -> wire.RecordBatch:
        return self.enc.batch(capacity, native=False)

    def submit_batch(self, b: wire.RecordBatch) -> None:
        self.data += b.finish()
        self.enc.commit()

    def publish_stats(self, stats: Any) -> None:
        pass


class CountingBatch(wire.RecordBatch):
    __slots__ = ("by_add",)

    def add(self, iv: Any) -> bool:
        self.by_add += 1
        return super().add(iv)


class BatchSink(ListSink):
    """The packed path: frames from ``new_batch``, written by ``submit_batch`` (``ProcessSink``'s shape)."""

    def __init__(self, enc: wire.WireEncoder) -> None:
        super().__init__(enc)
        self.packed = self.added = 0

    def new_batch(self, capacity: int) -> wire.RecordBatch:
        b = CountingBatch(self.enc, min(capacity, wire.MAX_BATCH))
        b.by_add = 0
        return b

    def submit_batch(self, b: CountingBatch) -> None:
        self.added += b.by_add
        self.packed += b.count - b.by_add
        self.data += b.finish()
        self.enc.commit()


@pytest.fixture(autouse=True)
def readout_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The readout reads this clock, not the machine's: the slots' fake end times (under 2 ms) are two hours old
    on it whatever the machine's uptime, so a slot whose events never complete is past the 3600 s timeout."""
    monkeypatch.setattr(readout_mod, "_clock", lambda: 7200 * 10**9)


def encoder_with(*strings: str) -> wire.WireEncoder:
    """An encoder whose child already has ``strings`` (their ids given and committed)."""
    enc = wire.WireEncoder()
    for s in strings:
        enc._id(s, bytearray())
    enc.commit()
    return enc


def scenario(seed: int, sink_of: Any) -> tuple[Readout, Any, Pool]:
    rng = random.Random(seed)
    enc = encoder_with(*(s for pair in NAMES[:-1] for s in pair), *REASONS[:3])  # not the last ones
    timers: list[Any] = []
    for name, group in NAMES:
        t = hot_path.core.TimerCore()
        t.name, t._group, t._level, t.collective = name, group, rng.choice((0, 1, 2)), rng.random() < 0.3
        t.label = t.name
        timers.append(t)
    timers.append(PyTimer("forward-compute", "compute"))
    ring = Ring(256)
    pool = Pool()
    n = rng.randrange(1, 200)
    idx = 0
    for i in range(n):
        sl = ring.slots[i & ring.mask]
        kind = rng.choices(("dev", "host", "nopre", "host_ev", "stall"), weights=(50, 30, 8, 8, 1))[0]
        sl.timer = rng.choice(timers) if rng.random() < 0.15 else timers[rng.randrange(4)]
        sl.start_ns = 10_000 * i
        sl.end_ns = 10_000 * i + rng.randrange(1, 9000)
        sl.repeat = rng.randrange(0, 8)
        sl.injected = rng.random() < 0.1
        step = rng.choice((i // 20, 2**40 + i))
        sl.binding = (step, rng.choice((None, 4096)), rng.choice((None, 2)), rng.choice((None, 8, 0)))
        if kind in ("dev", "nopre", "stall"):
            sl.start_ev, sl.end_ev = Ev(idx, True), Ev(idx + 1, kind != "stall")
            idx += 2
            sl.own = rng.randrange(4)
            sl.reason = None
            sl.pre = rng.uniform(0.0, 50.0) if kind == "dev" else None
        elif kind == "host_ev":
            sl.start_ev, sl.end_ev = Ev(idx, True), None
            idx += 1
            sl.own = 1
            sl.reason = rng.choice(REASONS)
        else:
            sl.start_ev = sl.end_ev = None
            sl.reason = rng.choice(REASONS)
    ring.head = n
    sink = sink_of(enc)
    readout = Readout(ring, pool, EmitterCounters(), sink, timeout_s=3600.0, wall_anchor=(1_700_000_000_000_000_000, 0))
    return readout, sink, pool


def state(readout: Readout, pool: Pool) -> dict[str, Any]:
    c = readout.counters
    return {
        "tail": readout.ring.tail,
        "free": [ev.idx for ev in pool.free],
        "tainted": sorted(ev.idx for ev in pool.free if ev.tainted),
        "quarantine": [[ev.idx for ev in g] for g in readout.quarantine],
        "degraded": dict(c.degraded),
        "intervals": c.intervals,
        "faults": c.faults_readout,
        "slots": [(s.timer, s.start_ev, s.end_ev, s.binding, s.reason, s.pre, s.injected)
                  for s in readout.ring.slots[: readout.ring.tail]],
    }


@native
def test_the_packed_drain_writes_the_bytes_and_leaves_the_state_of_the_interval_drain() -> None:
    packed = added = 0
    for seed in range(300):
        ra, sa, pa = scenario(seed, ListSink)
        rb, sb, pb = scenario(seed, BatchSink)
        assert ra.drain() == rb.drain(), seed
        assert sb.data == sa.data, seed
        assert state(rb, pb) == state(ra, pa), seed
        packed += sb.packed
        added += sb.added
    # most slots went through C; the kinds it leaves to readout.py went through ``add``
    assert packed > 2 * added > 0, (packed, added)


@native
def test_the_packed_records_decode_to_what_the_slots_held() -> None:
    readout, sink, _ = scenario(7, BatchSink)
    ring = readout.ring
    expect = []
    off = readout._wall_offset
    for i in range(ring.head):
        sl = ring.slots[i]
        dev, reason = sl.pre, sl.reason
        if sl.start_ev is not None and sl.end_ev is not None and dev is None:
            dev = Pool.elapsed(sl.start_ev, sl.end_ev)
            if dev is None:  # unfinished, and older than the timeout on the readout's clock
                reason = READOUT_TIMEOUT
        expect.append((sl.timer.name, sl.binding[0], sl.repeat, sl.start_ns + off, dev, reason, sl.injected,
                       sl.timer.collective))
    readout.drain()
    dec = wire.WireDecoder()
    dec._names = {v: k for k, v in sink.enc.ids.items()}
    got = [iv for kind, ivs in dec.feed(sink.data) if kind == wire.T_INTERVALS for iv in ivs]
    assert len(got) == len(expect) > 10
    for iv, (name, step, repeat, start, dev, reason, injected, collective) in zip(got, expect, strict=True):
        assert (iv.name, iv.step, iv.repeat, iv.host_start_ns, iv.injected, iv.collective) == (
            name, step, repeat, start, injected, collective)
        if dev is not None:
            assert iv.device_ms == pytest.approx(dev) and iv.degraded is None
        else:
            assert iv.device_ms is None and iv.degraded == reason


@native
def test_the_c_drain_stops_where_readout_must_read_and_at_a_full_frame() -> None:
    readout, _, pool = scenario(3, BatchSink)
    ring = readout.ring
    enc = encoder_with("forward-compute", "compute", "sampled_out")
    t = hot_path.core.TimerCore()
    t.name, t._group, t._level = "forward-compute", "compute", 2
    t.label = t.name
    ring.tail = ring.head = 0
    for i, reason in enumerate(("sampled_out", "sampled_out", "no_cuda", "sampled_out")):
        sl = ring.slots[i]
        sl.timer, sl.binding, sl.start_ev, sl.end_ev, sl.reason = t, (1, None, None, None), None, None, reason
    ring.head = 4
    b = enc.batch(8)
    degraded: dict[str, int] = {}
    assert b.pack_slots(ring, 4, degraded, pool.free, 0) == 0
    assert (b.count, ring.tail, degraded) == (2, 2, {"sampled_out": 2})  # "no_cuda" has no id: readout's
    ring.tail = 3
    small = enc.batch(1)
    small.pack_slots(ring, 4, degraded, pool.free, 0)
    assert (small.count, ring.tail) == (1, 4)
    ring.slots[4].timer, ring.slots[4].binding, ring.slots[4].reason = t, (1, None, None, None), "sampled_out"
    ring.head = 5
    small.pack_slots(ring, 5, degraded, pool.free, 0)
    assert (small.count, ring.tail) == (1, 4)  # the frame is full: the slot waits
    with pytest.raises(TypeError):
        hot_path.core.pack_slots(ring, 5, {}, {}, pool.free, 0, b"not a bytearray", 0)


@native
def test_timestamps_that_overflow_are_left_to_readout_which_counts_them() -> None:
    for start, off in ((2**62, 2**62), (-(2**63), -1)):
        counts = []
        for sink_of in (ListSink, BatchSink):
            readout, sink, _ = scenario(11, sink_of)
            ring = readout.ring
            ring.head = 1
            sl = ring.slots[0]
            sl.start_ev = sl.end_ev = None
            sl.reason = "sampled_out"
            sl.timer = hot_path.core.TimerCore()
            sl.timer.name, sl.timer._group = "forward-compute", "compute"
            sl.timer.label = sl.timer.name
            sl.binding = (1, None, None, None)
            sl.start_ns = start
            readout._wall_offset = off
            readout.drain()
            counts.append((readout.counters.faults_readout + readout.counters.sink_errors, sink.data))
        assert counts[0][0] >= 1 and counts[1] == (1, b""), counts


class FailingBatch(CountingBatch):
    __slots__ = ()

    def pack_slots(self, *args: Any) -> int:
        raise RuntimeError("C drain broken")


class FailingSink(BatchSink):
    def new_batch(self, capacity: int) -> wire.RecordBatch:
        b = FailingBatch(self.enc, min(capacity, wire.MAX_BATCH))
        b.by_add = 0
        return b


@native
def test_a_failing_c_drain_is_one_counted_fault_and_the_batch_is_read_slot_by_slot() -> None:
    ra, sa, pa = scenario(5, ListSink)
    rb, sb, pb = scenario(5, FailingSink)
    assert ra.drain() == rb.drain()
    assert sb.data == sa.data and sb.packed == 0
    assert rb.counters.faults_readout == ra.counters.faults_readout + 1
    assert state(rb, pb) | {"faults": 0} == state(ra, pa) | {"faults": 0}


@native
def test_a_string_new_to_the_child_goes_through_add_once_then_through_c_and_a_dropped_batch_forgets_it() -> None:
    enc = wire.WireEncoder()
    t = hot_path.core.TimerCore()
    t.name, t._group, t._level = "forward-compute", "compute", 2
    t.label = t.name
    ring = Ring(16)
    for i in range(5):
        sl = ring.slots[i]
        sl.timer, sl.binding, sl.start_ev, sl.end_ev, sl.reason = t, (1, None, None, None), None, None, "sampled_out"
    ring.head = 5
    sink = BatchSink(enc)
    sink.submit_batch = lambda b: setattr(sink, "last", b)  # keep the batch unwritten
    Readout(ring, Pool(), EmitterCounters(), sink, timeout_s=3600.0, wall_anchor=(0, 0)).drain()
    b = sink.last
    assert b.count == 5 and b.by_add == 1  # the first slot gave the three strings ids; C packed the rest with them
    assert set(enc.ids) == {"forward-compute", "compute", "sampled_out"}
    enc.rollback()  # the batch was dropped: the child never saw those names
    assert enc.ids == {}
    again = enc.batch(4)
    again.add(Interval("forward-compute", 2, "compute", 1, 0, 0, 1, None, "sampled_out", None, None, None, False))
    assert b"forward-compute" in again.finish()  # its NAME frame is sent again

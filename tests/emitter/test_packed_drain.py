"""The readout's drain packed in C (``_hotpath.pack_records`` through ``records.RecordBatch``) against its drain
record by record in Python (``RecordBatch.put``): the same bytes on the pipe, and the same state after.

Each seed fills a C ring with a random mix of records: read device-timed ones (``pre`` set), host-only ones without
events, and the kinds the C drain leaves to readout.py (no ``pre`` yet, host-only with events, unfinished events
that stop the drain, strings without an id yet). The two drains run on identical copies. CUDA cannot run here: the
events are ids into a table of plain flags, and the pool's ``elapsed``/``query`` answer from them (the real driver
path is in ``tests/gpu``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from otel_straggler import hot_path
from otel_straggler import readout as readout_mod
from otel_straggler.counters import CODE, READOUT_TIMEOUT, REASONS, EmitterCounters
from otel_straggler.event_pool import event_table
from otel_straggler.export import wire
from otel_straggler.hot_path import Ring
from otel_straggler.interval import Interval
from otel_straggler.readout import Readout
from otel_straggler.records import F_INJECTED, F_MICROBATCHES, F_SEQUENCES, F_TOKENS
from otel_straggler.ring import NAN, NO_EVENT, RECORD, record_at, register

native = pytest.mark.skipif(not wire.RecordBatch.packs, reason=f"the C hot path is not in use ({hot_path.REASON})")

SOME_REASONS = ("sampled_out", "no_cuda", "unbalanced", "pool_exhausted")
NAMES = [("forward-compute", "compute"), ("backward-compute", "compute"), ("all-grads-sync", "collective"),
         ("optimizer", "optimizer"), ("batch-generator", "data"), ("new-timer", "new-group")]


class Pool:
    """A pool of ``n`` fake events by id: ``done[i]`` says whether event ``i`` completed; every event starts out of
    the free list and tainted (the drain clears the taint of what it returns)."""

    def __init__(self, n: int = 512) -> None:
        self.capacity = n
        self.done = [False] * n
        self.table = event_table(list(range(n)))
        self.table.free.clear()
        for i in range(n):
            self.table.tainted[i] = 1
        self.free = self.table.free
        self.orphans = self.table.orphans
        self.elapsed_many = None

    def elapsed(self, a: int, b: int) -> float | None:
        return (b - a) * 0.25 if self.done[a] and self.done[b] else None

    def query(self, ev: int) -> bool:
        return self.done[ev]


class ListSink:
    """The record-by-record path: the readout packs every record with ``RecordBatch.put`` (``PyRecordBatch``: the
    C drain never runs on it), as it does without the C module."""

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
    __slots__ = ("by_put",)

    def put(self, *args: Any) -> bool:
        self.by_put += 1
        return super().put(*args)


class BatchSink(ListSink):
    """The packed path: frames from ``new_batch``, written by ``submit_batch`` (``ProcessSink``'s shape)."""

    def __init__(self, enc: wire.WireEncoder) -> None:
        super().__init__(enc)
        self.packed = self.added = 0

    def new_batch(self, capacity: int) -> wire.RecordBatch:
        b = CountingBatch(self.enc, min(capacity, wire.MAX_BATCH))
        b.by_put = 0
        return b

    def submit_batch(self, b: CountingBatch) -> None:
        self.added += b.by_put
        self.packed += b.count - b.by_put
        self.data += b.finish()
        self.enc.commit()


@pytest.fixture(autouse=True)
def readout_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The readout reads this clock, not the machine's: the records' fake end times (under 2 ms) are two hours old
    on it whatever the machine's uptime, so a record whose events never complete is past the 3600 s timeout."""
    monkeypatch.setattr(readout_mod, "_clock", lambda: 7200 * 10**9)


def encoder_with(*strings: str) -> wire.WireEncoder:
    """An encoder whose child already has ``strings`` (their ids given and committed)."""
    enc = wire.WireEncoder()
    for s in strings:
        enc._id(s, bytearray())
    enc.commit()
    return enc


def write(ring: Any, i: int, *, tid: int = 0, start: int = 0, end: int = 1, step: int = 1, sev: int = NO_EVENT,
          eev: int = NO_EVENT, own: int = 0, reason: str | None = "sampled_out", repeat: int = 0, flags: int = 0,
          tokens: int = 0, sequences: int = 0, microbatches: int = 0, pre: float = NAN) -> None:
    """Record ``i`` of ``ring``, as a stop writes it."""
    RECORD.pack_into(ring.buf, (i & ring.mask) * RECORD.size, start, end, step, tokens, sequences, microbatches,
                     repeat, tid, sev, eev, flags, own, CODE[reason] if reason else 0)
    ring.pre[i & ring.mask] = pre


def scenario(seed: int, sink_of: Any) -> tuple[Readout, Any, Pool]:
    rng = random.Random(seed)
    enc = encoder_with(*(s for pair in NAMES[:-1] for s in pair), *SOME_REASONS[:3])  # not the last ones
    ring = Ring(256)
    for name, group in NAMES:
        register(ring, name, rng.choice((0, 1, 2)), group, rng.random() < 0.3)
    pool = Pool()
    n = rng.randrange(1, 200)
    idx = 0
    for i in range(n):
        kind = rng.choices(("dev", "host", "nopre", "host_ev", "stall"), weights=(50, 30, 8, 8, 1))[0]
        tid = rng.randrange(len(NAMES)) if rng.random() < 0.15 else rng.randrange(4)
        tokens, sequences, microbatches = rng.choice((None, 4096)), rng.choice((None, 2)), rng.choice((None, 8, 0))
        flags = ((F_INJECTED if rng.random() < 0.1 else 0) | (0 if tokens is None else F_TOKENS)
                 | (0 if sequences is None else F_SEQUENCES) | (0 if microbatches is None else F_MICROBATCHES))
        common = dict(tid=tid, start=10_000 * i, end=10_000 * i + rng.randrange(1, 9000), repeat=rng.randrange(0, 8),
                      step=rng.choice((i // 20, 2**40 + i)), flags=flags, tokens=tokens or 0,
                      sequences=sequences or 0, microbatches=microbatches or 0)
        if kind in ("dev", "nopre", "stall"):
            pool.done[idx], pool.done[idx + 1] = True, kind != "stall"
            write(ring, i, sev=idx, eev=idx + 1, own=rng.randrange(4), reason=None,
                  pre=rng.uniform(0.0, 50.0) if kind == "dev" else NAN, **common)
            idx += 2
        elif kind == "host_ev":
            pool.done[idx] = True
            write(ring, i, sev=idx, own=1, reason=rng.choice(SOME_REASONS), **common)
            idx += 1
        else:
            write(ring, i, reason=rng.choice(SOME_REASONS), **common)
    ring.head = n
    sink = sink_of(enc)
    readout = Readout(ring, pool, EmitterCounters(), sink, timeout_s=3600.0, wall_anchor=(1_700_000_000_000_000_000, 0))
    return readout, sink, pool


def state(readout: Readout, pool: Pool) -> dict[str, Any]:
    c = readout.counters
    r = readout.ring
    return {
        "tail": r.tail,
        "free": list(pool.free),
        "tainted": sorted(ev for ev in pool.free if pool.table.tainted[ev]),
        "quarantine": [list(g) for g in readout.quarantine],
        "degraded": c.degraded,
        "intervals": c.intervals,
        "faults": c.faults_readout,
        "pre": [v == v for v in r.pre[: r.tail]],  # every record read lets go of its read-ahead time
        "records": bytes(r.buf),
    }


@native
def test_the_packed_drain_writes_the_bytes_and_leaves_the_state_of_the_record_drain() -> None:
    packed = added = 0
    for seed in range(300):
        ra, sa, pa = scenario(seed, ListSink)
        rb, sb, pb = scenario(seed, BatchSink)
        assert ra.drain() == rb.drain(), seed
        assert sb.data == sa.data, seed
        assert state(rb, pb) == state(ra, pa), seed
        packed += sb.packed
        added += sb.added
    # most records went through C; the kinds it leaves to readout.py went through ``put``
    assert packed > 2 * added > 0, (packed, added)


@native
def test_the_packed_records_decode_to_what_the_ring_held() -> None:
    readout, sink, pool = scenario(7, BatchSink)
    ring = readout.ring
    expect = []
    off = readout._wall_offset
    for i in range(ring.head):
        rec = record_at(ring, i)
        dev, reason = ring.pre[i], REASONS[rec.reason]
        dev = None if dev != dev else dev
        if rec.start_ev != NO_EVENT and rec.end_ev != NO_EVENT and dev is None:
            dev = pool.elapsed(rec.start_ev, rec.end_ev)
            if dev is None:  # unfinished, and older than the timeout on the readout's clock
                reason = READOUT_TIMEOUT
        name, _, _, collective = ring.timers[rec.timer]
        expect.append((name, rec.step, rec.repeat, rec.start_ns + off, dev, reason, bool(rec.flags & F_INJECTED),
                       collective, rec.tokens if rec.flags & F_TOKENS else None))
    readout.drain()
    dec = wire.WireDecoder()
    dec._names = {v: k for k, v in sink.enc.ids.items()}
    got = [iv for kind, ivs in dec.feed(sink.data) if kind == wire.T_INTERVALS for iv in ivs]
    assert len(got) == len(expect) > 10
    for iv, (name, step, repeat, start, dev, reason, injected, collective, tokens) in zip(got, expect, strict=True):
        assert (iv.name, iv.step, iv.repeat, iv.host_start_ns, iv.injected, iv.collective, iv.tokens) == (
            name, step, repeat, start, injected, collective, tokens)
        if dev is not None:
            assert iv.device_ms == pytest.approx(dev) and iv.degraded is None
        else:
            assert iv.device_ms is None and iv.degraded == reason


@native
def test_the_c_drain_stops_where_readout_must_read_and_at_a_full_frame() -> None:
    readout, _, pool = scenario(3, BatchSink)
    ring = readout.ring
    enc = encoder_with("forward-compute", "compute", "sampled_out")
    ring.tail = ring.head = 0
    for i, reason in enumerate(("sampled_out", "sampled_out", "no_cuda", "sampled_out")):
        write(ring, i, tid=0, reason=reason)
    ring.head = 4
    b = enc.batch(8)
    degraded = EmitterCounters().degraded_counts
    assert b.pack_records(ring, pool.table, 4, degraded, 0) == 0
    assert (b.count, ring.tail, degraded[CODE["sampled_out"]]) == (2, 2, 2)  # "no_cuda" has no id: readout's
    ring.tail = 3
    small = enc.batch(1)
    small.pack_records(ring, pool.table, 4, degraded, 0)
    assert (small.count, ring.tail) == (1, 4)
    write(ring, 4, tid=0)
    ring.head = 5
    small.pack_records(ring, pool.table, 5, degraded, 0)
    assert (small.count, ring.tail) == (1, 4)  # the frame is full: the record waits
    with pytest.raises(TypeError):
        hot_path.core.pack_records(ring, pool.table, 5, {}, degraded, 0, b"not a bytearray", 0)


@native
def test_timestamps_that_overflow_are_left_to_readout_which_counts_them() -> None:
    for start, off in ((2**62, 2**62), (-(2**63), -1)):
        counts = []
        for sink_of in (ListSink, BatchSink):
            readout, sink, _ = scenario(11, sink_of)
            ring = readout.ring
            ring.tail, ring.head = 0, 1
            write(ring, 0, tid=0, start=start)
            readout._wall_offset = off
            readout.drain()
            counts.append((readout.counters.faults_readout + readout.counters.sink_errors, sink.data))
        assert counts[0][0] >= 1 and counts[1] == (1, b""), counts


class FailingBatch(CountingBatch):
    __slots__ = ()

    def pack_records(self, *args: Any) -> int:
        raise RuntimeError("C drain broken")


class FailingSink(BatchSink):
    def new_batch(self, capacity: int) -> wire.RecordBatch:
        b = FailingBatch(self.enc, min(capacity, wire.MAX_BATCH))
        b.by_put = 0
        return b


@native
def test_a_failing_c_drain_is_one_counted_fault_and_the_batch_is_read_record_by_record() -> None:
    ra, sa, pa = scenario(5, ListSink)
    rb, sb, pb = scenario(5, FailingSink)
    assert ra.drain() == rb.drain()
    assert sb.data == sa.data and sb.packed == 0
    assert rb.counters.faults_readout == ra.counters.faults_readout + 1
    assert state(rb, pb) | {"faults": 0} == state(ra, pa) | {"faults": 0}


@native
def test_a_string_new_to_the_child_goes_through_put_once_then_through_c_and_a_dropped_batch_forgets_it() -> None:
    enc = wire.WireEncoder()
    ring = Ring(16)
    register(ring, "forward-compute", 2, "compute", False)
    for i in range(5):
        write(ring, i, tid=0)
    ring.head = 5
    sink = BatchSink(enc)
    sink.submit_batch = lambda b: setattr(sink, "last", b)  # keep the batch unwritten
    Readout(ring, Pool(), EmitterCounters(), sink, timeout_s=3600.0, wall_anchor=(0, 0)).drain()
    b = sink.last
    assert b.count == 5 and b.by_put == 1  # the first record gave the three strings ids; C packed the rest with them
    assert set(enc.ids) == {"forward-compute", "compute", "sampled_out"}
    enc.rollback()  # the batch was dropped: the child never saw those names
    assert enc.ids == {}
    again = enc.batch(4)
    again.add(Interval("forward-compute", 2, "compute", 1, 0, 0, 1, None, "sampled_out", None, None, None, False))
    assert b"forward-compute" in again.finish()  # its NAME frame is sent again


@native
def test_a_timer_id_the_ring_does_not_know_is_left_to_readout_which_counts_it() -> None:
    """A record whose timer id has no entry in the ring's table (a table that was full at the timer's creation):
    the C drain stops at it and readout.py counts it as a fault, then goes on."""
    ring = Ring(8)
    register(ring, "forward-compute", 2, "compute", False)
    write(ring, 0, tid=0)
    write(ring, 1, tid=0xFFFF)
    write(ring, 2, tid=0)
    ring.head = 3
    sink = BatchSink(encoder_with("forward-compute", "compute", "sampled_out"))
    readout = Readout(ring, Pool(), EmitterCounters(), sink, timeout_s=3600.0, wall_anchor=(0, 0))
    assert readout.drain() == 2
    assert readout.counters.faults_readout == 1 and ring.tail == 3 and sink.packed == 2

"""Packed records on the pipe between a training process and its export child.

Stream of frames ``<type:u8><length:u32>`` + payload:

* ``NAME``: ``<id:u16>`` + UTF-8 string. Each distinct string (timer name, group, degraded reason) is sent
  once; records refer to it by id.
* ``INTERVALS``: ``<count:u16>`` + ``count`` fixed-size records (``RECORD``, 68 bytes).
* ``STATS``: JSON object of cumulative counters (small, sent only when it changed).
* ``FLUSH``: ``<seq:u32><timeout_ms:u32>``; the child closes its open steps, flushes, and answers
  ``F<seq> <0|1> <json of its export counters>\\n`` on its stdout.

The encoder assigns ids tentatively; the caller commits them only once the bytes were accepted by the
pipe (a dropped batch must not leave names the child never saw).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from otel_straggler import hot_path
from otel_straggler.ring import F_COLLECTIVE, F_DEVICE, F_INJECTED, F_MICROBATCHES, F_SEQUENCES, F_TOKENS

__all__ = ["F_COLLECTIVE", "F_DEVICE", "F_INJECTED", "F_MICROBATCHES", "F_SEQUENCES", "F_TOKENS", "MAX_NAME_BYTES",
           "Interval", "bound_name", "wire_level"]

T_NAME = 1
T_INTERVALS = 2
T_STATS = 3
T_FLUSH = 4

FRAME = struct.Struct("<BI")
COUNT = struct.Struct("<H")
NAME_ID = struct.Struct("<H")
SEQ = struct.Struct("<II")  # flush: seq, timeout ms
# name, group, degraded (0xFFFF none), level, flags, step, repeat, start, end, device_ms, tokens, seqs, mbs
RECORD = struct.Struct("<HHHbBqiqqdqqq")
NONE_ID = 0xFFFF
MAX_NAMES = 0xFFFE
MAX_BATCH = 0xFFFF
MAX_FRAME = 64 * 1024 * 1024


class NameTableFull(Exception):
    pass


HEADER = FRAME.size + COUNT.size  # an INTERVALS frame's bytes before its first record


# A name's UTF-8 bytes on the wire at most (a timer name, a group, a reason): a longer one is truncated by
# ``bound_name``, so a frame, a span and an export batch stay small whatever name the program uses
MAX_NAME_BYTES = 256
LEVEL_MIN, LEVEL_MAX = -128, 127  # the record's level: one signed byte


def bound_name(name: object) -> tuple[str, bool]:
    """``name`` as it goes on the wire: its ``str`` (Megatron keys timers by any hashable), and when that is longer
    than ``MAX_NAME_BYTES`` its beginning plus ``~`` and 16 hex digits of its hash, so that two long names with the
    same beginning stay two; and whether it was truncated."""
    text = name if type(name) is str else str(name)
    if len(text) * 4 <= MAX_NAME_BYTES:
        return text, False
    raw = text.encode("utf-8", "replace")
    if len(raw) <= MAX_NAME_BYTES:
        return text, False
    digest = hashlib.blake2b(raw, digest_size=8).hexdigest()
    head = raw[: MAX_NAME_BYTES - len(digest) - 1].decode("utf-8", "ignore")
    return f"{head}~{digest}", True


def wire_level(level: object) -> int:
    """A Megatron log level as the record's signed byte: its integer part, clamped (a level is any number there)."""
    if type(level) is int and LEVEL_MIN <= level <= LEVEL_MAX:
        return level
    try:
        v = int(level)  # type: ignore[call-overload]
    except OverflowError:  # an infinity
        return LEVEL_MAX if level > 0 else LEVEL_MIN  # type: ignore[operator]
    except (TypeError, ValueError):  # NaN, or no number at all
        return 0
    return max(LEVEL_MIN, min(LEVEL_MAX, v))


@dataclass(slots=True)
class Interval:
    name: str  # Megatron timer name
    level: int  # Megatron log level of the timer
    group: str  # stage group (otel_straggler.stages)
    step: int  # step bound at stop time on the training thread
    repeat: int  # index of this interval among the same timer's intervals in the step (microbatch)
    host_start_ns: int  # wall clock (time.time_ns scale), derived from the monotonic clock
    host_end_ns: int
    device_ms: float | None  # None when timed host-only
    degraded: str | None  # schema.DEGRADED_REASONS entry when device_ms is None
    tokens: int | None  # workload bound at stop time (None when not published)
    sequences: int | None
    microbatches: int | None
    injected: bool  # the test-only slowdown ran inside this interval
    collective: bool = False  # the timer is marked as holding a wait in a collective (``stage(..., collective=True)``)


def _c_packer() -> Any:
    """The C drain that packs ring records into a frame (``hot_path.pack_records``) where it writes this module's
    layout; None on the Python path."""
    fn = hot_path.pack_records
    if fn is None or (hot_path.RECORD_SIZE, hot_path.RECORD_HEADER) != (RECORD.size, HEADER):
        return None
    return fn


_PACK_RECORDS = _c_packer()


class WireEncoder:
    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._added: list[str] = []  # strings given an id since the last commit (their NAME frames not yet written)
        self.generation = 0  # bumped by reset: a batch begun before it refers to ids the new child never saw

    @property
    def ids(self) -> dict[str, int]:
        """Every string's id: those the child has, and those since the last commit, whose NAME frames go ahead of
        the batch that uses them (``RecordBatch.names``). What the C drain (``_hotpath.pack_records``) packs with."""
        return self._ids

    def reset(self) -> None:
        """A new child: every name must be sent again."""
        self._ids.clear()
        self._added.clear()
        self.generation += 1

    def commit(self) -> None:
        """The batch was written: the child has its names."""
        self._added.clear()

    def rollback(self) -> None:
        """The batch was dropped: the child never saw the names it gave ids."""
        for name in self._added:
            del self._ids[name]
        self._added.clear()

    def _id(self, name: str, out: bytearray) -> int:
        nid = self._ids.get(name)
        if nid is None:
            nid = len(self._ids)
            if nid >= MAX_NAMES:
                raise NameTableFull(name)
            self._ids[name] = nid
            self._added.append(name)
            raw = name.encode("utf-8", "replace")
            out += FRAME.pack(T_NAME, NAME_ID.size + len(raw))
            out += NAME_ID.pack(nid)
            out += raw
        return nid

    def batch(self, capacity: int = MAX_BATCH, *, native: bool = True) -> RecordBatch:
        """An empty INTERVALS frame for up to ``capacity`` (at most ``MAX_BATCH``) records; ``native`` False: one
        the readout fills record by record in Python even where the C drain runs (``PyRecordBatch``)."""
        return (RecordBatch if native else PyRecordBatch)(self, min(max(1, int(capacity)), MAX_BATCH))

    def encode_intervals(self, intervals: Sequence[Interval]) -> bytes:
        """The NAME frames of strings not sent yet and one INTERVALS frame per ``MAX_BATCH`` intervals; raises
        ``NameTableFull`` when a string does not fit the table."""
        out = b""
        for start in range(0, len(intervals), MAX_BATCH):
            chunk = intervals[start : start + MAX_BATCH]
            b = self.batch(len(chunk))
            for iv in chunk:
                if not b.add(iv):
                    raise NameTableFull(iv.name)
            out += b.finish()
        return out


class RecordBatch:
    """One INTERVALS frame filled in place, on the readout thread with the GIL held: records go into a
    preallocated frame, packed by ``put`` (one ``struct.pack_into`` and a dict lookup per known string) or, many at
    a time, by the C drain (``_hotpath.pack_records``), which writes the same layout at ``HEADER + count *
    RECORD.size`` and looks strings up in ``ids`` (a string without an id goes through ``put``, which gives it one
    and puts its NAME frame in ``names``, ahead of the frame). ``finish`` is the bytes to write; the encoder's
    ``commit`` once they were written, its ``rollback`` when they were dropped."""

    __slots__ = ("count", "dropped", "encoder", "frame", "generation", "ids", "names")

    packs = _PACK_RECORDS is not None  # whether ``pack_records`` runs (the C module is loaded)

    def __init__(self, encoder: WireEncoder, capacity: int) -> None:
        self.encoder = encoder
        self.generation = encoder.generation
        self.ids = encoder.ids
        self.names = bytearray()
        self.frame = bytearray(HEADER + capacity * RECORD.size)
        self.count = 0
        self.dropped = 0  # intervals whose strings did not fit the name table (``dropped_overflow``)

    @property
    def capacity(self) -> int:
        return (len(self.frame) - HEADER) // RECORD.size

    def add(self, iv: Interval) -> bool:
        """Pack one interval (``put`` of its fields); False when it was dropped instead."""
        dev, tokens, sequences, microbatches = iv.device_ms, iv.tokens, iv.sequences, iv.microbatches
        flags = ((0 if dev is None else F_DEVICE) | (0 if tokens is None else F_TOKENS)
                 | (0 if sequences is None else F_SEQUENCES) | (0 if microbatches is None else F_MICROBATCHES)
                 | (F_INJECTED if iv.injected else 0) | (F_COLLECTIVE if iv.collective else 0))
        return self.put(iv.name, iv.group, iv.degraded, wire_level(iv.level), flags, iv.step, iv.repeat,
                        iv.host_start_ns, iv.host_end_ns, dev or 0.0, tokens or 0, sequences or 0, microbatches or 0)

    def put(self, name: str, group: str, degraded: str | None, level: int, flags: int, step: int, repeat: int,
            start_ns: int, end_ns: int, device_ms: float, tokens: int, sequences: int, microbatches: int) -> bool:
        """Pack one record (the wire's fields: ``level`` a byte, ``flags`` its bits, 0 for an absent value); False
        when it was dropped instead (the frame is full, or a string of it does not fit the name table: counted in
        ``dropped``)."""
        if self.count >= self.capacity:
            self.dropped += 1
            return False
        enc, known, names = self.encoder, self.ids, self.names
        try:
            name_id = known.get(name)
            if name_id is None:
                name_id = enc._id(name, names)
            group_id = known.get(group)
            if group_id is None:
                group_id = enc._id(group, names)
            if degraded:
                degraded_id = known.get(degraded)
                if degraded_id is None:
                    degraded_id = enc._id(degraded, names)
            else:
                degraded_id = NONE_ID
        except NameTableFull:
            self.dropped += 1
            return False
        RECORD.pack_into(self.frame, HEADER + self.count * RECORD.size, name_id, group_id, degraded_id, level,
                         flags, step, repeat, start_ns, end_ns, device_ms, tokens, sequences, microbatches)
        self.count += 1
        return True

    def pack_records(self, ring: Any, table: Any, head: int, degraded: Any, wall_offset: int) -> int:
        """The readout's drain in C (``_hotpath.pack_records``, only where ``packs``): from the ring's tail up to
        ``head``, each record that is read device-timed (its device ms in ``ring.pre``) or host-only without events,
        whose strings have an id, becomes a wire record here, as readout.py's ``put`` of it would; its events go
        back to the table's free list and a host-only one's reason code is counted in ``degraded``; the ring's tail
        moves past it. Stops at the first other record, for readout.py to read. Returns the records lost to an error
        (``faults_readout``)."""
        assert _PACK_RECORDS is not None
        self.count, faults = _PACK_RECORDS(ring, table, head, self.ids, degraded, wall_offset, self.frame,
                                           self.count)
        return int(faults)

    def finish(self) -> bytes:
        """The NAME frames of this batch's new strings, then its INTERVALS frame (nothing when it has no record)."""
        n = self.count
        if n == 0:
            return bytes(self.names)
        FRAME.pack_into(self.frame, 0, T_INTERVALS, COUNT.size + n * RECORD.size)
        COUNT.pack_into(self.frame, FRAME.size, n)
        with memoryview(self.frame) as view:
            return bytes(self.names) + view[: HEADER + n * RECORD.size]


class PyRecordBatch(RecordBatch):
    """A frame the readout fills record by record (``put``), never by the C drain: the Python path's packing, where the
    two are compared (tests, ``bench/readout_cost.py``)."""

    __slots__ = ()
    packs = False


def encode_stats(stats: dict[str, Any]) -> bytes:
    raw = json.dumps(stats, separators=(",", ":")).encode()
    return FRAME.pack(T_STATS, len(raw)) + raw


def encode_flush(seq: int, timeout_s: float) -> bytes:
    return FRAME.pack(T_FLUSH, SEQ.size) + SEQ.pack(seq & 0xFFFFFFFF, max(0, min(int(timeout_s * 1000), 0xFFFFFFFF)))


class WireDecoder:
    """Incremental decoder: ``feed`` bytes, get ``(type, value)`` messages."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._names: dict[int, str] = {}

    def feed(self, data: bytes) -> list[tuple[int, Any]]:
        self._buf += data
        pos = 0
        buf = self._buf
        msgs: list[tuple[int, Any]] = []
        try:
            while len(buf) - pos >= FRAME.size:
                ftype, length = FRAME.unpack_from(buf, pos)
                if length > MAX_FRAME:
                    raise ValueError(f"frame too large: {length}")
                if len(buf) - pos - FRAME.size < length:
                    break
                start = pos + FRAME.size
                pos = start + length
                with memoryview(buf)[start:pos] as payload:
                    msg = self._decode(ftype, payload)
                if msg is not None:
                    msgs.append(msg)
        finally:
            del self._buf[:pos]
        return msgs

    def _decode(self, ftype: int, payload: memoryview) -> tuple[int, Any] | None:
        if ftype == T_NAME:
            (nid,) = NAME_ID.unpack_from(payload, 0)
            self._names[nid] = bytes(payload[NAME_ID.size :]).decode("utf-8", "replace")
            return None
        if ftype == T_INTERVALS:
            (count,) = COUNT.unpack_from(payload, 0)
            names = self._names
            out = []
            for i in range(count):
                (nid, gid, did, level, flags, step, repeat, start, end, dev, tok, seqs, mbs) = RECORD.unpack_from(
                    payload, COUNT.size + i * RECORD.size
                )
                out.append(
                    Interval(
                        name=names.get(nid, "unknown"),
                        level=level,
                        group=names.get(gid, "other"),
                        step=step,
                        repeat=repeat,
                        host_start_ns=start,
                        host_end_ns=end,
                        device_ms=dev if flags & F_DEVICE else None,
                        degraded=names.get(did) if did != NONE_ID else None,
                        tokens=tok if flags & F_TOKENS else None,
                        sequences=seqs if flags & F_SEQUENCES else None,
                        microbatches=mbs if flags & F_MICROBATCHES else None,
                        injected=bool(flags & F_INJECTED),
                        collective=bool(flags & F_COLLECTIVE),
                    )
                )
            return (T_INTERVALS, out)
        if ftype == T_STATS:
            return (T_STATS, json.loads(bytes(payload).decode()))
        if ftype == T_FLUSH:
            return (T_FLUSH, SEQ.unpack_from(payload, 0))
        return None

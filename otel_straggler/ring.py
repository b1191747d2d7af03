"""Fixed single-producer / single-consumer ring of completed intervals, as bytes.

``buf`` is a preallocated ``bytearray`` of ``cap`` fixed-size records (``RECORD``, 64 bytes: one cache line), each
one interval: its host clock, the step and workload bound at its stop, its repeat index, and integer ids into
Python-owned tables: the timer (``timers``: the wire's name, level, group and collective flag of each timer of
this ring), its start and end events (the pool's ``event_pool.EventTable``) and its degraded reason
(``counters.REASONS``). No Python object lives in a record: a stop writes 64 bytes, and the readout turns a record
into the wire's (``records.py``) without touching an object per interval.

The TRAINING thread is the only producer: it writes record ``head & mask`` and then advances ``head``. The READOUT
thread is the only consumer: it reads records ``tail .. head-1`` and then advances ``tail``. No lock: each record
is written by one thread at a time, the GIL orders the producer's writes before its ``head`` store, and the producer
publishes a record only after writing all of it. Indices grow without wrapping (Python ints; 64-bit integers in the
C ring); the record is ``index & mask``. Full (``head - tail >= cap``): the producer drops and counts.

``pre`` holds, per record, the device ms the readout read ahead (``event_pool.EventPool.elapsed_many``), NaN while
unread: readout thread only.

The ring itself is ``hot_path.Ring`` (``_hotpath.c``, or ``_hotpath_py.py``: the same fields, ``buf`` and ``pre``
the same Python objects); both hot paths write the same bytes. This module is the layout they share.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any, Final, NamedTuple

# start_ns, end_ns, step, tokens, sequences, microbatches, repeat, timer id, start event, end event, flags (F_TOKENS,
# F_SEQUENCES, F_MICROBATCHES, F_INJECTED below), own (1: the record returns its start event to the pool, 2: its end
# event; _hotpath_py.py SharedEvent), reason code (counters.REASONS)
RECORD: Final = struct.Struct("<qqqqqqiHHHBBB3x")
# a record's flag bits, the wire's (records.py): its record adds F_DEVICE and F_COLLECTIVE at the readout
F_DEVICE: Final = 1
F_TOKENS: Final = 2
F_SEQUENCES: Final = 4
F_MICROBATCHES: Final = 8
F_INJECTED: Final = 16
F_COLLECTIVE: Final = 32
NO_EVENT: Final = 0xFFFF  # a record's event id when it has none
MAX_TIMERS: Final = 0xFFFF  # timer ids a ring's table holds
NAN: Final = float("nan")


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def _storage(n: int) -> tuple[bytearray, array, list[tuple[str, int, str, bool]]]:
    """A ring's ``buf`` and ``pre`` for ``n`` records, and its table of timers (the C ``Ring`` takes them too):
    timer id -> (wire name, wire level byte, group, collective), appended by ``register`` (training thread, at a
    timer's creation), read by the readout."""
    return bytearray(n * RECORD.size), array("d", [NAN]) * n, []


class Record(NamedTuple):
    """One record's fields (``RECORD``), as ``record_at`` reads them (tests, debugging; the readout unpacks)."""

    start_ns: int
    end_ns: int
    step: int
    tokens: int
    sequences: int
    microbatches: int
    repeat: int
    timer: int
    start_ev: int
    end_ev: int
    flags: int
    own: int
    reason: int


def record_at(ring: Any, index: int) -> Record:
    """The record at ring index ``index`` (``index & mask``)."""
    return Record(*RECORD.unpack_from(ring.buf, (index & ring.mask) * RECORD.size))


def register(ring: Any, label: str, level: int, group: str, collective: bool) -> int:
    """A timer's id in ``ring.timers`` (a new entry); ``MAX_TIMERS`` when the table is full: its intervals are then
    read as faults (``readout.py``), which a process with 65,535 timer objects on one ring has earned."""
    table = ring.timers
    if len(table) >= MAX_TIMERS:
        return MAX_TIMERS
    table.append((label, level, group, collective))
    return len(table) - 1

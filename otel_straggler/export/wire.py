"""Packed records on the pipe between a training process and its export child.

Stream of frames ``<type:u8><length:u32>`` + payload:

* ``NAME``: ``<id:u16>`` + UTF-8 string. Each distinct string (timer name, group, degraded reason) is sent
  once; records refer to it by id.
* ``INTERVALS``: ``<count:u16>`` + ``count`` fixed-size records (``RECORD``, 67 bytes).
* ``STATS``: JSON object of cumulative counters (small, sent only when it changed).
* ``FLUSH``: ``<seq:u32><timeout_ms:u32>``; the child closes its open steps, flushes, and answers
  ``F<seq> <0|1> <json of its export counters>\\n`` on its stdout.

The encoder assigns ids tentatively; the caller commits them only once the bytes were accepted by the
pipe (a dropped batch must not leave names the child never saw).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

from otel_straggler.interval import Interval

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

F_DEVICE = 1
F_TOKENS = 2
F_SEQUENCES = 4
F_MICROBATCHES = 8
F_INJECTED = 16
F_COLLECTIVE = 32


class NameTableFull(Exception):
    pass


class WireEncoder:
    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._tentative: dict[str, int] = {}

    def reset(self) -> None:
        """A new child: every name must be sent again."""
        self._ids.clear()
        self._tentative.clear()

    def commit(self) -> None:
        self._ids.update(self._tentative)
        self._tentative.clear()

    def rollback(self) -> None:
        self._tentative.clear()

    def _id(self, name: str, out: bytearray) -> int:
        nid = self._ids.get(name)
        if nid is None:
            nid = self._tentative.get(name)
            if nid is None:
                nid = len(self._ids) + len(self._tentative)
                if nid >= MAX_NAMES:
                    raise NameTableFull(name)
                self._tentative[name] = nid
                raw = name.encode("utf-8", "replace")
                out += FRAME.pack(T_NAME, NAME_ID.size + len(raw))
                out += NAME_ID.pack(nid)
                out += raw
        return nid

    def encode_intervals(self, intervals: Sequence[Interval]) -> bytes:
        """The NAME frames of strings not sent yet and one INTERVALS frame per ``MAX_BATCH`` intervals. Runs on
        the readout thread with the GIL held, once per interval: each record is packed in place into one
        preallocated frame, and a string already known costs one dict lookup."""
        out = bytearray()
        known = self._ids
        size = RECORD.size
        pack_into = RECORD.pack_into
        for start in range(0, len(intervals), MAX_BATCH):
            chunk = intervals[start : start + MAX_BATCH]
            n = len(chunk)
            frame = bytearray(FRAME.size + COUNT.size + n * size)
            FRAME.pack_into(frame, 0, T_INTERVALS, COUNT.size + n * size)
            COUNT.pack_into(frame, FRAME.size, n)
            off = FRAME.size + COUNT.size
            for iv in chunk:
                name, group, degraded, dev = iv.name, iv.group, iv.degraded, iv.device_ms
                tokens, sequences, microbatches = iv.tokens, iv.sequences, iv.microbatches
                name_id = known.get(name)
                if name_id is None:
                    name_id = self._id(name, out)
                group_id = known.get(group)
                if group_id is None:
                    group_id = self._id(group, out)
                if degraded:
                    degraded_id = known.get(degraded)
                    if degraded_id is None:
                        degraded_id = self._id(degraded, out)
                else:
                    degraded_id = NONE_ID
                flags = 0
                if dev is not None:
                    flags = F_DEVICE
                else:
                    dev = 0.0
                if tokens is not None:
                    flags |= F_TOKENS
                else:
                    tokens = 0
                if sequences is not None:
                    flags |= F_SEQUENCES
                else:
                    sequences = 0
                if microbatches is not None:
                    flags |= F_MICROBATCHES
                else:
                    microbatches = 0
                if iv.injected:
                    flags |= F_INJECTED
                if iv.collective:
                    flags |= F_COLLECTIVE
                pack_into(frame, off, name_id, group_id, degraded_id, iv.level, flags, iv.step, iv.repeat,
                          iv.host_start_ns, iv.host_end_ns, dev, tokens, sequences, microbatches)
                off += size
            out += frame
        return bytes(out)


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

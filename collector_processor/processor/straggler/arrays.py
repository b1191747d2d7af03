"""Reading the step summary's array attributes (``ArrayValue``) without a Python object per element.

Through the protobuf (upb) wrappers every element of an ``ArrayValue`` becomes a Python ``AnyValue`` object
before its value can be read: ~150 ns each, 65 per rank-step summary, which made reading the five arrays
most of the collector's per-rank-step cost. Both readers here start from the array's wire bytes (one C call):

* names and counts repeat from step to step (the same timers every step), so their decoded tuple is kept
  per distinct wire bytes and reused (bounded: cleared when ``_MEMO_MAX`` distinct arrays were seen; an array
  over ``MEMO_KEY_BYTES`` is read every time);
* doubles differ every step, but an array of doubles has one fixed layout on the wire, 11 bytes per element
  (``0a 09``: field 1, 9 bytes; ``21``: double_value, fixed64; 8 bytes little-endian), which one
  ``struct`` call unpacks. Anything else (ints, a mixed array, unknown fields) takes the per-element path.

The ``attribute_*`` readers take the whole attribute (``KeyValue``) instead: its wire bytes cost less than the
array's (no Python wrapper for the value and the array on the way), and they hold the array's bytes after a
prefix fixed by the key and the array's length (``0a`` key, ``12`` value, ``2a`` array). A prefix other than
that one (another kind of value, unknown fields) reads the array as the array readers above do.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue

_MEMO_MAX = 1024
# What one remembered entry may cost: arrays of more wire bytes, and double arrays of more elements, are read
# every time instead (a sender of ever-new 16 MiB arrays would otherwise leave 1,024 of them, gigabytes, held)
MEMO_KEY_BYTES = 4096
UNPACKER_MAX_ELEMENTS = 512
_strings_memo: dict[bytes, tuple[str, ...]] = {}
_ints_memo: dict[bytes, tuple[int, ...]] = {}
_unpackers: dict[int, struct.Struct] = {}
_DOUBLE_ELEMENT = 11  # 0a 09 21 + 8 bytes
_attr_strings_memo: dict[bytes, tuple[str, ...]] = {}
_attr_ints_memo: dict[bytes, tuple[int, ...]] = {}
# (key, length of the attribute's bytes) -> its prefix, where its doubles start, the three bytes each element
# starts with (one bytes per position: n times 0a, 09, 21) and the doubles' unpacker; () when no
# array of plain doubles has that length under that key
_attr_layouts: dict[tuple[str, int], tuple[bytes, int, bytes, bytes, bytes, struct.Struct] | tuple[()]] = {}


def number(v: AnyValue) -> float:
    """A numeric AnyValue as float (doubles normally; ints accepted)."""
    which = v.WhichOneof("value")
    if which == "double_value":
        return v.double_value
    if which == "int_value":
        return float(v.int_value)
    return math.nan


def _bounded_get(memo: dict, key: object, make: Callable[[], object]) -> Any:  # type: ignore[type-arg]
    """``memo[key]``, made by ``make()`` when missing; the memo is cleared when it holds ``_MEMO_MAX`` keys (a
    stream of ever-new arrays, not this project's emitter: start over)."""
    out = memo.get(key)
    if out is None:
        if isinstance(key, bytes) and len(key) > MEMO_KEY_BYTES:
            return make()
        if len(memo) >= _MEMO_MAX:
            memo.clear()
        out = memo[key] = make()
    return out


def _unpacker(n: int) -> struct.Struct:
    """The ``struct`` reading n plain double elements (remembered up to ``UNPACKER_MAX_ELEMENTS``)."""
    if n > UNPACKER_MAX_ELEMENTS:
        return struct.Struct("<" + "3xd" * n)
    return _bounded_get(_unpackers, n, lambda: struct.Struct("<" + "3xd" * n))


def strings(array: ArrayValue) -> tuple[str, ...]:
    """The string values of an array (an element that is not a string reads as "", as protobuf reads it)."""
    return _bounded_get(_strings_memo, array.SerializeToString(),
                        lambda: tuple(x.string_value for x in array.values))


def ints(array: ArrayValue) -> tuple[int, ...]:
    """The int values of an array (an element that is not an int reads as 0)."""
    return _bounded_get(_ints_memo, array.SerializeToString(), lambda: tuple(x.int_value for x in array.values))


def doubles(array: ArrayValue) -> Sequence[float]:
    """A numeric array as floats (homogeneous, as OTel requires): doubles straight from the wire bytes when
    every element is exactly a double ``AnyValue``, else element by element (ints converted)."""
    raw = array.SerializeToString()
    n, rest = divmod(len(raw), _DOUBLE_ELEMENT)
    # element k starts at 11 k: these three bytes at every start, and a length of exactly 11 n, mean that
    # parsing element by element would find n AnyValues each holding only a double
    if not rest and raw[0::11] == b"\x0a" * n and raw[1::11] == b"\x09" * n and raw[2::11] == b"\x21" * n:
        return _unpacker(n).unpack(raw)
    values = array.values
    if values and values[0].WhichOneof("value") != "double_value":
        return [number(x) for x in values]
    return [x.double_value for x in values]


def attribute_strings(kv: KeyValue) -> tuple[str, ...]:
    """``strings(kv.value.array_value)``, remembered by the attribute's wire bytes."""
    return _bounded_get(_attr_strings_memo, kv.SerializeToString(),
                        lambda: tuple(x.string_value for x in kv.value.array_value.values))


def attribute_ints(kv: KeyValue) -> tuple[int, ...]:
    """``ints(kv.value.array_value)``, remembered by the attribute's wire bytes."""
    return _bounded_get(_attr_ints_memo, kv.SerializeToString(),
                        lambda: tuple(x.int_value for x in kv.value.array_value.values))


def attribute_doubles(kv: KeyValue, key: str) -> Sequence[float]:
    """``doubles(kv.value.array_value)`` for the attribute ``kv`` whose key is ``key``: straight from the
    attribute's wire bytes when they are exactly the key, the value holding only an array and the array
    holding only double ``AnyValue``s (as ``doubles`` requires of the array's bytes); else through ``doubles``."""
    raw = kv.SerializeToString()
    size = len(raw)
    if size > _DOUBLE_ELEMENT * UNPACKER_MAX_ELEMENTS:  # no layout remembered for it (MEMO_KEY_BYTES)
        return doubles(kv.value.array_value)
    layout = _attr_layouts.get((key, size))
    if layout is None:
        if len(_attr_layouts) >= _MEMO_MAX:
            _attr_layouts.clear()
        layout = _attr_layouts[(key, size)] = _attribute_layout(key, size)
    if layout:
        prefix, start, fields, sizes, tags, unpacker = layout
        if (raw.startswith(prefix) and raw[start::11] == fields and raw[start + 1::11] == sizes
                and raw[start + 2::11] == tags):
            return unpacker.unpack_from(raw, start)
    return doubles(kv.value.array_value)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _attribute_layout(key: str, size: int) -> tuple[bytes, int, bytes, bytes, bytes, struct.Struct] | tuple[()]:
    """The prefix of a ``KeyValue`` of ``size`` bytes holding ``key`` and an array of n plain doubles
    (``0a`` len key ``12`` len ``2a`` len), with where the n elements start, their first three bytes (n times
    each) and their unpacker; () when no n gives ``size`` bytes."""
    kb = key.encode()
    head = b"\x0a" + _varint(len(kb)) + kb + b"\x12"
    for n in range(max(0, (size - len(head) - 11) // _DOUBLE_ELEMENT), (size - len(head)) // _DOUBLE_ELEMENT + 1):
        array_len = _DOUBLE_ELEMENT * n
        value = b"\x2a" + _varint(array_len)
        prefix = head + _varint(len(value) + array_len) + value
        if len(prefix) + array_len == size:
            return (prefix, len(prefix), b"\x0a" * n, b"\x09" * n, b"\x21" * n,
                    _unpacker(n))
    return ()

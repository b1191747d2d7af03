"""Reading the step summary's array attributes (``ArrayValue``) without a Python object per element.

Through the protobuf (upb) wrappers every element of an ``ArrayValue`` becomes a Python ``AnyValue`` object
before its value can be read: ~150 ns each, 65 per rank-step summary, which made reading the five arrays
most of the collector's per-rank-step cost. Both readers here start from the array's wire bytes (one C call):

* names and counts repeat from step to step (the same timers every step), so their decoded tuple is kept
  per distinct wire bytes and reused (bounded: cleared when ``_MEMO_MAX`` distinct arrays were seen);
* doubles differ every step, but an array of doubles has one fixed layout on the wire, 11 bytes per element
  (``0a 09``: field 1, 9 bytes; ``21``: double_value, fixed64; 8 bytes little-endian), which one
  ``struct`` call unpacks. Anything else (ints, a mixed array, unknown fields) takes the per-element path.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue

_MEMO_MAX = 1024
_strings_memo: dict[bytes, tuple[str, ...]] = {}
_ints_memo: dict[bytes, tuple[int, ...]] = {}
_unpackers: dict[int, struct.Struct] = {}
_DOUBLE_ELEMENT = 11  # 0a 09 21 + 8 bytes


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
        if len(memo) >= _MEMO_MAX:
            memo.clear()
        out = memo[key] = make()
    return out


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
        return _bounded_get(_unpackers, n, lambda: struct.Struct("<" + "3xd" * n)).unpack(raw)
    values = array.values
    if values and values[0].WhichOneof("value") != "double_value":
        return [number(x) for x in values]
    return [x.double_value for x in values]

"""Fixed single-producer / single-consumer ring of completed intervals.

Preallocated ``Slot`` objects, one per interval: a stop writes the fields of one object (a few cache lines)
instead of one entry in each of ten parallel lists (two lines per list); between a step's kernel launches the
ring's memory is cold, and cache lines are what a start+stop pays for there (``bench/results/cpu-emitter.md``).
The TRAINING thread is the only producer: it writes every field of slot ``head & mask`` and then advances
``head``. The READOUT thread is the only consumer: it reads slots ``tail .. head-1`` and then advances ``tail``.
No lock: each slot is written by one thread at a time and a plain attribute store is atomic under the GIL; the
producer publishes a slot only after writing all of it (``head`` is stored last). Indices grow without wrapping
(Python ints; 64-bit integers in the C ring); the slot is ``index & mask``. Full (``head - tail >= capacity``):
the producer drops and counts.

``Slot`` and ``Ring`` are the C extension's types of the same names and fields when it runs the hot path
(``hot_path.py``), else ``PySlot`` and ``PyRing`` below.
"""

from __future__ import annotations

from typing import Any

from otel_straggler import hot_path


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


class PySlot:
    """One interval's fields; the readout resets ``start_ev``, ``end_ev`` and ``injected`` before it frees the
    slot, so the producer writes those only when they are not the default."""

    __slots__ = ("binding", "end_ev", "end_ns", "injected", "own", "pre", "reason", "repeat", "start_ev", "start_ns",
                 "timer")

    def __init__(self) -> None:
        self.timer: Any = None
        self.start_ns = 0
        self.end_ns = 0
        self.start_ev: Any = None
        self.end_ev: Any = None
        # which of the slot's events it returns to the pool: 1 start, 2 end (shared_event.py); written with start_ev
        self.own = 0
        self.binding: Any = None
        self.repeat = 0
        self.reason: str | None = None
        self.injected = False
        self.pre: float | None = None  # device ms read ahead by the pool's elapsed_batch (readout thread only)


class PyRing:
    __slots__ = ("cap", "head", "mask", "slots", "tail")

    def __init__(self, capacity: int) -> None:
        cap = _pow2(max(1, int(capacity))) if capacity > 0 else 0
        self.cap = cap
        self.mask = cap - 1 if cap else 0
        self.slots: list[PySlot] = [PySlot() for _ in range(max(cap, 1))]
        self.head = 0  # written by the training thread only
        self.tail = 0  # written by the readout thread only

    def __len__(self) -> int:
        return self.head - self.tail


Slot: Any = hot_path.core.Slot if hot_path.core is not None else PySlot
Ring: Any = hot_path.core.Ring if hot_path.core is not None else PyRing

"""Fixed single-producer / single-consumer ring of completed intervals.

Parallel preallocated lists, one slot per interval. The TRAINING thread is the only producer: it
writes every field of slot ``head & mask`` and then advances ``head``. The READOUT thread is the only
consumer: it reads slots ``tail .. head-1`` and then advances ``tail``. No lock: each index is written by
one thread and a plain attribute store is atomic under the GIL; the producer publishes a slot only
after writing all of it (``head`` is stored last). Indices grow without wrapping (Python ints); the slot
is ``index & mask``. Full (``head - tail >= capacity``): the producer drops and counts.
"""

from __future__ import annotations

from typing import Any


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


class Ring:
    __slots__ = (
        "binding",
        "cap",
        "end_ev",
        "end_ns",
        "head",
        "injected",
        "mask",
        "own",
        "reason",
        "repeat",
        "start_ev",
        "start_ns",
        "tail",
        "timer",
    )

    def __init__(self, capacity: int) -> None:
        cap = _pow2(max(1, int(capacity))) if capacity > 0 else 0
        self.cap = cap
        self.mask = cap - 1 if cap else 0
        n = max(cap, 1)
        self.timer: list[Any] = [None] * n
        self.start_ns: list[int] = [0] * n
        self.end_ns: list[int] = [0] * n
        self.start_ev: list[Any] = [None] * n
        self.end_ev: list[Any] = [None] * n
        # which of the slot's events it returns to the pool: 1 start, 2 end (shared_event.py); written with start_ev
        self.own: list[int] = [0] * n
        self.binding: list[Any] = [None] * n
        self.repeat: list[int] = [0] * n
        self.reason: list[str | None] = [None] * n
        self.injected: list[bool] = [False] * n
        self.head = 0  # written by the training thread only
        self.tail = 0  # written by the readout thread only

    def __len__(self) -> int:
        return self.head - self.tail

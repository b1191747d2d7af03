"""Fake CUDA event backend for the emitter's CPU tests (CUDA cannot run on the CI machines).

``FakeDevice`` is a fake stream clock; ``FakeDevice.factory`` makes ``FakeEvent``s for
``EventPool(size, factory, synchronize=None)``, whose ``record``/``query``/``elapsed_time`` the pool and the
readout use as they use a ``torch.cuda.Event``'s. The real events are exercised in ``tests/gpu``.
"""

from __future__ import annotations

from typing import Any


class FakeEvent:
    """Test double for ``torch.cuda.Event`` (CUDA cannot run on CPU CI).

    ``record()`` marks the event recorded at the next value of a shared fake device clock
    (``FakeDevice``); ``query()`` is True once the device's completed time passes it;
    ``elapsed_time(end)`` returns the device-clock difference in ms. Each can be told to raise.
    """

    __slots__ = ("device", "raise_on_elapsed", "raise_on_query", "raise_on_record", "recorded_at", "records")

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.recorded_at: float | None = None
        self.records = 0
        self.raise_on_record = False
        self.raise_on_query = False
        self.raise_on_elapsed = False

    def record(self, stream: Any = None) -> Any:
        """Returns the device's current ``stream`` (what the driver's record returns: the stream it used)."""
        if self.raise_on_record or self.device.raise_on_record:
            raise RuntimeError("fake CUDA error on record")
        self.records += 1
        self.recorded_at = self.device.enqueue()
        return self.device.stream

    def query(self) -> bool:
        if self.raise_on_query or self.device.raise_on_query:
            raise RuntimeError("fake CUDA error on query")
        return self.recorded_at is None or self.recorded_at <= self.device.completed_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        if self.raise_on_elapsed or self.device.raise_on_elapsed:
            raise RuntimeError("fake CUDA error on elapsed_time")
        if self.recorded_at is None or end.recorded_at is None:
            raise RuntimeError("event not recorded")
        return float(end.recorded_at - self.recorded_at)


class FakeDevice:
    """Fake stream clock: each record enqueues at ``queued_ms`` (advanced by ``work(ms)``); events are
    complete up to ``completed_ms``. ``auto_complete`` makes every record complete immediately."""

    def __init__(self, auto_complete: bool = True) -> None:
        self.queued_ms = 0.0
        self.completed_ms = 0.0
        self.auto_complete = auto_complete
        self.raise_on_record = False
        self.raise_on_query = False
        self.raise_on_elapsed = False
        self.stream: Any = None  # the current stream (a test may switch it)
        self.events: list[FakeEvent] = []

    def work(self, ms: float) -> None:
        self.queued_ms += ms
        if self.auto_complete:
            self.completed_ms = self.queued_ms

    def enqueue(self) -> float:
        if self.auto_complete:
            self.completed_ms = self.queued_ms
        return self.queued_ms

    def complete_all(self) -> None:
        self.completed_ms = self.queued_ms

    def factory(self) -> FakeEvent:
        ev = FakeEvent(self)
        self.events.append(ev)
        return ev

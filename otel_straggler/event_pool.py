"""Fixed pool of pre-created, pre-warmed CUDA timing events.

All events are created AND recorded once at install (the first ``record()`` of a ``torch.cuda.Event``
lazily creates the CUDA event, ~11.7 us on an H200, which would skew the first windows), followed by one
``synchronize`` at install time only. The free list is a ``collections.deque``: ``popleft`` (training
thread only) and ``append`` (readout thread, and the training thread only for events it never recorded)
are atomic under the GIL, so no lock is shared with the training thread.

An event that was recorded is returned to the free list only after its ``query()`` is True (or at
shutdown): a recorded-but-unfinished event is never re-recorded.

``HostOnlyPool``: no CUDA (torch missing, no device, init error) -> every interval is host-only with
reason ``no_cuda``. ``FakeEvent`` is a test backend (CUDA cannot run on the CI machines): ``record``,
``query`` and ``elapsed_time`` are driven by the test.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from otel_straggler.counters import CUDA_ERROR, NO_CUDA

_log = logging.getLogger(__name__)


class EventPool:
    """``factory()`` makes one event (default: ``torch.cuda.Event(enable_timing=True)``)."""

    __slots__ = ("capacity", "cuda", "free", "orphans", "reason", "record_cost_s", "warm_error")

    def __init__(
        self, size: int, factory: Callable[[], Any] | None = None, *, synchronize: Callable[[], Any] | None = None
    ):
        self.cuda = True
        self.reason: str | None = None
        self.warm_error: str | None = None
        self.orphans: deque[Any] = deque()  # recorded events the training thread let go of (readout quarantines)
        if factory is None:
            import torch

            def factory() -> Any:
                return torch.cuda.Event(enable_timing=True)

            synchronize = synchronize or torch.cuda.synchronize
        events = [factory() for _ in range(int(size))]
        for ev in events:  # warm: force the lazy creation now, not in the first measured windows
            ev.record()
        if synchronize is not None:
            synchronize()
        # cost of one record of a warm event (adaptive device sampling budgets with it)
        sample = events[: min(len(events), 64)]
        t0 = time.perf_counter()
        for ev in sample:
            ev.record()
        self.record_cost_s = (time.perf_counter() - t0) / max(1, len(sample))
        if synchronize is not None:
            synchronize()
        self.capacity = len(events)
        self.free: deque[Any] = deque(events)

    def in_flight(self) -> int:
        return self.capacity - len(self.free)


class HostOnlyPool:
    """No device timing at all: the timers read ``cuda`` False and never touch ``free``."""

    __slots__ = ("capacity", "cuda", "free", "orphans", "reason", "record_cost_s", "warm_error")

    def __init__(self, reason: str = NO_CUDA, warm_error: str | None = None) -> None:
        self.cuda = False
        self.record_cost_s = 0.0
        self.reason = reason
        self.warm_error = warm_error
        self.capacity = 0
        self.free: deque[Any] = deque()
        self.orphans: deque[Any] = deque()

    def in_flight(self) -> int:
        return 0


def create_pool(size: int, factory: Callable[[], Any] | None = None) -> EventPool | HostOnlyPool:
    """A warmed CUDA pool, or a ``HostOnlyPool`` when CUDA is unavailable or fails (fail open)."""
    if factory is not None:
        try:
            return EventPool(size, factory, synchronize=None)
        except Exception as exc:
            return HostOnlyPool(CUDA_ERROR, type(exc).__name__)
    try:
        import torch

        if not torch.cuda.is_available():
            return HostOnlyPool()
        return EventPool(size)
    except ImportError:
        return HostOnlyPool()
    except Exception as exc:  # CUDA init errors of any kind: host-only
        _log.warning("otel-straggler: CUDA event pool unavailable (%s); timing host-only", type(exc).__name__)
        return HostOnlyPool(warm_error=type(exc).__name__)


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

    def record(self, stream: Any = None) -> None:
        if self.raise_on_record or self.device.raise_on_record:
            raise RuntimeError("fake CUDA error on record")
        self.records += 1
        self.recorded_at = self.device.enqueue()

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

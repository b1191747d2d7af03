"""What the readout thread hands to the export side: one completed timer interval (``Interval``, defined with the
wire's records in ``records.py``), and the interface of the sinks that take them.

Data path: ``timers`` (training thread: host clock + CUDA event record into a fixed ring)
-> ``readout`` (background thread: device duration from the events) -> the wire's records (``records.py``)
-> an ``IntervalSink`` (export side: per-step aggregation, spans, OTLP; ``NullSink`` when export is off), which
decodes them into ``Interval`` objects where it aggregates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from otel_straggler import records
from otel_straggler.records import MAX_NAME_BYTES, Interval, RecordBatch, bound_name, wire_level

__all__ = ["MAX_NAME_BYTES", "DecodingSink", "Interval", "IntervalSink", "NullSink", "bound_name", "wire_level"]

@runtime_checkable
class IntervalSink(Protocol):
    """Where the readout thread hands completed intervals: the one interface every sink implements and the readout
    uses (called from the readout thread only, never the training thread). An interval leaves the ring by one
    route: packed into the wire's record (``records.py``) in a frame from ``new_batch``, by the C drain or by
    ``RecordBatch.add``; ``submit_batch`` takes the frame. ``ProcessSink`` writes it to its export child; a sink
    that works on ``Interval`` objects derives from ``DecodingSink``."""

    def new_batch(self, capacity: int) -> RecordBatch:
        """An empty frame for up to ``capacity`` records, from this sink's encoder (whose ids it packs with).
        Always a frame: a sink that takes nothing now (closed, a forked copy) drops it in ``submit_batch``."""
        ...

    def submit_batch(self, batch: RecordBatch) -> None:
        """Take a frame from ``new_batch``, in completion order. Must not block; drop and count instead."""
        ...

    def publish_stats(self, stats: dict[str, int]) -> None:
        """Latest emitter counters (cumulative), for the self-metrics."""
        ...

    def flush(self, timeout_s: float) -> bool:
        """Export what is buffered, bounded by timeout_s. True when everything went out."""
        ...

    def shutdown(self, timeout_s: float) -> None: ...


class DecodingSink(ABC):
    """An ``IntervalSink`` whose consumer takes ``Interval`` objects (the in-process export, tests, benchmarks):
    each frame is decoded back (``records.WireDecoder``) and its intervals go to ``submit``. ``dropped_overflow``
    counts the intervals a frame could not hold (a name table full)."""

    def __init__(self) -> None:
        self._encoder = records.WireEncoder()
        self._decoder = records.WireDecoder()
        self._intervals_frame = records.T_INTERVALS
        self.dropped_overflow = 0

    def new_batch(self, capacity: int) -> RecordBatch:
        return self._encoder.batch(capacity)

    def submit_batch(self, batch: RecordBatch) -> None:
        if batch.dropped:
            self.overflowed(batch.dropped)
        data = batch.finish()
        self._encoder.commit()
        kind = self._intervals_frame
        intervals = [iv for k, ivs in self._decoder.feed(data) if k == kind for iv in ivs]
        if intervals:
            self.submit(intervals)

    def overflowed(self, n: int) -> None:
        """``n`` intervals a frame could not hold (counted)."""
        self.dropped_overflow += n

    @abstractmethod
    def submit(self, intervals: Sequence[Interval]) -> None:
        """Take intervals in completion order. Must not block; drop and count instead."""

    def publish_stats(self, stats: dict[str, int]) -> None:
        return None

    def flush(self, timeout_s: float) -> bool:
        return True

    def shutdown(self, timeout_s: float) -> None:
        return None


class NullSink(DecodingSink):
    """The sink that discards: export off (``export_mode=off``, ``OTEL_SDK_DISABLED=true``), or the export
    side missing or failing to start. Counts what it discarded (``discarded``, readout thread only); decodes
    nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.discarded = 0
        self.stats: dict[str, int] = {}

    def submit_batch(self, batch: RecordBatch) -> None:
        self.discarded += batch.count + batch.dropped
        self._encoder.commit()

    def submit(self, intervals: Sequence[Interval]) -> None:
        self.discarded += len(intervals)

    def publish_stats(self, stats: dict[str, int]) -> None:
        self.stats = stats

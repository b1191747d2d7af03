"""What the readout thread hands to the export side: one completed timer interval.

Data path: ``timers`` (training thread: host clock + CUDA event record into a fixed ring)
-> ``readout`` (background thread: device duration from the events) -> the wire's records (``records.py``)
-> an ``IntervalSink`` (export side: per-step aggregation, spans, OTLP; ``NullSink`` when export is off), which
decodes them into ``Interval`` objects where it aggregates.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from otel_straggler.records import RecordBatch

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
        from otel_straggler import records  # records imports this module

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

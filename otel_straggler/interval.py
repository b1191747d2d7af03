"""What the readout thread hands to the export side: one completed timer interval.

Data path: ``timers`` (training thread: host clock + CUDA event record into a fixed ring)
-> ``readout`` (background thread: device duration from the events) -> ``Interval``
-> an ``IntervalSink`` (export side: per-step aggregation, spans, OTLP; ``NullSink`` when export is off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


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


class IntervalSink(Protocol):
    """Consumer of completed intervals. Called only from the readout thread (never the training thread)."""

    def submit(self, intervals: Sequence[Interval]) -> None:
        """Take a batch of intervals in completion order. Must not block; drop and count instead."""
        ...

    def publish_stats(self, stats: dict[str, int]) -> None:
        """Latest emitter counters (cumulative), for the self-metrics."""
        ...

    def flush(self, timeout_s: float) -> bool:
        """Export what is buffered, bounded by timeout_s. True when everything went out."""
        ...

    def shutdown(self, timeout_s: float) -> None: ...


class NullSink:
    """The sink that discards: export off (``export_mode=off``, ``OTEL_SDK_DISABLED=true``), or the export
    side missing or failing to start. Counts what it discarded (``discarded``, readout thread only)."""

    def __init__(self) -> None:
        self.discarded = 0
        self.stats: dict[str, int] = {}

    def submit(self, intervals: Sequence[Interval]) -> None:
        self.discarded += len(intervals)

    def publish_stats(self, stats: dict[str, int]) -> None:
        self.stats = stats

    def flush(self, timeout_s: float) -> bool:
        return True

    def shutdown(self, timeout_s: float) -> None:
        return None

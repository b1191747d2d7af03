"""The sink the emitter tests record into (a module of its own: imported by name from any test file)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from otel_straggler.interval import DecodingSink, Interval


class RecordingSink(DecodingSink):
    """IntervalSink that records what the readout thread hands it (thread-safe for test reads)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.intervals: list[Interval] = []
        self.batches = 0
        self.stats: list[dict[str, int]] = []
        self.submit_threads: set[str] = set()
        self.flushed = 0
        self.shut = 0
        self.raise_on_submit = False
        self.raise_on_stats = False

    def submit(self, intervals: Sequence[Interval]) -> None:
        self.submit_threads.add(threading.current_thread().name)
        if self.raise_on_submit:
            raise RuntimeError("sink down")
        with self._lock:
            self.intervals.extend(intervals)
            self.batches += 1

    def publish_stats(self, stats: dict[str, int]) -> None:
        if self.raise_on_stats:
            raise RuntimeError("stats down")
        with self._lock:
            self.stats.append(dict(stats))

    def flush(self, timeout_s: float) -> bool:
        self.flushed += 1
        return True

    def shutdown(self, timeout_s: float) -> None:
        self.shut += 1

    def names(self) -> list[str]:
        with self._lock:
            return [iv.name for iv in self.intervals]

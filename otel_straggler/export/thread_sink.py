"""``ThreadSink``: the same aggregation and span building, in-process on the caller (readout) thread.

For CPU runs and tests. Costs the training process GIL time per span (see ``bench/emitter_cost.py``);
``ProcessSink`` is the default for GPU runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from otel_straggler.config import DEFAULTS, EmitterConfig
from otel_straggler.export.fork_guard import ForkGuarded
from otel_straggler.export.pipeline import ExportPipeline
from otel_straggler.export.provider import Counters
from otel_straggler.interval import DecodingSink, Interval


class ThreadSink(DecodingSink, ForkGuarded):
    def __init__(
        self,
        resource_attributes: Mapping[str, Any],
        *,
        rank: int,
        job_id: str,
        config: EmitterConfig = DEFAULTS,
        counters: Counters | None = None,
        **pipeline_opts: Any,
    ) -> None:
        """``pipeline_opts``: the other keyword options of ``ExportPipeline`` (``otel`` settings, exporters)."""
        DecodingSink.__init__(self)
        self.counters = counters if counters is not None else Counters()
        self.pipeline = ExportPipeline(
            resource_attributes, rank=rank, job_id=job_id, config=config, counters=self.counters, **pipeline_opts
        )
        self._lock = threading.Lock()  # readout thread vs. flush/shutdown caller; never the training thread
        self._init_guard()

    def _locked(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` under the lock while the sink is usable and open; faults are counted."""
        if not self._usable():
            return
        with self._lock:
            if self._closed:
                return
            try:
                fn(*args)
            except Exception:
                self.counters.add("faults_thread_sink")

    def submit(self, intervals: Sequence[Interval]) -> None:
        if intervals:
            self._locked(self.pipeline.add, intervals)

    def overflowed(self, n: int) -> None:
        self.counters.add("dropped_overflow", n)

    def publish_stats(self, stats: dict[str, int]) -> None:
        self._locked(self._publish, stats)

    def _publish(self, stats: dict[str, int]) -> None:
        self.pipeline.set_stats(stats)
        self.pipeline.tick()

    def flush(self, timeout_s: float) -> bool:
        if not self._usable():
            return False
        with self._lock:
            try:
                return self.pipeline.flush(timeout_s)
            except Exception:
                self.counters.add("faults_thread_sink")
                return False

    def shutdown(self, timeout_s: float) -> None:
        if not self._usable():
            return
        self._closed = True
        with self._lock:
            try:
                self.pipeline.shutdown(timeout_s)
            except Exception:
                self.counters.add("faults_thread_sink")

    def after_fork_in_child(self) -> None:
        """A forked copy never exports (its exporters are pid-guarded too)."""
        self._inert = True
        self._lock = threading.Lock()

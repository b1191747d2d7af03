"""``ThreadSink``: the same aggregation and span building, in-process on the caller (readout) thread.

For CPU runs and tests. Costs the training process GIL time per span (see ``bench/emitter_cost.py``);
``ProcessSink`` is the default for GPU runs.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from otel_straggler.export.fork_guard import ForkGuarded
from otel_straggler.export.pipeline import ExportPipeline
from otel_straggler.export.provider import Counters
from otel_straggler.interval import Interval


class ThreadSink(ForkGuarded):
    def __init__(
        self,
        resource_attributes: Mapping[str, Any],
        *,
        rank: int,
        job_id: str,
        detail: str = "step",
        step_close_s: float = 2.0,
        max_open_steps: int = 8,
        close_lag_steps: int = 0,
        counters: Counters | None = None,
        span_exporter: Any = None,
        metric_exporter: Any = None,
    ) -> None:
        self.counters = counters if counters is not None else Counters()
        self.pipeline = ExportPipeline(
            resource_attributes,
            rank=rank,
            job_id=job_id,
            detail=detail,
            step_close_s=step_close_s,
            max_open_steps=max_open_steps,
            close_lag_steps=close_lag_steps,
            counters=self.counters,
            span_exporter=span_exporter,
            metric_exporter=metric_exporter,
        )
        self._lock = threading.Lock()  # readout thread vs. flush/shutdown caller; never the training thread
        self._init_guard()

    def submit(self, intervals: Sequence[Interval]) -> None:
        if not intervals or not self._usable():
            return
        with self._lock:
            if self._closed:
                return
            try:
                self.pipeline.add(intervals)
            except Exception:
                self.counters.add("faults_thread_sink")

    def publish_stats(self, stats: dict[str, int]) -> None:
        if not self._usable():
            return
        with self._lock:
            if self._closed:
                return
            try:
                self.pipeline.set_stats(stats)
                self.pipeline.tick()
            except Exception:
                self.counters.add("faults_thread_sink")

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

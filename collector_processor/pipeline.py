"""One pipeline = bounded queue + one worker thread + processors + exporters.

Receivers ``submit`` decoded requests; the pipeline refuses (``throttled``) when its queue is full by item count or
bytes, or when a memory limiter in its processor list is over its soft limit. The single worker thread runs the
processors (so a processor never sees two threads at once), ticks them at least every ``TICK_S``, and hands the
result to the exporters, which queue internally and never block the worker for long.

A ``logs`` pipeline may also be fed verdicts by a processor listed among its receivers (the OTel Collector would call
that processor a connector): verdicts go through the same bounded queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message

from collector_processor.processor.straggler.model import Verdict
from collector_processor.telemetry import Telemetry

log = logging.getLogger(__name__)
TICK_S = 0.25
VERDICT_BYTES = 512  # queue byte estimate per verdict


@dataclass
class Result:
    """Outcome of a submit, as the receiver reports it to the client."""

    status: str = "ok"  # ok | throttled
    rejected: int = 0  # items the processors refused (partial success)
    message: str = ""
    reason: str = ""  # queue_full | memory_limit when throttled


@dataclass
class _Item:
    kind: str  # "request" | "verdicts"
    payload: Any
    nbytes: int
    n: int
    done: threading.Event | None = None
    rejected: int = 0
    message: str = ""


@dataclass
class Stage:
    """A processor in a pipeline; ``lock`` serialises every call to a shared instance."""

    id: str
    impl: Any
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pipeline:
    def __init__(self, pid: str, telemetry: Telemetry, *, max_items: int, max_bytes: int,
                 processors: list[Stage], exporters: list[tuple[str, Any]],
                 admit: list[Callable[[], bool]] | None = None) -> None:
        self.id = pid
        self.signal = pid.split("/", 1)[0]
        self.t = telemetry
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.processors = processors
        self.exporters = exporters
        self.admit = admit or []
        self._q: queue.Queue[_Item] = queue.Queue()
        self._bytes = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pipeline-{pid}", daemon=True)
        self._depth = telemetry.queue_depth.labels(pid)
        self._last_tick = 0.0

    # ---- producer side (receiver threads) -----------------------------------------------------------------
    def _offer(self, item: _Item) -> bool:
        """Enqueue unless full by items or bytes (one request bigger than the byte cap still fits an empty queue)."""
        with self._lock:
            if self._q.qsize() >= self.max_items or (self._bytes + item.nbytes > self.max_bytes and self._bytes > 0):
                return False
            self._bytes += item.nbytes
            self._q.put(item)
        self._depth.set(self._q.qsize())
        return True

    def submit(self, msg: Message, nbytes: int, n: int, wait_s: float = 0.0) -> Result:
        """Queue a request. With ``wait_s`` > 0 wait that long for the worker so that spans the processors
        rejected can be reported as a partial success; past it the answer is a plain success (queued)."""
        if self._closing.is_set():
            return Result("throttled", reason="shutting_down", message="collector is shutting down")
        for ok in self.admit:
            if not ok():
                return Result("throttled", reason="memory_limit", message="memory limit reached")
        done = threading.Event() if wait_s > 0 else None
        item = _Item("request", msg, nbytes, n, done)
        if not self._offer(item):
            return Result("throttled", reason="queue_full", message=f"pipeline {self.id} queue is full")
        if done is not None and done.wait(wait_s):
            return Result("ok", rejected=item.rejected, message=item.message)
        return Result("ok")

    def submit_verdicts(self, verdicts: list[Verdict]) -> bool:
        nbytes = VERDICT_BYTES * len(verdicts)
        if self._closing.is_set() and not self._thread.is_alive():
            self._deliver_verdicts(verdicts)  # after the drain: deliver inline (shutdown flush)
            return True
        if not self._offer(_Item("verdicts", verdicts, nbytes, len(verdicts))):
            self.t.evictions.labels(f"queue:{self.id}").inc(len(verdicts))
            return False
        return True

    # ---- worker ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def _tick(self, now: float) -> None:
        if now - self._last_tick < TICK_S:
            return
        self._last_tick = now
        wall = time.time()
        for st in self.processors:
            tick = getattr(st.impl, "tick", None)
            if tick is None:
                continue
            try:
                with st.lock:
                    tick(wall)
            except Exception:
                log.exception("processor %s tick failed", st.id)
                self.t.component_errors.labels(st.id).inc()

    def _run(self) -> None:
        while True:
            self._tick(time.monotonic())
            try:
                item = self._q.get(timeout=TICK_S)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            if item.kind == "wake":  # close() wakes the worker; it leaves once the queue is empty
                if self._closing.is_set() and self._q.empty():
                    return
                continue
            try:
                self._handle(item)
            except Exception:
                log.exception("pipeline %s failed on an item", self.id)
            finally:
                with self._lock:
                    self._bytes -= item.nbytes
                self._depth.set(self._q.qsize())
                if item.done is not None:
                    item.done.set()

    def _handle(self, item: _Item) -> None:
        if item.kind == "verdicts":
            self._deliver_verdicts(item.payload)
            return
        t0 = time.perf_counter()
        msg: Message | None = item.payload
        for st in self.processors:
            fn = getattr(st.impl, f"process_{self.signal}", None)
            if fn is None or msg is None:
                continue
            try:
                with st.lock:
                    msg = fn(msg)
                    rej = int(getattr(st.impl, "last_rejected", 0) or 0)
            except Exception as e:  # fail open: forward what we had
                log.exception("processor %s failed; passing the request on unchanged", st.id)
                self.t.component_errors.labels(st.id).inc()
                item.message = f"processor {st.id} failed: {type(e).__name__}"
                continue
            if rej:
                item.rejected += rej
                item.message = f"{rej} spans rejected by {st.id} (see the collector's rejected counters)"
        self.t.processing_seconds.observe(time.perf_counter() - t0)
        if msg is None:
            return
        for eid, exp in self.exporters:
            fn = getattr(exp, f"export_{self.signal}", None)
            if fn is None:
                continue
            try:
                fn(msg)
            except Exception:
                log.exception("exporter %s failed", eid)
                self.t.export_failures.labels(eid).inc()

    def _deliver_verdicts(self, verdicts: list[Verdict]) -> None:
        logs_req = None
        for eid, exp in self.exporters:
            try:
                if hasattr(exp, "export_verdicts"):
                    exp.export_verdicts(verdicts)
                elif hasattr(exp, "export_logs"):
                    if logs_req is None:
                        from collector_processor.processor.straggler.events import verdicts_to_logs
                        logs_req = verdicts_to_logs(verdicts)
                    exp.export_logs(logs_req)
            except Exception:
                log.exception("exporter %s failed on verdicts", eid)
                self.t.export_failures.labels(eid).inc()

    # ---- shutdown ----------------------------------------------------------------------------------------
    def close(self, deadline: float) -> bool:
        """Stop accepting, let the worker drain the queue until ``deadline`` (monotonic). True when drained."""
        self._closing.set()
        self._q.put(_Item("wake", None, 0, 0))
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        left = 0
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item.kind == "wake":
                continue
            if item.kind == "verdicts" and not self._thread.is_alive():
                self._deliver_verdicts(item.payload)  # cheap, and the evidence of the last windows matters
            else:
                left += item.n
        if left:
            log.warning("pipeline %s: %d queued items not processed before the shutdown deadline", self.id, left)
            if self.signal == "traces":
                self.t.spans_dropped.labels("shutdown").inc(left)
        self._depth.set(0)
        return not self._thread.is_alive()

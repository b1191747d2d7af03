"""One pipeline = bounded queue + one worker thread + processors + exporters.

Receivers ``submit`` decoded requests; the pipeline refuses (``throttled``) when its queue is full by item count or
bytes, or when one of its admission processors (``component.Admission``, the memory limiter) refuses. The single
worker thread runs the processors (so a processor never sees two threads at once), ticks the ``Ticking`` ones at
least every ``TICK_S``, and hands the result to the exporters, which queue internally and never block the worker
for long.

A receiver on an event loop may also hand a small request over with ``process_now``: when the pipeline is idle (its
queue empty, its worker between items) and its inline budget is not spent, the request is processed on the
caller's thread at once, under the same lock the worker holds per item (no hand-off to the worker and back, no
thread woken); otherwise the receiver queues it (``offer``). The budget bounds the caller's time taken by long
items: each item's time beyond ``INLINE_FREE_S`` is charged to a credit that refills at ``INLINE_BUDGET_S`` per
second up to ``INLINE_BUDGET_S``; while the credit is spent, requests are queued instead (counted in
``inline_deferred_total``). Quick items (a rank's batch: about a millisecond) are never charged; a client whose
requests each take a large part of a second holds the caller's thread (a receiver's event loop) for about a tenth of
the time at most.

A pipeline fed by a connector takes ``EventBatch`` items through the same bounded queue (``submit_events``): each
exporter gets them as events (``EventsExporter``) or as an OTLP logs request (``LogsExporter``).
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

from collector_processor.component import (
    Admission,
    EventBatch,
    EventsExporter,
    LogsExporter,
    LogsProcessor,
    MetricsExporter,
    MetricsProcessor,
    ReportsRejections,
    Ticking,
    TracesExporter,
    TracesProcessor,
)
from collector_processor.telemetry import Telemetry

log = logging.getLogger(__name__)
TICK_S = 0.25
# process_now: an item's time beyond INLINE_FREE_S is charged to a credit of at most INLINE_BUDGET_S that refills at
# INLINE_BUDGET_S per second; a spent credit (<= 0) queues requests instead (a slow processor, or a client whose
# requests are made slow to process, must not hold a receiver's event loop). The debt of one very slow item is
# capped at INLINE_MAX_DEBT_S (the path is back within 10 s).
INLINE_FREE_S = 0.01
INLINE_BUDGET_S = 0.1
INLINE_MAX_DEBT_S = 1.0
EVENT_BYTES = 512  # queue byte estimate per event
_PROCESS = {"traces": (TracesProcessor, "process_traces"), "metrics": (MetricsProcessor, "process_metrics"),
            "logs": (LogsProcessor, "process_logs")}
_EXPORT = {"traces": (TracesExporter, "export_traces"), "metrics": (MetricsExporter, "export_metrics"),
           "logs": (LogsExporter, "export_logs")}


@dataclass
class Result:
    """Outcome of a submit, as the receiver reports it to the client."""

    status: str = "ok"  # ok | throttled
    rejected: int = 0  # items the processors refused (partial success)
    message: str = ""
    reason: str = ""  # queue_full | memory_limit | shutting_down when throttled


@dataclass
class _Item:
    kind: str  # "request" | "events" | "wake"
    payload: Any
    nbytes: int
    n: int
    done: Any = None  # anything with set(): a threading.Event, or a receiver's waiter on its event loop
    rejected: int = 0
    message: str = ""
    share: str = ""  # the tenant whose share of the queue it takes (auth.Tenant.share)


@dataclass
class Stage:
    """A processor in a pipeline; ``lock`` serialises every call to a shared instance."""

    id: str
    impl: Any
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pipeline:
    def __init__(self, pid: str, telemetry: Telemetry, *, max_items: int, max_bytes: int,
                 processors: list[Stage], exporters: list[tuple[str, Any]],
                 admission: list[Admission] | None = None) -> None:
        self.id = pid
        self.signal = pid.split("/", 1)[0]
        self.t = telemetry
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.admission = admission or []
        proto, name = _PROCESS[self.signal]
        self._process: list[tuple[Stage, Callable[[Message], Message | None], bool]] = [
            (st, getattr(st.impl, name), isinstance(st.impl, ReportsRejections))
            for st in processors if isinstance(st.impl, proto)]
        self._ticking = [st for st in processors if isinstance(st.impl, Ticking)]
        proto, name = _EXPORT[self.signal]
        self._export = [(eid, getattr(exp, name)) for eid, exp in exporters if isinstance(exp, proto)]
        self._events = [(eid, exp) for eid, exp in exporters
                        if isinstance(exp, EventsExporter) or isinstance(exp, LogsExporter)]
        self._q: queue.Queue[_Item] = queue.Queue()
        self._bytes = 0
        self._shares: dict[str, list[int]] = {}  # tenant -> [items, bytes] queued (tenants with some only)
        self._lock = threading.Lock()
        self._handling = threading.Lock()  # held while an item is processed, by the worker or process_now
        self._inline_credit = INLINE_BUDGET_S
        self._inline_at = time.monotonic()
        self._inline_deferred = telemetry.inline_deferred.labels(pid)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pipeline-{pid}", daemon=True)
        self._depth = telemetry.queue_depth.labels(pid)
        self._last_tick = 0.0
        # the counters this pipeline increments, at 0 from the start
        for st in processors:
            telemetry.component_errors.labels(st.id)
        for eid, _ in exporters:
            telemetry.export_failures.labels(eid)
        telemetry.evictions.labels(f"queue:{pid}")

    # ---- producer side (receiver threads) -----------------------------------------------------------------
    def _offer(self, item: _Item, label: str = "") -> bool:
        """Enqueue unless full by items or bytes (one request bigger than the byte cap still fits an empty queue).
        Past half of either cap, a tenant's request (``item.share`` not empty: the all-jobs token's are not) is
        refused too, counted for it (``label``), while the tenant holds a share of the caps (over the tenants with
        requests queued plus one): however many tenants flood it, the queue keeps room for a newcomer."""
        with self._lock:
            depth = self._q.qsize()
            if depth >= self.max_items or (self._bytes + item.nbytes > self.max_bytes and self._bytes > 0):
                return False
            held = self._shares.get(item.share)
            if held is not None and item.share and (2 * depth >= self.max_items
                                                    or 2 * (self._bytes + item.nbytes) > self.max_bytes):
                tenants = len(self._shares) + 1
                if held[0] >= self.max_items // tenants or held[1] + item.nbytes > self.max_bytes // tenants:
                    self.t.tenant_evictions.labels(tenant=label, structure=f"queue:{self.id}").inc()
                    return False
            if held is None:
                held = self._shares[item.share] = [0, 0]
            held[0] += 1
            held[1] += item.nbytes
            self._bytes += item.nbytes
            self._q.put(item)
        self._depth.set(self._q.qsize())
        return True

    def _taken(self, item: _Item) -> None:
        """``item`` left the queue (called under the lock)."""
        self._bytes -= item.nbytes
        held = self._shares.get(item.share)
        if held is not None:
            held[0] -= 1
            held[1] -= item.nbytes
            if held[0] <= 0:
                del self._shares[item.share]

    def _refused(self) -> Result | None:
        """The answer to a request the pipeline does not take now (shutting down, or an admission gate such as
        the memory limiter refusing), else None."""
        if self._closing.is_set():
            return Result("throttled", reason="shutting_down", message="collector is shutting down")
        for gate in self.admission:
            refusal = gate.refusal()
            if refusal is not None:
                return Result("throttled", reason=refusal.reason, message=refusal.message)
        return None

    def submit(self, msg: Message, nbytes: int, n: int, wait_s: float = 0.0, share: str = "", label: str = ""
               ) -> Result:
        """Queue a request (of tenant ``share``, counted as ``label``). With ``wait_s`` > 0 wait that long for the
        worker so that spans the processors rejected can be reported as a partial success; past it the answer is
        a plain success (queued)."""
        refused = self._refused()
        if refused is not None:
            return refused
        done = threading.Event() if wait_s > 0 else None
        item = _Item("request", msg, nbytes, n, done, share=share)
        if not self._offer(item, label):
            return Result("throttled", reason="queue_full", message=f"pipeline {self.id} queue is full")
        if done is not None and done.wait(wait_s):
            return Result("ok", rejected=item.rejected, message=item.message)
        return Result("ok")

    def offer(self, msg: Message, nbytes: int, n: int, done: Any, share: str = "", label: str = "") -> Result | _Item:
        """Queue a request without waiting: the queued item (its ``rejected`` and ``message`` are set once
        ``done.set()`` is called, from the worker, after processing), or the refusal."""
        refused = self._refused()
        if refused is not None:
            return refused
        item = _Item("request", msg, nbytes, n, done, share=share)
        if not self._offer(item, label):
            return Result("throttled", reason="queue_full", message=f"pipeline {self.id} queue is full")
        return item

    def process_now(self, msg: Message, nbytes: int, n: int) -> Result | _Item | None:
        """Process a request on the calling thread if the pipeline is idle and its inline budget is not spent: the
        processed item (``rejected``, ``message`` set), the refusal (as ``offer`` refuses), or None when it must
        be queued instead (``offer``; counted in ``inline_deferred_total`` when the budget was the reason)."""
        refused = self._refused()
        if refused is not None:
            return refused
        if self._q.qsize():
            return None
        now = time.monotonic()
        credit = min(INLINE_BUDGET_S, self._inline_credit + (now - self._inline_at) * INLINE_BUDGET_S)
        self._inline_credit, self._inline_at = credit, now
        if credit <= 0.0:
            self._inline_deferred.inc()
            return None
        if not self._handling.acquire(blocking=False):
            return None
        try:
            item = _Item("request", msg, nbytes, n)
            try:
                self._handle(item)
            except Exception:
                log.exception("pipeline %s failed on an item", self.id)
            end = time.monotonic()
            self._inline_at = end  # the item's own time refills nothing
            if end - now > INLINE_FREE_S:
                self._inline_credit = max(-INLINE_MAX_DEBT_S, self._inline_credit - (end - now - INLINE_FREE_S))
        finally:
            self._handling.release()
        return item

    def submit_events(self, batch: EventBatch) -> bool:
        """Queue a connector's events; when the queue is full they are dropped and counted in
        ``evictions_total{structure="queue:<pipeline>"}``."""
        n = len(batch)
        if self._closing.is_set() and not self._thread.is_alive():
            self._deliver_events(batch)  # after the drain: deliver inline (shutdown flush)
            return True
        if not self._offer(_Item("events", batch, EVENT_BYTES * n, n)):
            self.t.evictions.labels(f"queue:{self.id}").inc(n)
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
        for st in self._ticking:
            try:
                with st.lock:
                    st.impl.tick(wall)
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
                with self._handling:
                    self._handle(item)
            except Exception:
                log.exception("pipeline %s failed on an item", self.id)
            finally:
                with self._lock:
                    self._taken(item)
                self._depth.set(self._q.qsize())
                if item.done is not None:
                    item.done.set()
            del item  # a worker waiting for the next item holds none: its request's memory goes back now

    def _handle(self, item: _Item) -> None:
        if item.kind == "events":
            self._deliver_events(item.payload)
            return
        t0 = time.perf_counter()
        msg: Message | None = item.payload
        for st, fn, reports in self._process:
            if msg is None:
                break
            try:
                with st.lock:
                    msg = fn(msg)
                    rej = int(st.impl.last_rejected or 0) if reports else 0
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
        for eid, fn in self._export:
            try:
                fn(msg)
            except Exception:
                log.exception("exporter %s failed", eid)
                self.t.export_failures.labels(eid).inc()

    def _deliver_events(self, batch: EventBatch) -> None:
        for eid, exp in self._events:
            try:
                if isinstance(exp, EventsExporter):
                    exp.export_events(batch)
                else:
                    exp.export_logs(batch.to_logs())
            except Exception:
                log.exception("exporter %s failed on events", eid)
                self.t.export_failures.labels(eid).inc()

    # ---- shutdown ----------------------------------------------------------------------------------------
    def close(self, deadline: float) -> bool:
        """Stop accepting, let the worker drain the queue until ``deadline`` (monotonic). True when drained."""
        self._closing.set()
        self._q.put(_Item("wake", None, 0, 0))
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._handling.acquire(timeout=max(0.0, deadline - time.monotonic())):  # an item in process_now
            self._handling.release()
        left = 0
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item.kind == "wake":
                continue
            if item.kind == "events" and not self._thread.is_alive():
                self._deliver_events(item.payload)  # cheap, and the evidence of the last windows matters
            else:
                left += item.n
        if left:
            log.warning("pipeline %s: %d queued items not processed before the shutdown deadline", self.id, left)
            if self.signal == "traces":
                self.t.spans_dropped.labels("shutdown").inc(left)
        self._depth.set(0)
        return not self._thread.is_alive()

"""Fixed pool of pre-created, pre-warmed CUDA timing events.

All events are created AND recorded once at install (the first ``record()`` of a ``torch.cuda.Event``
lazily creates the CUDA event, which costs far more than a warm record and would skew the first windows),
followed by one ``synchronize`` at install time only. Events are named by id (0..n-1) everywhere past the pool:
in the ring's records, the free list and the orphans; ``table`` (``hot_path.EventTable``) keeps the events and
each one's state in arrays indexed by id. The free list is a ``collections.deque`` of ids: ``popleft`` (training
thread only) and ``append`` (readout thread only; the training thread hands the ids it lets go of to ``orphans``,
which the readout quarantines) are atomic under the GIL, so no lock is shared with the training thread.

An event that was recorded is returned to the free list only after its ``query()`` is True (or at
shutdown): a recorded-but-unfinished event is never re-recorded.

``pool.record(i)`` records event ``i`` on the current stream; ``pool.elapsed(start, end)`` (readout thread)
gives the device ms between two, or None while unfinished; ``pool.query(i)`` (readout thread) says whether a
lone event (an interval that lost its end event, a quarantined one) completed. With ``record_api`` ``auto``
(the default) they are the CUDA driver's ``cuEventRecord``, ``cuEventElapsedTime`` and ``cuEventQuery`` called
on the events' raw handles (``table.handle``, kept once created) and the device's current raw
stream: through ``ctypes``, or from the C hot path's module (``_hotpath.c``, where it runs: the timers call
``cuEventRecord`` through the address ``record.cu_event_record`` gives, the readout ``event_elapsed`` and
``event_query``). They are the same operations as torch's ``Event.record()``, ``query()`` and ``elapsed_time()``
without their Python layers (``torch.cuda.current_stream()`` builds a ``Stream`` object per record, then a
device guard); the readout makes one call per interval instead of two (``bench/results/gpu-h200.md`` section 2).
Each of these calls keeps the GIL (``ctypes.PyDLL``, or C that does not release it): none blocks, and a call
that released it would be a point where the other thread takes the GIL, so a drain and the training thread's
records would hand it back and forth, each hand-off a context switch on the training thread
(``bench/results/gpu-h200.md`` section 3). The one exception is ``elapsed_many`` (``driver_elapsed_batch``):
the readout reads all pending records' times in one call that releases the GIL once per 256 records. They are
checked once at install against torch's on a short GPU sleep; if the check fails, or ``record_api`` is
``torch``, torch's methods are used. A driver record that fails later (e.g. on a thread with no current CUDA
context) falls back to torch's record for that call, which makes the context current.

``HostOnlyPool``: no CUDA (torch missing, no device, init error) -> every interval is host-only with
reason ``no_cuda``. A pool built with a ``factory`` uses its events' own ``record``, ``query`` and
``elapsed_time`` (the CPU tests and ``bench/gil_handoff.py`` drive device timing through such a factory).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from array import array
from collections import deque
from collections.abc import Callable
from typing import Any

from otel_straggler import hot_path
from otel_straggler.counters import CUDA_ERROR, NO_CUDA
from otel_straggler.hot_path import EventTable

_log = logging.getLogger(__name__)


RECORD_APIS = ("auto", "driver", "torch")
_DRIVER_CHECK_CYCLES = 2_000_000  # GPU sleep between the check's two records (~1 ms)
CUDA_ERROR_NOT_READY = 600  # CUresult: an event of the pair has not completed yet


def _driver_call(name: str, *argtypes: Any, hold_gil: bool = False) -> Any:
    """A CUDA driver API function (``libcuda.so.1``) through ctypes, returning its ``CUresult`` as an int.
    ``hold_gil``: called through ``ctypes.PyDLL``, which keeps the GIL during the call (``CDLL`` releases and
    re-takes it: a hand-off point for every other Python thread)."""
    fn = getattr((ctypes.PyDLL if hold_gil else ctypes.CDLL)("libcuda.so.1"), name)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def _address(fn: Any) -> int:
    """The address of a ctypes function (what the C hot path's module calls through)."""
    return ctypes.cast(fn, ctypes.c_void_p).value


_ELAPSED_ARGS = (ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p)  # cuEventElapsedTime's


def _by_id(events: list[Any]) -> tuple[Callable[[int], Any], Callable[[int, int], float | None],
                                         Callable[[int], bool]]:
    """``record``, ``elapsed`` and ``query`` by event id through the events' own methods (torch's, a test
    factory's): ``elapsed`` is None while the end event is unfinished."""

    def record(i: int) -> Any:
        return events[i].record()

    def elapsed(s: int, e: int) -> float | None:
        eev = events[e]
        if not eev.query():
            return None
        return float(events[s].elapsed_time(eev))

    def query(i: int) -> bool:
        return bool(events[i].query())

    return record, elapsed, query


def driver_elapsed(handle: Any, hold_gil: bool = True) -> Callable[[int, int], float | None]:
    """``elapsed(s, e)``: one ``cuEventElapsedTime`` on the events' raw handles (``handle[id]``) instead of torch's
    ``query()`` and ``elapsed_time()``; None while either event is unfinished, raises on any other error. Called from
    the C hot path's module (``_hotpath.event_elapsed``) where it runs and the GIL is kept, else through ctypes. Not
    thread-safe (one result buffer): the readout thread's alone."""
    fn = _driver_call("cuEventElapsedTime", *_ELAPSED_ARGS, hold_gil=hold_gil)
    core_elapsed = hot_path.event_elapsed
    if hold_gil and core_elapsed is not None:  # the same call from C: no ctypes argument conversion per call
        address = _address(fn)

        def c_elapsed(s: int, e: int) -> float | None:
            return core_elapsed(address, handle[s], handle[e])

        return c_elapsed
    out = ctypes.c_float()
    ref = ctypes.byref(out)

    def elapsed(s: int, e: int) -> float | None:
        rc = fn(ref, handle[s], handle[e])
        if rc == 0:
            return out.value
        if rc == CUDA_ERROR_NOT_READY:
            return None
        raise RuntimeError(f"cuEventElapsedTime failed ({rc})")

    return elapsed


def driver_elapsed_batch() -> Callable[[Any, Any, int, int], int] | None:
    """``elapsed_many(ring, table, tail, head)``: the C module's ``elapsed_batch`` on ``cuEventElapsedTime``: the
    device times of the ring's pending records read with the GIL released once around the driver calls, each left in
    the ring's ``pre`` for the readout (``_hotpath.c``); None without the C module (the readout then calls
    ``elapsed`` per record)."""
    if hot_path.elapsed_batch is None:
        return None
    return functools.partial(hot_path.elapsed_batch, _address(_driver_call("cuEventElapsedTime", *_ELAPSED_ARGS)))


def driver_query(handle: Any, hold_gil: bool = True) -> Callable[[int], bool]:
    """``query(i)``: ``cuEventQuery`` on the event's raw handle (from C as ``driver_elapsed``, else through ctypes):
    True once it completed, False while it has not, raises on any other error."""
    fn = _driver_call("cuEventQuery", ctypes.c_void_p, hold_gil=hold_gil)
    core_query = hot_path.event_query
    if hold_gil and core_query is not None:
        address = _address(fn)

        def c_query(i: int) -> bool:
            return core_query(address, handle[i])

        return c_query

    def query(i: int) -> bool:
        rc = fn(handle[i])
        if rc == 0:
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        raise RuntimeError(f"cuEventQuery failed ({rc})")

    return query


def driver_recorder(device_index: int, events: list[Any], handle: Any,
                    hold_gil: bool = True) -> Callable[[int], Any]:
    """``record(i)``: ``cuEventRecord(handle[i], current raw stream of device_index)`` through ctypes, returning
    that stream (``raw_stream`` of ``driver_stream``); on a non-zero result, torch's ``events[i].record()`` (raises
    if that fails too) and None. ``record.cu_event_record``: the function's address, which the C hot path
    (``_hotpath.c``) calls directly, falling back to this function when it fails."""
    fn = _driver_call("cuEventRecord", ctypes.c_void_p, ctypes.c_void_p, hold_gil=hold_gil)
    stream_of = driver_stream(device_index)

    def record(i: int) -> Any:
        stream = stream_of()
        if fn(handle[i], stream):
            events[i].record()
            return None
        return stream

    record.cu_event_record = _address(fn)  # type: ignore[attr-defined]  # the C hot path's
    return record


def driver_stream(device_index: int) -> Callable[[], int]:
    """The current raw CUDA stream of ``device_index`` (an int), as ``driver_recorder`` records on it."""
    import torch

    return functools.partial(torch._C._cuda_getCurrentRawStream, device_index)


def _check_driver(record: Callable[[int], Any], elapsed: Callable[[int, int], float | None],
                  query: Callable[[int], bool], events: list[Any]) -> None:
    """Event 1 recorded by ``record`` after a GPU sleep that follows torch's record of event 0 on the same stream:
    ``elapsed`` answers None and ``query`` False while the sleep runs (when it still does), then the same time
    as torch's ``elapsed_time`` and True once it completed, and that time covers the sleep; raises
    otherwise."""
    import torch

    a, b = events[0], events[1]
    a.record()
    torch.cuda._sleep(_DRIVER_CHECK_CYCLES)
    record(1)
    early = elapsed(0, 1)
    early_done = query(1)
    ref_done = b.query()  # asked after the driver: completion is monotonic, so it must agree when that said done
    b.synchronize()
    ms, ref = elapsed(0, 1), a.elapsed_time(b)
    if (early is not None or early_done) and not ref_done:
        raise RuntimeError("the driver answered before the event completed")
    if not query(1):
        raise RuntimeError("cuEventQuery says a completed event is unfinished")
    if ms is None or not (ref > 0.0 and abs(ms - ref) <= 1e-3 * max(1.0, ref)):
        raise RuntimeError(f"driver events disagree with torch's ({ms} ms vs {ref} ms)")


def _none() -> None:
    return None


MAX_EVENTS = 0xFFFE  # event ids fit the ring record's 16 bits (0xFFFF: none)


def event_table(events: list[Any]) -> Any:
    """The table of ``events`` (ids 0..n-1), all free."""
    n = len(events)
    return EventTable(events, array("i", bytes(4 * n)), array("q", bytes(8 * n)), bytearray(n),
                      array("Q", bytes(8 * n)), deque(range(n)), deque())


class EventPool:
    """``factory()`` makes one event (default: ``torch.cuda.Event(enable_timing=True)``); at most ``MAX_EVENTS``."""

    __slots__ = ("capacity", "cuda", "elapsed", "elapsed_many", "events", "free", "orphans", "query", "reason",
                 "record", "record_api", "record_cost_s", "stream", "table", "warm_error")

    def __init__(
        self, size: int, factory: Callable[[], Any] | None = None, *, synchronize: Callable[[], Any] | None = None,
        record_api: str = "auto", stream: Callable[[], Any] | None = None,
    ):
        self.cuda = True
        self.reason: str | None = None
        self.warm_error: str | None = None
        self.record_api = "event"
        # the stream a record would use now, compared with what ``record`` returned (``SharedEvent``); None: no
        # event is reused. A factory's events: ``stream`` (their record's result, None, by default)
        self.stream: Callable[[], Any] | None = stream if stream is not None else _none
        # the device times of a ring's pending records in one call, left in the ring's ``pre`` (readout thread
        # only; the driver record API with the C module: ``driver_elapsed_batch``), else None
        self.elapsed_many: Callable[[Any, Any, int, int], int] | None = None
        torch_events = factory is None
        if factory is None:
            import torch

            def factory() -> Any:
                return torch.cuda.Event(enable_timing=True)

            synchronize = synchronize or torch.cuda.synchronize
        events = [factory() for _ in range(max(0, min(int(size), MAX_EVENTS)))]
        for ev in events:  # warm: force the lazy creation now, not in the first measured windows
            ev.record()
        if synchronize is not None:
            synchronize()
        self.events = events
        self.table = event_table(events)
        self.free: deque[int] = self.table.free
        self.orphans: deque[int] = self.table.orphans  # ids the training thread let go of (readout quarantines)
        # record(id) -> the stream; elapsed(start id, end id) -> device ms, None while unfinished; query(id) -> done
        self.record, self.elapsed, self.query = _by_id(events)
        if torch_events:
            self._choose_record(record_api)
        # cost of one record of a warm event (adaptive device sampling budgets with it)
        sample = range(min(len(events), 64))
        record = self.record
        t0 = time.perf_counter()
        for i in sample:
            record(i)
        self.record_cost_s = (time.perf_counter() - t0) / max(1, len(sample))
        if synchronize is not None:
            synchronize()
        self.capacity = len(events)

    def _choose_record(self, record_api: str) -> None:
        """The driver's record, elapsed time and query when ``record_api`` allows them and they pass
        ``_check_driver`` on two of the (warm, complete) events; else torch's ``Event.record``, ``query`` and
        ``elapsed_time``."""
        import torch

        self.record_api = "torch"
        self.stream = None  # torch's record does not say on which stream
        events = self.events
        if record_api == "torch" or len(events) < 2:
            return
        handle = self.table.handle
        try:
            for i, ev in enumerate(events):
                handle[i] = ev.cuda_event  # created by the warm record: the raw CUevent for the driver calls
            record = driver_recorder(torch.cuda.current_device(), events, handle)
            elapsed = driver_elapsed(handle)
            query = driver_query(handle)
            _check_driver(record, elapsed, query, events)
        except Exception as exc:
            level = logging.WARNING if record_api == "driver" else logging.INFO
            _log.log(level, "otel-straggler: driver event calls unavailable (%s: %s); using torch's",
                     type(exc).__name__, exc)
            return
        self.record = record
        self.elapsed = elapsed
        self.query = query
        try:
            self.elapsed_many = driver_elapsed_batch()
        except Exception:  # the readout then reads each record with ``elapsed``
            self.elapsed_many = None
        self.stream = driver_stream(torch.cuda.current_device())
        self.record_api = "driver"


class HostOnlyPool:
    """No device timing at all: the timers read ``cuda`` False and never touch ``free``."""

    __slots__ = ("capacity", "cuda", "elapsed", "elapsed_many", "events", "free", "orphans", "query", "reason",
                 "record", "record_api", "record_cost_s", "stream", "table", "warm_error")

    def __init__(self, reason: str = NO_CUDA, warm_error: str | None = None) -> None:
        self.cuda = False
        self.stream: Callable[[], Any] | None = None
        self.events: list[Any] = []
        self.table = event_table(self.events)
        self.record, self.elapsed, self.query = _by_id(self.events)  # never called: no events
        self.elapsed_many: Callable[[Any, Any, int, int], int] | None = None
        self.record_api = "none"
        self.record_cost_s = 0.0
        self.reason = reason
        self.warm_error = warm_error
        self.capacity = 0
        self.free: deque[int] = self.table.free
        self.orphans: deque[int] = self.table.orphans


def create_pool(size: int, factory: Callable[[], Any] | None = None,
                record_api: str = "auto") -> EventPool | HostOnlyPool:
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
        return EventPool(size, record_api=record_api)
    except ImportError:
        return HostOnlyPool()
    except Exception as exc:  # CUDA init errors of any kind: host-only
        _log.warning("otel-straggler: CUDA event pool unavailable (%s); timing host-only", type(exc).__name__)
        return HostOnlyPool(warm_error=type(exc).__name__)

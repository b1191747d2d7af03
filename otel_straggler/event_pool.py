"""Fixed pool of pre-created, pre-warmed CUDA timing events.

All events are created AND recorded once at install (the first ``record()`` of a ``torch.cuda.Event``
lazily creates the CUDA event, which costs far more than a warm record and would skew the first windows),
followed by one ``synchronize`` at install time only. The free list is a ``collections.deque``: ``popleft``
(training thread only) and ``append`` (readout thread only; the training thread hands the events it lets go of
to ``orphans``, which the readout quarantines) are atomic under the GIL, so no lock is shared with the training
thread.

An event that was recorded is returned to the free list only after its ``query()`` is True (or at
shutdown): a recorded-but-unfinished event is never re-recorded.

``pool.record(ev)`` records an event on the current stream; ``pool.elapsed(start, end)`` (readout thread)
gives the device ms between two, or None while unfinished; ``pool.query(ev)`` (readout thread) says whether a
lone event (an interval that lost its end event, a quarantined one) completed. With ``record_api`` ``auto``
(the default) they are the CUDA driver's ``cuEventRecord``, ``cuEventElapsedTime`` and ``cuEventQuery`` called
on the events' raw handles (kept in each pool event's ``handle`` once created) and the device's current raw
stream: through ``ctypes``, or from the C hot path's module (``_hotpath.c``, where it runs: the timers call
``cuEventRecord`` through the address ``record.cu_event_record`` gives, the readout ``event_elapsed`` and
``event_query``). They are the same operations as torch's ``Event.record()``, ``query()`` and ``elapsed_time()``
without their Python layers (``torch.cuda.current_stream()`` builds a ``Stream`` object per record, then a
device guard); the readout makes one call per interval instead of two (``bench/results/gpu-h200.md`` section 2).
Each of these calls keeps the GIL (``ctypes.PyDLL``, or C that does not release it): none blocks, and a call
that released it would be a point where the other thread takes the GIL, so a drain and the training thread's
records would hand it back and forth, each hand-off a context switch on the training thread
(``bench/results/gpu-h200.md`` section 3). The one exception is ``elapsed_many`` (``driver_elapsed_batch``):
the readout reads all pending slots' times in one call that releases the GIL once per 256 slots. They are
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
import operator
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from otel_straggler import hot_path
from otel_straggler.counters import CUDA_ERROR, NO_CUDA

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


def query_then_elapsed(sev: Any, eev: Any) -> float | None:
    """Device ms from ``sev`` to ``eev`` through the events' own methods; None while ``eev`` is unfinished."""
    if not eev.query():
        return None
    return float(sev.elapsed_time(eev))


def driver_elapsed(hold_gil: bool = True) -> Callable[[Any, Any], float | None]:
    """``elapsed(sev, eev)``: one ``cuEventElapsedTime`` on the events' ``handle`` instead of torch's ``query()``
    and ``elapsed_time()``; None while either event is unfinished, raises on any other error. Called from the C
    hot path's module (``_hotpath.event_elapsed``) where it runs and the GIL is kept, else through ctypes. Not
    thread-safe (one result buffer): the readout thread's alone."""
    fn = _driver_call("cuEventElapsedTime", *_ELAPSED_ARGS, hold_gil=hold_gil)
    if hold_gil and hot_path.core is not None:  # the same call from C: no ctypes argument conversion per call
        return functools.partial(hot_path.core.event_elapsed, _address(fn))
    out = ctypes.c_float()
    ref = ctypes.byref(out)

    def elapsed(sev: Any, eev: Any) -> float | None:
        rc = fn(ref, sev.handle, eev.handle)
        if rc == 0:
            return out.value
        if rc == CUDA_ERROR_NOT_READY:
            return None
        raise RuntimeError(f"cuEventElapsedTime failed ({rc})")

    return elapsed


def driver_elapsed_batch() -> Callable[[Any, int, int], int] | None:
    """``elapsed_many(ring, tail, head)``: the C module's ``elapsed_batch`` on ``cuEventElapsedTime``: the device
    times of the ring's pending slots read with the GIL released once around the driver calls, each left in its
    slot's ``pre`` for the readout (``_hotpath.c``); None without the C module (the readout then calls
    ``elapsed`` per slot)."""
    if hot_path.core is None:
        return None
    return functools.partial(hot_path.core.elapsed_batch, _address(_driver_call("cuEventElapsedTime", *_ELAPSED_ARGS)))


def driver_query(hold_gil: bool = True) -> Callable[[Any], bool]:
    """``query(ev)``: ``cuEventQuery`` on the event's ``handle`` (from C as ``driver_elapsed``, else through
    ctypes): True once it completed, False while it has not, raises on any other error."""
    fn = _driver_call("cuEventQuery", ctypes.c_void_p, hold_gil=hold_gil)
    if hold_gil and hot_path.core is not None:
        return functools.partial(hot_path.core.event_query, _address(fn))

    def query(ev: Any) -> bool:
        rc = fn(ev.handle)
        if rc == 0:
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        raise RuntimeError(f"cuEventQuery failed ({rc})")

    return query


def driver_recorder(device_index: int, hold_gil: bool = True) -> Callable[[Any], Any]:
    """``record(ev)``: ``cuEventRecord(ev.handle, current raw stream of device_index)`` through ctypes, returning
    that stream (``raw_stream`` of ``driver_stream``); on a non-zero result, torch's ``ev.record()`` (raises if
    that fails too) and None. ``record.cu_event_record``: the function's address, which the C hot path
    (``_hotpath.c``) calls directly, with the same fallback."""
    fn = _driver_call("cuEventRecord", ctypes.c_void_p, ctypes.c_void_p, hold_gil=hold_gil)
    stream_of = driver_stream(device_index)

    def record(ev: Any) -> Any:
        stream = stream_of()
        if fn(ev.handle, stream):
            ev.record()
            return None
        return stream

    record.cu_event_record = _address(fn)  # type: ignore[attr-defined]  # the C hot path's
    return record


def driver_stream(device_index: int) -> Callable[[], int]:
    """The current raw CUDA stream of ``device_index`` (an int), as ``driver_recorder`` records on it."""
    import torch

    return functools.partial(torch._C._cuda_getCurrentRawStream, device_index)


def _check_driver(record: Callable[[Any], None], elapsed: Callable[[Any, Any], float | None],
                  query: Callable[[Any], bool], a: Any, b: Any) -> None:
    """``b`` recorded by ``record`` after a GPU sleep that follows torch's record of ``a`` on the same stream:
    ``elapsed`` answers None and ``query`` False while the sleep runs (when it still does), then the same time
    as torch's ``elapsed_time`` and True once ``b`` completed, and that time covers the sleep; raises
    otherwise."""
    import torch

    a.record()
    torch.cuda._sleep(_DRIVER_CHECK_CYCLES)
    record(b)
    early = elapsed(a, b)
    early_done = query(b)
    ref_done = b.query()  # asked after the driver: completion is monotonic, so it must agree when that said done
    b.synchronize()
    ms, ref = elapsed(a, b), a.elapsed_time(b)
    if (early is not None or early_done) and not ref_done:
        raise RuntimeError("the driver answered before the event completed")
    if not query(b):
        raise RuntimeError("cuEventQuery says a completed event is unfinished")
    if ms is None or not (ref > 0.0 and abs(ms - ref) <= 1e-3 * max(1.0, ref)):
        raise RuntimeError(f"driver events disagree with torch's ({ms} ms vs {ref} ms)")


def _none() -> None:
    return None


@functools.cache
def _slotted_event_type() -> Any:
    """``torch.cuda.Event`` with the pool's attributes (``refs``, ``tag``, ``tainted``, ``handle``) as
    ``__slots__``: the C hot path reads and writes them at their offsets instead of through the type's MRO
    (``_hotpath.c`` ``slot_offset``); plain ``torch.cuda.Event`` where the subclass cannot be made."""
    import torch

    try:
        class PoolEvent(torch.cuda.Event):
            __slots__ = ("handle", "refs", "tag", "tainted")

        return PoolEvent
    except Exception:
        return torch.cuda.Event


class EventPool:
    """``factory()`` makes one event (default: ``torch.cuda.Event(enable_timing=True)``)."""

    __slots__ = ("capacity", "cuda", "elapsed", "elapsed_many", "free", "orphans", "query", "reason", "record",
                 "record_api", "record_cost_s", "stream", "warm_error")

    def __init__(
        self, size: int, factory: Callable[[], Any] | None = None, *, synchronize: Callable[[], Any] | None = None,
        record_api: str = "auto", stream: Callable[[], Any] | None = None,
    ):
        self.cuda = True
        self.reason: str | None = None
        self.warm_error: str | None = None
        self.orphans: deque[Any] = deque()  # recorded events the training thread let go of (readout quarantines)
        # records an event on the current stream; a test factory's events: their own record()
        self.record: Callable[[Any], None] = operator.methodcaller("record")
        # device ms between two recorded events, None while unfinished (readout thread only)
        self.elapsed: Callable[[Any, Any], float | None] = query_then_elapsed
        # whether a recorded event completed (readout thread only)
        self.query: Callable[[Any], bool] = operator.methodcaller("query")
        # the device times of a ring's pending slots in one call, left in each slot's ``pre`` (readout thread only;
        # the driver record API with the C module: ``driver_elapsed_batch``), else None
        self.elapsed_many: Callable[[Any, int, int], int] | None = None
        self.record_api = "event"
        # the stream a record would use now, compared with what ``record`` returned (shared_event.py); None: no
        # event is reused. A factory's events: ``stream`` (their record's result, None, by default)
        self.stream: Callable[[], Any] | None = stream if stream is not None else _none
        torch_events = factory is None
        if factory is None:
            import torch

            event_type = _slotted_event_type()

            def factory() -> Any:
                return event_type(enable_timing=True)

            synchronize = synchronize or torch.cuda.synchronize
        events = [factory() for _ in range(int(size))]
        for ev in events:  # warm: force the lazy creation now, not in the first measured windows
            ev.refs = 0  # references not yet published in the ring (training thread; shared_event.py)
            ev.tag = 0  # the ring head at its release (shared_event.py)
            ev.tainted = False  # released with its state unknown: the readout queries it before reuse
            ev.record()
        if synchronize is not None:
            synchronize()
        if torch_events:
            self._choose_record(record_api, events)
        # cost of one record of a warm event (adaptive device sampling budgets with it)
        sample = events[: min(len(events), 64)]
        record = self.record
        t0 = time.perf_counter()
        for ev in sample:
            record(ev)
        self.record_cost_s = (time.perf_counter() - t0) / max(1, len(sample))
        if synchronize is not None:
            synchronize()
        self.capacity = len(events)
        self.free: deque[Any] = deque(events)

    def _choose_record(self, record_api: str, events: list[Any]) -> None:
        """The driver's record, elapsed time and query when ``record_api`` allows them and they pass
        ``_check_driver`` on two of the (warm, complete) events; else torch's ``Event.record``, ``query`` and
        ``elapsed_time``."""
        import torch

        self.record = torch.cuda.Event.record
        self.record_api = "torch"
        self.stream = None  # torch's record does not say on which stream
        if record_api == "torch" or len(events) < 2:
            return
        try:
            for ev in events:
                ev.handle = ev.cuda_event  # created by the warm record; a plain attribute for the driver calls
            record = driver_recorder(torch.cuda.current_device())
            elapsed = driver_elapsed()
            query = driver_query()
            _check_driver(record, elapsed, query, events[0], events[1])
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
        except Exception:  # the readout then reads each slot with ``elapsed``
            self.elapsed_many = None
        self.stream = driver_stream(torch.cuda.current_device())
        self.record_api = "driver"


class HostOnlyPool:
    """No device timing at all: the timers read ``cuda`` False and never touch ``free``."""

    __slots__ = ("capacity", "cuda", "elapsed", "elapsed_many", "free", "orphans", "query", "reason", "record",
                 "record_api", "record_cost_s", "stream", "warm_error")

    def __init__(self, reason: str = NO_CUDA, warm_error: str | None = None) -> None:
        self.cuda = False
        self.stream: Callable[[], Any] | None = None
        self.record: Callable[[Any], None] = operator.methodcaller("record")  # never called: no events
        self.elapsed: Callable[[Any, Any], float | None] = query_then_elapsed
        self.query: Callable[[Any], bool] = operator.methodcaller("query")
        self.elapsed_many: Callable[[Any, int, int], int] | None = None
        self.record_api = "none"
        self.record_cost_s = 0.0
        self.reason = reason
        self.warm_error = warm_error
        self.capacity = 0
        self.free: deque[Any] = deque()
        self.orphans: deque[Any] = deque()


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

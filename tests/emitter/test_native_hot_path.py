"""The C hot path's own parts (``otel_straggler/_hotpath.c``): its driver calls, the checks on its wiring, and
the references it takes and gives back, on both implementations where both have the part.

The rest of the emitter suite runs on whichever implementation ``otel_straggler/hot_path.py`` chose, and
``scripts/test`` runs it on both. CUDA cannot run on this machine, so the driver functions the C code calls
through a pointer are ctypes callbacks here (``cuEventRecord``, ``cuEventElapsedTime``, ``cuEventQuery`` with the
driver's signatures and result codes); the real driver is called by the CUDA tests in ``tests/gpu``.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from typing import Any

import pytest
from fake_cuda import FakeDevice, FakeEvent

from otel_straggler import hot_path
from otel_straggler.config import EmitterConfig
from otel_straggler.counters import CUDA_ERROR, EmitterCounters
from otel_straggler.event_pool import CUDA_ERROR_NOT_READY, EventPool, _address
from otel_straggler.interval import NullSink
from otel_straggler.ring import NO_EVENT
from otel_straggler.timers import Timers

native = pytest.mark.skipif(hot_path.core is None, reason=f"the C hot path is not in use ({hot_path.REASON})")

RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
ELAPSED = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p)
QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class HandleEvent(FakeEvent):
    __slots__ = ("handle",)


class HandleDevice(FakeDevice):
    """Fake events with raw ``handle``s, as the driver record API's events have; ``pool`` copies them into its
    table, where the driver calls read them."""

    def factory(self) -> HandleEvent:
        ev = HandleEvent(self)
        ev.handle = 0x1000 + len(self.events)
        self.events.append(ev)
        return ev

    @staticmethod
    def pool(size: int, **kw: Any) -> EventPool:
        dev = kw.pop("dev")
        pool = EventPool(size, dev.factory, synchronize=None, **kw)
        for i, ev in enumerate(pool.events):
            pool.table.handle[i] = ev.handle
        return pool


def refused(call: Any) -> None:
    """``call`` is a start of a started timer or a stop of a stopped one: Megatron's AssertionError."""
    with pytest.raises(AssertionError, match=r"^timer (has already been started|is not started)$"):
        call()


@native
def test_event_elapsed_and_query_pass_the_handles_and_map_the_result_codes() -> None:
    seen: list[tuple[int, ...]] = []
    rc = [0]

    @ELAPSED
    def elapsed(out: Any, a: int, b: int) -> int:
        seen.append((a, b))
        out[0] = 1.25
        return rc[0]

    @QUERY
    def query(h: int) -> int:
        seen.append((h,))
        return rc[0]

    a, b = 0xA0, 0xB0  # two raw events' handles
    core = hot_path.core
    assert core.event_elapsed(_address(elapsed), a, b) == 1.25
    assert core.event_query(_address(query), a) is True
    rc[0] = CUDA_ERROR_NOT_READY
    assert core.event_elapsed(_address(elapsed), a, b) is None
    assert core.event_query(_address(query), b) is False
    rc[0] = 700  # any other result: an error the readout counts (cuda_error) and quarantines for
    with pytest.raises(RuntimeError, match="cuEventElapsedTime failed \\(700\\)"):
        core.event_elapsed(_address(elapsed), a, b)
    with pytest.raises(RuntimeError, match="cuEventQuery failed \\(700\\)"):
        core.event_query(_address(query), a)
    assert seen == [(0xA0, 0xB0), (0xA0,), (0xA0, 0xB0), (0xB0,), (0xA0, 0xB0), (0xA0,)]
    with pytest.raises(TypeError):
        core.event_query(_address(query), object())  # no handle


def _driver_timers(sink: Any, dev: HandleDevice) -> Timers:
    cfg = EmitterConfig(enabled=True, device_every=1, pool_size=16, ring_size=64, share_gap_us=0.0,
                        device_repeats="all")
    pool = HandleDevice.pool(16, dev=dev, stream=lambda: 0x5000)
    return Timers(2, "minmax", config=cfg, pool=pool, sink=sink)


@native
def test_the_c_record_calls_cu_event_record_on_the_current_stream_and_falls_back(sink) -> None:
    dev = HandleDevice()
    by_handle: dict[int, HandleEvent] = {}
    calls: list[tuple[int, int]] = []
    rc = [0]

    @RECORD
    def cu_event_record(handle: int, stream: int) -> int:
        calls.append((handle, stream))
        if rc[0] == 0:
            by_handle[handle].record()  # what the driver does: the event marks this point of the stream
        return rc[0]

    t = _driver_timers(sink, dev)
    by_handle.update({ev.handle: ev for ev in dev.events})
    x = t("forward-compute")
    x._cu_record = _address(cu_event_record)
    try:
        t.set_step(0)
        x.start()
        dev.work(2.0)
        x.stop()
        assert len(calls) == 2 and {s for _, s in calls} == {0x5000}
        assert calls[0][0] != calls[1][0]  # two distinct events
        # the driver refuses: the event's own record() makes up for it (torch's, which makes a context current)
        rc[0] = 1
        x.start()
        dev.work(3.0)
        x.stop()
        assert len(calls) == 4
        # and when that fails too, the interval is host-only (cuda_error), counted, never raised
        dev.raise_on_record = True
        x.start()
        x.stop()
        dev.raise_on_record = False
        t.readout.drain()
        got = [(iv.device_ms, iv.degraded) for iv in sink.intervals]
        assert got[:2] == [(2.0, None), (3.0, None)]
        assert got[2][0] is None and got[2][1] == CUDA_ERROR
        assert t.counters.faults_training == 0
        assert t.counters.degraded[CUDA_ERROR] == 1
    finally:
        t.shutdown(1.0)


@native
def test_the_wiring_is_checked_when_set_not_on_every_call(make_timers) -> None:
    t = make_timers()
    x = t("forward-compute")
    for attr in ("_ctx", "_share", "_ring", "_tab", "_c"):
        with pytest.raises(TypeError, match=attr):
            setattr(x, attr, object())
    x._ring = None  # unwired: every call is a counted fault, none raises
    x.start()
    refused(x.stop)  # the start failed: no running timer, Megatron's misuse error
    assert t.counters.faults_training == 1
    assert t.counters.unbalanced == 1


def test_an_event_id_set_from_python_beyond_the_table_is_a_counted_fault(make_timers) -> None:
    """``_sev`` is writable (``reset`` writes it): an id the pool's table does not have is refused before anything
    indexes with it, on either path, and counted; the timer is usable again after a reset."""
    t = make_timers(pool_size=4)
    x = t("forward-compute")
    x.start()
    x._sev = 4000
    x.stop()
    assert t.counters.faults_training == 1
    x._sev = NO_EVENT
    x.reset()
    x.start()
    x.stop()
    assert t.counters.faults_training == 1 and t.counters.unbalanced == 0


def test_a_call_with_an_unknown_argument_raises_like_a_python_method(make_timers) -> None:
    x = make_timers()("forward-compute")
    with pytest.raises(TypeError):
        x.start(barrier=False, sync=True)
    with pytest.raises(TypeError):
        x.stop(True, True)
    x.start(True)
    x.stop(barrier=True)
    assert x.elapsed() >= 0.0


def test_references_taken_on_the_hot_path_are_given_back(make_timers, device) -> None:
    """Many steps of starts and stops with device timing, reuse, sampled-out repeats and unbalanced calls, each
    drained: every event, the timers, the step's binding and the reasons hold as many references as before."""
    # NullSink keeps no interval, so what the intervals referred to is referred to by the emitter alone
    t = make_timers(pool_size=32, ring_size=64, share_gap_us=10_000.0, device_repeats="middle", sink_=NullSink())
    fc, bc = t("forward-compute"), t("backward-compute")

    def step() -> None:
        for _ in range(3):
            fc.start()
            device.work(0.5)
            fc.stop()
            bc.start()
            refused(bc.start)  # the first start is kept
            device.work(1.0)
            bc.stop()
            refused(bc.stop)  # no running timer
        t.readout.drain()

    def steps(first: int, n: int) -> None:
        for s in range(first, first + n):
            t.set_step(s)
            step()

    steps(0, 30)
    watched = [fc, bc, t.ring, t.pool.table, t.ctx, t.share, *device.events]

    def refs() -> list[int]:
        gc.collect()  # garbage of earlier tests is not this test's
        return [sys.getrefcount(o) for o in watched]

    before = refs()
    steps(30, 200)
    assert refs() == before
    b = t.ctx.binding  # the binding of one step, through many intervals of it
    n = sys.getrefcount(b)
    for _ in range(50):
        step()
    assert sys.getrefcount(b) == n
    assert t.counters.faults_training == 0 and t.counters.unbalanced == 2 * 3 * 280
    assert t.counters.intervals == 2 * 3 * 280


def _batch_timers(sink: Any, dev: HandleDevice, elapsed_fn: Any) -> Timers:
    """Timers whose pool reads the ring's device times with the C batch (as a driver-API pool does), calling
    ``elapsed_fn`` as ``cuEventElapsedTime``."""
    import functools

    cfg = EmitterConfig(enabled=True, device_every=1, pool_size=32, ring_size=64, share_gap_us=0.0,
                        device_repeats="all")
    pool = HandleDevice.pool(32, dev=dev)
    pool.elapsed_many = functools.partial(hot_path.core.elapsed_batch, _address(elapsed_fn))
    return Timers(2, "minmax", config=cfg, pool=pool, sink=sink)


@native
def test_the_readout_takes_device_times_from_the_batch_up_to_the_first_unfinished_pair(sink) -> None:
    dev = HandleDevice(auto_complete=False)
    by_handle: dict[int, HandleEvent] = {}
    calls: list[tuple[int, int]] = []

    @ELAPSED
    def cu_elapsed(out: Any, a: int, b: int) -> int:
        calls.append((a, b))
        ea, eb = by_handle[a], by_handle[b]
        if not eb.query():
            return CUDA_ERROR_NOT_READY
        out[0] = eb.recorded_at - ea.recorded_at + 1000.0  # +1000: tells the batch's answer from the event's own
        return 0

    t = _batch_timers(sink, dev, cu_elapsed)
    by_handle.update({ev.handle: ev for ev in dev.events})
    x = t("forward-compute")
    try:
        t.set_step(0)
        for ms in (1.0, 2.0, 3.0):
            x.start()
            dev.work(ms)
            x.stop()
            if ms == 2.0:
                dev.complete_all()  # the first two intervals completed, the third not yet
        t.readout.drain()
        assert [iv.device_ms for iv in sink.intervals] == [1001.0, 1002.0]
        assert len(calls) == 3  # the third pair answered not ready and ended the batch
        assert len(t.ring) == 1  # head-of-line: the third waits
        dev.complete_all()
        t.readout.drain()
        assert [iv.device_ms for iv in sink.intervals] == [1001.0, 1002.0, 1003.0]
        assert t.counters.faults_readout == 0
        assert all(v != v for v in t.ring.pre)  # each read-ahead time is let go with its record
    finally:
        t.shutdown(1.0)


@native
def test_an_error_in_the_batch_leaves_the_slot_to_the_readouts_own_call(sink) -> None:
    dev = HandleDevice()

    @ELAPSED
    def cu_elapsed(out: Any, a: int, b: int) -> int:
        return 700

    t = _batch_timers(sink, dev, cu_elapsed)
    x = t("forward-compute")
    try:
        t.set_step(0)
        x.start()
        dev.work(4.0)
        x.stop()
        t.readout.drain()
        assert [iv.device_ms for iv in sink.intervals] == [4.0]  # the event's own elapsed_time answered
        assert t.counters.faults_readout == 0
    finally:
        t.shutdown(1.0)


@native
def test_the_batch_releases_the_gil_around_the_driver_calls(make_timers) -> None:
    """``PyGILState_Check`` as the driver function: it answers 0 (success here) only where the calling thread does
    not hold the GIL, and 1 (an error: the batch stops) where it does. Its extra arguments are ignored (the C calling
    convention on x86-64 and aarch64)."""
    device = HandleDevice()
    t = make_timers(pool_size=32, ring_size=64, fake=device)
    x = t("forward-compute")
    t.set_step(0)
    for _ in range(5):
        x.start()
        device.work(1.0)
        x.stop()
    check = ctypes.cast(ctypes.pythonapi.PyGILState_Check, ctypes.c_void_p).value
    r = t.ring
    assert hot_path.core.elapsed_batch(check, r, t.pool.table, r.tail, r.head) == 5
    for i in range(len(r.pre)):
        r.pre[i] = float("nan")  # what was read is garbage: the check wrote no time
    t.readout.drain()
    assert [iv.device_ms for iv in t.readout.sink.intervals] == [1.0] * 5


def test_a_barrier_whose_truth_value_raises_is_a_counted_fault(make_timers) -> None:
    class Ambiguous:  # a tensor with several elements answers bool() like this
        def __bool__(self) -> bool:
            raise ValueError("ambiguous truth value")

    t = make_timers()
    x = t("forward-compute")
    x.start(barrier=Ambiguous())  # nothing happens but the count, as on the Python path
    x.start()
    x.stop(Ambiguous())
    x.stop()
    t.readout.drain()
    assert t.counters.faults_training == 2
    assert t.counters.unbalanced == 0 and t.counters.intervals == 1


def test_a_shared_event_never_initialised_raises_and_does_not_crash() -> None:
    """Its table and ring unset (NULL in C): releasing or recording an event raises, where reading them through a
    NULL pointer would end the process."""
    from otel_straggler.hot_path import SharedEvent

    bare = SharedEvent.__new__(SharedEvent)
    with pytest.raises((TypeError, AttributeError)):
        bare.release(0)
    with pytest.raises((TypeError, AttributeError)):
        bare.recorded(0, 0, None, False)


@native
def test_the_c_lookup_answers_like_megatrons_call_in_every_shape() -> None:
    """``timers(name, log_level)`` (``TimersCore``): an existing timer from C, on the vectorcall and the tp_call
    route (``t.__call__``: what Python 3.11 takes for a subclass), everything else from ``Timers._get``."""
    t = Timers(2, "minmax")
    assert isinstance(t, hot_path.core.TimersCore) and "__call__" not in vars(type(t))
    fc = t("forward-compute", log_level=2)
    for call in (t, t.__call__):
        assert call("forward-compute") is fc
        assert call("forward-compute", 2) is fc
        assert call("forward-compute", log_level=2) is fc
        assert call("forward-compute", None) is fc
        assert call(name="forward-compute") is fc  # another shape: _get answers
        with pytest.raises(AssertionError, match="does not match already existing log level"):
            call("forward-compute", log_level=1)
        with pytest.raises(AssertionError, match="larger than max supported"):
            call("new-" + str(id(call)), 3)
        with pytest.raises(TypeError):
            call("forward-compute", 2, 3)
        with pytest.raises(TypeError):
            call("forward-compute", level=2)
        with pytest.raises(TypeError):
            call()
    assert t("optimizer", 1)._level == 1 and t("optimizer") is t("optimizer", True)  # True == 1, as in Python

    class Name(str):
        pass

    assert t(Name("forward-compute"), 2) is fc  # not exactly a str: _get's dict lookup, as before
    before = sys.getrefcount(fc)
    for _ in range(10_000):
        t("forward-compute", log_level=2)
        t.__call__("forward-compute", 2)
    assert sys.getrefcount(fc) == before


@native
def test_the_lookup_follows_a_replaced_timer_table_and_a_patched_call() -> None:
    t = Timers(2, "minmax")
    fc = t("forward-compute", 2)
    t._timers = {}
    other = t("forward-compute", 2)
    assert other is not fc and t("forward-compute") is other
    t._timers = None  # broken wiring: _get raises what Python raises
    with pytest.raises(AttributeError):
        t("forward-compute")

    class Patched(Timers):
        def __call__(self, name: str, log_level: int | None = None) -> Any:
            return ("patched", name)

    assert Patched(2, "minmax")("x", 2) == ("patched", "x")


@native
def test_the_training_counters_are_c_fields_of_the_counters_the_timer_is_wired_to() -> None:
    """The C path counts into ``HotCounters``' C fields (``EmitterCounters`` derives from it): a subclass sees the
    counts through the same attributes, and counters of another type are refused when wired, not on a call."""
    class Mine(EmitterCounters):
        __slots__ = ()

    counters = Mine()
    t = Timers(2, "minmax", counters=counters)
    fc = t("forward-compute", 2)
    refused(fc.stop)
    fc.start(barrier=True)
    refused(fc.start)
    assert (counters.unbalanced, counters.barriers_skipped) == (2, 1)
    assert counters.snapshot()["unbalanced"] == 2
    with pytest.raises(TypeError, match="_c must be the C hot path's HotCounters"):
        fc._c = object()
    assert isinstance(counters, hot_path.core.HotCounters)


def test_the_collective_flag_of_a_timer_reaches_the_wire_on_both_paths(make_timers, sink) -> None:
    """A timer's name, level, group and collective flag are its entry in the ring's table, which the records name by
    id; ``collective`` set after the timer was made (``stage(..., collective=True)``) changes that entry."""
    t = make_timers()
    a, b = t("all-grads-sync"), t("forward-compute")
    a.collective = True
    assert a.collective and not b.collective
    assert t.ring.timers[a._id] == ("all-grads-sync", 2, a.group, True)
    for x in (a, b, a):
        x.start()
        x.stop()
    t.readout.drain()
    assert [(iv.name, iv.collective) for iv in sink.intervals] == [
        ("all-grads-sync", True), ("forward-compute", False), ("all-grads-sync", True)]

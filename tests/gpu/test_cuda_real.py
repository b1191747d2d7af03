"""CUDA-only paths, on a real GPU (skipped without one; run on the GPU machine with ``pytest -m cuda``).

These are the checks the CPU suite can only do with a fake event backend: real CUDA events, created and
warmed at install, measuring real device work; no device sync on the training thread; the device-side
slowdown injection; and a real megatron-core GPT with the shim as ``config.timers``.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from otel_straggler import hot_path  # noqa: E402
from otel_straggler.config import EmitterConfig  # noqa: E402
from otel_straggler.event_pool import create_pool  # noqa: E402
from otel_straggler.interval import DecodingSink  # noqa: E402
from otel_straggler.ring import record_at  # noqa: E402
from otel_straggler.timers import Timers  # noqa: E402


class RecordingSink(DecodingSink):
    def __init__(self) -> None:
        super().__init__()
        self.intervals: list = []
        self.lock = threading.Lock()

    def submit(self, intervals) -> None:
        with self.lock:
            self.intervals.extend(intervals)

    def publish_stats(self, stats) -> None:
        self.stats = dict(stats)

    def flush(self, timeout_s: float) -> bool:
        return True

    def shutdown(self, timeout_s: float) -> None:
        pass


_CYCLES_PER_MS: list[float] = []


def _gpu_sleep_ms(ms: float) -> None:
    """Occupy the current stream for about ``ms`` (torch.cuda._sleep spins cycles; calibrated once)."""
    if not _CYCLES_PER_MS:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        _CYCLES_PER_MS.append(20_000_000 / max(a.elapsed_time(b), 1e-3))
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS[0]))


def _timers(device_every: int = 1, device_repeats: str = "all", start_readout: bool = True,
            **kw) -> tuple[Timers, RecordingSink]:
    """Every repeat of a step on the device unless ``device_repeats`` says otherwise (test_repeat_sampling.py)."""
    _gpu_sleep_ms(0.0)  # calibrate before any timed interval (calibration synchronises the device)
    cfg = EmitterConfig.from_env({}, enabled=True, device_every=device_every, readout_interval_ms=5,
                                 device_repeats=device_repeats)
    sink = RecordingSink()
    t = Timers(2, "minmax", config=cfg, pool=create_pool(64), sink=sink, start_readout=start_readout, **kw)
    return t, sink


def test_pool_is_real_cuda_and_warmed_at_install() -> None:
    pool = create_pool(32)
    assert pool.cuda and pool.capacity == 32
    ev = pool.events[pool.free.popleft()]
    # a warmed event was already recorded once: query() answers without creating it
    assert ev.query() is True
    # warm records are cheaper than the first record of a fresh event (which creates it)
    fresh = [torch.cuda.Event(enable_timing=True) for _ in range(200)]
    warm = [pool.events[pool.free.popleft()] for _ in range(20)]
    t_fresh, t_warm = [], []
    for i in range(20):
        t0 = time.perf_counter_ns()
        fresh[i].record()
        t_fresh.append(time.perf_counter_ns() - t0)
        t0 = time.perf_counter_ns()
        warm[i].record()
        t_warm.append(time.perf_counter_ns() - t0)
    print(f"first record of a fresh event {statistics.median(t_fresh) / 1e3:.1f} us, "
          f"record of a warmed pool event {statistics.median(t_warm) / 1e3:.1f} us")
    assert statistics.median(t_warm) < statistics.median(t_fresh)


def test_pool_records_through_the_driver_on_the_current_stream() -> None:
    """auto passes the install check and records with cuEventRecord; like torch's record it uses the CURRENT
    stream: a pair around work on a side stream times that work (on the default stream it would time
    nothing), and a pair mixing torch's and the driver's records agrees."""
    pool = create_pool(16)
    assert pool.record_api == "driver"
    assert create_pool(4, record_api="torch").record_api == "torch"
    side = torch.cuda.Stream()
    ia, ib, ic, id_ = (pool.free.popleft() for _ in range(4))
    a, b, c, d = (pool.events[i] for i in (ia, ib, ic, id_))
    _gpu_sleep_ms(0.0)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        pool.record(ia)
        _gpu_sleep_ms(6.0)
        pool.record(ib)
        c.record()  # torch
        _gpu_sleep_ms(6.0)
        pool.record(id_)
    d.synchronize()
    assert a.elapsed_time(b) > 3.0, a.elapsed_time(b)
    assert c.elapsed_time(d) > 3.0, c.elapsed_time(d)
    # a lone event's completion through the driver (cuEventQuery), as torch's query() answers it
    ie = pool.free.popleft()
    e = pool.events[ie]
    _gpu_sleep_ms(50.0)
    pool.record(ie)
    early = pool.query(ie)
    e.synchronize()
    assert early is False and pool.query(ie) is True and e.query() is True


def _voluntary_switches() -> int:
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


def test_driver_calls_keep_the_gil_and_use_the_cached_handles() -> None:
    """The pool's driver record, elapsed time and query are calls on each event's cached ``handle`` through
    ``ctypes.PyDLL`` or the C hot path's module (``_hotpath.c``): they never release the GIL, so a busy Python
    thread cannot take it between the training thread's records (each such hand-off blocks the training thread: a
    voluntary context switch). With the GIL kept, a loop of records gives it up only when the other thread forces
    a switch, once per switch interval."""
    import ctypes
    import sys

    from otel_straggler.event_pool import driver_recorder

    pool = create_pool(16)
    assert pool.record_api == "driver"
    for fn in (pool.record, pool.elapsed, pool.query):
        cells = [c.cell_contents for c in fn.__closure__ or ()]
        if hot_path.core is not None and {hot_path.core.event_elapsed, hot_path.core.event_query} & {
                c for c in cells if callable(c) and not isinstance(c, ctypes._CFuncPtr)}:
            continue  # the C module's calls (_hotpath.c), which never release the GIL
        calls = [c for c in cells if isinstance(c, ctypes._CFuncPtr)]
        assert calls and all(c._flags_ & ctypes._FUNCFLAG_PYTHONAPI for c in calls)
    a, b = pool.free.popleft(), pool.free.popleft()
    assert pool.table.handle[a] == pool.events[a].cuda_event and pool.table.handle[b] == pool.events[b].cuda_event

    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    def switches(record, n: int) -> tuple[int, float]:
        v0, t0 = _voluntary_switches(), time.perf_counter()
        for i in range(n):
            record(a if i & 1 else b)
        return _voluntary_switches() - v0, time.perf_counter() - t0

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        held, held_s = switches(pool.record, 20_000)
        # released per call, the busy thread takes the GIL at nearly every record and the loop waits a switch
        # interval for it (bench/results/gpu-h200/pytest-cuda.log): a few hundred records show it
        released, released_s = switches(driver_recorder(torch.cuda.current_device(), pool.events, pool.table.handle,
                                                        hold_gil=False), 300)
    finally:
        stop.set()
        th.join()
    torch.cuda.synchronize()
    print(f"voluntary switches beside a busy thread: GIL kept {held} in 20000 records ({held_s * 1e3:.0f} ms), "
          f"released per call {released} in 300 ({released_s * 1e3:.0f} ms)")
    assert held <= held_s / sys.getswitchinterval() + 20
    assert held / 20_000 < 0.1 * released / 300


def test_driver_record_on_a_thread_that_never_used_cuda() -> None:
    """A fresh thread has no current CUDA context until its first runtime call; the driver record falls back
    to torch's record there (which makes the context current) instead of failing the interval."""
    timers, sink = _timers()
    assert timers.pool.record_api == "driver"
    errors: list[BaseException] = []

    def run() -> None:
        try:
            timers.set_step(0)
            timers("forward-compute", log_level=2).start()  # the thread's first CUDA call
            _gpu_sleep_ms(6.0)
            timers("forward-compute").stop()
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    assert not errors
    assert timers.flush(10.0)
    timers.shutdown(5.0)
    got = [iv for iv in sink.intervals if iv.name == "forward-compute"]
    assert len(got) == 1 and got[0].degraded is None and got[0].device_ms > 3.0, got


def test_device_time_measures_gpu_work_not_launch_time() -> None:
    timers, sink = _timers()
    timers.set_step(4)
    for _ in range(5):
        timers("forward-compute", log_level=2).start()
        _gpu_sleep_ms(8.0)
        timers("forward-compute").stop()
    assert timers.flush(10.0)
    timers.shutdown(5.0)
    got = [iv for iv in sink.intervals if iv.name == "forward-compute"]
    assert len(got) == 5
    for iv in got:
        assert iv.device_ms is not None and iv.degraded is None
        host_ms = (iv.host_end_ns - iv.host_start_ns) / 1e6
        # at least half the requested GPU work (the spin's cycles-per-ms moves with the SM clock, which
        # boosts and drops under us, so no upper bound), and the launch returned long before the GPU finished
        assert iv.device_ms > 4.0, iv.device_ms
        assert host_ms < 0.5 * iv.device_ms, (host_ms, iv.device_ms)
    assert [iv.repeat for iv in got] == [0, 1, 2, 3, 4]


@pytest.mark.skipif(hot_path.core is None, reason="the batch read is the C module's")
def test_the_batch_read_agrees_with_one_call_per_record() -> None:
    """The pool's ``elapsed_many`` (``_hotpath.elapsed_batch``, which releases the GIL around its driver calls:
    ``tests/emitter/test_native_hot_path.py`` checks that) gives each pending record the time one ``elapsed`` call
    gives it, stops at the first unfinished pair, and the readout ships those times."""
    timers, sink = _timers(start_readout=False)
    pool = timers.pool
    assert pool.elapsed_many is not None
    timers.set_step(4)
    x = timers("forward-compute", log_level=2)
    for k in range(6):
        x.start()
        _gpu_sleep_ms(1.0 + k)
        x.stop()
    r = timers.ring
    torch.cuda.synchronize()
    assert pool.elapsed_many(r, pool.table, r.tail, r.head) == 6
    recs = [(i & r.mask, record_at(r, i)) for i in range(r.tail, r.head)]
    for i, rec in recs:
        assert r.pre[i] == pool.elapsed(rec.start_ev, rec.end_ev) and r.pre[i] > 0.5
    ahead = [r.pre[i] for i, _ in recs]
    x.start()
    _gpu_sleep_ms(200.0)  # unfinished when read
    x.stop()
    for i, _ in recs:
        r.pre[i] = float("nan")
    n = pool.elapsed_many(r, pool.table, r.tail, r.head)  # the six completed; the seventh ends the batch while asleep
    seventh = (r.head - 1) & r.mask
    if n == 7:  # this host stalled longer than the sleep before the read: then the seventh has its time too
        assert pool.query(record_at(r, r.head - 1).end_ev)
    else:
        assert n == 6 and r.pre[seventh] != r.pre[seventh]
    timers.readout.drain()
    assert [iv.device_ms for iv in sink.intervals] == ahead
    assert timers.flush(10.0)
    timers.shutdown(5.0)
    assert len(sink.intervals) == 7 and sink.intervals[-1].device_ms > 100.0


def test_the_middle_repeat_carries_the_step_device_time() -> None:
    """The default ``device_repeats=middle`` on real events: repeat k of 4 sleeps 2 x (k + 1)^2 ms on the GPU; step
    0 measures repeat 0 (2 ms), later steps repeat 2 alone (18 ms: 9x repeat 0's, where repeats 1 and 3 would give
    4x and 16x; a ratio, since the spin's speed moves with the SM clock)."""
    timers, sink = _timers(device_repeats="middle")
    for step in range(3):
        timers.set_step(step)
        for k in range(4):
            timers("forward-compute", log_level=2).start()
            _gpu_sleep_ms(2.0 * (k + 1) ** 2)
            timers("forward-compute").stop()
    assert timers.flush(10.0)
    timers.shutdown(5.0)
    measured = [(iv.step, iv.repeat, iv.device_ms) for iv in sink.intervals if iv.device_ms is not None]
    assert [(s, r) for s, r, _ in measured] == [(0, 0), (1, 2), (2, 2)]
    assert all(iv.degraded == "sampled_out" for iv in sink.intervals if iv.device_ms is None)
    first = measured[0][2]
    for _, _, ms in measured[1:]:
        assert 6.0 < ms / first < 12.0, (ms, first)


def test_no_device_sync_on_the_training_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    timers, sink = _timers()
    main = threading.get_ident()
    calls: list[str] = []

    def spy(name, real):
        def wrapped(*a, **k):
            if threading.get_ident() == main:
                calls.append(name)
            return real(*a, **k)
        return wrapped

    monkeypatch.setattr(torch.cuda, "synchronize", spy("torch.cuda.synchronize", torch.cuda.synchronize))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", spy("Event.synchronize", torch.cuda.Event.synchronize))
    monkeypatch.setattr(torch.cuda.Event, "elapsed_time", spy("Event.elapsed_time", torch.cuda.Event.elapsed_time))
    for step in range(1, 41):
        timers.set_step(step)
        timers("forward-backward", log_level=1).start()
        for _ in range(4):
            timers("forward-compute", log_level=2).start()
            _gpu_sleep_ms(0.2)
            timers("forward-compute").stop()
        timers("forward-backward").stop()
    assert calls == []
    monkeypatch.undo()
    assert timers.flush(10.0)
    timers.shutdown(5.0)
    assert len([iv for iv in sink.intervals if iv.name == "forward-compute"]) == 160
    assert any(iv.device_ms is not None for iv in sink.intervals)


def test_device_sampling_times_every_nth_step_on_the_device() -> None:
    timers, sink = _timers(device_every=4)
    for step in range(1, 13):
        timers.set_step(step)
        timers("optimizer", log_level=1).start()
        _gpu_sleep_ms(0.5)
        timers("optimizer").stop()
    timers.flush(10.0)
    timers.shutdown(5.0)
    dev_steps = sorted(iv.step for iv in sink.intervals if iv.device_ms is not None)
    assert dev_steps == [4, 8, 12]
    assert all(iv.degraded == "sampled_out" for iv in sink.intervals if iv.device_ms is None)


def test_device_injection_adds_gpu_time_inside_the_stage() -> None:
    from otel_straggler.inject import Injector

    inj = Injector("forward-compute", device_ms=5.0, from_step=3)
    inj.calibrate(True)
    timers, sink = _timers(injector=inj)
    for step in range(1, 7):
        timers.set_step(step)
        timers("forward-compute", log_level=2).start()
        _gpu_sleep_ms(2.0)
        timers("forward-compute").stop()
    timers.flush(10.0)
    timers.shutdown(5.0)
    by_step = {iv.step: iv for iv in sink.intervals}
    base = statistics.median(by_step[s].device_ms for s in (1, 2))
    slow = statistics.median(by_step[s].device_ms for s in (3, 4, 5, 6))
    print(f"device ms without injection {base:.2f}, with +5 ms injected {slow:.2f}")
    assert by_step[4].injected and not by_step[1].injected
    assert 3.0 < slow - base < 8.0


def test_megatron_gpt_with_the_shim_as_config_timers() -> None:
    pytest.importorskip("megatron.core")
    import socket

    from otel_straggler_demo.megatron_gpt import LAUNCH_BOUND, MegatronGPT, init_single_process

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_single_process(port)
    model = MegatronGPT(LAUNCH_BOUND)
    timers, sink = _timers(device_every=2)
    model.set_timers(timers)
    for _ in range(6):
        model.train_step()  # auto step: forward-backward's start advances it
    torch.cuda.synchronize()
    timers.flush(10.0)
    names = {iv.name for iv in sink.intervals}
    assert {"forward-backward", "forward-compute", "backward-compute", "optimizer"} <= names
    fc = [iv for iv in sink.intervals if iv.name == "forward-compute"]
    assert len(fc) == 6 * LAUNCH_BOUND.microbatches
    assert any(iv.device_ms is not None for iv in fc) and any(iv.device_ms is None for iv in fc)
    text = timers.get_all_timers_string(["forward-backward", "optimizer"], normalizer=6, reset=True)
    assert "forward-backward" in text and "(ms)" in text
    timers.shutdown(5.0)

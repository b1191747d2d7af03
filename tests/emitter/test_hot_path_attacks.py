"""What a training script can do to the hot path, on whichever implementation runs it (``scripts/test`` runs this
file on both): a signal handler that raises inside start/stop, a step object that runs Python code when read,
Megatron's loose log levels and names, names of any size. Each test reproduces one finding of an attack on the
drop-in; faults of the user's stay the user's (they propagate), the emitter's own state stays whole."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from otel_straggler.export import wire
from otel_straggler.timers import DummyTimer, Timer, Timers

HERE = Path(__file__).resolve().parent


def _settle(t: Timers) -> None:
    """Everything the timers took from the pool back in it: running timers reset, the latest event retired, the
    ring and the orphans read."""
    for timer in list(t._timers.values()):
        if timer._started:
            timer.reset()
    t.share.retire()
    t.readout.drain(force=True)
    t.readout._release_quarantine(force=True)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("where", ["start", "stop"])
def test_base_exception_from_a_record_propagates(make_timers, device, exc, where) -> None:
    """A KeyboardInterrupt or SystemExit raised by Python code the hot path calls (a signal handler runs there)
    reaches the caller; it is not counted as the emitter's fault, and no pool event is lost."""
    t = make_timers(share_gap_us=0.0)
    x = t("forward-compute")
    if where == "stop":
        x.start()

    def boom(stream=None):
        raise exc("from a signal handler")

    ev = t.pool.events[t.pool.free[0]]
    type(ev).record, saved = boom, type(ev).record
    try:
        with pytest.raises(exc):
            getattr(x, where)()
    finally:
        type(ev).record = saved
    assert t.counters.faults_training == 0
    _settle(t)
    assert len(t.pool.free) == t.pool.capacity


def test_signal_handler_exceptions_are_never_swallowed(make_timers, device) -> None:
    """A timer signal raises KeyboardInterrupt wherever the main thread is (Ctrl-C while training): every one of
    them reaches the loop, and after it no pool event is missing."""
    t = make_timers(share_gap_us=50.0, pool_size=64)
    fired = [0]
    armed = [False]

    def handler(signum, frame):
        if armed[0]:
            armed[0] = False
            fired[0] += 1
            raise KeyboardInterrupt

    caught = 0
    prev = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.0003, 0.0003)
    try:
        for i in range(200_000):  # bounded; ends once enough signals landed
            if fired[0] >= 40:
                break
            try:
                t.set_step(i // 4)
                armed[0] = True
                a = t("forward-backward")
                a.start()
                b = t("forward-compute")
                b.start()
                b.stop()
                a.stop()
                armed[0] = False
            except KeyboardInterrupt:
                caught += 1
                for timer in (t("forward-backward"), t("forward-compute")):
                    if timer._started:  # the one the signal interrupted, or the outer one
                        timer.reset()
            if i % 64 == 0:
                armed[0] = False
                t.readout.drain()
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, prev)
    assert fired[0] >= 40  # the handler did run inside the loop
    assert caught == fired[0]  # none swallowed
    assert t.counters.faults_training == 0
    _settle(t)
    assert len(t.pool.free) == t.pool.capacity


def test_step_whose_index_replaces_the_binding() -> None:
    """``ctx.binding`` replaced while stop reads its step (the step's ``__index__`` does it): stop returns, nothing
    is freed under it. A subprocess: the failure this guards against is a crash."""
    code = textwrap.dedent(
        """
        import gc
        from otel_straggler.timers import Timers
        from recording_sink import RecordingSink
        t = Timers(2, "minmax", sink=RecordingSink())
        ctx = t.ctx
        class Step:
            def __index__(self):
                ctx.binding = (7, None, None, None)
                junk = [bytes(64) for _ in range(2000)]  # reuse the freed memory
                return 3
        for _ in range(50):
            ctx.binding = (Step(), None, None, None)
            x = t("forward-compute")
            x.start()
            assert x.stop() is None
        t.readout.drain(force=True)
        print("ok", len(t.sink.intervals), t.counters.faults_training)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ok, n, faults = out.stdout.split()
    assert ok == "ok" and int(n) == 50 and int(faults) == 0


def test_megatron_log_levels_of_any_number() -> None:
    """``timers(name, 1.5)`` and levels beyond 32 bits behave as megatron.core.timers.Timers: a timer (or the dummy)
    as its comparisons say, the same timer again for the same level, Megatron's AssertionError for another one."""
    mt = pytest.importorskip("megatron.core.timers")
    for log_level in (2, 1):
        ours, theirs = Timers(log_level, "minmax"), mt.Timers(log_level, "minmax")
        for name, level in (("half", 1.5), ("low", -(2**31) - 1), ("lower", -(2**63) - 5), ("zero", 0.0)):
            a, b = ours(name, level), theirs(name, level)
            assert isinstance(a, DummyTimer) == isinstance(b, mt.DummyTimer), (name, level, log_level)
            if isinstance(a, DummyTimer):
                continue
            assert ours(name, level) is a and ours(name) is a
            assert a.level == level and type(a.level) is type(level)
            with pytest.raises(AssertionError):
                theirs(name, 2**31 - 1)
            with pytest.raises(AssertionError):
                ours(name, 2**31 - 1)
            a.start()
            assert a.stop() is None
    assert ours.counters.faults_training == 0


def test_level_on_the_wire_is_clamped_not_dropped(make_timers, sink) -> None:
    """The wire's level is one signed byte: a level outside it is clamped (the interval is not lost)."""
    t = make_timers(sink_=wire_sink(), log_level=2)
    for name, level in (("half", 1.5), ("low", -(2**31) - 1), ("lower", -(2**70)), ("plain", 1)):
        x = t(name, level)
        x.start()
        x.stop()
    t.readout.drain(force=True)
    got = {iv.name: iv.level for iv in t.sink.decoded()}
    assert got == {"half": 1, "low": -128, "lower": -128, "plain": 1}
    assert t.counters.faults_readout == 0


def test_names_of_any_hashable_type(make_timers) -> None:
    """Megatron keys its timers by any hashable name: so do these timers, and the name goes out as its str."""
    mt = pytest.importorskip("megatron.core.timers")
    t = make_timers(sink_=wire_sink())
    theirs = mt.Timers(2, "minmax")
    names = [("forward", 1), 7, frozenset({"a"}), b"raw", "forward-compute"]
    for name in names:
        x = t(name)
        assert isinstance(x, Timer) and t(name) is x and x.name == name == theirs(name).name
        x.start()
        x.stop()
    assert t.get_all_timers_string() is not None
    t.readout.drain(force=True)
    assert [iv.name for iv in t.sink.decoded()] == [str(n) for n in names]
    assert t.counters.faults_training == t.counters.faults_readout == 0


@pytest.mark.parametrize("size", [256 * 1024, 65 * 1024 * 1024])
def test_long_names_are_truncated_and_counted(make_timers, size) -> None:
    """A name longer than the bound goes out truncated, distinct from another with the same beginning, and counted
    (``names_truncated``); the frame that carries it stays small."""
    t = make_timers(sink_=wire_sink())
    long_a, long_b = "a" * size, "a" * (size - 1) + "b"
    for name in (long_a, long_b, "short"):
        x = t(name)
        x.start()
        x.stop()
    t.readout.drain(force=True)
    names = [iv.name for iv in t.sink.decoded()]
    assert len(set(names)) == 3 and names[2] == "short"
    assert all(len(n.encode()) <= wire.MAX_NAME_BYTES for n in names)
    assert names[0].startswith("a" * 100)
    assert t.counters.names_truncated == 2
    assert t.counters.snapshot()["names_truncated"] == 2
    assert max(len(f) for f in t.sink.frames) < 64 * 1024
    assert t(long_a).name == long_a  # Megatron's name, whole


class _WireSink:
    """The process sink's half that runs in the training process: frames packed from the ring, kept here."""

    def __init__(self) -> None:
        self.encoder = wire.WireEncoder()
        self.frames: list[bytes] = []

    def new_batch(self, capacity: int) -> wire.RecordBatch:
        return self.encoder.batch(capacity)

    def submit_batch(self, batch: wire.RecordBatch) -> None:
        self.frames.append(batch.finish())
        self.encoder.commit()

    def publish_stats(self, stats: dict[str, int]) -> None:
        return None

    def flush(self, timeout_s: float) -> bool:
        return True

    def shutdown(self, timeout_s: float) -> None:
        return None

    def decoded(self) -> list:
        dec = wire.WireDecoder()
        out = []
        for kind, value in dec.feed(b"".join(self.frames)):
            if kind == wire.T_INTERVALS:
                out.extend(value)
        return out


def wire_sink() -> _WireSink:
    return _WireSink()

"""lifecycle: bounded shutdown, SIGTERM chaining, main-thread rule, fork inertness (in-process)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from export_rank_driver import identity, make_intervals

from otel_straggler import lifecycle
from otel_straggler.export.thread_sink import ThreadSink


class FakeTimers:
    """Anything with ``shutdown(timeout_s)`` and ``flush(timeout_s)``; records calls, optionally hangs."""

    def __init__(self, hang_s: float = 0.0) -> None:
        self.calls: list[float] = []  # shutdowns
        self.flushes: list[float] = []
        self.hang_s = hang_s

    def shutdown(self, timeout_s: float) -> None:
        self.calls.append(timeout_s)
        time.sleep(self.hang_s)

    def flush(self, timeout_s: float) -> bool:
        self.flushes.append(timeout_s)
        time.sleep(self.hang_s)
        return True


def test_shutdown_once_and_bounded_even_if_timers_hang() -> None:
    timers = FakeTimers(hang_s=30.0)
    reg = lifecycle.register(timers, 0.5)
    try:
        t0 = time.monotonic()
        assert reg.shutdown_once() is False  # timed out, but returned
        assert time.monotonic() - t0 < 0.5 + 15  # bounded: the hanging timers would hold it 30 s
        assert reg.shutdown_once() is True and timers.calls == [0.5]  # idempotent
    finally:
        reg.unregister()


def test_sigterm_with_a_program_handler_flushes_then_chains_and_keeps_running() -> None:
    """A program that handles SIGTERM (checkpoint on signal) decides whether it ends: what was measured is
    flushed (bounded), its handler runs, nothing is shut down, so telemetry keeps flowing if it goes on."""
    seen: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    timers = FakeTimers()
    reg = lifecycle.register(timers, 1.0)
    try:
        assert reg.sigterm_installed
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30.0
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGTERM] and timers.flushes == [1.0] and timers.calls == []
        os.kill(os.getpid(), signal.SIGTERM)  # a second one too: still running, still exporting
        deadline = time.monotonic() + 5.0
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(seen) == 2 and timers.calls == []
        assert reg.shutdown_once() and timers.calls == [1.0]  # the real exit (atexit) shuts down once
    finally:
        reg.unregister()
        signal.signal(signal.SIGTERM, old)


def test_a_program_handler_that_exits_gets_the_flush_then_the_atexit_shutdown() -> None:
    def leave(signum: int, frame: object) -> None:
        raise SystemExit(0)

    old = signal.signal(signal.SIGTERM, leave)
    timers = FakeTimers()
    reg = lifecycle.register(timers, 1.0)
    try:
        with pytest.raises(SystemExit):
            reg._on_sigterm(signal.SIGTERM, None)
        assert timers.flushes == [1.0] and timers.calls == []
        reg.shutdown_once()  # what atexit runs on the way out
        assert timers.calls == [1.0]
    finally:
        reg.unregister()
        signal.signal(signal.SIGTERM, old)


def test_sigterm_ignored_before_stays_ignored_and_nothing_stops() -> None:
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    timers = FakeTimers()
    before = lifecycle.STATE.sigterm_ignored
    reg = lifecycle.register(timers, 1.0)
    try:
        assert not reg.sigterm_installed and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert lifecycle.STATE.sigterm_ignored == before + 1
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert timers.calls == [] and timers.flushes == []  # the process goes on, and so does the export
    finally:
        reg.unregister()
        signal.signal(signal.SIGTERM, old)


def test_register_from_other_thread_skips_signal_and_counts() -> None:
    before = lifecycle.STATE.sigterm_skipped
    regs: list[lifecycle.Registration] = []
    t = threading.Thread(target=lambda: regs.append(lifecycle.register(FakeTimers(), 1.0)))
    t.start()
    t.join(5)
    (reg,) = regs
    try:
        assert not reg.sigterm_installed and lifecycle.STATE.sigterm_skipped == before + 1
        assert signal.getsignal(signal.SIGTERM) != reg._on_sigterm
    finally:
        reg.unregister()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_tracked_sink_is_inert_in_forked_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mem = InMemorySpanExporter()
    sink = ThreadSink(identity(0, 1, "f").resource_attributes(), rank=0, job_id="f", span_exporter=mem)
    lifecycle.track_sink(sink)
    sink.submit(make_intervals(0, 0))
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if not sink._inert:
                code = 2
            sink.submit(make_intervals(0, 1))
            if sink.pipeline.aggregator.open_steps != 1 or sink.flush(0.5) is not False:
                code = 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not sink._inert
    assert sink.flush(2.0)
    assert {s.attributes["dl.iteration"] for s in mem.get_finished_spans()} == {0}
    sink.shutdown(1.0)

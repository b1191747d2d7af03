"""The behavioural cases of Megatron-LM's own timer unit tests (``tests/unit_tests/test_timers.py``), each run
against the installed ``megatron.core.timers`` and against ``otel_straggler.timers`` on the hot path this process
runs (CI runs ``tests/emitter`` on both). The cases are written here from what those tests check; the two
implementations differ only in how a test sets their clocks and their world (``Impl``).

Megatron reads ``time.time()`` after a ``torch.cuda.synchronize()`` and asks ``torch.distributed`` for the rank and
world size when it logs; ours reads ``timers._clock`` (nanoseconds) and is told its rank and world size. Each
``Impl`` sets a clock that a test moves by hand (``at(seconds)``) and a one-rank (or given) world.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch

mt = pytest.importorskip("megatron.core.timers")

import otel_straggler._hotpath_py as hot_path_py  # noqa: E402
import otel_straggler.timers as ours  # noqa: E402


class Impl:
    def __init__(self, name: str, mod: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.name, self.mod, self.mp = name, mod, monkeypatch
        self.now = 0.0
        self.rank, self.size = 0, 1
        if name == "megatron":
            monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
            monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
            monkeypatch.setattr(mod.time, "time", lambda: self.now)
            self.world(0, 1)
            monkeypatch.setattr(mod, "dist_all_gather_func", lambda out, inp: None)  # one rank: in place
        else:
            # the C path reads the module's clock when it differs from perf_counter_ns at timer creation, the Python
            # path its own module's
            monkeypatch.setattr(mod, "_clock", lambda: round(self.now * 1e9))
            monkeypatch.setattr(hot_path_py, "_clock", mod._clock)

    def at(self, seconds: float) -> None:
        self.now = seconds

    def world(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        if self.name == "megatron":
            self.mp.setattr(torch.distributed, "get_rank", lambda *a, **k: rank)
            self.mp.setattr(torch.distributed, "get_world_size", lambda *a, **k: size)

    def timers(self, log_level: int = 2, log_option: str = "minmax") -> Any:
        if self.name == "megatron":
            return self.mod.Timers(log_level=log_level, log_option=log_option)
        return self.mod.Timers(log_level, log_option, rank=self.rank, world_size=self.size)

    def timer(self, name: str) -> Any:
        return self.timers(2)(name, 1)


@pytest.fixture(params=["megatron", "otel_straggler"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Impl]:
    yield Impl(request.param, mt if request.param == "megatron" else ours, monkeypatch)


def test_a_dummy_timer_starts_and_stops_but_refuses_elapsed_queries(impl: Impl) -> None:
    timer = impl.mod.DummyTimer()
    timer.start()
    timer.stop()
    timer.reset()
    with pytest.raises(Exception, match="dummy timer should not be used"):
        timer.elapsed()
    with pytest.raises(Exception, match="active timer should not be used"):
        timer.active_time()


def test_a_timer_accumulates_elapsed_and_active_time_and_reset_keeps_active(impl: Impl) -> None:
    timer = impl.timer("forward")
    impl.at(10.0)
    timer.start()
    impl.at(10.25)
    timer.stop()
    assert timer.elapsed(reset=False) == pytest.approx(0.25)
    assert timer.active_time() == pytest.approx(0.25)
    assert not timer._started
    timer.reset()
    assert timer.elapsed(reset=False) == 0.0
    assert timer.active_time() == pytest.approx(0.25)


def test_elapsed_of_a_running_timer_reads_it_and_leaves_it_running(impl: Impl) -> None:
    timer = impl.timer("backward")
    impl.at(1.0)
    timer.start()
    impl.at(1.5)
    assert timer.elapsed(reset=False) == pytest.approx(0.5)
    assert timer._started
    impl.at(2.0)
    timer.stop()
    assert timer.elapsed() == pytest.approx(1.0)


def test_start_and_stop_out_of_order_raise_megatrons_assertion_errors(impl: Impl) -> None:
    timer = impl.timer("optimizer")
    with pytest.raises(AssertionError, match="timer is not started"):
        timer.stop()
    timer.start()
    with pytest.raises(AssertionError, match="timer has already been started"):
        timer.start()


def test_timers_return_a_real_or_the_dummy_timer_by_log_level(impl: Impl) -> None:
    timers = impl.timers(log_level=1, log_option="max")
    real = timers("train", log_level=1)
    dummy = timers("debug", log_level=2)
    assert isinstance(real, impl.mod.Timer)
    assert isinstance(dummy, impl.mod.DummyTimer)
    assert timers("train") is real
    with pytest.raises(AssertionError, match="does not match already existing"):
        timers("train", log_level=0)
    with pytest.raises(AssertionError, match="larger than max supported"):
        timers("too-high", log_level=3)


def test_an_unknown_log_option_is_refused(impl: Impl) -> None:
    with pytest.raises(AssertionError, match="input log option"):
        impl.mod.Timers(log_level=1, log_option="median")


def _timed(impl: Impl, option: str, times: dict[str, float]) -> Any:
    timers = impl.timers(log_level=1, log_option=option)
    for name, seconds in times.items():
        t = timers(name, 1)
        impl.at(100.0)
        t.start()
        impl.at(100.0 + seconds)
        t.stop()
    return timers


@pytest.mark.parametrize("option", ["max", "minmax"])
def test_the_max_and_minmax_strings(impl: Impl, option: str) -> None:
    out = _timed(impl, option, {"forward": 3.0, "backward": 2.0}).get_all_timers_string(["forward", "backward"])
    if option == "max":
        assert out.startswith("max time across ranks (ms):")
        assert "forward " in out and "3000.00" in out
    else:
        assert out.startswith("(min, max) time across ranks (ms):")
        assert "(3000.00, 3000.00)" in out and "(2000.00, 2000.00)" in out


def test_the_all_ranks_string(impl: Impl) -> None:
    out = _timed(impl, "all", {"forward": 1.0}).get_all_timers_string(["forward"])
    assert out.startswith("times across ranks (ms):")
    assert "rank  0: 1000.00" in out


def test_write_records_each_timers_max_time(impl: Impl, monkeypatch: pytest.MonkeyPatch) -> None:
    class Writer:
        def __init__(self) -> None:
            self.calls: list[tuple[str, float, int]] = []

        def add_scalar(self, name: str, value: float, iteration: int) -> None:
            self.calls.append((name, value, iteration))

    if impl.name == "megatron":
        monkeypatch.setattr(mt, "SummaryWriter", Writer)  # Megatron writes to a tensorboard SummaryWriter
    writer = Writer()
    _timed(impl, "max", {"forward": 4.0}).write(["forward"], writer=writer, iteration=7)
    assert writer.calls == [("forward-time", pytest.approx(4.0), 7)]


@pytest.mark.parametrize("rank", [3, 1])
def test_log_writes_on_the_last_rank_by_default(impl: Impl, rank: int, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    impl.world(rank, 4)
    lines: list[str] = []
    if impl.name == "megatron":
        monkeypatch.setattr(mt.logger, "info", lines.append)
    caplog.set_level(logging.INFO, logger="megatron.core.timers")
    monkeypatch.setattr(impl.mod.Timers, "get_all_timers_string", lambda *a, **k: "timing output")
    impl.timers(log_level=1, log_option="max").log(["forward"])
    lines += [r.getMessage() for r in caplog.records if r.name == "megatron.core.timers"]
    assert lines == (["timing output"] if rank == 3 else [])


def _params(fn: Any) -> list[tuple[str, Any]]:
    """Parameter names and defaults (kinds and annotations aside: a C method's ``self`` is positional-only)."""
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(("owner", "method"), [
    ("Timers", "__call__"), ("Timer", "start"), ("Timer", "stop"), ("Timer", "elapsed"), ("Timer", "reset"),
    ("Timer", "active_time"), ("Timers", "log"), ("Timers", "write"), ("Timers", "get_all_timers_string"),
    ("DummyTimer", "start"), ("DummyTimer", "elapsed"),
])
def test_signatures_are_megatrons(owner: str, method: str) -> None:
    assert _params(getattr(getattr(ours, owner), method)) == _params(getattr(getattr(mt, owner), method))


def test_wrappers_and_autospec_see_the_call_signature() -> None:
    timers = ours.Timers(2, "minmax")
    assert _params(timers) == _params(mt.Timers(2, "minmax")) == [("name", inspect.Parameter.empty),
                                                                   ("log_level", None)]
    for spec in (timers, ours.Timers):
        m = mock.create_autospec(spec, instance=spec is ours.Timers)
        m("forward-compute", log_level=1)
        with pytest.raises(TypeError):
            m("forward-compute", 1, 2)
    assert timers.__call__("forward-compute") is timers("forward-compute")

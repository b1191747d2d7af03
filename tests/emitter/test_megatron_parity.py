"""Parity with the REAL megatron-core ``Timers`` (imported from the installed megatron-core).

Megatron's timers call ``torch.cuda.synchronize`` and gather across ranks; on this CPU machine the test
patches, inside the test only, ``torch.cuda.synchronize`` (no-op), ``torch.cuda.current_device``
(``"cpu"``), ``torch.distributed.get_rank/get_world_size`` (a one-rank world) and megatron's gather
function (a one-rank all-gather is the identity) so that Megatron's own code renders its strings.
"""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch

mt = pytest.importorskip("megatron.core.timers")

from otel_straggler.timers import DummyTimer, Timer, Timers  # noqa: E402


@pytest.fixture
def one_rank_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(mt, "dist_all_gather_func", lambda out, inp: None)


def pair(level: int = 1, option: str = "minmax") -> tuple[mt.Timers, Timers]:
    return mt.Timers(level, option), Timers(level, option)


def test_level_filtering_and_return_types(one_rank_world: None) -> None:
    for t, kind, dummy_kind in ((pair()[0], mt.Timer, mt.DummyTimer), (pair()[1], Timer, DummyTimer)):
        a = t("a", 1)
        assert isinstance(a, kind)
        assert t("a") is a  # later lookup without a level finds the registered timer
        assert t("a", 1) is a
        d1 = t("deep", 2)  # above the configured level: shared dummy, not registered
        assert isinstance(d1, dummy_kind)
        assert t("deep2", 2) is d1 is t._dummy_timer
        assert "deep" not in t._timers
        assert t("deep") is d1  # None -> level 2 -> still the dummy
        n = t("new")  # None -> 2 > 1 -> dummy
        assert n is d1
        z = t("zero", 0)
        assert isinstance(z, kind) and "zero" in t._timers
        with pytest.raises(AssertionError):
            t("a", 0)  # different level for an existing name
        with pytest.raises(AssertionError):
            t("x", 3)  # above the max supported level for a new name
        with pytest.raises(Exception, match="dummy timer should not be used"):
            d1.elapsed()
        with pytest.raises(Exception, match="active timer should not be used"):
            d1.active_time()
        assert d1.start() is None and d1.stop() is None and d1.reset() is None


def test_bad_log_option_asserts_like_megatron() -> None:
    with pytest.raises(AssertionError):
        mt.Timers(1, "median")
    with pytest.raises(AssertionError):
        Timers(1, "median")


def test_elapsed_reset_active_set_elapsed_semantics(one_rank_world: None) -> None:
    for t in pair(2):
        x = t("x")
        assert isinstance(x.elapsed(), float) and x.elapsed() == 0.0
        x.start()
        x.stop()
        first = x.elapsed(reset=False)
        assert first > 0.0
        assert x.elapsed(reset=False) == first  # not reset
        assert x.elapsed() == first  # read and reset
        assert x.elapsed() == 0.0
        assert x.active_time() == pytest.approx(first)  # active time survives reset
        # running timer: elapsed() stops, reads, resets and restarts it
        x.start()
        running = x.elapsed()
        assert running > 0.0
        x.stop()  # still started after elapsed(): a stop is balanced
        assert x.elapsed() > 0.0
        x.set_elapsed(2.5)
        assert x.elapsed(reset=False) == 2.5
        active = x.active_time()
        x.reset()
        assert x.elapsed() == 0.0
        assert x.active_time() == active
        assert isinstance(x.active_time(), float)


def _strings(option: str, normalizer: float, values: dict[str, float], names: list[str] | None) -> tuple[str, str]:
    meg, ours = mt.Timers(2, option), Timers(2, option)
    for t in (meg, ours):
        for name, v in values.items():
            t(name).set_elapsed(v)
        t("never-ran")  # registered, zero -> filtered out by both
    return (
        meg.get_all_timers_string(names, normalizer=normalizer, reset=False),
        ours.get_all_timers_string(names, normalizer=normalizer, reset=False),
    )


@pytest.mark.parametrize("option", ["max", "minmax", "all"])
@pytest.mark.parametrize("normalizer", [1.0, 10.0])
def test_text_format_identical_for_one_rank(one_rank_world: None, option: str, normalizer: float) -> None:
    values = {
        "forward-backward": 1.2345,
        "forward-compute": 0.5,
        "a-very-long-timer-name-that-is-longer-than-48-characters": 3.0,
    }
    for names in (None, ["forward-compute", "forward-backward", "not-registered"]):
        meg, ours = _strings(option, normalizer, values, names)
        assert ours == meg
    header = {"max": "max time across ranks (ms):", "minmax": "(min, max) time across ranks (ms):"}
    meg, _ = _strings(option, normalizer, values, None)
    assert meg.splitlines()[0] == header.get(option, "times across ranks (ms):")
    if option != "all":
        assert re.search(r"\n    forward-backward \.+: ", meg)


def test_nothing_timed_returns_none(one_rank_world: None) -> None:
    for t in pair(2):
        t("idle")
        assert t.get_all_timers_string(["idle"]) is None


def test_log_and_write_match(
    one_rank_world: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: dict[str, list] = {"meg": [], "ours": []}

    class Writer:  # stands in for tensorboard's SummaryWriter (not installed here)
        def __init__(self, key: str) -> None:
            self.key = key

        def add_scalar(self, name: str, value: float, iteration: int) -> None:
            calls[self.key].append((name, round(value, 9), iteration))

    monkeypatch.setattr(mt, "SummaryWriter", Writer)
    meg, ours = pair(2)
    for t in (meg, ours):
        t("forward-compute").set_elapsed(0.25)
        t("optimizer", 1).set_elapsed(0.5)
    meg.write(["forward-compute", "optimizer"], Writer("meg"), 7, normalizer=2.0, reset=False)
    ours.write(["forward-compute", "optimizer"], Writer("ours"), 7, normalizer=2.0, reset=False)
    assert calls["ours"] == calls["meg"] == [("forward-compute-time", 0.125, 7), ("optimizer-time", 0.25, 7)]

    # where megatron-core puts it: logging set up for Megatron alone (INFO on "megatron", the root at WARNING)
    # shows both texts, on the same logger
    caplog.set_level(logging.WARNING)
    caplog.set_level(logging.INFO, logger="megatron")
    meg.log(["forward-compute", "optimizer"], normalizer=1.0)
    ours.log(["forward-compute", "optimizer"], normalizer=1.0)
    shown = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if "forward-compute" in r.getMessage()]
    assert len(shown) == 2 and shown[0] == shown[1] and shown[0][:2] == ("megatron.core.timers", logging.INFO)
    # reset=True in log() reset both
    assert meg("optimizer").elapsed() == ours("optimizer").elapsed() == 0.0
    # rank filter: logging for another rank prints nothing on this one
    caplog.clear()
    ours("optimizer").set_elapsed(1.0)
    ours.log(["optimizer"], rank=3)
    assert not [r for r in caplog.records if "optimizer" in r.getMessage()]


def test_misuse_raises_megatrons_assertion_errors_and_is_counted(one_rank_world: None) -> None:
    meg, ours = pair(2)
    for timers in (meg, ours):
        t = timers("x")
        with pytest.raises(AssertionError, match=r"^timer is not started$"):
            t.stop()
        t.start()
        with pytest.raises(AssertionError, match=r"^timer has already been started$"):
            t.start()
        t.stop()  # the misuse changed nothing: the first start still runs
        with pytest.raises(AssertionError, match=r"^timer is not started$"):
            t.stop(barrier=True)
        assert t.elapsed() > 0.0
    assert ours.counters.unbalanced == 3
    assert ours.counters.barriers_skipped == 0  # a refused call does nothing else


def test_deepcopy_of_a_config_holding_the_timers(one_rank_world: None) -> None:
    from megatron.core.model_parallel_config import ModelParallelConfig

    ours = Timers(2, "minmax")
    cfg = ModelParallelConfig()
    cfg.timers = ours
    assert copy.deepcopy(cfg).timers is ours


def test_private_helpers_match(one_rank_world: None) -> None:
    meg, ours = pair(2)
    for t in (meg, ours):
        t("forward-compute").set_elapsed(0.25)
        t("optimizer", 1).set_elapsed(0.5)
        t("idle")
    names = ["forward-compute", "optimizer", "idle", "missing"]
    assert ours._get_global_min_max_time(names, False, False, 2.0) == meg._get_global_min_max_time(
        names, False, False, 2.0
    )
    for max_only in (True, False):
        assert ours._get_global_min_max_time_string(names, False, False, 0.001, max_only) == (
            meg._get_global_min_max_time_string(names, False, False, 0.001, max_only)
        )
    assert ours._get_all_ranks_time_string(names, False, False, 0.001) == meg._get_all_ranks_time_string(
        names, False, False, 0.001
    )
    a = ours._get_elapsed_time_all_ranks(names, False, False)
    b = meg._get_elapsed_time_all_ranks(names, False, False)
    assert a.shape == b.shape and torch.equal(a, b.cpu())
    assert ours._get_elapsed_time_all_ranks([], False, False) is None


def test_assertion_messages_match() -> None:
    msgs = []
    for t in pair(2):
        t("a", 1)
        row = []
        for args in (("a", 0), ("b", 3)):
            with pytest.raises(AssertionError) as err:
                t(*args)
            row.append(str(err.value))
        msgs.append(row)
    assert msgs[0] == msgs[1]

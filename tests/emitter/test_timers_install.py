"""Configuration, install_megatron and the generic stage/step API (CPU: host-only pool, or the fake
CUDA event backend where device timing matters)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

import otel_straggler
from otel_straggler.config import EmitterConfig
from otel_straggler.interval import NullSink
from otel_straggler.timers import Timers


def test_config_defaults_env_and_overrides() -> None:
    c = EmitterConfig.from_env({})
    assert (c.enabled, c.device_every, c.pool_size, c.ring_size, c.detail) == (False, 0, 1024, 8192, "step")
    assert (c.readout_interval_ms, c.readout_timeout_s, c.export_mode, c.step_timer, c.export_nice) == (
        100.0,
        30.0,
        "process",
        "forward-backward",
        10,
    )
    c = EmitterConfig.from_env({"OTEL_STRAGGLER_ENABLED": "1", "OTEL_STRAGGLER_DEVICE_EVERY": "2"}, device_every=8)
    assert c.enabled and c.device_every == 8 and c.config_errors == ()
    assert EmitterConfig.from_env({}).record_api == "auto"
    assert EmitterConfig.from_env({"OTEL_STRAGGLER_RECORD_API": "torch"}).record_api == "torch"
    c = EmitterConfig.from_env({"OTEL_STRAGGLER_RECORD_API": "cupy"})
    assert c.record_api == "auto" and c.config_errors == ("record_api",)


def test_bad_values_fall_back_warn_once_and_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    env = {
        "OTEL_STRAGGLER_DEVICE_EVERY": "-1",
        "OTEL_STRAGGLER_DETAIL": "span",
        "OTEL_STRAGGLER_READOUT_TIMEOUT_S": "nan",
    }
    c = EmitterConfig.from_env(env, bogus=1)
    assert (c.device_every, c.detail, c.readout_timeout_s) == (0, "step", 30.0)
    assert set(c.config_errors) == {"device_every", "detail", "readout_timeout_s", "bogus"}
    EmitterConfig.from_env(env)
    warned = [r for r in caplog.records if "device_every" in r.getMessage()]
    assert len(warned) <= 1
    t = Timers(2, "minmax", config=c)
    assert t.counters.snapshot()["faults_config_error"] == 4


def test_disabled_install_touches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_STRAGGLER_ENABLED", raising=False)
    model_cfg = types.SimpleNamespace(timers="original")
    assert otel_straggler.install_megatron(model_cfg, None) is None
    assert model_cfg.timers == "original"


def test_install_assigns_configs_and_global(monkeypatch: pytest.MonkeyPatch, sink) -> None:
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    gv = types.ModuleType("megatron.training.global_vars")
    gv._GLOBAL_TIMERS = None
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    model_cfg, opt_cfg = ModelParallelConfig(), OptimizerConfig()
    t = otel_straggler.install_megatron(model_cfg, opt_cfg, enabled=True, sink=sink, readout_interval_ms=5)
    try:
        assert isinstance(t, Timers)
        assert model_cfg.timers is t and opt_cfg.timers is t and gv._GLOBAL_TIMERS is t
        assert t.readout.alive
        # Megatron-style use through the config
        model_cfg.timers("forward-backward", log_level=1).start(barrier=model_cfg.barrier_with_L1_time)
        model_cfg.timers("forward-compute", log_level=2).start()
        model_cfg.timers("forward-compute").stop()
        model_cfg.timers("forward-backward").stop(barrier=True)
        assert t.flush(2.0)
        assert sink.names() == ["forward-compute", "forward-backward"]
        assert {iv.step for iv in sink.intervals} == {1}  # auto step from forward-backward
        assert t.counters.barriers_skipped == 2
    finally:
        t.shutdown(2.0)
        otel_straggler.shutdown(0.1)


def test_missing_export_side_falls_back_to_null_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_export = types.ModuleType("otel_straggler.export")  # no create_sink in it

    monkeypatch.setitem(sys.modules, "otel_straggler.export", fake_export)
    t = otel_straggler.configure(enabled=True, readout_interval_ms=5, register_lifecycle=False)
    try:
        assert isinstance(t.sink, NullSink)
        assert t.counters.sink_errors == 1
        with otel_straggler.stage("forward-compute"):
            pass
        assert t.flush(2.0)
    finally:
        otel_straggler.shutdown(1.0)


def test_raising_create_sink_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_export = types.ModuleType("otel_straggler.export")

    def create_sink(config, identity, counters):
        raise OSError("no collector")

    fake_export.create_sink = create_sink
    monkeypatch.setitem(sys.modules, "otel_straggler.export", fake_export)
    t = otel_straggler.configure(enabled=True, register_lifecycle=False)
    try:
        assert isinstance(t.sink, NullSink) and t.counters.snapshot()["faults"] >= 1
    finally:
        otel_straggler.shutdown(1.0)


def test_generic_stage_and_step_api(sink) -> None:
    t = otel_straggler.configure(enabled=True, sink=sink, readout_interval_ms=5)
    try:
        assert otel_straggler.get_timers() is t

        @otel_straggler.stage("optimizer")
        def opt_step() -> str:
            return "done"

        for s in range(3):
            otel_straggler.step(s, tokens=100 * s)
            with otel_straggler.stage("forward-compute"):
                pass
            with pytest.raises(ValueError), otel_straggler.stage("backward-compute"):
                raise ValueError("user error propagates, interval still closed")
            assert opt_step() == "done"
        assert t.flush(2.0)
        assert sink.names() == ["forward-compute", "backward-compute", "optimizer"] * 3
        assert [iv.step for iv in sink.intervals][::3] == [0, 1, 2]
        assert sink.intervals[-1].tokens == 200
    finally:
        otel_straggler.shutdown(1.0)
    assert otel_straggler.get_timers() is None
    with otel_straggler.stage("forward-compute"):  # not configured: no-op
        otel_straggler.step(5)


def test_injection_env_only_on_target_rank(monkeypatch: pytest.MonkeyPatch, sink) -> None:
    env = {
        "OTEL_STRAGGLER_INJECT_RANK": "0",
        "OTEL_STRAGGLER_INJECT_STAGE": "forward-compute",
        "OTEL_STRAGGLER_INJECT_HOST_MS": "2",
        "RANK": "0",
    }
    t = otel_straggler.configure(enabled=True, sink=sink, env=env)
    try:
        assert t.injector is not None and t.injector.stage == "forward-compute"
        t("forward-compute").start()
        t("forward-compute").stop()
        assert t.flush(2.0)
        assert sink.intervals[0].injected
    finally:
        otel_straggler.shutdown(1.0)
    env["RANK"] = "1"
    t = otel_straggler.configure(enabled=True, sink=sink, env=env)
    try:
        assert t.injector is None
    finally:
        otel_straggler.shutdown(1.0)

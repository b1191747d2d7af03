"""Configuration, install_megatron and the generic stage/step API (CPU: host-only pool, or the fake
CUDA event backend where device timing matters)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest

import otel_straggler
from otel_straggler.config import EmitterConfig
from otel_straggler.interval import NullSink
from otel_straggler.timers import Timers


def test_config_defaults_env_and_overrides() -> None:
    c = EmitterConfig.from_env({})
    assert (c.enabled, c.device_every, c.pool_size, c.ring_size, c.detail) == (False, 0, 4096, 8192, "step")
    assert (c.readout_interval_ms, c.readout_timeout_s, c.export_mode, c.step_timer, c.export_nice) == (
        500.0,
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


@pytest.mark.parametrize(
    ("name", "raw"),
    [("ring_size", 10**11), ("ring_size", "1e11"), ("pool_size", 2**40), ("max_open_steps", 10**9),
     ("max_timers_per_step", 10**7), ("device_every_max", 10**6), ("readout_interval_ms", float("inf"))],
)
def test_size_knobs_are_bounded(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str,
                                raw: object) -> None:
    """A huge value (keyword or OTEL_STRAGGLER_*) is warned about, replaced by the default and counted; configure()
    returns working timers instead of raising MemoryError."""
    from otel_straggler import config

    monkeypatch.setattr(config, "_warned", set())
    caplog.set_level(logging.WARNING)
    monkeypatch.setenv(f"OTEL_STRAGGLER_{name.upper()}", str(raw))
    t = otel_straggler.configure(enabled=True, export_mode="off", register_lifecycle=False)
    try:
        assert t is not None and getattr(t.config, name) == getattr(config.DEFAULTS, name)
        assert t.config.config_errors == (name,) and t.counters.snapshot()["faults_config_error"] == 1
        assert t.ring.cap == 8192
        assert any(f"OTEL_STRAGGLER_{name.upper()}" in r.getMessage() for r in caplog.records)
    finally:
        otel_straggler.shutdown(1.0)
    assert EmitterConfig.from_env({}, **{name: raw}).config_errors == (name,)


def test_configure_fails_open_when_setup_itself_fails(monkeypatch: pytest.MonkeyPatch, caplog) -> None:  # type: ignore[no-untyped-def]
    import otel_straggler.install as install

    def no_memory(*_a: object, **_k: object) -> None:
        raise MemoryError

    monkeypatch.setattr(install, "create_pool", no_memory)
    caplog.set_level(logging.WARNING)
    assert otel_straggler.configure(enabled=True, register_lifecycle=False) is None
    assert any("setup failed (MemoryError" in r.getMessage() for r in caplog.records)


def test_configure_outside_megatron_imports_no_megatron() -> None:
    """Outside a Megatron program configure() neither imports megatron-core (seconds, and its warnings) nor
    prints anything."""
    code = ("import sys, otel_straggler\n"
            "t = otel_straggler.configure(enabled=True, export_mode='off', register_lifecycle=False)\n"
            "assert t is not None\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    assert "megatron" not in out.stderr.lower() and "warning" not in out.stderr.lower(), out.stderr[-2000:]


def test_parallel_state_is_read_when_the_program_imported_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_straggler.identity import resolve_identity

    ps = types.ModuleType("megatron.core.parallel_state")
    ps.model_parallel_is_initialized = lambda: True
    ps.get_tensor_model_parallel_rank = lambda: 1
    ps.get_tensor_model_parallel_world_size = lambda: 2
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    ident = resolve_identity(env={})
    assert (ident.tp_rank, ident.tp_size, ident.source) == (1, 2, "parallel_state")
    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state")
    assert resolve_identity(env={}).source == "default"

"""Every public entry point fails open: an exception injected into a stage of the path never reaches the training
call, and a counter moves. Real Timers with a real in-process export sink (export_mode=thread, exporter none)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from otel_straggler import install
from otel_straggler.install import build_timers, install_megatron, stage, step
from otel_straggler.interval import NullSink


class Boom(RuntimeError):
    pass


def boom(*_a: object, **_k: object) -> None:
    raise Boom("injected")


@pytest.fixture
def timers(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    t = build_timers(enabled=True, export_mode="thread", register_lifecycle=False, readout_interval_ms=5,
                     job_id="failopen")
    assert t is not None
    old, install._DEFAULT[0] = install._DEFAULT[0], t
    yield t
    install._DEFAULT[0] = old
    t.shutdown(2.0)


def test_timer_start_stop_faults(timers) -> None:  # type: ignore[no-untyped-def]
    t = timers("forward-compute", log_level=2)
    before = timers.counters.faults_training
    saved = t._ctx
    t._ctx = None  # start() dereferences the step context
    t.start()
    t._ctx = saved
    assert timers.counters.faults_training == before + 1
    t.start()
    saved_ring = t._ring
    t._ring = None  # stop() writes into the ring
    t.stop()
    t._ring = saved_ring
    assert timers.counters.faults_training == before + 2


def test_step_and_set_step_faults(timers) -> None:  # type: ignore[no-untyped-def]
    before = timers.counters.faults_training
    saved = timers.ctx
    timers.ctx = None
    step(5, tokens=10)
    timers.set_step(6)
    timers.ctx = saved
    assert timers.counters.faults_training == before + 2


def test_stage_survives_a_raising_timers_lookup(timers, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    before = timers.counters.faults_training
    monkeypatch.setattr(type(timers), "__call__", boom)
    ran = []
    with stage("forward-compute"):
        ran.append(1)

    @stage("optimizer")
    def opt() -> int:
        return 7

    assert opt() == 7 and ran == [1]
    assert timers.counters.faults_training == before + 2


def test_install_megatron_with_broken_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")

    class Frozen:
        def __setattr__(self, k: str, v: object) -> None:
            raise AttributeError("frozen")

    t = install_megatron(Frozen(), SimpleNamespace(), set_global=False, enabled=True, export_mode="thread",
                         register_lifecycle=False, pool_size="many", ring_size=-3, bogus_option=1)
    try:
        assert t is not None
        assert t.counters.faults_training == 1  # the frozen model config
        assert t.counters.config_errors == 3  # pool_size, ring_size, bogus_option
        with stage("forward-compute"):
            pass
        assert t.flush(2.0) in (True, False)
    finally:
        t.shutdown(2.0)


def test_raising_export_factory_and_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    import otel_straggler.export as export

    monkeypatch.setattr(export, "create_sink", boom)
    t = build_timers(enabled=True, register_lifecycle=False, readout_interval_ms=5, job_id="nosink")
    assert t is not None and isinstance(t.sink, NullSink) and t.counters.sink_errors == 1
    t.shutdown(1.0)

    class RaisingSink:
        def new_batch(self, capacity: int) -> object:
            raise Boom("new_batch")

        def submit_batch(self, batch: object) -> None:
            raise Boom("submit_batch")

        def submit(self, intervals: object) -> None:
            raise Boom("submit")

        def publish_stats(self, stats: object) -> None:
            raise Boom("stats")

        def flush(self, timeout_s: float) -> bool:
            raise Boom("flush")

        def shutdown(self, timeout_s: float) -> None:
            raise Boom("shutdown")

    t = build_timers(enabled=True, sink=RaisingSink(), readout_interval_ms=5, job_id="raising")
    assert t is not None
    t("forward-compute", log_level=2).start()
    t("forward-compute").stop()
    assert t.flush(1.0) is False  # readout drained into a raising sink: counted, returns
    t.shutdown(1.0)
    assert t.counters.sink_errors >= 3


def test_span_building_and_exporter_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    t = build_timers(enabled=True, export_mode="thread", register_lifecycle=False, readout_interval_ms=5,
                     job_id="build")
    assert t is not None
    sink = t.sink
    pipeline = sink._pipeline if hasattr(sink, "_pipeline") else sink.pipeline
    monkeypatch.setattr(pipeline.builder, "build", boom)
    for n in range(3):
        t.set_step(n)
        t("forward-compute", log_level=2).start()
        t("forward-compute").stop()
    t.flush(2.0)
    assert sink.counters.get("faults_span_build") > 0
    t.shutdown(2.0)

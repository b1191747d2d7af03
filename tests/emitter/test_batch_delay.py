"""The batch schedule delay fitted to the step time (``export/batch_delay.py``): the rule against the straggler
collector's defaults, the fit over a rank's closed steps, the real SDK processor swapped to it without losing a
span, and OTEL_BSP_SCHEDULE_DELAY respected."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from export_rank_driver import identity, make_intervals
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_straggler_schema as schema
from collector_processor.processor.straggler.config import Config
from otel_straggler.config import DEFAULTS
from otel_straggler.export import batch_delay as bd
from otel_straggler.export.otel_env import OtelSettings
from otel_straggler.export.provider import (
    MAX_DELAY_SWAPS,
    Counters,
    CountingBatchSpanProcessor,
    CountingSpanExporter,
)
from otel_straggler.export.thread_sink import ThreadSink


def test_rule_uses_the_collector_defaults() -> None:
    c = Config()
    assert (bd.COLLECTOR_GRACE_S, bd.COLLECTOR_WINDOW_STEPS) == (c.grace_s, c.window_steps)
    assert bd.COLLECTOR_MAX_OPEN_WINDOWS <= c.max_open_windows  # the rule assumes fewer: it fits a smaller setting


@pytest.mark.parametrize(("step_s", "delay_ms"), [
    (None, 200), (0.005, 200), (0.020, 300), (0.070, 1300), (0.125, 2400), (1.0, 3400), (2.6, 5000), (30.0, 5000),
])
def test_rule(step_s: float | None, delay_ms: int) -> None:
    assert bd.fitted_delay_ms(step_s, 0.1) == delay_ms


@pytest.mark.parametrize("step_s", [0.020, 0.070, 0.3, 1.0, 5.0])
def test_delivery_spread_stays_inside_half_of_each_collector_allowance(step_s: float) -> None:
    """The spread between two ranks delivering the same step (at most delay + readout period) leaves half the
    grace (beyond one step) and half the open windows unused."""
    spread_s = bd.fitted_delay_ms(step_s, 0.1) / 1000 + 0.1
    c = Config()
    if bd.fitted_delay_ms(step_s, 0.1) > bd.MIN_DELAY_MS:
        assert spread_s <= c.grace_s / 2 + step_s + 1e-9
        assert spread_s <= c.max_open_windows / 2 * c.window_steps * step_s + 1e-9


@pytest.mark.parametrize("step_s", [0.018, 0.025, 0.035, 0.070, 0.3, 1.0, 5.0])
def test_the_default_readout_period_keeps_the_spread_inside_the_collector_allowances(step_s: float) -> None:
    """With the default readout period (config.py) the delivery spread (fitted delay + period) stays inside the
    grace and inside all of the collector's open windows down to 18 ms steps, inside half of them from 35 ms."""
    r = DEFAULTS.readout_interval_ms / 1000
    spread_s = bd.fitted_delay_ms(step_s, r) / 1000 + r
    c = Config()
    assert spread_s <= c.grace_s / 2 + step_s + 1e-9
    assert spread_s <= c.max_open_windows * c.window_steps * step_s + 1e-9
    if step_s >= 0.035:
        assert spread_s <= c.max_open_windows / 2 * c.window_steps * step_s + 1e-9


def _closing(fit: bd.DelayFit, first: int, n: int, period_s: float, t0_ns: int) -> list[int | None]:
    """Close ``n`` steps ``period_s`` apart; every proposed change is applied."""
    out = []
    for step in range(first, first + n):
        new = fit.observe(step, t0_ns + int((step - first) * period_s * 1e9))
        if new is not None:
            fit.applied(new)
        out.append(new)
    return out


def test_fit_after_a_few_steps_then_only_on_a_real_change() -> None:
    fit = bd.DelayFit(0.1)
    assert fit.delay_ms == bd.MIN_DELAY_MS
    seen = _closing(fit, 0, 5, 0.070, 0)
    assert seen == [None, None, None, None, 1300]  # 4 periods measured
    assert set(_closing(fit, 5, 40, 0.071, 5 * 70_000_000)) == {None}  # within the hysteresis: kept
    later = _closing(fit, 45, 40, 1.0, 5 * 70_000_000 + 40 * 71_000_000)
    changes = [d for d in later if d is not None]
    # the first re-fit after the change straddles both step times (a median over the last 16), the next one
    # would be 3.4 s: within the hysteresis of that, so it stays
    assert len(changes) == 1 and 3400 / bd.HYSTERESIS <= fit.delay_ms <= 3400
    assert fit.observe(10, 10**13) is None  # a step going backwards (a restart) is not a period
    fit = bd.DelayFit(0.1)
    assert _closing(fit, 0, 5, 0.070, 0)[-1] == 1300
    proposals = [fit.observe(step, 10**9 + step * 10**9) for step in range(5, 60)]  # 1 s steps, never applied
    assert len([d for d in proposals if d is not None]) >= 2 and fit.delay_ms == 1300  # proposed again


def _feed(sink: ThreadSink, first: int, n: int, period_ms: float) -> None:
    """Steps ``first``.. of rank 1 whose intervals end ``period_ms`` apart (the aggregator's time is the intervals')."""
    for step in range(first, first + n):
        shift = int((step * period_ms - step * 1000.0) * 1e6)  # make_intervals puts steps 1 s apart
        ivs = make_intervals(1, step)
        for iv in ivs:
            iv.host_start_ns += shift
            iv.host_end_ns += shift
        sink.submit(ivs)


def test_the_pipeline_fits_and_swaps_the_sdk_processor_without_losing_a_span(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.delenv("OTEL_BSP_SCHEDULE_DELAY", raising=False)
    mem = InMemorySpanExporter()
    sink = ThreadSink(identity(1, 4, "fit").resource_attributes(), rank=1, job_id="fit",
                      config=replace(DEFAULTS, readout_interval_ms=100.0), span_exporter=mem, metric_exporter=None)
    proc = sink.pipeline.providers.processor
    assert proc is not None and proc.schedule_delay_ms == bd.MIN_DELAY_MS and not proc.fixed_delay
    _feed(sink, 0, 8, 70.0)  # ~70 ms steps: 1.3 s
    assert proc.schedule_delay_ms == 1300 and proc.swaps == 1
    # steps arrive here far faster than in training: let the retired processor finish (a flush waits for it)
    # before the next fit, which would otherwise be proposed again 16 steps later
    assert sink.flush(10.0)
    _feed(sink, 8, 40, 1000.0)  # then 1 s steps: 3.4 s
    assert proc.schedule_delay_ms == 3400 and proc.swaps == 2
    assert sink.pipeline.delay_fit is not None and sink.pipeline.delay_fit.delay_ms == 3400
    assert sink.flush(10.0)
    spans = mem.get_finished_spans()
    assert len(spans) == 48 * 4  # every step's rank-step + 3 stage spans, once
    assert len({s.context.span_id for s in spans}) == len(spans)
    assert {s.attributes[schema.ATTR_ITERATION] for s in spans} == set(range(48))
    assert sink.counters.get("spans_exported") == 48 * 4 and sink.counters.get("dropped_queue_full") == 0
    sink.shutdown(2.0)


def test_a_set_schedule_delay_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "700")
    sink = ThreadSink(identity(1, 4, "fixed").resource_attributes(), rank=1, job_id="fixed",
                      span_exporter=InMemorySpanExporter(), metric_exporter=None)
    proc = sink.pipeline.providers.processor
    assert proc is not None and proc.fixed_delay and sink.pipeline.delay_fit is None
    _feed(sink, 0, 30, 70.0)
    assert proc.schedule_delay_ms == 700 and proc.swaps == 0
    sink.shutdown(2.0)


def test_processor_swaps_beyond_the_cap_are_refused_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    """Every swap leaves an SDK processor's at-fork hook behind: after ``MAX_DELAY_SWAPS`` the delay stays, each
    refusal is counted, one warning says so, and spans still go out through the processor in place."""
    counters = Counters()
    mem = InMemorySpanExporter()
    proc = CountingBatchSpanProcessor(CountingSpanExporter(mem, counters), counters, OtelSettings(),
                                      schedule_delay_ms=bd.MIN_DELAY_MS)
    tp = TracerProvider(shutdown_on_exit=False)
    tp.add_span_processor(proc)
    tracer = tp.get_tracer("cap")
    delays = [bd.MIN_DELAY_MS + 100 * (k + 1) for k in range(MAX_DELAY_SWAPS + 2)]
    with caplog.at_level(logging.WARNING, logger="otel_straggler.export.provider"):
        for k, delay in enumerate(delays):
            tracer.start_span(f"s{k}").end()
            assert proc._wait_retired(10.0)  # one swap at a time: let the previous one finish
            assert proc.set_schedule_delay(delay) is (k < MAX_DELAY_SWAPS)
    assert proc.swaps == MAX_DELAY_SWAPS
    assert proc.schedule_delay_ms == delays[MAX_DELAY_SWAPS - 1]
    assert counters.get("delay_swaps_refused") == 2
    assert len([r for r in caplog.records if "swaps" in r.getMessage()]) == 1
    assert proc.force_flush(10_000)
    assert len(mem.get_finished_spans()) == len(delays) and counters.get("spans_exported") == len(delays)
    proc.shutdown()

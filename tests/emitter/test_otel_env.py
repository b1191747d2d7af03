"""The standard OTEL_* settings, validated in the training process: each bad value is warned about once,
replaced by its default and listed as an error; good values follow the specification (timeouts in
milliseconds, per-signal variables win, the HTTP signal paths); the SDK objects are built from them."""

from __future__ import annotations

import logging

import pytest
from grpc import Compression as GrpcCompression
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter

from otel_straggler import config
from otel_straggler.export import otel_env
from otel_straggler.export.otel_env import OtelSettings, SignalSettings
from otel_straggler.export.provider import make_metric_exporter, make_span_exporter

BAD = {
    "OTEL_BSP_MAX_QUEUE_SIZE": "0",
    "OTEL_EXPORTER_OTLP_TIMEOUT": "ten",
    "OTEL_EXPORTER_OTLP_COMPRESSION": "zstd",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "grcp",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "-5",
    "OTEL_BSP_SCHEDULE_DELAY": "soon",
    "OTEL_METRIC_EXPORT_INTERVAL": "0",
    "OTEL_SDK_DISABLED": "maybe",
    "OTEL_TRACES_EXPORTER": "zipkin",
}


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "_warned", set())


def test_defaults_without_any_variable() -> None:
    s = OtelSettings.from_env({})
    assert s == OtelSettings()
    assert s.traces == SignalSettings(exporter="otlp", protocol="grpc", endpoint="http://localhost:4317",
                                      timeout_s=10.0, compression="none")
    assert (s.bsp_schedule_delay_ms, s.bsp_max_queue_size, s.bsp_max_export_batch_size) == (None, 2048, 512)
    assert (s.metric_export_interval_ms, s.metric_export_timeout_ms, s.errors) == (60000, 30000, ())


def test_every_bad_value_is_warned_once_defaulted_and_listed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    s = OtelSettings.from_env(BAD)
    assert set(s.errors) == set(BAD)
    assert s.bsp_max_queue_size == 2048 and s.bsp_schedule_delay_ms is None
    assert s.metric_export_interval_ms == 60000 and s.sdk_disabled is False
    for sig in (s.traces, s.metrics):
        assert (sig.exporter, sig.protocol, sig.endpoint, sig.timeout_s, sig.compression) == (
            "otlp", "grpc", "http://localhost:4317", 10.0, "none")
    first = [r.getMessage() for r in caplog.records]
    assert len(first) == len(BAD) and all(any(name in m for m in first) for name in BAD)
    assert not any(BAD["OTEL_EXPORTER_OTLP_ENDPOINT"] in m for m in first)  # names the variable, not the value
    OtelSettings.from_env(BAD)
    assert len(caplog.records) == len(first)  # once per process


def test_timeout_is_milliseconds_and_per_signal_variables_win(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    s = OtelSettings.from_env({
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1500",
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "250",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "deflate",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://metrics-host:9999/custom/path",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:4317",
    })
    assert s.errors == () and caplog.records == []
    assert s.traces == SignalSettings("otlp", "grpc", "collector:4317", 1.5, "deflate")
    assert s.metrics == SignalSettings("otlp", "http/protobuf", "http://metrics-host:9999/custom/path", 0.25, "gzip")
    s = OtelSettings.from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                               "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/"})
    assert s.traces.endpoint == "https://collector:4318/v1/traces"  # the general endpoint gets the signal path
    assert s.metrics.endpoint == "https://collector:4318/v1/metrics"


def test_a_bad_per_signal_value_falls_back_to_the_general_one() -> None:
    s = OtelSettings.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://gateway:4317",
                               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://gateway:notaport"})
    assert s.traces.endpoint == "http://gateway:4317" and s.metrics.endpoint == "http://gateway:4317"
    assert s.errors == ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",)


def test_unsupported_protocol_and_exporters_warn(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    s = OtelSettings.from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_TRACES_EXPORTER": "otlp,console",
                               "OTEL_METRICS_EXPORTER": "none"})
    assert s.traces.protocol == s.metrics.protocol == "http/protobuf"  # same endpoint, a supported encoding
    assert s.traces.endpoint == "http://localhost:4318/v1/traces"
    assert s.traces.exporter == "otlp" and s.metrics.exporter == "none"
    assert set(s.errors) == {"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_TRACES_EXPORTER"}
    assert any("http/json" in r.getMessage() for r in caplog.records)


def test_a_timeout_that_looks_like_seconds_is_used_as_milliseconds_and_warned(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING)
    s = OtelSettings.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": "10"})
    assert s.traces.timeout_s == 0.010 and s.errors == ()
    assert any("milliseconds" in r.getMessage() for r in caplog.records)


def test_batch_size_is_bounded_by_the_queue_and_sizes_by_their_caps() -> None:
    s = OtelSettings.from_env({"OTEL_BSP_MAX_QUEUE_SIZE": "64", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "128"})
    assert (s.bsp_max_queue_size, s.bsp_max_export_batch_size) == (64, 64)
    assert s.errors == ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE",)
    s = OtelSettings.from_env({"OTEL_BSP_MAX_QUEUE_SIZE": str(otel_env.MAX_QUEUE_SIZE + 1)})
    assert s.bsp_max_queue_size == 2048 and s.errors == ("OTEL_BSP_MAX_QUEUE_SIZE",)


def test_header_round_trip_and_child_environment() -> None:
    s = OtelSettings.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": "2500", "OTEL_BSP_SCHEDULE_DELAY": "300"})
    assert OtelSettings.from_dict(s.as_dict()) == s
    env = {**BAD, "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20x", "OTEL_SERVICE_NAME": "svc", "PATH": "/bin"}
    assert otel_env.child_env(env) == {"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20x",
                                       "OTEL_SERVICE_NAME": "svc", "PATH": "/bin"}


def test_sdk_exporters_are_built_from_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the general variables bad in the environment (where the SDK would raise on the compression and
    timeout), the real exporters come up with the validated values passed to them."""
    for k, v in BAD.items():
        if k != "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT":  # see the next test
            monkeypatch.setenv(k, v)
    exp = make_span_exporter(SignalSettings(endpoint="http://127.0.0.1:4317", timeout_s=1.25, compression="gzip"))
    assert isinstance(exp, GrpcSpanExporter)
    assert (exp._timeout, exp._compression) == (1.25, GrpcCompression.Gzip)
    exp.shutdown()
    mexp = make_metric_exporter(SignalSettings(protocol="http/protobuf", endpoint="http://127.0.0.1:4318/v1/metrics",
                                               timeout_s=0.5))
    assert isinstance(mexp, HttpMetricExporter) and mexp._endpoint == "http://127.0.0.1:4318/v1/metrics"
    mexp.shutdown()
    assert make_span_exporter(SignalSettings(exporter="none")) is None


def test_thread_mode_with_a_bad_grpc_signal_timeout_falls_back_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gRPC SDK exporter parses ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`` itself whatever it is given. The export
    child starts without it (``child_env``); in-process (``export_mode=thread``) the sink cannot start: the
    emitter falls back to the NullSink, warned and counted, and training goes on."""
    from otel_straggler.install import build_timers
    from otel_straggler.interval import NullSink

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "ten")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    t = build_timers(enabled=True, export_mode="thread", register_lifecycle=False, job_id="thread-bad-timeout")
    try:
        assert t is not None and isinstance(t.sink, NullSink)
        snap = t.counters.snapshot()
        assert snap["faults_config_error"] == 1 and snap["faults_sink"] == 1
        t("forward-compute").start()
        t("forward-compute").stop()
        assert t.flush(2.0) and t.sink.discarded == 1
    finally:
        t.shutdown(1.0)


@pytest.mark.parametrize(("var", "raw", "why"), [
    ("OTEL_STRAGGLER_RING_SIZE", "1e11", "not an integer"),
    ("OTEL_STRAGGLER_POOL_SIZE", "abc-secret", "not an integer"),
    ("OTEL_STRAGGLER_RING_SIZE", "99999999999", "must be in"),
    ("OTEL_STRAGGLER_READOUT_INTERVAL_MS", "fast-secret", "not a number"),
    ("OTEL_STRAGGLER_ENABLED", "maybe-secret", "not a boolean"),
])
def test_own_settings_are_warned_by_variable_never_by_value(caplog: pytest.LogCaptureFixture, var: str, raw: str,
                                                            why: str) -> None:
    """The package's own ``OTEL_STRAGGLER_*`` variables follow the standard ones: the warning names the
    variable a user set, says why, and never quotes the value."""
    with caplog.at_level("WARNING", logger="otel_straggler.config"):
        cfg = config.EmitterConfig.from_env({var: raw})
    name = var.removeprefix(config.ENV_PREFIX).lower()
    assert cfg.config_errors == (name,) and getattr(cfg, name) == getattr(config.DEFAULTS, name)
    [msg] = [r.getMessage() for r in caplog.records]
    assert var in msg and why in msg and raw not in msg, msg


@pytest.mark.parametrize("sampler", ["always_off", "traceidratio", "parentbased_traceidratio"])
def test_a_thinning_sampler_is_not_applied_to_the_straggler_spans(
        sampler: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The detector needs every step of every rank: the export side samples ALWAYS_ON whatever the application's
    ``OTEL_TRACES_SAMPLER`` says (one INFO line says so), and its child process never sees the variable."""
    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    from otel_straggler.export.ids import PresetIdGenerator
    from otel_straggler.export.provider import Counters, Providers

    monkeypatch.setattr(config, "_informed", set())
    env = {"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": "0.0"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with caplog.at_level(logging.INFO, logger="otel_straggler.config"):
        settings = OtelSettings.from_env(env)
        OtelSettings.from_env(env)
    said = [r.getMessage() for r in caplog.records if "OTEL_TRACES_SAMPLER" in r.getMessage()]
    assert len(said) == 1 and sampler in said[0] and "always_on" in said[0]
    assert otel_env.child_env({**env, "PATH": "/bin"}) == {"PATH": "/bin"}

    exported: list = []

    class Keep:
        def export(self, spans):  # type: ignore[no-untyped-def]
            exported.extend(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            return True

    providers = Providers({"service.name": "t"}, PresetIdGenerator(), Counters(), settings=settings,
                          span_exporter=Keep(), metrics=False)
    try:
        assert providers.tracer_provider.sampler is ALWAYS_ON
        for i in range(20):
            providers.tracer.start_span(f"s{i}").end()
        providers.tracer_provider.force_flush()
    finally:
        providers.shutdown(5.0)
    assert len(exported) == 20


def test_keep_all_samplers_say_nothing(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(config, "_informed", set())
    with caplog.at_level(logging.INFO, logger="otel_straggler.config"):
        OtelSettings.from_env({"OTEL_TRACES_SAMPLER": "parentbased_always_on"})
    assert not [r for r in caplog.records if "OTEL_TRACES_SAMPLER" in r.getMessage()]

"""Config loading: ``${env:...}`` substitution, merging, validation errors that name the key path and the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from collector_processor.cli import main
from collector_processor.config.loader import ConfigError, load_files, load_text, merge
from collector_processor.config.types import parse_duration
from collector_processor.config.validate import validate

REPO = Path(__file__).resolve().parents[2]
GOOD = """\
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "${env:GRPC_EP:-127.0.0.1:4317}"}
      http:
    auth: {bearer_token: ${env:TOKEN:-}}
processors:
  straggler: {}
exporters:
  otlp/traces: {endpoint: ${env:BACKEND}, tls: {insecure: true}}
  otlphttp/events: {endpoint: "http://127.0.0.1:14318"}
  prometheus: {endpoint: 127.0.0.1:9464, max_series: ${env:SERIES:-100}}
  debug: {verbosity: basic}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [straggler], exporters: [otlp/traces]}
    logs/verdicts: {receivers: [straggler], exporters: [debug, otlphttp/events]}
    metrics: {receivers: [otlp], exporters: [prometheus]}
"""


def _validate(text: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    raw, marks = load_text(text, "c.yaml", env if env is not None else {"BACKEND": "127.0.0.1:14317"})
    return validate(raw, marks)


def test_env_substitution_defaults_types_and_aliases() -> None:
    cfg = _validate(GOOD, {"BACKEND": "backend:4317", "SERIES": "7", "TOKEN": "a: {b}"})
    rc = cfg.receivers["otlp"].config
    assert rc.protocols.grpc.endpoint == "127.0.0.1:4317"  # default
    assert rc.protocols.http is not None and rc.protocols.http.endpoint == "127.0.0.1:4318"  # `http:` = defaults
    assert rc.auth.bearer_token == "a: {b}"  # a value cannot inject YAML structure
    assert cfg.exporters["prometheus"].config.max_series == 7  # re-typed after substitution
    assert cfg.exporters["otlp/traces"].factory.type == "otlp_grpc"  # legacy alias
    assert cfg.exporters["otlphttp/events"].factory.type == "otlp_http"
    assert cfg.exporters["otlp/traces"].config.endpoint == "backend:4317"
    raw, _ = load_text("a: ${env:X}$$x\n", env={"X": "1"})
    assert raw == {"a": "1$x"}


def test_missing_env_without_default_names_variable_and_line() -> None:
    with pytest.raises(ConfigError, match=r"BACKEND is not set.*c\.yaml:10"):
        _validate(GOOD, env={})


def test_unknown_key_error_names_path_and_line() -> None:
    text = GOOD.replace("debug: {verbosity: basic}", "debug: {verbosty: basic}")
    with pytest.raises(ConfigError) as ei:
        _validate(text)
    assert "exporters.debug.verbosty: unknown key (c.yaml:13)" in str(ei.value)


def test_bad_value_unknown_type_and_undefined_ids_are_all_reported() -> None:
    text = (GOOD.replace("max_series: ${env:SERIES:-100}", "max_series: -3")
            .replace("  debug: {verbosity: basic}", "  debug: {verbosity: basic}\n  kafka: {}")
            .replace("exporters: [prometheus]", "exporters: [prometheus, nope]")
            .replace("processors: [straggler]", "processors: [straggler, batch]"))
    with pytest.raises(ConfigError) as ei:
        _validate(text)
    msg = str(ei.value)
    assert "exporters.prometheus.max_series: Input should be greater than or equal to 1 (c.yaml:12)" in msg
    assert "exporters.kafka: unknown exporter type 'kafka'" in msg and "(c.yaml:14)" in msg
    assert "service.pipelines.metrics.exporters.1: exporter 'nope' is not defined under exporters (c.yaml:19)" in msg
    assert "service.pipelines.traces.processors.1: processor 'batch' is not defined" in msg


def test_signal_mismatch_and_orphan_verdict_source_rejected() -> None:
    text = GOOD.replace("exporters: [prometheus]}", "exporters: [prometheus, debug]}").replace(
        "traces: {receivers: [otlp], processors: [straggler], exporters: [otlp/traces]}",
        "traces: {receivers: [otlp], exporters: [prometheus]}")
    with pytest.raises(ConfigError) as ei:
        _validate(text)
    msg = str(ei.value)
    assert "exporter 'prometheus' does not support traces" in msg
    assert "straggler is in no traces pipeline" in msg


def test_merge_replaces_lists_and_deep_merges_maps(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(GOOD)
    b.write_text("exporters:\n  prometheus: {max_series: 5}\nservice:\n  pipelines:\n    logs/verdicts: "
                 "{exporters: [debug]}\n")
    raw, marks = load_files([a, b], env={"BACKEND": "x:1"})
    cfg = validate(raw, marks)
    assert cfg.exporters["prometheus"].config.max_series == 5
    assert cfg.exporters["prometheus"].config.endpoint == "127.0.0.1:9464"
    assert cfg.service.pipelines["logs/verdicts"].exporters == ["debug"]
    assert cfg.service.pipelines["logs/verdicts"].receivers == ["straggler"]
    assert merge({"a": [1, 2], "m": {"x": 1}}, {"a": [3], "m": {"y": 2}}) == {"a": [3], "m": {"x": 1, "y": 2}}
    b.write_text("exporters:\n  prometheus: {bogus: 1}\n")
    with pytest.raises(ConfigError, match=r"exporters\.prometheus\.bogus: unknown key \(b\.yaml:2\)"):
        validate(*load_files([a, b], env={"BACKEND": "x:1"}))


def test_durations() -> None:
    assert parse_duration("1s") == 1.0 and parse_duration("250ms") == 0.25 and parse_duration("2m") == 120
    assert parse_duration(3) == 3.0
    for bad in ("soon", "-1s", True):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_shipped_config_validates_and_cli_validate_exit_codes(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    shipped = REPO / "configs" / "collector.yaml"
    assert main(["--config", str(shipped), "--validate"]) == 0
    cfg = validate(*load_files([shipped], env={}))
    rc = cfg.receivers["otlp"].config
    assert rc.protocols.grpc.endpoint == "127.0.0.1:4317" and rc.protocols.http.endpoint == "127.0.0.1:4318"
    assert cfg.exporters["prometheus"].config.endpoint == "127.0.0.1:9464"
    assert cfg.exporters["otlp_grpc/traces"].config.endpoint == ""  # no backend needed by default
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("straggler: {}", "straggler: {no_such_option: 1}").replace("${env:BACKEND}", "h:1"))
    assert main(["--config", str(bad), "--validate"]) == 2
    err = capsys.readouterr().err
    assert "processors.straggler.no_such_option: unknown key (bad.yaml:8)" in err
    assert main(["--config", str(tmp_path / "missing.yaml"), "--validate"]) == 2


def test_receiver_without_any_protocol_is_rejected() -> None:
    text = GOOD.replace('      grpc: {endpoint: "${env:GRPC_EP:-127.0.0.1:4317}"}\n      http:\n', "      {}\n")
    text = text.replace("    protocols:\n      {}\n", "    protocols: {}\n")
    with pytest.raises(ConfigError, match=r"receivers\.otlp: .*enable at least one of protocols"):
        _validate(text)


CONNECTOR_FORM = (GOOD.replace("processors:\n  straggler: {}\n",
                               "processors:\n  straggler: {}\nconnectors:\n  straggler: {}\n")
                  .replace("exporters: [otlp/traces]}", "exporters: [otlp/traces, straggler]}"))


def test_connector_form_validates_without_warning(caplog: pytest.LogCaptureFixture) -> None:
    cfg = _validate(CONNECTOR_FORM)
    assert cfg.connectors["straggler"].factory.kind == "connector"
    assert cfg.service.pipelines["traces"].exporters == ["otlp/traces", "straggler"]
    assert cfg.service.pipelines["logs/verdicts"].receivers == ["straggler"]
    assert "deprecated" not in caplog.text


def test_processor_as_logs_receiver_is_read_as_a_connector_with_a_warning_showing_the_new_form(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = _validate(GOOD)  # logs/verdicts lists the straggler processor among its receivers
    assert set(cfg.connectors) == {"straggler"}
    assert cfg.service.pipelines["traces"].exporters == ["otlp/traces", "straggler"]
    assert "deprecated" in caplog.text
    assert "connectors:\n  straggler: {}" in caplog.text
    assert "traces: {processors: [..., straggler], exporters: [otlp/traces, straggler]}" in caplog.text
    assert "logs/verdicts: {receivers: [straggler], ...}" in caplog.text


@pytest.mark.parametrize(("change", "error"), [
    # a connector that feeds nothing
    (lambda t: t.replace("logs/verdicts: {receivers: [straggler], exporters: [debug, otlphttp/events]}",
                         "logs/verdicts: {receivers: [otlp], exporters: [debug, otlphttp/events]}"),
     "connectors.straggler: must be used as both receiver and exporter but is not the receiver of any pipeline"),
    # a connector whose upstream pipeline has no processor emitting what it carries
    (lambda t: t.replace("processors: [straggler], exporters: [otlp/traces, straggler]",
                         "exporters: [otlp/traces, straggler]"),
     "service.pipelines.traces.exporters.1: connector 'straggler' carries the verdicts of a processor of its "
     "pipeline, and traces has no processor that emits verdicts"),
    # traces -> logs only
    (lambda t: t.replace("metrics: {receivers: [otlp], exporters: [prometheus]}",
                         "metrics: {receivers: [straggler], exporters: [prometheus]}"),
     "service.pipelines.metrics.receivers.0: connector 'straggler' cannot feed metrics pipelines"),
    # one id for a receiver and a connector
    (lambda t: t.replace("connectors:\n  straggler: {}\n", "connectors:\n  straggler: {}\n  otlp: {}\n"),
     "is both a connector and one of the receivers"),
])
def test_connector_misuse_is_named(change, error: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as ei:
        _validate(change(CONNECTOR_FORM))
    assert error in str(ei.value)

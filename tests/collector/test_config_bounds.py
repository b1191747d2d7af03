"""Config values are bounded at ``--validate``: non-finite and insane numbers are refused with an error naming
the key and line (never a raw OverflowError at start); YAML alias expansion is bounded (an alias bomb of 1 KB is
refused at once, without its memory); every key of the straggler processor is finite."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from collector_processor.cli import main
from collector_processor.config.loader import MAX_CONFIG_VALUES, ConfigError, load_text
from collector_processor.config.types import parse_duration
from collector_processor.config.validate import validate

CFG = """\
receivers:
  otlp:
    protocols:
      grpc: {endpoint: 127.0.0.1:0, max_recv_msg_size_mib: %(recv)s}
      http: {endpoint: 127.0.0.1:0}
    retry_delay: %(retry)s
processors:
  memory_limiter: {limit_mib: %(limit)s, check_interval: %(check)s}
  straggler: {wall_window_s: %(wall)s, grace_s: %(grace)s}
connectors:
  straggler: {}
exporters:
  debug: {}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [memory_limiter, straggler], exporters: [straggler]}
    logs/verdicts: {receivers: [straggler], exporters: [debug]}
  shutdown_timeout: %(shutdown)s
"""
SANE = {"recv": "16", "retry": "1s", "limit": "1024", "check": "1s", "wall": "10", "grace": "5",
        "shutdown": "10"}


def _text(**over: str) -> str:
    return CFG % {**SANE, **over}


def _errors(text: str) -> str:
    raw, marks = load_text(text, "c.yaml", {})
    with pytest.raises(ConfigError) as ei:
        validate(raw, marks)
    return str(ei.value)


def test_the_sane_config_validates() -> None:
    raw, marks = load_text(_text(), "c.yaml", {})
    validate(raw, marks)


@pytest.mark.parametrize(("key", "value", "path", "line"), [
    ("limit", ".inf", "processors.memory_limiter.limit_mib", 8),
    ("limit", ".nan", "processors.memory_limiter.limit_mib", 8),
    ("limit", "1e12", "processors.memory_limiter.limit_mib", 8),
    ("wall", "1e300", "processors.straggler.wall_window_s", 9),
    ("grace", ".inf", "processors.straggler.grace_s", 9),
    ("recv", "1e6", "receivers.otlp.protocols.grpc.max_recv_msg_size_mib", 4),
    ("check", "1e-9", "processors.memory_limiter.check_interval", 8),
    ("check", "1ns", "processors.memory_limiter.check_interval", 8),
    ("retry", ".inf", "receivers.otlp.retry_delay", 6),
    ("retry", "100000000000000000000000000000000000000000s", "receivers.otlp.retry_delay", 6),
    ("shutdown", "1e300", "service.shutdown_timeout", 18),
])
def test_non_finite_and_insane_values_are_refused_naming_the_key(key: str, value: str, path: str, line: int) -> None:
    msg = _errors(_text(**{key: value}))
    assert f"{path}:" in msg and f"(c.yaml:{line})" in msg, msg


def test_cli_validate_refuses_the_values_that_used_to_crash_the_start(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "c.yaml"
    p.write_text(_text(limit=".inf", wall="1e300", recv="1e6", check="1e-9"))
    assert main(["--config", str(p), "--validate"]) == 2
    err = capsys.readouterr().err
    for key in ("memory_limiter.limit_mib", "straggler.wall_window_s", "grpc.max_recv_msg_size_mib",
                "memory_limiter.check_interval"):
        assert key in err, err
    assert "Traceback" not in err and "OverflowError" not in err


def test_durations_are_finite_and_at_most_a_week() -> None:
    assert parse_duration("168h") == 7 * 86400.0
    for bad in (float("inf"), float("nan"), "169h", 1e300, "1" * 40 + "s"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_a_yaml_alias_bomb_is_refused_without_its_memory() -> None:
    """Nine levels of nine aliases: under 1 KB of YAML standing for 9^9 (387 million) values."""
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    text = "\n".join(lines) + "\n"
    assert len(text) < 1024
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=f"more than {MAX_CONFIG_VALUES} values"):
            load_text(text, "bomb.yaml", {})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak


def test_deep_nesting_is_refused_with_a_config_error() -> None:
    with pytest.raises(ConfigError, match="nested"):
        load_text("a: " + "[" * 5000 + "]" * 5000 + "\n", "deep.yaml", {})
    with pytest.raises(ConfigError, match="nested deeper"):
        load_text("a: " + "[" * 100 + "]" * 100 + "\n", "deep.yaml", {})


def test_anchors_and_aliases_within_the_bound_still_work() -> None:
    raw, _ = load_text("base: &b {x: 1}\nother: *b\n", "c.yaml", {})
    assert raw == {"base": {"x": 1}, "other": {"x": 1}}

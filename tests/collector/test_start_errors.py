"""A collector that cannot start says which component could not listen, and where; ``--validate`` refuses
addresses that cannot be listened on or exported to, naming the key."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from collector_processor.cli import main

CONFIG = """
receivers:
  otlp:
    protocols:
      grpc: {endpoint: "127.0.0.1:%(grpc)s"}
      http: {endpoint: "127.0.0.1:%(http)s"}
exporters:
  prometheus: {endpoint: "127.0.0.1:%(metrics)s"}
service:
  pipelines:
    metrics: {receivers: [otlp], exporters: [prometheus]}
"""


def _taken() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, s.getsockname()[1]


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("clash", ["metrics", "grpc", "http"])
def test_a_port_clash_names_the_component_and_the_address(tmp_path: Path, clash: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    sock, port = _taken()
    ports = {"grpc": _free(), "http": _free(), "metrics": _free(), clash: port}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG % ports, encoding="utf-8")
    caplog.set_level(logging.ERROR)
    try:
        assert main(["--config", str(cfg)]) == 1
    finally:
        sock.close()
    (line,) = [r.getMessage() for r in caplog.records if "cannot start" in r.getMessage()]
    assert f"127.0.0.1:{port}" in line, line
    assert ("prometheus" if clash == "metrics" else "otlp") in line, line


def test_a_clash_on_every_port_is_one_message_naming_each_port(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """All three listening ports taken: one line names the three addresses and why (the gRPC one too, with an
    errno's text, never "[Errno None]"), instead of one port per attempt."""
    taken = [_taken() for _ in range(3)]
    ports = dict(zip(("grpc", "http", "metrics"), (p for _s, p in taken)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG % ports, encoding="utf-8")
    caplog.set_level(logging.ERROR)
    try:
        assert main(["--config", str(cfg)]) == 1
    finally:
        for s, _p in taken:
            s.close()
    (line,) = [r.getMessage() for r in caplog.records if "cannot start" in r.getMessage()]
    for what, port in (("otlp (grpc)", ports["grpc"]), ("otlp (http)", ports["http"]),
                       ("prometheus", ports["metrics"])):
        assert f"{what} 127.0.0.1:{port}: Address already in use" in line, line
    assert "Errno None" not in line


@pytest.mark.parametrize(("value", "key"), [
    ('"127.0.0.1:99999"', "99999"), ('"127.0.0.1:notaport"', "notaport"),
])
def test_validate_refuses_an_address_that_cannot_be_listened_on(tmp_path: Path, value: str, key: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    text = CONFIG % {"grpc": "4317", "http": "4318", "metrics": "9464"}
    text = text.replace('"127.0.0.1:4317"', value)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text, encoding="utf-8")
    assert main(["--config", str(cfg), "--validate"]) == 2
    err = capsys.readouterr().err
    assert "grpc" in err and "endpoint" in err and key in err, err


def test_validate_refuses_a_listen_address_without_a_port_whose_host_does_not_resolve(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT=notaport``: read as host ``notaport``, which cannot be listened on;
    ``--validate`` says so (the start would fail) and names the key."""
    monkeypatch.setenv("OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT", "notaport")
    assert main(["--validate"]) == 2
    err = capsys.readouterr().err
    assert "grpc.endpoint" in err and "OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT" in err and "resolves" in err, err


def test_validate_refuses_an_exporter_endpoint_with_a_bad_port(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    text = (CONFIG % {"grpc": "4317", "http": "4318", "metrics": "9464"}).replace(
        "exporters:\n", 'exporters:\n  otlp_grpc/out: {endpoint: "http://127.0.0.1:70000", tls: {insecure: true}}\n')
    text += "    traces: {receivers: [otlp], exporters: [otlp_grpc/out]}\n"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text, encoding="utf-8")
    assert main(["--config", str(cfg), "--validate"]) == 2
    err = capsys.readouterr().err
    assert "otlp_grpc/out" in err and "70000" in err, err


def test_every_listener_beyond_loopback_without_credentials_is_named(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """One warning line per address reachable from the network that asks no credentials; loopback, a bearer
    token, tenants or client certificates silence it."""
    from collector_processor import preflight

    raw = {"receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "0.0.0.0:4317"},
                                                "http": {"endpoint": "127.0.0.1:4318"}}}},
           "exporters": {"prometheus": {"endpoint": "[::]:9464"}, "prometheus/2": {"endpoint": "localhost:9465"}},
           "service": {"telemetry": {"metrics": {"address": "10.1.2.3:8888", "allow_unauthenticated": True}}}}
    assert preflight.exposed(raw) == ["otlp (grpc) 0.0.0.0:4317", "prometheus [::]:9464",
                                      "service.telemetry.metrics 10.1.2.3:8888"]
    raw["receivers"]["otlp"]["auth"] = {"tenants": [{"bearer_token": "t", "jobs": ["a"]}]}
    raw["exporters"]["prometheus"]["auth"] = {"bearer_token_file": "/run/secrets/metrics"}
    assert preflight.exposed(raw) == ["service.telemetry.metrics 10.1.2.3:8888"]
    raw["receivers"]["otlp"]["auth"] = {"job_secret_file": "/run/secrets/job-secret"}  # each job's own token
    assert preflight.exposed(raw) == ["service.telemetry.metrics 10.1.2.3:8888"]
    raw["receivers"]["otlp"] = {"protocols": {"grpc": {"endpoint": "node-7:4317"}}, "tls": {"client_ca_file": "ca"}}
    assert preflight.exposed(raw) == ["service.telemetry.metrics 10.1.2.3:8888"]
    del raw["receivers"]["otlp"]["tls"]
    assert preflight.exposed(raw)[0] == "otlp (grpc) node-7:4317"

    # through the command: the lines come before anything binds (here a clash then stops it)
    sock, port = _taken()
    cfg = tmp_path / "c.yaml"
    cfg.write_text((CONFIG % {"grpc": _free(), "http": _free(), "metrics": port}).replace(
        '"127.0.0.1:', '"0.0.0.0:').replace("}\nservice", ", allow_unauthenticated: true}\nservice"),
        encoding="utf-8")
    caplog.set_level(logging.WARNING)
    try:
        assert main(["--config", str(cfg)]) == 1
    finally:
        sock.close()
    lines = [r.getMessage() for r in caplog.records if "without authentication" in r.getMessage()]
    assert len(lines) == 3, lines
    for what in ("otlp (grpc) 0.0.0.0:", "otlp (http) 0.0.0.0:", f"prometheus 0.0.0.0:{port} "):
        assert any(line.startswith(what) for line in lines), (what, lines)

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

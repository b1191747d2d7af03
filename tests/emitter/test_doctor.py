"""``otel-straggler doctor`` says what the emitter will do on a node and exits 1 when something will not work."""

from __future__ import annotations

import json

import pytest

from otel_straggler import doctor
from otel_straggler.cli import main
from otel_straggler_demo.run import free_port
from otel_straggler_demo.tap import TraceTap

WORKER = {"OTEL_STRAGGLER_ENABLED": "1", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
          "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
          "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_x/none_y/attempt_0/1/error.json",
          "OTEL_STRAGGLER_JOB_ID": "pretrain-1"}


def _by_name(found: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {c.name: c for c in found}


def test_a_worker_pointed_at_a_live_collector_passes_and_says_what_it_derived() -> None:
    tap, port = TraceTap(), free_port()
    tap.start(port)
    try:
        found = _by_name(doctor.checks({**WORKER, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}))
    finally:
        tap.stop()
    assert all(c.status != doctor.FAIL for c in found.values()), found
    assert found["enabled"].status == doctor.OK
    assert "'pretrain-1'" in found["job id"].detail and "OTEL_STRAGGLER_JOB_ID" in found["job id"].detail
    assert found["run id"].status == doctor.OK and "launch" in found["run id"].detail
    assert "RANK=1" in found["ranks"].detail and "WORLD_SIZE=2" in found["ranks"].detail
    assert found["endpoint"].status == doctor.OK and f"127.0.0.1:{port}" in found["endpoint"].detail


def test_a_dead_endpoint_a_bad_setting_and_an_unnamed_multi_rank_job_fail(capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"OTEL_STRAGGLER_ENABLED": "1", "WORLD_SIZE": "4", "OTEL_STRAGGLER_RING_SIZE": "-3",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    found = _by_name(doctor.checks(env, timeout_s=2.0))
    assert found["endpoint"].status == doctor.FAIL and "no collector takes exports" in found["endpoint"].detail
    assert found["settings"].status == doctor.FAIL and "ring_size" in found["settings"].detail
    assert found["job id"].status == doctor.FAIL and "'local'" in found["job id"].detail
    for k in list(__import__("os").environ):
        if k.startswith(("OTEL_", "RANK", "WORLD_", "LOCAL_", "SLURM_", "TORCHELASTIC_", "MASTER_")):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["doctor", "--json", "--timeout", "2"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and {c["name"] for c in report["checks"] if c["status"] == "FAIL"} == {
        "settings", "job id", "endpoint"}


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_real_collector_says_what_it_is_and_what_its_clock_reads(tmp_path, protocol: str) -> None:  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    grpc, http, metrics = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT=f"127.0.0.1:{grpc}",
               OTEL_STRAGGLER_OTLP_HTTP_ENDPOINT=f"127.0.0.1:{http}",
               OTEL_STRAGGLER_METRICS_ENDPOINT=f"127.0.0.1:{metrics}",
               OTEL_STRAGGLER_EVIDENCE_PATH=str(tmp_path / "verdicts.jsonl"))
    proc = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config", "configs/collector.yaml"],
                            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{metrics}/healthz", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.3)
        port = grpc if protocol == "grpc" else http
        found = _by_name(doctor.checks({**WORKER, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                                        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}))
    finally:
        proc.terminate()
        proc.wait(30)
    assert found["endpoint"].status == doctor.OK, found["endpoint"]
    assert found["collector"].status == doctor.OK and found["collector"].detail.startswith("otel-straggler-collector ")
    assert found["clock"].status == doctor.OK  # the same machine's clock, within the round trip (HTTP: 1 s)


def test_a_password_in_the_endpoint_is_never_printed(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    env = {**WORKER, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://trainer:s3cr3t-pw@127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    found = _by_name(doctor.checks(env, timeout_s=2.0))
    assert found["endpoint"].status == doctor.FAIL
    assert "trainer:***@127.0.0.1" in found["endpoint"].detail
    assert all("s3cr3t" not in c.detail for c in found.values())


@pytest.mark.skipif(__import__("shutil").which("openssl") is None, reason="needs the openssl binary for certificates")
def test_the_otlp_certificate_variables_are_honoured(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An HTTPS collector whose certificate only a private CA signs: the probe trusts
    ``OTEL_EXPORTER_OTLP_CERTIFICATE`` as the exporter does; without it, or with an unreadable file, it fails."""
    import http.server
    import ssl
    import subprocess
    import threading

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.pem")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "srv.key",
            "-out", "srv.csr")
    (tmp_path / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days",
            "1", "-extfile", "ext.cnf", "-out", "srv.pem")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "srv.pem", tmp_path / "srv.key")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = {**WORKER, "OTEL_EXPORTER_OTLP_ENDPOINT": f"https://127.0.0.1:{server.server_address[1]}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
        found = _by_name(doctor.checks({**base, "OTEL_EXPORTER_OTLP_CERTIFICATE": str(tmp_path / "ca.pem")},
                                       timeout_s=5.0))
        assert found["endpoint"].status == doctor.OK, found["endpoint"]
        assert found["tls"].status == doctor.OK and "ca.pem" in found["tls"].detail
        found = _by_name(doctor.checks(base, timeout_s=5.0))
        assert found["endpoint"].status == doctor.FAIL and "CERTIFICATE_VERIFY_FAILED" in found["endpoint"].detail
        found = _by_name(doctor.checks({**base, "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(tmp_path / "nope.pem")},
                                       timeout_s=5.0))
        assert found["tls"].status == doctor.FAIL and "nope.pem" in found["tls"].detail
    finally:
        server.shutdown()
        server.server_close()

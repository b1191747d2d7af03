"""Security of a real collector process: bearer tokens on both receivers and /metrics (from env and from a file),
refusals counted per endpoint, secrets never in logs or config errors, loopback by default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "emitter"))
from export_e2e_support import otlp_env
from rel_support import (
    ROOT,
    CollectorProcess,
    collector_config,
    grpc_call,
    healthy_request,
    http_get,
    http_post,
    total,
    wait_for,
)

import otel_straggler_schema as s
from collector_processor.config.loader import load_files
from collector_processor.config.validate import validate

pytestmark = pytest.mark.slow

TOKEN = "tok-3f9c1e7a-RECEIVER-secret"
METRICS_TOKEN = "tok-88d2-METRICS-secret"
WRONG = "tok-WRONG-guess-0042"
UNAUTH = s.M_UNAUTHENTICATED


def test_auth_on_every_endpoint_counted_and_never_logged(tmp_path) -> None:
    token_file = tmp_path / "metrics.token"
    token_file.write_text(METRICS_TOKEN + "\n")
    cfg = collector_config(tmp_path, auth='    auth: {bearer_token: "${env:OTEL_STRAGGLER_TOKEN}"}',
                           prom_auth=f', auth: {{bearer_token_file: "{token_file}"}}')
    c = CollectorProcess(tmp_path, cfg, env={"OTEL_STRAGGLER_TOKEN": TOKEN}, name="auth")
    # the token is not in the config file: it comes from the environment
    assert TOKEN not in c.cfg_path.read_text()
    c.start()
    try:
        good = {"Authorization": f"Bearer {TOKEN}"}
        mgood = {"Authorization": f"Bearer {METRICS_TOKEN}"}
        body = healthy_request(1, 2).SerializeToString()
        with grpc.insecure_channel(c.grpc_target) as ch:
            assert grpc_call(ch, body).code == "UNAUTHENTICATED"
            assert grpc_call(ch, body, metadata=(("authorization", f"Bearer {WRONG}"),)).code == "UNAUTHENTICATED"
            assert grpc_call(ch, body, metadata=(("authorization", f"Bearer {TOKEN}"),)).code == "OK"
        a = http_post(c.http_base, "/v1/traces", body)
        assert a.code == "401" and a.headers.get("WWW-Authenticate") == "Bearer"
        assert http_post(c.http_base, "/v1/traces", body, headers={"Authorization": f"Bearer {WRONG}"}).code == "401"
        assert http_post(c.http_base, "/v1/traces", body, headers=good).code == "200"
        assert http_get(c.metrics_url).code == "401"
        assert http_get(c.metrics_url, {"Authorization": f"Bearer {TOKEN}"}).code == "401"  # receiver token != metrics
        assert http_get(f"http://127.0.0.1:{c.ports['metrics']}/healthz").code == "200"  # health stays open
        m = c.metrics(mgood)  # a non-200 answer raises
        per_endpoint = {k: v for k, v in m.items() if k.startswith(UNAUTH + "{")}
        assert total(m, UNAUTH) == 2 + 2 + 2
        assert len(per_endpoint) == 3 and all(v == 2 for v in per_endpoint.values()), per_endpoint
        assert total(m, s.M_REQUESTS, outcome="unauthenticated") == 4
    finally:
        c.stop()
    log = c.log()
    assert ("listening" in log and "DEBUG" in log) or "INFO" in log
    for secret in (TOKEN, METRICS_TOKEN, WRONG):
        assert secret not in log


def _validate(tmp_path, text: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    full_env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **(env or {})}
    return subprocess.run([sys.executable, "-m", "collector_processor", "--config", str(p), "--validate"],
                          capture_output=True, text=True, env=full_env, timeout=60)


@pytest.mark.parametrize("case", ["yaml_syntax", "unknown_key", "wrong_type", "both_token_kinds", "env_token_bad",
                                  "headers_bad"])
def test_config_errors_never_echo_secrets(tmp_path, case: str) -> None:
    base = collector_config(tmp_path)
    texts = {
        "yaml_syntax": base.replace("    retry_delay: 250ms",
                                    f'    auth: {{bearer_token: "{TOKEN}"\n    retry_delay: 250ms'),
        "unknown_key": base.replace("    retry_delay: 250ms", f"    auth: {{bearer_token: {TOKEN}, tokn: 1}}\n"
                                    "    retry_delay: 250ms"),
        "wrong_type": base.replace("    retry_delay: 250ms", f"    auth: {{bearer_token: [{TOKEN}]}}\n"
                                   "    retry_delay: 250ms"),
        "both_token_kinds": base.replace("    retry_delay: 250ms", f"    auth: {{bearer_token: {TOKEN}, "
                                         "bearer_token_file: /nonexistent}\n    retry_delay: 250ms"),
        "env_token_bad": base.replace("    retry_delay: 250ms",
                                      "    auth: {bearer_token: ${env:OTEL_STRAGGLER_TOKEN}}\n"
                                      "    retry_delay: ${env:OTEL_STRAGGLER_TOKEN}"),
        "headers_bad": base.replace("  debug: {verbosity: basic}", "  debug: {verbosity: basic}\n"
                                    f"  otlp_http/x: {{endpoint: 'http://127.0.0.1:1', headers: "
                                    f"{{authorization: 'Bearer {TOKEN}'}}, timeout: nonsense}}"),
    }
    r = _validate(tmp_path, texts[case], {"OTEL_STRAGGLER_TOKEN": TOKEN})
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "invalid" in r.stderr
    assert TOKEN not in r.stderr and TOKEN not in r.stdout


def test_shipped_config_binds_loopback_only() -> None:
    raw, marks = load_files([str(ROOT / "configs" / "collector.yaml")])
    cfg = validate(raw, marks)
    endpoints = []
    for comp in cfg.receivers.values():
        for proto in (comp.config.protocols.grpc, comp.config.protocols.http):  # type: ignore[attr-defined]
            if proto is not None:
                endpoints.append(proto.endpoint)
    for comp in cfg.exporters.values():
        ep = getattr(comp.config, "endpoint", None)
        if ep and comp.factory.type == "prometheus":
            endpoints.append(ep)
    assert len(endpoints) == 3
    assert all(ep.startswith("127.0.0.1:") for ep in endpoints), endpoints
    assert "0.0.0.0" not in (ROOT / "configs" / "collector.yaml").read_text()


@pytest.mark.parametrize("right", [True, False])
def test_trainer_token_accepted_or_refused_and_never_logged(tmp_path, right: bool) -> None:
    """A real trainer (Timers, export child) sends its token in OTEL_EXPORTER_OTLP_HEADERS to a real collector with
    auth on: the right token gets its spans processed; a wrong one is refused and counted. Neither token appears
    in the trainer's or the collector's output."""
    import json

    cfg = collector_config(tmp_path, auth='    auth: {bearer_token: "${env:OTEL_STRAGGLER_TOKEN}"}')
    c = CollectorProcess(tmp_path, cfg, env={"OTEL_STRAGGLER_TOKEN": TOKEN}, name="trainer-auth").start()
    sent = TOKEN if right else WRONG
    try:
        env = otlp_env(f"http://{c.grpc_target}", OTEL_EXPORTER_OTLP_HEADERS=f"authorization=Bearer%20{sent}",
                       OTEL_METRIC_EXPORT_INTERVAL="500")
        # a generous shutdown bound: on a loaded machine the export child needs more than 3 s to deliver
        args = {"job": "auth-job", "steps": 12, "end": "exit", "shutdown_timeout_s": 30.0}
        out = subprocess.run([sys.executable, str(ROOT / "tests" / "reliability" / "trainer_driver.py"),
                              json.dumps(args)], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        wait_for(lambda: total(c.metrics(), s.M_SPANS_RECEIVED if right else UNAUTH) > 0, 60)
        m = c.metrics()
        unauth = total(m, UNAUTH)
        received = total(m, s.M_SPANS_RECEIVED)
        if right:
            assert received > 0 and unauth == 0
        else:
            assert received == 0 and unauth > 0
    finally:
        c.stop()
    for text in (out.stdout, out.stderr, c.log()):
        assert TOKEN not in text and WRONG not in text


def test_a_tenants_real_trainer_stays_in_its_own_step_traces(tmp_path) -> None:
    """A real trainer (rank 70 of 128: the step traces of its block, a run id) sends with a tenant's token, which
    the receivers check span by span against the step traces its resource derives: every span is taken."""
    import json

    auth = '    auth:\n      tenants: [{name: team-a, bearer_token: "${env:OTEL_STRAGGLER_TOKEN}", jobs: [auth-job]}]'
    c = CollectorProcess(tmp_path, collector_config(tmp_path, auth=auth), env={"OTEL_STRAGGLER_TOKEN": TOKEN},
                         name="trainer-tenant").start()
    try:
        env = otlp_env(f"http://{c.grpc_target}", OTEL_EXPORTER_OTLP_HEADERS=f"authorization=Bearer%20{TOKEN}",
                       RANK="70", WORLD_SIZE="128", LOCAL_RANK="6", OTEL_STRAGGLER_RUN_ID="attempt-2")
        args = {"job": "auth-job", "steps": 12, "end": "exit", "shutdown_timeout_s": 30.0}
        out = subprocess.run([sys.executable, str(ROOT / "tests" / "reliability" / "trainer_driver.py"),
                              json.dumps(args)], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert wait_for(lambda: total(c.metrics(), s.M_SPANS_RECEIVED) >= 12, 60)
        m = c.metrics()
        assert total(m, s.M_TENANT_REFUSED) == 0 and total(m, UNAUTH) == 0
    finally:
        c.stop()


@pytest.mark.skipif(__import__("shutil").which("openssl") is None, reason="needs the openssl binary for a test cert")
def test_tls_client_that_never_handshakes_blocks_nobody(tmp_path) -> None:
    """With TLS on, a client that opens TCP and never starts the handshake must not block other clients (the
    handshake runs on the connection's own thread under the read timeout, not in the accept loop)."""
    import socket
    import ssl
    import time

    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", "s.key", "-out", "s.crt"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=30)
    cfg = collector_config(tmp_path).replace(
        "    retry_delay: 250ms",
        f"    tls: {{cert_file: {tmp_path / 's.crt'}, key_file: {tmp_path / 's.key'}}}\n    retry_delay: 250ms")
    c = CollectorProcess(tmp_path, cfg, name="tls").start()
    idle = [socket.create_connection(("127.0.0.1", c.ports[k]), timeout=5) for k in ("http", "grpc", "http")]
    try:
        time.sleep(0.3)
        body = healthy_request(1, 2).SerializeToString()
        ctx = ssl.create_default_context(cafile=str(tmp_path / "s.crt"))
        t0 = time.monotonic()
        import urllib.request

        req = urllib.request.Request(f"https://127.0.0.1:{c.ports['http']}/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf"})
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            assert resp.status == 200
        creds = grpc.ssl_channel_credentials((tmp_path / "s.crt").read_bytes())
        with grpc.secure_channel(c.grpc_target, creds) as ch:
            assert grpc_call(ch, body, timeout=5).code == "OK"
        assert time.monotonic() - t0 < 30.0  # served, not held behind the idle connections (generous bound)
    finally:
        for so in idle:
            so.close()
        c.stop()

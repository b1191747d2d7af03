"""/metrics names every job's ids, hosts, GPUs, ranks, verdicts and trace ids: it binds loopback by default, and
an address beyond loopback needs a token or the explicit ``allow_unauthenticated`` (the exporter's and the
service's own telemetry address alike)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from service_support import BASE_RECEIVER

from collector_processor.config.loader import ConfigError, load_text
from collector_processor.config.validate import validate
from collector_processor.exporter.prometheus import Config

PIPELINE = """
service:
  pipelines:
    metrics: {receivers: [otlp], exporters: [prometheus]}
"""


def _cfg(prometheus: str, telemetry: str = "") -> str:
    service = PIPELINE + (f"  telemetry: {{metrics: {telemetry}}}\n" if telemetry else "")
    return BASE_RECEIVER + f"exporters:\n  prometheus: {prometheus}\n" + service


def _check(text: str) -> str:
    raw, marks = load_text(text, "t.yaml", {})
    try:
        validate(raw, marks)
    except ConfigError as e:
        return str(e)
    return ""


def test_metrics_bind_loopback_by_default(start_service) -> None:  # type: ignore[no-untyped-def]
    assert Config().endpoint.startswith("127.0.0.1:")
    run = start_service(_cfg("{endpoint: '127.0.0.1:0'}"))
    (ep,) = [e for e in run.svc.listening() if e.what == "metrics"]
    assert ep.host == "127.0.0.1"
    with urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/metrics", timeout=5) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "10.1.2.3"])
def test_metrics_beyond_loopback_want_a_token_or_the_opt_in(host: str) -> None:
    msg = _check(_cfg(f"{{endpoint: '{host}:9464'}}"))
    assert "allow_unauthenticated" in msg and "every job" in msg, msg
    assert _check(_cfg(f"{{endpoint: '{host}:9464', auth: {{bearer_token: scrape-tok}}}}")) == ""
    assert _check(_cfg(f"{{endpoint: '{host}:9464', allow_unauthenticated: true}}")) == ""


def test_the_service_telemetry_address_follows_the_same_rule() -> None:
    local = "{endpoint: '127.0.0.1:9464'}"
    assert _check(_cfg(local, "{address: '127.0.0.1:9465'}")) == ""
    assert "allow_unauthenticated" in _check(_cfg(local, "{address: '0.0.0.0:9465'}"))
    assert _check(_cfg(local, "{address: '0.0.0.0:9465', allow_unauthenticated: true}")) == ""


def test_a_metrics_token_is_asked_on_every_interface(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg("{endpoint: '0.0.0.0:0', auth: {bearer_token: scrape-tok}}"))
    (ep,) = [e for e in run.svc.listening() if e.what == "metrics"]
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/metrics", timeout=5)
    assert ei.value.code == 401
    req = urllib.request.Request(f"http://127.0.0.1:{ep.port}/metrics",
                                 headers={"Authorization": "Bearer scrape-tok"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200

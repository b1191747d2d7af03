"""Alerting end to end with the real programs: the straggler collector (subprocess), Prometheus scraping it and
evaluating ``configs/prometheus/rules/straggler.rules.yml``, Alertmanager routing to a webhook served by this
test. 8 ranks (one Resource + TracerProvider each) send stage spans through the OTel SDK's ``OTLPSpanExporter``;
rank 3 is 20 % slower in ``forward-compute`` for 8 steps, then back to par. ``StragglerDetected`` must fire with
``rank="3"`` (Alertmanager API and webhook), then resolve.

The only change to the shipped rules is ``for: 1m`` -> ``for: 2s`` (in a test copy) so the test runs in seconds;
the scrape and evaluation intervals are 1 s for the same reason."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from stack_support import (
    JOB_ID,
    PROM_RULES,
    SLOW_RANK,
    STAGE,
    StragglerFeed,
    free_ports,
    http_get,
    load_yaml,
    process,
    require_binary,
    run_collector,
    tail,
    wait_until,
)

pytestmark = pytest.mark.slow

TEST_FOR = "2s"


class _Webhook:
    """Alertmanager webhook receiver on 127.0.0.1: keeps every notification."""

    def __init__(self) -> None:
        self.notifications: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with outer._lock:
                    outer.notifications.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alert"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _Webhook:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def alerts(self, status: str) -> list[dict[str, Any]]:
        with self._lock:
            return [a for n in self.notifications for a in n["alerts"]
                    if a["status"] == status and a["labels"].get("alertname") == "StragglerDetected"]


def _rules_copy(dst: Path) -> None:
    doc = load_yaml(PROM_RULES)
    rule = next(r for g in doc["groups"] for r in g["rules"] if r.get("alert") == "StragglerDetected")
    assert rule["for"] == "1m"
    rule["for"] = TEST_FOR
    dst.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")


def _am_alerts(port: int) -> list[dict[str, Any]]:
    code, body = http_get(f"http://127.0.0.1:{port}/api/v2/alerts?active=true&silenced=false&inhibited=false")
    if code != 200:
        raise ValueError(f"alertmanager answered {code}")
    return [a for a in json.loads(body) if a["labels"].get("alertname") == "StragglerDetected"]


def test_straggler_alert_fires_with_the_slow_rank_and_resolves(tmp_path: Path) -> None:
    prometheus = require_binary("prometheus")
    alertmanager = require_binary("prometheus-alertmanager")
    started = time.monotonic()
    prom_port, am_port = free_ports(2)

    with _Webhook() as hook, run_collector(tmp_path) as col:
        am_dir = tmp_path / "alertmanager"
        am_dir.mkdir()
        (am_dir / "alertmanager.yml").write_text(yaml.safe_dump({
            "route": {"receiver": "test", "group_by": ["alertname", "job", "cohort"], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "test", "webhook_configs": [{"url": hook.url, "send_resolved": True}]}],
        }), encoding="utf-8")
        prom_dir = tmp_path / "prometheus"
        prom_dir.mkdir()
        _rules_copy(prom_dir / "straggler.rules.yml")
        (prom_dir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["straggler.rules.yml"],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": "otel-straggler-collector", "honor_labels": True,
                                "static_configs": [{"targets": [f"127.0.0.1:{col.metrics}"]}]}],
        }), encoding="utf-8")

        am_argv = [alertmanager, f"--config.file={am_dir / 'alertmanager.yml'}", f"--storage.path={am_dir}",
                   f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="]
        prom_argv = [prometheus, f"--config.file={prom_dir / 'prometheus.yml'}",
                     f"--storage.tsdb.path={prom_dir / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                     "--rules.alert.resend-delay=1s", "--log.level=warn"]
        with process(am_argv, tmp_path / "am.log") as am, process(prom_argv, tmp_path / "prom.log") as prom:
            logs = "\n--- alertmanager:\n{}\n--- prometheus:\n{}\n--- collector:\n{}"

            def diag() -> str:
                return logs.format(tail(tmp_path / "am.log"), tail(tmp_path / "prom.log"), tail(col.log))

            try:
                wait_until(lambda: http_get(f"http://127.0.0.1:{am_port}/-/ready")[0] == 200, 20,
                           what="alertmanager ready")
                wait_until(lambda: http_get(f"http://127.0.0.1:{prom_port}/-/ready")[0] == 200, 20,
                           what="prometheus ready")
                assert am.poll() is None and prom.poll() is None

                feed = StragglerFeed(col.otlp_grpc)
                try:
                    for step in range(8):
                        feed.step(step, slow_factor=1.2)
                    firing = wait_until(lambda: _am_alerts(am_port), 40, what="StragglerDetected in Alertmanager")
                    (alert,) = firing
                    labels = alert["labels"]
                    assert labels["rank"] == str(SLOW_RANK) and labels["job"] == JOB_ID
                    assert labels["stage"] == STAGE and labels["severity"] == "warning"
                    assert labels["cohort"] == feed.cohort and labels["host"] and labels["gpu"]
                    assert labels["attribution"] in ("gpu_stream_stall", "host_only_stall", "attribution_unknown")
                    assert alert["annotations"]["runbook_url"].startswith("docs/runbook.md#")
                    assert "Deviation" in alert["annotations"]["description"]
                    wait_until(lambda: hook.alerts("firing"), 15, what="firing webhook")
                    assert {a["labels"]["rank"] for a in hook.alerts("firing")} == {str(SLOW_RANK)}

                    for step in range(8, 20):  # back to par: a recovered verdict clears the gauge
                        feed.step(step, slow_factor=1.0)
                    resolved = wait_until(lambda: hook.alerts("resolved"), 40, what="resolved webhook")
                    assert {a["labels"]["rank"] for a in resolved} == {str(SLOW_RANK)}
                    wait_until(lambda: not _am_alerts(am_port), 15, what="alert gone from Alertmanager")
                finally:
                    feed.shutdown()
            except AssertionError as e:
                raise AssertionError(f"{e}{diag()}") from e
    assert time.monotonic() - started < 90

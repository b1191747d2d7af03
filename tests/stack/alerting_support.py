"""Real Prometheus + Alertmanager around a straggler collector, for the alerting end-to-end tests.

``alert_stack`` starts Alertmanager (the shipped route's grouping, a webhook to an in-test receiver) and Prometheus
(the default scrape config, i.e. ``honor_labels: false``; exemplar storage on; 1 s scrape and evaluation; the
shipped rules with every ``for`` -> ``2s`` in a test copy) on free loopback ports.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml
from stack_support import (
    CONFIGS,
    PROM_RULES,
    free_ports,
    http_get,
    load_yaml,
    process,
    require_binary,
    tail,
    wait_until,
)

TEST_FOR = "2s"


class Webhook:
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

    def __enter__(self) -> Webhook:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def alerts(self, status: str, alertname: str = "StragglerDetected") -> list[dict[str, Any]]:
        with self._lock:
            return [a for n in self.notifications for a in n["alerts"]
                    if a["status"] == status and a["labels"].get("alertname") == alertname]


def rules_copy(dst: Path) -> None:
    """The shipped rules with every alert's ``for`` shortened to ``TEST_FOR`` (nothing else changed)."""
    doc = load_yaml(PROM_RULES)
    rule = next(r for g in doc["groups"] for r in g["rules"] if r.get("alert") == "StragglerDetected")
    assert rule["for"] == "1m"
    for g in doc["groups"]:
        for r in g["rules"]:
            if "for" in r:
                r["for"] = TEST_FOR
    dst.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")


def am_alerts(port: int) -> list[dict[str, Any]]:
    code, body = http_get(f"http://127.0.0.1:{port}/api/v2/alerts?active=true&silenced=false&inhibited=false")
    if code != 200:
        raise ValueError(f"alertmanager answered {code}")
    return [a for a in json.loads(body) if a["labels"].get("alertname") == "StragglerDetected"]


@dataclass
class AlertStack:
    hook: Webhook
    am_port: int
    prom_port: int
    diag: Callable[[], str]

    def active(self) -> list[dict[str, Any]]:
        return am_alerts(self.am_port)

    def query(self, expr: str) -> list[dict[str, str]]:
        """Label sets of an instant query's result in the real Prometheus."""
        return [r["metric"] for r in self.api("query", query=expr)["result"]]

    def api(self, path: str, **params: str) -> Any:
        """``data`` of a Prometheus HTTP API answer (``/api/v1/<path>``)."""
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/{path}?" + urllib.parse.urlencode(params)
        code, body = http_get(url)
        if code != 200:
            raise ValueError(f"prometheus answered {code}: {body[:300]!r}")
        return json.loads(body)["data"]

    def exemplars(self, expr: str, lookback_s: float = 600.0) -> list[dict[str, Any]]:
        """Exemplars Prometheus stored for the series of ``expr`` (``/api/v1/query_exemplars``)."""
        now = time.time()
        return self.api("query_exemplars", query=expr, start=f"{now - lookback_s:.3f}", end=f"{now + 60:.3f}")


@contextmanager
def alert_stack(tmp_path: Path, metrics_port: int | list[int], collector_log: Path,
                extra_jobs: dict[str, list[str]] | None = None) -> Iterator[AlertStack]:
    """Prometheus scraping the collector(s) on ``metrics_port`` (one port or several: the shipped job's targets)
    and ``extra_jobs`` (job name -> targets), with the shipped rules; Alertmanager with the shipped route."""
    prometheus = require_binary("prometheus")
    alertmanager = require_binary("prometheus-alertmanager")
    ports = metrics_port if isinstance(metrics_port, list) else [metrics_port]
    prom_port, am_port = free_ports(2)
    with Webhook() as hook:
        am_dir = tmp_path / "alertmanager"
        am_dir.mkdir()
        am_cfg = load_yaml(CONFIGS / "alertmanager" / "alertmanager.yml")  # the shipped route, faster
        am_cfg["route"].update({"group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"})
        for receiver in am_cfg["receivers"]:
            for hook_cfg in receiver["webhook_configs"]:
                hook_cfg["url"] = hook.url
        (am_dir / "alertmanager.yml").write_text(yaml.safe_dump(am_cfg), encoding="utf-8")
        prom_dir = tmp_path / "prometheus"
        prom_dir.mkdir()
        rules_copy(prom_dir / "straggler.rules.yml")
        (prom_dir / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["straggler.rules.yml"],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            # the shipped scrape job's name and defaults (honor_labels: false), on the test's collector
            "scrape_configs": [{"job_name": "otel-straggler-collector",
                                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}]
            + [{"job_name": job, "static_configs": [{"targets": targets}]}
               for job, targets in (extra_jobs or {}).items()],
        }), encoding="utf-8")
        am_argv = [alertmanager, f"--config.file={am_dir / 'alertmanager.yml'}", f"--storage.path={am_dir}",
                   f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="]
        prom_argv = [prometheus, f"--config.file={prom_dir / 'prometheus.yml'}",
                     f"--storage.tsdb.path={prom_dir / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                     "--rules.alert.resend-delay=1s", "--log.level=warn", "--enable-feature=exemplar-storage"]
        with process(am_argv, tmp_path / "am.log") as am, process(prom_argv, tmp_path / "prom.log") as prom:
            logs = "\n--- alertmanager:\n{}\n--- prometheus:\n{}\n--- collector:\n{}"

            def diag() -> str:
                return logs.format(tail(tmp_path / "am.log"), tail(tmp_path / "prom.log"), tail(collector_log))

            wait_until(lambda: http_get(f"http://127.0.0.1:{am_port}/-/ready")[0] == 200, 120,
                       what="alertmanager ready")
            wait_until(lambda: http_get(f"http://127.0.0.1:{prom_port}/-/ready")[0] == 200, 120,
                       what="prometheus ready")
            assert am.poll() is None and prom.poll() is None
            yield AlertStack(hook, am_port, prom_port, diag)

"""Prometheus and Alertmanager configs checked by the real tools: ``promtool check config|rules``, ``promtool test
rules`` (the alert fires with the right labels for a synthetic straggler series and not when the gauge is 0), and
``amtool check-config``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml
from stack_support import CONFIGS, PROM_RULES, load_yaml, require_binary

PROM_YML = CONFIGS / "prometheus" / "prometheus.yml"
RULES_TEST = CONFIGS / "prometheus" / "rules" / "straggler.rules.test.yml"
ALERTMANAGER_YML = CONFIGS / "alertmanager" / "alertmanager.yml"


def _run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_promtool_check_config_including_rule_files() -> None:
    promtool = require_binary("promtool")
    r = _run([promtool, "check", "config", str(PROM_YML)])
    assert r.returncode == 0, r.stdout + r.stderr
    n = sum(len(g["rules"]) for g in load_yaml(PROM_RULES)["groups"])
    assert f"SUCCESS: {n} rules found" in r.stdout + r.stderr, "the rule file was not checked with the config"


def test_promtool_check_rules() -> None:
    promtool = require_binary("promtool")
    r = _run([promtool, "check", "rules", str(PROM_RULES)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_rule_unit_tests_pass() -> None:
    promtool = require_binary("promtool")
    r = _run([promtool, "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_rule_unit_tests_fail_when_the_expected_rank_is_wrong(tmp_path: Path) -> None:
    """The unit test really checks labels: expecting rank 4 instead of 3 fails."""
    promtool = require_binary("promtool")
    shutil.copy(PROM_RULES, tmp_path / PROM_RULES.name)
    text = RULES_TEST.read_text(encoding="utf-8")
    assert 'rank: "3"' in text
    (tmp_path / RULES_TEST.name).write_text(text.replace('rank: "3"', 'rank: "4"'), encoding="utf-8")
    r = _run([promtool, "test", "rules", RULES_TEST.name], cwd=tmp_path)
    assert r.returncode != 0 and 'rank="4"' in r.stdout + r.stderr


def test_rule_unit_tests_cover_firing_and_silence() -> None:
    tests = load_yaml(RULES_TEST)["tests"]
    cases = [c for t in tests for c in t["alert_rule_test"] if c["alertname"] == "StragglerDetected"]
    assert any(c["exp_alerts"] for c in cases) and sum(1 for c in cases if not c["exp_alerts"]) >= 2
    zero_series = [sr for t in tests for sr in t["input_series"] if sr["values"].startswith("0x")]
    assert zero_series, "a series that stays 0 must be part of the test"


def test_every_alert_has_a_firing_and_a_silent_promtool_case() -> None:
    """Each shipped alert (the straggler, and the watcher's: collector down or dropping, job stopped sending,
    emitters dropping) is unit-tested by promtool: an evaluation where it fires with its labels and annotations,
    and one where it does not."""
    alerts = {r["alert"] for g in load_yaml(PROM_RULES)["groups"] for r in g["rules"] if "alert" in r}
    assert {"StragglerDetected", "StragglerCollectorDropping", "StragglerCollectorDown",
            "StragglerJobStoppedSending", "StragglerEmitterDropping"} <= alerts
    cases = [c for t in load_yaml(RULES_TEST)["tests"] for c in t["alert_rule_test"]]
    for name in alerts:
        mine = [c for c in cases if c["alertname"] == name]
        firing = [a for c in mine for a in c["exp_alerts"]]
        assert firing and any(not c["exp_alerts"] for c in mine), name
        assert all(a["exp_annotations"].get("runbook_url") and a["exp_labels"].get("severity") for a in firing), name


def test_rule_unit_tests_fail_when_a_watcher_rule_is_silenced(tmp_path: Path) -> None:
    """The watcher's cases really evaluate the rules: with StragglerCollectorDown's threshold moved out of reach,
    ``promtool test rules`` fails."""
    promtool = require_binary("promtool")
    text = PROM_RULES.read_text(encoding="utf-8")
    down = '(1 - up{job=~"(otel-)?straggler-collector(-shards)?"} > 0)'
    assert down in text
    (tmp_path / PROM_RULES.name).write_text(text.replace(down, down.replace("> 0", "> 1")))
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    r = _run([promtool, "test", "rules", RULES_TEST.name], cwd=tmp_path)
    assert r.returncode != 0 and "StragglerCollectorDown" in r.stdout + r.stderr


def test_amtool_check_config() -> None:
    amtool = require_binary("amtool")
    r = _run([amtool, "check-config", str(ALERTMANAGER_YML)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_amtool_check_config_of_the_silent_alertmanager() -> None:
    """The Alertmanager config mounted when Grafana-managed alerting notifies instead."""
    amtool = require_binary("amtool")
    r = _run([amtool, "check-config", str(CONFIGS / "alertmanager" / "alertmanager-silent.yml")])
    assert r.returncode == 0, r.stdout + r.stderr


def test_amtool_rejects_a_route_to_an_unknown_receiver(tmp_path: Path) -> None:
    amtool = require_binary("amtool")
    cfg = load_yaml(ALERTMANAGER_YML)
    cfg["route"]["receiver"] = "nobody"
    bad = tmp_path / "am.yml"
    bad.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    assert _run([amtool, "check-config", str(bad)]).returncode != 0


def test_alertmanager_route_and_receiver() -> None:
    cfg = load_yaml(ALERTMANAGER_YML)
    assert cfg["route"]["group_by"] == ["alertname", "training_job", "host"]
    receivers = {r["name"]: r for r in cfg["receivers"]}
    hooks = receivers[cfg["route"]["receiver"]]["webhook_configs"]
    assert hooks and hooks[0]["url"].startswith("http") and hooks[0]["send_resolved"] is True


def test_prometheus_alerts_to_alertmanager_and_loads_the_rules() -> None:
    cfg = load_yaml(PROM_YML)
    targets = cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert targets == ["alertmanager:9093"]
    assert [(PROM_YML.parent / f).resolve() for f in cfg["rule_files"]] == [PROM_RULES.resolve()]

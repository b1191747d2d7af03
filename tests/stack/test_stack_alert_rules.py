"""Grafana-managed alert rules match the Prometheus ones (names, expressions, ``for``, labels, annotations), point
at the runbook, and are provisioned in Grafana's file format with an environment-driven webhook contact point."""

from __future__ import annotations

import re

import pytest
from stack_support import GRAFANA_ALERTS, GRAFANA_PROVISIONING, PROM_RULES, REPO, load_yaml

STRAGGLER_LABELS = ["training_job", "run", "cohort", "rank", "host", "gpu", "stage", "attribution", "first_step",
                    "trace_id"]
ALERTS = {"StragglerDetected", "StragglerCollectorDropping", "StragglerCollectorDown", "StragglerJobStoppedSending",
          "StragglerEmitterDropping"}
LINKS = ("tempo_url", "jaeger_url", "dashboard_url")


def _prom_rules() -> dict[str, dict]:
    return {r["alert"]: r for g in load_yaml(PROM_RULES)["groups"] for r in g["rules"] if "alert" in r}


def _grafana_rules() -> dict[str, dict]:
    return {r["title"]: r for g in load_yaml(GRAFANA_ALERTS)["groups"] for r in g["rules"]}


def _condition_query(rule: dict) -> str:
    """The Prometheus expression the Grafana rule's condition thresholds."""
    data = {d["refId"]: d for d in rule["data"]}
    cond = data[rule["condition"]]
    assert cond["datasourceUid"] == "__expr__" and cond["model"]["type"] == "threshold"
    src = data[cond["model"]["expression"]]
    assert src["model"]["instant"] is True
    return src["model"]["expr"]


def _norm(expr: str) -> str:
    return re.sub(r"\s+", " ", expr).strip()


def test_the_alerts_exist_in_both_systems() -> None:
    assert set(_prom_rules()) == set(_grafana_rules()) == ALERTS


def test_straggler_detected_expression_and_labels() -> None:
    rule = _prom_rules()["StragglerDetected"]
    assert _norm(rule["expr"]) == (f'max by ({", ".join(STRAGGLER_LABELS)}) '
                                   '(otel_straggler_active{covered_by=""}) > 0 '
                                   'unless on (training_job, run) (min by (training_job, run) '
                                   '(otel_straggler_emitter_ended) == 1)')
    assert "job" not in STRAGGLER_LABELS and "instance" not in STRAGGLER_LABELS  # the scrape's, not the job's
    assert rule["for"] == "1m"
    assert rule["labels"]["severity"]


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_grafana_rule_equals_prometheus_rule(name: str) -> None:
    prom, graf = _prom_rules()[name], _grafana_rules()[name]
    assert _norm(_condition_query(graf)) == _norm(prom["expr"])
    assert graf["for"] == prom["for"]
    assert graf["labels"] == prom["labels"]
    assert set(graf["annotations"]) == set(prom["annotations"]) >= {"summary", "description", "runbook_url"}
    assert graf["annotations"]["summary"] == prom["annotations"]["summary"]
    assert graf["annotations"]["runbook_url"] == prom["annotations"]["runbook_url"]
    cond = {d["refId"]: d for d in graf["data"]}[graf["condition"]]
    assert cond["model"]["conditions"][0]["evaluator"] == {"type": "gt", "params": [0]}
    assert graf["noDataState"] == "OK", "no series means no straggler, not an alert"


def test_straggler_description_carries_deviation_and_cost_in_both() -> None:
    prom = _prom_rules()["StragglerDetected"]["annotations"]["description"]
    graf_rule = _grafana_rules()["StragglerDetected"]
    graf = graf_rule["annotations"]["description"]
    assert "otel_straggler_deviation_ratio" in prom and "otel_straggler_gpu_lost_ratio" in prom
    queries = {d["refId"]: d["model"].get("expr", "") for d in graf_rule["data"]}
    for metric in ("otel_straggler_deviation_ratio", "otel_straggler_gpu_lost_ratio"):
        ref = next(r for r, q in queries.items() if metric in q)
        assert f"$values.{ref}" in graf, f"Grafana description does not use the {metric} query {ref}"
        assert _norm(queries[ref]) == f"max by ({', '.join(STRAGGLER_LABELS)}) ({metric})", \
            "the value query must carry the alert's label set to match its instances"
    for text in (prom, graf):
        assert "Deviation" in text and "GPUs' worth of time" in text


def test_straggler_alert_links_to_the_trace_in_both() -> None:
    """Both alert definitions link to the convicting step's trace by its id (Tempo and Jaeger) and to the overview
    dashboard filtered to the job, cohort and rank; Prometheus builds them from the base URLs of its recording
    rule, Grafana from its own URL."""
    prom = _prom_rules()["StragglerDetected"]["annotations"]
    graf = _grafana_rules()["StragglerDetected"]["annotations"]
    for ann in (prom, graf):
        assert ann["trace_id"] == "{{ $labels.trace_id }}"
        for key in LINKS:
            assert key in ann, key
        assert "{{ $labels.trace_id }}" in ann["tempo_url"] and "tempo" in ann["tempo_url"]
        assert "{{ $labels.trace_id }}" in ann["jaeger_url"]
        assert "var-job={{ $labels.training_job | urlquery }}" in ann["dashboard_url"]
        assert "var-rank={{ $labels.rank }}" in ann["dashboard_url"]
        assert "/d/otel-straggler-overview/" in ann["dashboard_url"]
    base = next(r for g in load_yaml(PROM_RULES)["groups"] for r in g["rules"]
                if r.get("record") == "otel_straggler:link_base_urls:info")
    assert set(base["labels"]) == {"grafana_url", "jaeger_url", "tempo_datasource"}
    for key in LINKS:
        assert 'query "otel_straggler:link_base_urls:info"' in prom[key], key
    assert all(graf[key].startswith("{{ externalURL }}") for key in LINKS)


def test_runbook_urls_point_at_existing_runbook_sections() -> None:
    runbook = (REPO / "docs" / "runbook.md").read_text(encoding="utf-8")
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+\s+(.*)$", runbook, re.M)}
    import tomllib

    home = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]["Source"]
    for rule in _prom_rules().values():
        url, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        # absolute: a notification (mail, chat, pager) opens it outside the repository
        assert url == f"{home}/blob/main/docs/runbook.md" and anchor in anchors, (rule["alert"], url, anchor)


def test_grafana_alerting_provisioning_format() -> None:
    doc = load_yaml(GRAFANA_ALERTS)
    assert doc["apiVersion"] == 1
    datasource_uids = {d["uid"] for f in (GRAFANA_PROVISIONING / "datasources").glob("*.yaml")
                       for d in load_yaml(f)["datasources"]}
    for group in doc["groups"]:
        assert group["orgId"] == 1 and group["folder"] and re.fullmatch(r"\d+[sm]", group["interval"])
        for rule in group["rules"]:
            assert {"uid", "title", "condition", "data", "for", "labels", "annotations"} <= set(rule)
            assert rule["condition"] in {d["refId"] for d in rule["data"]}
            for d in rule["data"]:
                assert d["datasourceUid"] == "__expr__" or d["datasourceUid"] in datasource_uids
                assert d["model"]["refId"] == d["refId"]
            # Grafana expands $VAR in labels (not in annotations or queries): a `$` there would be eaten.
            assert not any("$" in str(v) for v in rule["labels"].values())
    contact = doc["contactPoints"][0]
    receiver = contact["receivers"][0]
    assert receiver["type"] == "webhook" and receiver["settings"]["url"] == "${ALERT_WEBHOOK_URL}"
    policy = doc["policies"][0]
    assert policy["receiver"] == contact["name"]
    assert policy["group_by"] == ["alertname", "training_job", "host"]


def test_deployment_guide_walks_from_the_alert_to_the_trace_in_five_steps() -> None:
    """docs/deployment.md: "From the alert to the trace" is at most five numbered steps, and every label and link
    annotation it names is one the StragglerDetected alert carries."""
    text = (REPO / "docs" / "deployment.md").read_text(encoding="utf-8")
    section = text.split("### From the alert to the trace", 1)[1].split("\n#", 1)[0]
    steps = re.findall(r"^(\d+)\. ", section, re.M)
    assert 1 <= len(steps) <= 5 and steps == [str(i) for i in range(1, len(steps) + 1)], steps
    rule = _prom_rules()["StragglerDetected"]
    carried = set(STRAGGLER_LABELS) | set(rule["annotations"])
    named = set(re.findall(r"`([a-z_]+)`", section.split("The links are built", 1)[0]))
    for key in ("training_job", "first_step", "trace_id", "jaeger_url", "tempo_url", "dashboard_url"):
        assert key in named, key
    assert {k for k in named if k.endswith("_url") or k in STRAGGLER_LABELS} <= carried

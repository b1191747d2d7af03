"""Grafana provisioning: datasource and dashboard provider YAML have Grafana's keys; the dashboards load, have fixed
uids, the job/cohort/rank variables, and every panel and query names a datasource uid that is provisioned."""

from __future__ import annotations

from pathlib import Path

import pytest
from stack_support import GRAFANA_PROVISIONING, dashboard_files, dashboard_panels, load_dashboard, load_yaml

EXPECTED_DASHBOARDS = {
    "otel-straggler-overview": "Straggler overview",
    "otel-straggler-rank-stages": "Rank stage breakdown",
    "otel-straggler-collector": "Collector health",
}


def _datasources() -> list[dict]:
    out = []
    for f in sorted((GRAFANA_PROVISIONING / "datasources").glob("*.yaml")):
        doc = load_yaml(f)
        assert doc["apiVersion"] == 1, f
        out.extend(doc["datasources"])
    return out


def test_datasource_provisioning() -> None:
    ds = {d["uid"]: d for d in _datasources()}
    assert {"prometheus", "tempo", "jaeger"} <= set(ds)
    for d in ds.values():
        assert {"name", "uid", "type", "url", "access"} <= set(d), d
        assert d["access"] == "proxy"
    assert ds["prometheus"]["type"] == "prometheus" and ds["prometheus"]["url"] == "http://prometheus:9090"
    assert ds["tempo"]["type"] == "tempo" and ds["tempo"]["url"] == "http://tempo:3200"
    assert ds["jaeger"]["type"] == "jaeger" and ds["jaeger"]["url"] == "http://jaeger:16686"
    assert ds["tempo"]["jsonData"]["serviceMap"]["datasourceUid"] in ds
    assert sum(1 for d in ds.values() if d.get("isDefault")) == 1


def test_dashboard_provider() -> None:
    doc = load_yaml(GRAFANA_PROVISIONING / "dashboards" / "dashboards.yaml")
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file" and provider["orgId"] == 1 and provider["options"]["path"].startswith("/")


def test_dashboards_load_with_fixed_uids() -> None:
    found = {(d := load_dashboard(p))["uid"]: d["title"] for p in dashboard_files()}
    assert found == EXPECTED_DASHBOARDS


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_every_panel_and_query_uses_a_provisioned_datasource(path: Path) -> None:
    uids = {d["uid"]: d["type"] for d in _datasources()}
    panels = [p for p in dashboard_panels(path) if p["type"] != "row"]
    assert panels
    for p in panels:
        ds = p.get("datasource")
        assert isinstance(ds, dict) and uids.get(ds.get("uid")) == ds.get("type"), (p["title"], ds)
        assert p["targets"], p["title"]
        for t in p["targets"]:
            tds = t.get("datasource", ds)
            assert uids.get(tds["uid"]) == tds["type"], (p["title"], t["refId"])
    for v in load_dashboard(path)["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"]["uid"] in uids, v["name"]


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    dash = load_dashboard(path)
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names[:3] == ["job", "cohort", "rank"]
    panels = dashboard_panels(path)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p.get("targets", []):
            assert t["expr"].count("(") == t["expr"].count(")"), (p["title"], t["expr"])


def _by_type(uid: str, ptype: str) -> list[dict]:
    path = next(p for p in dashboard_files() if load_dashboard(p)["uid"] == uid)
    return [p for p in dashboard_panels(path) if p["type"] == ptype]


def test_overview_heatmap_table_and_verdict_timeline() -> None:
    (heat,) = _by_type("otel-straggler-overview", "heatmap")
    assert "otel_straggler_rank_deviation_ratio" in heat["targets"][0]["expr"]
    assert "by (rank)" in heat["targets"][0]["expr"]
    (table,) = _by_type("otel-straggler-overview", "table")
    exprs = [t["expr"] for t in table["targets"]]
    assert "otel_straggler_active" in exprs[0] and "== 1" in exprs[0]
    for metric in ("otel_straggler_deviation_ratio", "otel_straggler_step_time_lost_seconds",
                   "otel_straggler_gpu_seconds_lost_per_hour"):
        assert any(metric in e and "otel_straggler_active" in e for e in exprs), metric
    assert all(t["instant"] and t["format"] == "table" for t in table["targets"])
    # one row per straggler: every query is aggregated to the straggler's labels before the merge joins them
    labels = "max by (job, cohort, rank, host, gpu, stage, attribution) ("
    assert all(t["expr"].startswith(labels) for t in table["targets"]), [t["expr"] for t in table["targets"]]
    assert table["transformations"][0]["id"] == "merge"
    rank_links = [link for o in table["fieldConfig"]["overrides"] if o["matcher"]["options"] == "rank"
                  for prop in o["properties"] for link in prop["value"]]
    assert any("tempo" in link["url"] and "dl.rank" in link["url"] and "straggler.cohort.key" in link["url"]
               for link in rank_links)
    assert any("jaeger_url" in link["url"] and "dl.rank" in link["url"] for link in rank_links)
    timeline = next(p for p in _by_type("otel-straggler-overview", "timeseries")
                    if "otel_straggler_verdicts_total" in p["targets"][0]["expr"])
    assert "by (job, verdict, reason)" in timeline["targets"][0]["expr"]
    assert "increase(" in timeline["targets"][0]["expr"]
    links = timeline["fieldConfig"]["defaults"]["links"]
    assert {("tempo" in link["url"]) for link in links} == {True, False}, "one Tempo link and one Jaeger link"
    (state,) = _by_type("otel-straggler-overview", "state-timeline")
    assert "by (job, cohort, rank) (otel_straggler_active" in state["targets"][0]["expr"]
    state_links = state["fieldConfig"]["defaults"]["links"]
    assert any("resource.dl.rank" in link["url"] and "${__field.labels.rank}" in link["url"]
               and "resource.straggler.cohort.key" in link["url"] for link in state_links)


def test_rank_stage_breakdown_splits_device_and_host() -> None:
    exprs = [t["expr"] for p in _by_type("otel-straggler-rank-stages", "timeseries") for t in p["targets"]]
    assert any('measurement="device"' in e and "by (rank, stage_group)" in e for e in exprs)
    assert any('measurement="host_only"' in e and "by (rank, stage_group)" in e for e in exprs)
    assert all('rank=~"$rank"' in e for e in exprs if "otel_straggler_rank_stage_seconds{" in e.split("-")[0])


def test_collector_health_covers_the_collector_self_metrics() -> None:
    path = next(p for p in dashboard_files() if load_dashboard(p)["uid"] == "otel-straggler-collector")
    text = " ".join(t["expr"] for p in dashboard_panels(path) for t in p.get("targets", []))
    for metric in ("spans_received_total", "spans_accepted_total", "spans_rejected_total", "spans_dropped_total",
                   "queue_depth", "processing_seconds_bucket", "memory_bytes", "evictions_total",
                   "export_failures_total"):
        assert f"otel_straggler_collector_{metric}" in text, metric
    assert "histogram_quantile(0.99" in text
    assert text.count("otel_straggler_emitter_") >= 5

"""Grafana provisioning: datasource and dashboard provider YAML have Grafana's keys; the dashboards load, have fixed
uids, the job/cohort/rank variables, and every panel and query names a datasource uid that is provisioned."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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
                   "otel_straggler_gpu_lost_ratio"):
        assert any(metric in e and "otel_straggler_active" in e for e in exprs), metric
    assert all(t["instant"] and t["format"] == "table" for t in table["targets"])
    # one row per straggler: every query is aggregated to the straggler's labels before the merge joins them
    labels = "max by (training_job, cohort, rank, host, gpu, stage, attribution, first_step, trace_id) ("
    assert all(t["expr"].startswith(labels) for t in table["targets"]), [t["expr"] for t in table["targets"]]
    assert table["transformations"][0]["id"] == "merge"
    timeline = next(p for p in _by_type("otel-straggler-overview", "timeseries")
                    if "otel_straggler_verdicts_total" in p["targets"][0]["expr"])
    assert "by (training_job, verdict, reason)" in timeline["targets"][0]["expr"]
    assert "increase(" in timeline["targets"][0]["expr"]
    (state,) = _by_type("otel-straggler-overview", "state-timeline")
    assert "by (training_job, cohort, rank, first_step, trace_id) (otel_straggler_active" in state["targets"][0]["expr"]


def _links(panel: dict, field: str | None = None) -> list[dict]:
    """Data links of a panel's fields (``field`` None) or of one field (an override by name)."""
    if field is None:
        return panel["fieldConfig"]["defaults"].get("links", [])
    return [link for o in panel["fieldConfig"]["overrides"] if o["matcher"]["options"] == field
            for prop in o["properties"] if prop["id"] == "links" for link in prop["value"]]


def _explore_query(url: str) -> tuple[str, str]:
    """(datasource uid, query) of a Grafana Explore link."""
    import json
    import urllib.parse

    pane = json.loads(urllib.parse.unquote(urllib.parse.parse_qs(urllib.parse.urlsplit(url).query,
                                                                 keep_blank_values=True)["panes"][0]))["a"]
    (q,) = pane["queries"]
    assert q["datasource"]["uid"] == pane["datasource"]
    return pane["datasource"], q["query"]


def test_verdict_rows_link_to_the_convicting_steps_trace_in_tempo_and_jaeger() -> None:
    """A verdict row (the *Active stragglers* table's trace_id cell, a lane of the state timeline) links to the trace
    of the step where the rank was first convicted, by trace id: Grafana Explore on the Tempo datasource and the
    Jaeger UI; the rank cell to the rank's traces filtered to its job and rank."""
    (table,) = _by_type("otel-straggler-overview", "table")
    (state,) = _by_type("otel-straggler-overview", "state-timeline")
    for links, ref in ((_links(table, "trace_id"), "${__data.fields.trace_id}"),
                       (_links(state), "${__field.labels.trace_id}")):
        tempo = [link for link in links if link["url"].startswith("/explore") and ref in link["url"]]
        assert [_explore_query(link["url"]) for link in tempo] == [("tempo", ref)]
        assert any(link["url"] == "${jaeger_url}/trace/" + ref for link in links), links
    rank_links = _links(table, "rank")
    assert any(_explore_query(link["url"]) == (
        "tempo", '{ resource.straggler.job.id = "${__data.fields.training_job}" && '
                 'resource.dl.rank = ${__data.fields.rank} }') for link in rank_links if "/explore" in link["url"])


@pytest.mark.parametrize("uid", ["otel-straggler-overview", "otel-straggler-rank-stages"])
def test_per_rank_panels_link_to_the_ranks_traces_filtered_by_job_and_rank(uid: str) -> None:
    """Every panel with one series per rank links to that rank's traces in Tempo (TraceQL on the job and the rank,
    no service named)."""
    path = next(p for p in dashboard_files() if load_dashboard(p)["uid"] == uid)
    per_rank = [p for p in dashboard_panels(path) if p["type"] in ("timeseries", "state-timeline")
                and any("rank" in t.get("legendFormat", "") for t in p["targets"])]
    assert per_rank
    for p in per_rank:
        links = _links(p)
        tempo = [_explore_query(link["url"])[1] for link in links if link["url"].startswith("/explore")]
        assert any("resource.straggler.job.id" in q and "resource.dl.rank = ${__field.labels.rank}" in q
                   for q in tempo), (p["title"], tempo)


def _all_link_urls(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [str(node["url"])] if "url" in node and "title" in node else []
        return own + [u for v in node.values() for u in _all_link_urls(v)]
    if isinstance(node, list):
        return [u for v in node for u in _all_link_urls(v)]
    return []


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.stem)
def test_jaeger_links_go_by_trace_id_and_name_no_service(path: Path) -> None:
    """A Jaeger search needs a service, which a dashboard cannot know (each job sets its own
    ``OTEL_SERVICE_NAME``): every Jaeger link opens a trace by its id, and no dashboard has a ``service``
    variable."""
    dash = load_dashboard(path)
    jaeger = [u for u in _all_link_urls(dash) if u.startswith("${jaeger_url}")]
    assert all(re.fullmatch(r"\$\{jaeger_url\}/trace/\$\{__(data\.fields|field\.labels)\.trace_id\}", u)
               for u in jaeger), jaeger
    assert "service=" not in path.read_text(encoding="utf-8")
    assert not any(v["name"] == "service" for v in dash["templating"]["list"])


def test_prometheus_datasource_links_exemplars_to_tempo_and_jaeger() -> None:
    prom = next(d for d in _datasources() if d["uid"] == "prometheus")
    dests = {(d["name"], d["datasourceUid"]) for d in prom["jsonData"]["exemplarTraceIdDestinations"]}
    assert dests == {("trace_id", "tempo"), ("trace_id", "jaeger")}
    exemplar_panels = [p for path in dashboard_files() for p in dashboard_panels(path)
                       if any(t.get("exemplar") for t in p.get("targets", []))]
    exprs = " ".join(t["expr"] for p in exemplar_panels for t in p["targets"])
    assert "otel_straggler_verdicts_total" in exprs and "otel_straggler_gpu_lost_seconds_total" in exprs


def test_rank_stage_breakdown_splits_device_and_host() -> None:
    exprs = [t["expr"] for p in _by_type("otel-straggler-rank-stages", "timeseries") for t in p["targets"]]
    assert any('measurement="device"' in e and "by (training_job, rank, stage_group)" in e for e in exprs)
    assert any('measurement="host_only"' in e and "by (training_job, rank, stage_group)" in e for e in exprs)
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


def _all_links(path: Path) -> list[str]:
    import re

    return re.findall(r'"url": "([^"]*)"', path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_explore_links_name_provisioned_datasources(path: Path) -> None:
    """Every Explore data link names a provisioned datasource by uid, with that datasource's type."""
    import json
    import urllib.parse

    uids = {d["uid"]: d["type"] for d in _datasources()}
    explore = [u for u in _all_links(path) if u.startswith("/explore")]
    for url in explore:
        pane = json.loads(urllib.parse.unquote(urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["panes"][0]))
        for q in pane["a"]["queries"]:
            assert uids.get(q["datasource"]["uid"]) == q["datasource"]["type"], url


def _sdk() -> Any:
    sdk = pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk (the dev extra) checks "
                                                                "dashboards against Grafana's schema models")
    from grafana_foundation_sdk.cog import plugins, runtime
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    plugins.register_default_plugins()
    return sdk, runtime, JSONEncoder, Dashboard


def _lost(a: Any, b: Any, path: str = "") -> list[str]:
    """What of ``a`` is not in ``b`` (keys, values, list lengths)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [x for k in a for x in ([f"{path}/{k}"] if k not in b else _lost(a[k], b[k], f"{path}/{k}"))]
    if isinstance(a, list) and isinstance(b, list):
        out = [f"{path}: {len(a)} items, {len(b)} after"] if len(a) != len(b) else []
        return out + [x for i, (u, v) in enumerate(zip(a, b)) for x in _lost(u, v, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]


def _round_trip(dash: dict) -> list[str]:
    import json

    _, _, encoder, model = _sdk()
    back = json.loads(json.dumps(model.from_json(dash), cls=encoder))
    # `definition` (what Grafana's editor shows for a query variable) is not in the schema: it must repeat the query
    for v in dash["templating"]["list"]:
        if "definition" in v:
            assert v["definition"] == v["query"]["query"], v["name"]
    return [x for x in _lost(dash, back) if not x.endswith("/definition")]


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_dashboard_conforms_to_grafanas_schema_models(path: Path) -> None:
    """Each dashboard loads into grafana-foundation-sdk's models of Grafana's dashboard schema (generated from its
    CUE kinds: the dashboard, every panel plugin's options and field config, the Prometheus query) and comes back
    whole: no key or value the schema does not know, every panel type and query type known."""
    _, runtime, _, _ = _sdk()
    dash = load_dashboard(path)
    assert _round_trip(dash) == []
    for p in dashboard_panels(path):
        if p["type"] != "row":
            assert runtime.panelcfg_config(p["type"]) is not None, p["type"]
            for t in p["targets"]:
                q = runtime.dataquery_from_json(t, t["datasource"]["type"])
                assert not isinstance(q, runtime.UnknownDataquery), (p["title"], t["refId"])


def test_schema_check_catches_a_misspelled_key() -> None:
    dash = load_dashboard(dashboard_files()[0])
    panel = next(p for p in dash["panels"] if p["type"] != "row")
    panel["fieldConfig"]["defaults"]["unitt"] = "s"
    panel["targets"][0]["exprr"] = "up"
    assert {x.rsplit("/", 1)[-1] for x in _round_trip(dash)} == {"unitt", "exprr"}

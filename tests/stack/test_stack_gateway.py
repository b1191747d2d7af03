"""OTel Collector gateway, Jaeger v2 and Tempo configs: they parse, every pipeline references defined components,
exporters point at compose services, and the sharded gateway routes by the resource attribute
``straggler.cohort.key`` over the sharded straggler collectors."""

from __future__ import annotations

from typing import Any

import pytest
from stack_support import CONFIGS, REPO, load_yaml

import otel_straggler_schema as s
from collector_processor.config.loader import substitute_env

GATEWAYS = ["otelcol-gateway.yaml", "otelcol-gateway-sharded.yaml"]
# Component types of otelcol-contrib used here; the old names are deprecated aliases since v0.144.
TRACE_EXPORTER_TYPES = {"otlp_grpc", "otlp_http", "load_balancing", "debug"}


def _collector_pipelines_are_wired(cfg: dict[str, Any], name: str) -> None:
    defined = {kind: set(cfg.get(kind) or {}) for kind in ("receivers", "processors", "exporters", "connectors")}
    used: set[str] = set()
    for pid, p in cfg["service"]["pipelines"].items():
        assert pid.split("/")[0] in {"traces", "metrics", "logs"}, (name, pid)
        assert p["receivers"] and p["exporters"], (name, pid)
        for kind in ("receivers", "processors", "exporters"):
            for cid in p.get(kind, []):
                ok = cid in defined[kind] or (kind != "processors" and cid in defined["connectors"])
                assert ok, f"{name}: pipeline {pid} uses {kind[:-1]} {cid!r}, which is not defined"
                used.add(cid)
    for ext in cfg["service"].get("extensions", []):
        assert ext in (cfg.get("extensions") or {}), f"{name}: extension {ext} is not defined"
    unused = {c for kind in ("receivers", "processors", "exporters") for c in defined[kind]} - used
    assert not unused, f"{name}: defined but unused: {unused}"


@pytest.mark.parametrize("name", GATEWAYS)
def test_gateway_pipelines_reference_defined_components(name: str) -> None:
    cfg = load_yaml(CONFIGS / name)
    _collector_pipelines_are_wired(cfg, name)
    for eid in cfg["exporters"]:
        assert eid.split("/")[0] in TRACE_EXPORTER_TYPES, f"{name}: exporter type of {eid}"
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == "0.0.0.0:4318"


@pytest.mark.parametrize("name", GATEWAYS)
def test_gateway_sends_spans_to_jaeger_tempo_and_the_straggler_collector(name: str) -> None:
    cfg = load_yaml(CONFIGS / name)
    compose = load_yaml(REPO / "docker-compose.yml")["services"]
    traces = cfg["service"]["pipelines"]["traces"]["exporters"]
    endpoints = []
    for eid in traces:
        exp = cfg["exporters"][eid]
        if "endpoint" in exp:
            endpoints.append(substitute_env(exp["endpoint"], env={}))  # ${env:VAR:-default}: the default
            assert exp["tls"]["insecure"] is True  # plain gRPC inside the compose network
        else:
            endpoints.extend(exp["resolver"]["static"]["hostnames"])
    hosts = {e.rsplit(":", 1)[0] for e in endpoints}
    assert {"jaeger", "tempo"} <= hosts
    assert any(h.startswith("straggler-collector") for h in hosts)
    for ep in endpoints:
        host, port = ep.rsplit(":", 1)
        assert host in compose, f"{name}: {host} is not a compose service"
        assert port == "4317"
    metric_exporters = cfg["service"]["pipelines"]["metrics"]["exporters"]
    assert metric_exporters and all("straggler" in e for e in metric_exporters), "emitter self-metrics"


def test_sharded_gateway_routes_by_cohort_key_on_the_resource() -> None:
    cfg = load_yaml(CONFIGS / "otelcol-gateway-sharded.yaml")
    lbs = {k: v for k, v in cfg["exporters"].items() if k.split("/")[0] == "load_balancing"}
    assert len(lbs) == 1
    (lb_id, lb), = lbs.items()
    assert lb["routing_key"] == "attributes"
    assert lb["routing_attributes"] == [s.RES_COHORT_KEY]
    assert "endpoint" not in lb["protocol"]["otlp"], "backends come from the resolver"
    hostnames = lb["resolver"]["static"]["hostnames"]
    compose = load_yaml(REPO / "docker-compose.yml")["services"]
    sharded = sorted(n for n, svc in compose.items()
                     if n.startswith("straggler-collector-") and svc.get("profiles") == ["sharded"])
    assert sorted(h.rsplit(":", 1)[0] for h in hostnames) == sharded and len(sharded) >= 2
    for pipeline in ("traces", "metrics"):
        assert lb_id in cfg["service"]["pipelines"][pipeline]["exporters"]


def test_the_unsharded_gateway_targets_the_single_collector() -> None:
    cfg = load_yaml(CONFIGS / "otelcol-gateway.yaml")
    assert cfg["exporters"]["otlp_grpc/straggler"]["endpoint"] == "straggler-collector:4317"
    assert not any(k.startswith("load_balancing") for k in cfg["exporters"])


def test_jaeger_v2_in_memory_config() -> None:
    cfg = load_yaml(CONFIGS / "jaeger.yaml")
    _collector_pipelines_are_wired(cfg, "jaeger.yaml")
    backends = cfg["extensions"]["jaeger_storage"]["backends"]
    (store, backend), = backends.items()
    assert set(backend) == {"memory"} and backend["memory"]["max_traces"] > 0
    assert cfg["extensions"]["jaeger_query"]["storage"]["traces"] == store
    assert cfg["exporters"]["jaeger_storage_exporter"]["trace_storage"] == store
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")


def test_tempo_single_binary_local_storage_on_its_volume() -> None:
    cfg = load_yaml(CONFIGS / "tempo.yaml")
    assert cfg["server"]["http_listen_port"] == 3200
    trace = cfg["storage"]["trace"]
    assert trace["backend"] == "local"
    compose = load_yaml(REPO / "docker-compose.yml")["services"]["tempo"]
    volume_target = next(v.split(":")[1] for v in compose["volumes"] if not v.startswith("."))
    for path in (trace["wal"]["path"], trace["local"]["path"]):
        assert path.startswith(volume_target + "/"), f"{path} is not on the tempo-data volume"
    assert cfg["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"

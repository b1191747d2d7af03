"""deploy/kubernetes/, validated offline: every built-in resource against the Kubernetes OpenAPI schema
(kubernetes-validate, strict), the Prometheus Operator resources against the operator's CRD models
(cloudcoil-models-prometheus-operator, unknown keys rejected), the alert rules with promtool, the collector's
configuration with the collector's own validation, and the wiring between them (selectors, ports, names)."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import otel_straggler
import otel_straggler_schema as s
from collector_processor.config.loader import ConfigError, load_text
from collector_processor.config.validate import validate

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
VERSION = "1.31.0"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
NS = "otel-straggler"


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc:
                out.append((path.relative_to(K8S).as_posix(), doc))
    return out


DOCS = _docs()


def _find(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _p, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _ids(docs: list[tuple[str, dict]]) -> list[str]:
    return [f"{p}:{d['kind']}/{d['metadata']['name']}" for p, d in docs]


BUILTIN = [(p, d) for p, d in DOCS if d["kind"] not in CRD_KINDS]
CRDS = [(p, d) for p, d in DOCS if d["kind"] in CRD_KINDS]


def test_every_manifest_is_there() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for _p, d in DOCS}
    assert {("Deployment", "straggler-collector"), ("Service", "straggler-collector"),
            ("ConfigMap", "straggler-collector-config"), ("ServiceMonitor", "straggler-collector"),
            ("PrometheusRule", "otel-straggler"), ("StatefulSet", "straggler-collector-shard"),
            ("Service", "straggler-collector-shards"), ("Deployment", "straggler-gateway"),
            ("Service", "straggler-gateway"), ("ConfigMap", "straggler-gateway-config"),
            ("ConfigMap", "otel-straggler-training"), ("Job", "pretrain-gpt"),
            ("NetworkPolicy", "straggler-collector"), ("NetworkPolicy", "straggler-collector-shard"),
            ("NetworkPolicy", "straggler-gateway")} <= kinds


@pytest.mark.parametrize(("path", "doc"), BUILTIN, ids=_ids(BUILTIN))
def test_builtin_resources_validate_against_the_kubernetes_schema(path: str, doc: dict[str, Any]) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(doc, VERSION, strict=True)


def test_the_kubernetes_schema_rejects_a_broken_manifest() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    bad = copy.deepcopy(_find("Deployment", "straggler-collector"))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "otlp"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, VERSION, strict=True)
    unknown = copy.deepcopy(_find("Service", "straggler-collector"))
    unknown["spec"]["portz"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(unknown, VERSION, strict=True)


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for v in node.values():
            _strict(v)
    elif isinstance(node, list):
        for v in node:
            _strict(v)
    return node


def _crd_errors(doc: dict[str, Any]) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    models = pytest.importorskip("cloudcoil.models.prometheus_operator.v1")
    model = getattr(models, doc["kind"])
    model.model_validate(doc)  # types, enums and patterns of the CRD (e.g. a Prometheus duration)
    schema = _strict(model.model_json_schema(by_alias=True))
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in jsonschema.Draft202012Validator(schema)
            .iter_errors(doc)]


@pytest.mark.parametrize(("path", "doc"), CRDS, ids=_ids(CRDS))
def test_prometheus_operator_resources_validate_against_their_crd(path: str, doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert _crd_errors(doc) == []


def test_the_crd_check_rejects_unknown_keys_and_bad_durations() -> None:
    monitor = copy.deepcopy(_find("ServiceMonitor", "straggler-collector"))
    monitor["spec"]["endpoints"][0]["scrapeEvery"] = "15s"
    assert _crd_errors(monitor)
    monitor = copy.deepcopy(_find("ServiceMonitor", "straggler-collector"))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(ValueError, match="interval"):
        _crd_errors(monitor)


def test_the_generated_manifests_match_configs() -> None:
    proc = subprocess.run([sys.executable, str(K8S / "render.py"), "--check"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_prometheusrule_holds_the_stacks_rules_and_promtool_accepts_them(tmp_path: Path) -> None:
    rule = _find("PrometheusRule", "otel-straggler")
    stack = yaml.safe_load((ROOT / "configs/prometheus/rules/straggler.rules.yml").read_text(encoding="utf-8"))
    assert rule["spec"]["groups"] == stack["groups"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    extracted = tmp_path / "rules.yml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}), encoding="utf-8")
    proc = subprocess.run([promtool, "check", "rules", str(extracted)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    count = sum(len(g["rules"]) for g in rule["spec"]["groups"])
    assert count >= 2 and f"SUCCESS: {count} rules found" in proc.stdout + proc.stderr


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]


def _container_ports(workload: dict[str, Any]) -> dict[str, int]:
    (c,) = _pod(workload)["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in c["ports"]}


@pytest.mark.parametrize(("kind", "name"), [("Deployment", "straggler-collector"),
                                            ("StatefulSet", "straggler-collector-shard"),
                                            ("Deployment", "straggler-gateway")])
def test_workloads_services_and_probes_line_up(kind: str, name: str) -> None:
    w = _find(kind, name)
    selector = w["spec"]["selector"]["matchLabels"]
    labels = _pod(w)["metadata"]["labels"]
    assert selector.items() <= labels.items()
    services = [d for _p, d in DOCS if d["kind"] == "Service" and d["spec"]["selector"].items() <= labels.items()]
    assert services, f"no Service selects {name}"
    ports = _container_ports(w)
    for svc in services:
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (svc["metadata"]["name"], port)
    (c,) = _pod(w)["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] in ports
    assert _pod(w)["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    if name.startswith("straggler-collector"):
        assert c["image"] == f"otel-straggler-collector:{otel_straggler.__version__}"
        assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"


@pytest.mark.parametrize(("kind", "name"), [("Deployment", "straggler-collector"),
                                            ("StatefulSet", "straggler-collector-shard")])
def test_the_collector_runs_the_configmaps_valid_configuration(kind: str, name: str) -> None:
    w = _find(kind, name)
    (c,) = _pod(w)["spec"]["containers"]
    cm = _find("ConfigMap", "straggler-collector-config")
    (key,) = cm["data"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod(w)["spec"]["volumes"]}
    config_volume = next(n for n, v in volumes.items()
                         if v.get("configMap", {}).get("name") == "straggler-collector-config")
    assert c["args"][:2] == ["--config", f"{mounts[config_volume]}/{key}"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    with pytest.raises(ConfigError, match="allow_unauthenticated"):  # /metrics on every interface wants a token
        validate(*load_text(cm["data"][key], key, env={}))
    raw, marks = load_text(cm["data"][key], key, env=env)
    validate(raw, marks)
    assert raw["exporters"]["prometheus"]["auth"]["bearer_token_file"].startswith("/etc/otel-straggler-auth/")
    ports = _container_ports(w)
    protocols = raw["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == f"0.0.0.0:{ports['otlp-grpc']}"
    assert protocols["http"]["endpoint"] == f"0.0.0.0:{ports['otlp-http']}"
    assert raw["exporters"]["prometheus"]["endpoint"] == f"0.0.0.0:{ports['metrics']}"
    evidence = raw["exporters"]["file/evidence"]["path"]
    assert evidence.startswith(mounts["evidence"] + "/"), "evidence is written to its volume"
    # the verdict spans go to the trace stores the pod's environment names
    with_env, _ = load_text(cm["data"][key], key, env=env)
    assert with_env["exporters"]["otlp_grpc/jaeger"]["endpoint"] == env["JAEGER_OTLP_ENDPOINT"]
    assert with_env["exporters"]["otlp_grpc/tempo"]["endpoint"] == env["TEMPO_OTLP_ENDPOINT"]
    moved, _ = load_text(cm["data"][key], key, env={**env, "JAEGER_OTLP_ENDPOINT": "jaeger.observability:4317"})
    assert moved["exporters"]["otlp_grpc/jaeger"]["endpoint"] == "jaeger.observability:4317"


def test_the_servicemonitor_scrapes_every_collector_and_keeps_the_job_label() -> None:
    monitor = _find("ServiceMonitor", "straggler-collector")
    sel = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True, "the collector's job label is the training job id"
    scraped = {d["metadata"]["name"] for _p, d in DOCS
               if d["kind"] == "Service" and sel.items() <= d["metadata"]["labels"].items()}
    assert scraped == {"straggler-collector", "straggler-collector-shards"}
    for name in scraped:
        assert endpoint["port"] in {p["name"] for p in _find("Service", name)["spec"]["ports"]}


def test_the_sharded_gateway_routes_each_cohort_to_one_shard() -> None:
    gateway = yaml.safe_load(_find("ConfigMap", "straggler-gateway-config")["data"]["config.yaml"])
    lb = gateway["exporters"]["load_balancing/straggler"]
    assert lb["routing_key"] == "attributes" and lb["routing_attributes"] == [s.RES_COHORT_KEY]
    headless = _find("Service", "straggler-collector-shards")
    assert headless["spec"]["clusterIP"] == "None"
    assert lb["resolver"]["dns"]["hostname"] == f"straggler-collector-shards.{NS}.svc.cluster.local"
    assert int(lb["resolver"]["dns"]["port"]) == 4317
    shards = _find("StatefulSet", "straggler-collector-shard")
    assert shards["spec"]["serviceName"] == "straggler-collector-shards" and shards["spec"]["replicas"] >= 2
    assert headless["spec"]["selector"].items() <= _pod(shards)["metadata"]["labels"].items()
    # every pipeline component is defined and every defined one is used
    defined = {k: set(gateway.get(k) or {}) for k in ("receivers", "processors", "exporters")}
    used = {k: set() for k in defined}
    for pipeline in gateway["service"]["pipelines"].values():
        for k in defined:
            used[k] |= set(pipeline.get(k, []))
    assert used == defined
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    (c,) = _pod(_find("Deployment", "straggler-gateway"))["spec"]["containers"]
    assert c["image"] == compose["services"]["gateway-sharded"]["image"]
    sharded_compose = yaml.safe_load((ROOT / "configs/otelcol-gateway-sharded.yaml").read_text(encoding="utf-8"))
    compose_lb = sharded_compose["exporters"]["load_balancing/straggler"]
    # in Kubernetes the gateway sends the shards' token (compose's shards take the gateway's traffic without one)
    headers = lb["protocol"]["otlp"].pop("headers")
    assert headers == {"authorization": "Bearer ${env:OTEL_STRAGGLER_GATEWAY_TOKEN}"}
    (gw,) = _pod(_find("Deployment", "straggler-gateway"))["spec"]["containers"]
    (shard,) = _pod(shards)["spec"]["containers"]
    assert (_env_var(gw, "OTEL_STRAGGLER_GATEWAY_TOKEN")["valueFrom"]["secretKeyRef"]
            == _env_var(shard, "OTEL_STRAGGLER_TOKEN")["valueFrom"]["secretKeyRef"]
            == {"name": "otel-straggler-auth", "key": "gateway-token", "optional": False})
    assert {k: v for k, v in lb.items() if k != "resolver"} == {k: v for k, v in compose_lb.items() if k != "resolver"}


def test_training_pods_point_at_the_collector_service() -> None:
    env = _find("ConfigMap", "otel-straggler-training")["data"]
    assert env["OTEL_STRAGGLER_ENABLED"] == "1" and env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    svc = _find("Service", "straggler-collector")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "otlp-grpc")
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://{svc['metadata']['name']}.{NS}.svc.cluster.local:{port}"
    (c,) = _pod(_find("Job", "pretrain-gpt"))["spec"]["containers"]
    assert {"configMapRef": {"name": "otel-straggler-training"}} in c["envFrom"]
    assert any(e["name"] == "OTEL_STRAGGLER_JOB_ID" for e in c["env"]), "every rank of the job shares one id"
    assert c["command"][0] == "opentelemetry-instrument"


def test_kustomizations_list_every_manifest_once() -> None:
    listed: set[Path] = set()
    for kz in K8S.rglob("kustomization.yaml"):
        for res in yaml.safe_load(kz.read_text(encoding="utf-8"))["resources"]:
            target = (kz.parent / res).resolve()
            assert target.exists(), f"{kz.relative_to(ROOT)}: {res} does not exist"
            if target.is_file():
                listed.add(target)
    manifests = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"
                 and "training" not in p.parts}
    assert manifests == listed


def _env_var(container: dict[str, Any], name: str) -> dict[str, Any]:
    (var,) = [e for e in container["env"] if e["name"] == name]
    return var


def _secret_volume(w: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, dict[str, Any]]:
    """(key, secret volume source) of the Secret file ``path`` in the container's mounts."""
    mount, _, key = path.rpartition("/")
    name = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}[mount]
    (vol,) = [v for v in _pod(w)["spec"]["volumes"] if v["name"] == name]
    return key, vol["secret"]


def test_training_pods_send_their_jobs_own_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The collector reads the job secret from a Secret it cannot start without; each training job's pods read
    their header from a Secret of their own (required) that ``training/env.yaml`` makes with ``otel-straggler
    token``. That header, parsed by the OTel exporter, is a token the collector takes for that job and no other."""
    from opentelemetry.util.re import parse_env_headers

    from collector_processor.receiver.auth import AuthConfig, BearerAuth
    from otel_straggler.job_token import main as token_main

    job = _find("Job", "pretrain-gpt")
    (rank,) = _pod(job)["spec"]["containers"]
    w = _find("Deployment", "straggler-collector")
    (collector,) = _pod(w)["spec"]["containers"]
    key, secret = _secret_volume(w, collector, _env_var(collector, "OTEL_STRAGGLER_JOB_SECRET_FILE")["value"])
    assert key == "job-secret" and secret["optional"] is False
    assert not [e for e in collector["env"] if e["name"] == "OTEL_STRAGGLER_TOKEN"], "no all-jobs token"
    header_ref = _env_var(rank, "OTEL_EXPORTER_OTLP_HEADERS")["valueFrom"]["secretKeyRef"]
    job_name = job["metadata"]["name"]
    assert header_ref == {"name": f"otel-straggler-job-{job_name}", "key": "otlp-headers", "optional": False}
    # the job id the ranks send is the Job's name
    assert _env_var(rank, "OTEL_STRAGGLER_JOB_ID")["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['batch.kubernetes.io/job-name']"
    env_doc = (K8S / "training" / "env.yaml").read_text(encoding="utf-8")
    made = f"create secret generic {header_ref['name']}"
    assert made in env_doc
    command = f'--from-literal={header_ref["key"]}="$(otel-straggler token --job {job_name} --header --secret-file'
    assert command in env_doc
    secret_file = tmp_path / "job-secret"
    secret_file.write_text("0123456789abcdef" * 4)
    assert token_main(["--job", job_name, "--header", "--secret-file", str(secret_file)], env={}) == 0
    headers = parse_env_headers(capsys.readouterr().out.strip(), liberal=True)
    tenant = BearerAuth(AuthConfig(job_secret_file=str(secret_file))).identify(headers["authorization"])
    assert tenant is not None and tenant.allows(job_name) and not tenant.allows("another-job")


def test_metrics_want_the_token_the_servicemonitor_sends() -> None:
    (endpoint,) = _find("ServiceMonitor", "straggler-collector")["spec"]["endpoints"]
    ref = endpoint["authorization"]["credentials"]
    assert endpoint["authorization"]["type"] == "Bearer"
    for kind, name in (("Deployment", "straggler-collector"), ("StatefulSet", "straggler-collector-shard")):
        w = _find(kind, name)
        (c,) = _pod(w)["spec"]["containers"]
        key, secret = _secret_volume(w, c, _env_var(c, "OTEL_STRAGGLER_METRICS_TOKEN_FILE")["value"])
        assert (secret["secretName"], key) == (ref["name"], ref["key"]) and secret["optional"] is False


def _admits(policy: dict[str, Any], port: str) -> list[dict[str, Any]]:
    """The peers ``policy`` admits to the named port."""
    return [peer for rule in policy["spec"]["ingress"] if {"port": port, "protocol": "TCP"} in rule["ports"]
            for peer in rule["from"]]


PROMETHEUS = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


@pytest.mark.parametrize(("kind", "name", "otlp_from"), [
    ("Deployment", "straggler-collector", "training"),
    ("StatefulSet", "straggler-collector-shard", "gateway"),
    ("Deployment", "straggler-gateway", "training"),
])
def test_network_policies_admit_otlp_from_senders_and_metrics_from_prometheus(kind: str, name: str,
                                                                               otlp_from: str) -> None:
    w = _find(kind, name)
    labels = _pod(w)["metadata"]["labels"]
    (policy,) = [d for _p, d in DOCS if d["kind"] == "NetworkPolicy"
                 and d["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    training = _pod(_find("Job", "pretrain-gpt"))["metadata"]["labels"]
    gateway = _pod(_find("Deployment", "straggler-gateway"))["metadata"]["labels"]
    for port in ("otlp-grpc", "otlp-http"):
        (peer,) = _admits(policy, port)
        sender = training if otlp_from == "training" else gateway
        assert peer["podSelector"]["matchLabels"].items() <= sender.items()
        assert ("namespaceSelector" in peer) == (otlp_from == "training"), "the gateway is in this namespace"
    ports = {p["name"] for p in _pod(w)["spec"]["containers"][0]["ports"]}
    if "metrics" in ports:
        assert _admits(policy, "metrics") == [PROMETHEUS]
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert admitted <= ports and admitted == {"otlp-grpc", "otlp-http"} | ({"metrics"} & ports)


def test_training_pods_name_their_node_in_host_name_and_k8s_node_name() -> None:
    """In a pod ``gethostname()`` is the pod's name: the resource names the node (downward API) so node verdicts
    and alert grouping follow the machine."""
    (rank,) = _pod(_find("Job", "pretrain-gpt"))["spec"]["containers"]
    assert _env_var(rank, "NODE_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    attrs = dict(kv.split("=", 1) for kv in _env_var(rank, "OTEL_RESOURCE_ATTRIBUTES")["value"].split(","))
    assert attrs == {s.RES_HOST_NAME: "$(NODE_NAME)", "k8s.node.name": "$(NODE_NAME)"}


def _effective_collector_config(w: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """The configuration a collector pod runs: every ``--config`` file of its args, read from the ConfigMap its
    mount holds, merged in order by the collector's own loader."""
    from collector_processor.config.loader import load_files

    (c,) = _pod(w)["spec"]["containers"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod(w)["spec"]["volumes"]}
    args = c["args"]
    paths = [args[i + 1] for i, a in enumerate(args) if a == "--config"]
    files = []
    for i, path in enumerate(paths):
        mount, _, key = path.rpartition("/")
        cm = _find("ConfigMap", volumes[mounts[mount]]["configMap"]["name"])
        f = tmp / f"{i}-{key}"
        f.write_text(cm["data"][key], encoding="utf-8")
        files.append(str(f))
    raw, marks = load_files(files, env={e["name"]: e["value"] for e in c["env"] if "value" in e})
    validate(raw, marks)
    return raw


def test_the_single_profile_forwards_every_span_to_the_trace_stores(tmp_path: Path) -> None:
    """No gateway in front of the single collector: its traces pipeline keeps the ranks' stage spans (no
    ``filter/verdict_spans``) and exports them, with the verdict spans, to Jaeger and Tempo."""
    raw = _effective_collector_config(_find("Deployment", "straggler-collector"), tmp_path)
    traces = raw["service"]["pipelines"]["traces"]
    assert not [p for p in traces["processors"] if p.startswith("filter")], traces
    assert {"otlp_grpc/jaeger", "otlp_grpc/tempo"} <= set(traces["exporters"])


def test_the_sharded_profile_forwards_stage_spans_at_the_gateway(tmp_path: Path) -> None:
    """Sharded: the gateway sends every span to the trace stores as well as to the shards; each shard forwards
    only its verdict spans (the stage spans already went from the gateway)."""
    gateway = yaml.safe_load(_find("ConfigMap", "straggler-gateway-config")["data"]["config.yaml"])
    traces = gateway["service"]["pipelines"]["traces"]
    assert {"otlp_grpc/jaeger", "otlp_grpc/tempo", "load_balancing/straggler"} <= set(traces["exporters"])
    assert not [p for p in traces["processors"] if p.startswith("filter")]
    (c,) = _pod(_find("Deployment", "straggler-gateway"))["spec"]["containers"]
    env = {e["name"] for e in c.get("env", [])}
    assert {"JAEGER_OTLP_ENDPOINT", "TEMPO_OTLP_ENDPOINT"} <= env
    shard = _effective_collector_config(_find("StatefulSet", "straggler-collector-shard"), tmp_path)
    assert "filter/verdict_spans" in shard["service"]["pipelines"]["traces"]["processors"]

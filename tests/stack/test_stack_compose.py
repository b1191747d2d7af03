"""docker-compose.yml, Dockerfile and .dockerignore, checked statically (no Docker engine runs in CI): the compose
file against the Compose Specification JSON schema, pinned images, mounted paths, published ports, profiles."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest
import yaml
from stack_support import CONFIGS, REPO, load_yaml

COMPOSE = REPO / "docker-compose.yml"
GRAFANA_ALERTING = REPO / "docker-compose.grafana-alerting.yml"
SCHEMA = Path(__file__).parent / "data" / "compose-spec.json"


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE)


def test_compose_validates_against_the_compose_specification(compose: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_schema_copy_rejects_an_invalid_compose_file() -> None:
    """The committed schema is the real one: it rejects what Compose rejects."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    bad = {"services": {"x": {"image": "a:1", "ports": [{"target": "not-a-port"}], "restart_policy": "always"}}}
    assert list(jsonschema.Draft7Validator(schema).iter_errors(bad))


def test_every_image_is_pinned_to_a_version_tag(compose: dict) -> None:
    for name, svc in compose["services"].items():
        image = svc.get("image")
        assert image or svc.get("build"), f"{name}: neither image nor build"
        if image is None:
            continue
        assert "$" not in image, f"{name}: image {image!r} depends on the environment"
        ref, _, tag = image.rpartition(":")
        assert ref and "/" not in tag, f"{name}: image {image!r} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{name}: image {image!r} is not pinned to a version"


def test_the_services_of_the_stack_are_there(compose: dict) -> None:
    services = compose["services"]
    for name in ("gateway", "straggler-collector", "jaeger", "tempo", "prometheus", "alertmanager", "grafana"):
        assert name in services and "profiles" not in services[name], name
    for name in ("gateway-sharded", "straggler-collector-0", "straggler-collector-1"):
        assert services[name]["profiles"] == ["sharded"], name
    assert services["straggler-collector"]["build"]["context"] == "."
    assert "otelcol-gateway-sharded.yaml" in " ".join(services["gateway-sharded"]["volumes"])
    assert "otelcol-gateway.yaml" in " ".join(services["gateway"]["volumes"])
    assert services["gateway"]["image"] == services["gateway-sharded"]["image"]
    assert services["gateway"]["image"].startswith("otel/opentelemetry-collector-contrib:")
    assert services["jaeger"]["image"].split(":")[1].startswith("2."), "Jaeger v2"


def _bind_mounts(compose: dict) -> list[tuple[str, str, str]]:
    out = []
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            source, target = vol.split(":")[:2]
            if source.startswith((".", "/")):
                out.append((name, source, target))
    return out


def test_every_bind_mounted_path_exists_and_lives_in_configs(compose: dict) -> None:
    mounts = _bind_mounts(compose)
    assert len(mounts) >= 10
    for name, source, _target in mounts:
        path = (REPO / source).resolve()
        assert path.exists(), f"{name}: {source} does not exist"
        assert path.is_relative_to(CONFIGS), f"{name}: {source} is outside configs/"


def test_named_volumes_are_declared(compose: dict) -> None:
    declared = set(compose.get("volumes", {}))
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name}: volume {source} is not declared"


def test_published_ports_bind_loopback_by_default(compose: dict) -> None:
    published = 0
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert isinstance(port, str) and port.startswith("${BIND_ADDRESS:-127.0.0.1}:"), (name, port)
            published += 1
    assert published >= 8


def test_configs_mounted_where_each_service_reads_them(compose: dict) -> None:
    services = compose["services"]
    mounts = {(n, t): s for n, s, t in _bind_mounts(compose)}
    assert mounts[("prometheus", "/etc/prometheus")] == "./configs/prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in services["alertmanager"]["command"]
    assert "-config.file=/etc/tempo.yaml" in services["tempo"]["command"]
    assert mounts[("jaeger", "/etc/jaeger/config.yaml")] == "./configs/jaeger.yaml"
    assert services["jaeger"]["command"] == ["--config=/etc/jaeger/config.yaml"]
    for gw in ("gateway", "gateway-sharded"):
        assert services[gw]["command"] == ["--config=/etc/otelcol/config.yaml"]
    for col in ("straggler-collector", "straggler-collector-0", "straggler-collector-1"):
        assert mounts[(col, "/etc/otel-straggler/collector.yaml")] == "./configs/collector-compose.yaml"
    dash_provider = load_yaml(CONFIGS / "grafana/provisioning/dashboards/dashboards.yaml")
    dash_path = dash_provider["providers"][0]["options"]["path"]
    assert mounts[("grafana", dash_path)] == "./configs/grafana/dashboards"
    for sub in ("datasources", "dashboards"):
        assert mounts[("grafana", f"/etc/grafana/provisioning/{sub}")] == f"./configs/grafana/provisioning/{sub}"
    env = services["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert "ALERT_WEBHOOK_URL" in env
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dash_path + "/") and (CONFIGS / "grafana/dashboards" / Path(home).name).exists()


def test_one_alert_path_by_default_and_the_override_switches_it(compose: dict) -> None:
    """By default Prometheus evaluates the rules and Alertmanager notifies; Grafana has no alert rules. The
    override file gives Grafana its rules and contact point and Alertmanager a receiver that delivers nowhere:
    each alert is notified once either way."""
    mounts = {(n, t): s for n, s, t in _bind_mounts(compose)}
    assert ("grafana", "/etc/grafana/provisioning/alerting") not in mounts
    assert mounts[("alertmanager", "/etc/alertmanager/alertmanager.yml")] == "./configs/alertmanager/alertmanager.yml"
    hooks = load_yaml(CONFIGS / "alertmanager/alertmanager.yml")["receivers"][0]["webhook_configs"]
    assert hooks and load_yaml(CONFIGS / "prometheus/prometheus.yml")["alerting"]["alertmanagers"]

    override = load_yaml(GRAFANA_ALERTING)
    assert set(override["services"]) == {"grafana", "alertmanager"}
    over = {(n, t): s for n, s, t in _bind_mounts(override)}
    assert over[("grafana", "/etc/grafana/provisioning/alerting")] == "./configs/grafana/provisioning/alerting"
    silent = over[("alertmanager", "/etc/alertmanager/alertmanager.yml")]
    cfg = load_yaml(REPO / silent)
    (receiver,) = cfg["receivers"]
    assert cfg["route"]["receiver"] == receiver["name"] and set(receiver) == {"name"}, "delivers nowhere"
    for _name, source, _target in _bind_mounts(override):
        assert (REPO / source).exists() and (REPO / source).resolve().is_relative_to(CONFIGS), source
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    assert not list(jsonschema.Draft7Validator(schema).iter_errors(override))


def test_alertmanager_runs_without_clustering(compose: dict) -> None:
    assert "--cluster.listen-address=" in compose["services"]["alertmanager"]["command"]


def _dockerfile() -> list[tuple[str, str]]:
    lines, buf = [], ""
    for raw in (REPO / "Dockerfile").read_text(encoding="utf-8").splitlines():
        if raw.strip().startswith("#") and not buf:
            continue
        buf += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            if buf.strip():
                instr, _, rest = buf.strip().partition(" ")
                lines.append((instr.upper(), rest.strip()))
            buf = ""
    return lines


def test_dockerfile_base_image_entrypoint_and_copied_files() -> None:
    instrs = _dockerfile()
    base = next(arg for i, arg in instrs if i == "FROM")
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", base), base
    entry = json.loads(next(arg for i, arg in instrs if i == "ENTRYPOINT"))
    assert entry == ["otel-straggler-collector", "--config", "/etc/otel-straggler/collector.yaml"]
    assert any(i == "RUN" and "pip install '.[collector]'" in arg for i, arg in instrs), "the collector extra"
    assert any(i == "USER" for i, _ in instrs), "the collector must not run as root"
    ignore = [ln.strip() for ln in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
              if ln.strip() and not ln.startswith("#")]
    copied = 0
    for i, arg in instrs:
        if i != "COPY":
            continue
        for src in arg.split()[:-1]:
            if src.startswith("--"):
                continue
            if "*" in src:  # optional file (a glob may match nothing when another source matches)
                continue
            assert (REPO / src).exists(), f"Dockerfile copies {src}, which does not exist"
            # .dockerignore: last matching pattern wins; "!" re-includes.
            included = True
            for pat in ignore:
                neg = pat.startswith("!")
                p = pat[1:] if neg else pat
                if fnmatch.fnmatch(src, p.rstrip("/")) or src.startswith(p.rstrip("/") + "/"):
                    included = neg
            assert included, f"{src} is excluded from the build context by .dockerignore"
            copied += 1
    assert copied >= 4


def test_every_package_of_the_distribution_is_copied_into_the_image() -> None:
    """``pip install .`` in the image installs what it was given: a package left out (the contract the collector
    imports) would build an image whose collector cannot start."""
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"][
        "find"]["include"]
    packages = {name for name in include if "*" not in name}
    assert {"otel_straggler", "otel_straggler_schema", "collector_processor"} <= packages
    copied = {arg.split()[0] for i, arg in _dockerfile() if i == "COPY"}
    assert packages <= copied, packages - copied


def test_pyproject_readme_is_copied_into_the_image() -> None:
    """``pip install .`` needs every file pyproject.toml names (the readme) inside the image."""
    import tomllib

    readme = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"].get("readme")
    if readme:
        copies = " ".join(arg for i, arg in _dockerfile() if i == "COPY").split()
        assert any(fnmatch.fnmatch(readme, src) for src in copies), f"Dockerfile does not copy {readme}"


def test_collector_compose_config_forwards_only_verdict_spans_to_jaeger_and_tempo(compose: dict) -> None:
    """The compose collector forwards, by default, the spans its straggler processor appends (service.name
    otel-straggler-collector: the verdict spans) to Jaeger and Tempo, and nothing to the gateway (which sends every
    span to it: a loop) or elsewhere; the stage spans reach the trace stores through the gateway only. Both
    addresses come from JAEGER_OTLP_ENDPOINT / TEMPO_OTLP_ENDPOINT (compose passes them to the collectors and the
    gateways), defaulting to the stack's own stores."""
    from collector_processor.config.loader import ConfigError, load_files
    from collector_processor.config.validate import validate

    def forwarders(cfg: dict) -> dict[str, str]:
        return {e: cfg["exporters"][e]["endpoint"] for e in cfg["exporters"]
                if e.split("/")[0] in ("otlp", "otlp_grpc", "otlphttp", "otlp_http")}

    # /metrics listens on the container's network without a token only as compose opts in
    with pytest.raises(ConfigError, match="allow_unauthenticated"):
        validate(*load_files([CONFIGS / "collector-compose.yaml"], env={}))
    opt_in = {"OTEL_STRAGGLER_METRICS_OPEN": compose["services"]["straggler-collector"]["environment"][
        "OTEL_STRAGGLER_METRICS_OPEN"]}
    cfg, marks = load_files([CONFIGS / "collector-compose.yaml"], env=opt_in)
    protocols = cfg["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317" and protocols["http"]["endpoint"] == "0.0.0.0:4318"
    assert cfg["exporters"]["prometheus"]["endpoint"] == "0.0.0.0:9464"
    assert forwarders(cfg) == {"otlp_grpc/jaeger": "jaeger:4317", "otlp_grpc/tempo": "tempo:4317"}
    own = {"JAEGER_OTLP_ENDPOINT": "jaeger-collector.observability:4317", "TEMPO_OTLP_ENDPOINT": "tempo.obs:4317"}
    moved, _ = load_files([CONFIGS / "collector-compose.yaml"], env={**own, **opt_in})
    assert forwarders(moved) == {"otlp_grpc/jaeger": own["JAEGER_OTLP_ENDPOINT"],
                                 "otlp_grpc/tempo": own["TEMPO_OTLP_ENDPOINT"]}
    for name in ("jaeger", "tempo"):
        assert "4317" in compose["services"][name]["expose"]
    for service in ("straggler-collector", "straggler-collector-0", "gateway", "gateway-sharded"):
        env = compose["services"][service]["environment"]
        assert env == {"JAEGER_OTLP_ENDPOINT": "${JAEGER_OTLP_ENDPOINT:-jaeger:4317}",
                       "TEMPO_OTLP_ENDPOINT": "${TEMPO_OTLP_ENDPOINT:-tempo:4317}",
                       **(opt_in if service.startswith("straggler") else {})}, service
    traces = cfg["service"]["pipelines"]["traces"]
    assert traces["processors"][-2:] == ["straggler", "filter/verdict_spans"]
    assert cfg["processors"]["filter/verdict_spans"]["include_services"] == ["otel-straggler-collector"]
    assert set(traces["exporters"]) == {*forwarders(cfg), "straggler"}
    for name in ("otelcol-gateway.yaml", "otelcol-gateway-sharded.yaml"):
        gateway = load_yaml(CONFIGS / name)
        assert {"otlp_grpc/jaeger", "otlp_grpc/tempo"} <= set(gateway["service"]["pipelines"]["traces"]["exporters"])
        assert forwarders(gateway)["otlp_grpc/jaeger"] == "${env:JAEGER_OTLP_ENDPOINT:-jaeger:4317}", name
        assert forwarders(gateway)["otlp_grpc/tempo"] == "${env:TEMPO_OTLP_ENDPOINT:-tempo:4317}", name
    validated = validate(cfg, marks)
    assert "straggler" in validated.service.pipelines["traces"].processors
    assert validated.processors["straggler"].config.collector_service_name == "otel-straggler-collector"


def test_ports_agree_between_compose_prometheus_and_collector(compose: dict) -> None:
    prom = load_yaml(CONFIGS / "prometheus/prometheus.yml")
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    col_job = jobs["otel-straggler-collector"]
    assert col_job.get("honor_labels", False) is False, "a default scrape: the collector sets no job/instance"
    sd = col_job["dns_sd_configs"][0]
    assert set(sd["names"]) == {n for n in compose["services"] if n.startswith("straggler-collector")}
    metrics_port = int(load_yaml(CONFIGS / "collector-compose.yaml")["exporters"]["prometheus"]["endpoint"]
                       .rsplit(":", 1)[1])
    assert sd["port"] == metrics_port
    gw = jobs["otel-gateway"]["dns_sd_configs"][0]
    assert set(gw["names"]) == {"gateway", "gateway-sharded"}
    gw_cfg = load_yaml(CONFIGS / "otelcol-gateway.yaml")
    assert gw["port"] == gw_cfg["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"][
        "prometheus"]["port"]


def test_compose_yaml_has_no_duplicate_keys() -> None:
    """PyYAML keeps the last of two equal keys silently; Compose refuses the file."""

    def walk(node: yaml.Node) -> None:
        if isinstance(node, yaml.MappingNode):
            keys = [k.value for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]
            dups = {k for k in keys if keys.count(k) > 1}
            assert not dups, f"duplicate keys {dups} at line {node.start_mark.line + 1}"
            for _, v in node.value:
                walk(v)
        elif isinstance(node, yaml.SequenceNode):
            for v in node.value:
                walk(v)

    walk(yaml.compose(COMPOSE.read_text(encoding="utf-8"), Loader=yaml.SafeLoader))


_PUBLISHED = re.compile(r"\$\{BIND_ADDRESS:-127\.0\.0\.1\}:\$\{([A-Z_]+):-(\d+)\}:(\d+)")


def test_host_ports_are_set_by_the_environment_and_keep_off_4317(compose: dict) -> None:
    """A node's own OTel agent often holds 4317/4318: every published host port is a variable whose default is
    another port, one variable per port."""
    seen: dict[str, int] = {}
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            m = _PUBLISHED.fullmatch(port)
            assert m, f"{name}: {port} is not ${{BIND_ADDRESS:-127.0.0.1}}:${{VAR:-default}}:port"
            var, default = m.group(1), int(m.group(2))
            assert var not in seen, f"{var} is used twice"
            seen[var] = default
    assert not {4317, 4318} & set(seen.values())
    assert len(set(seen.values())) == len(seen), "distinct default host ports"
    assert seen["STRAGGLER_OTLP_GRPC_PORT"] == 14317 and seen["STRAGGLER_SHARDED_OTLP_GRPC_PORT"] == 24317
    header = COMPOSE.read_text(encoding="utf-8").split("\nname:", 1)[0]
    for var in seen:
        assert var in header, f"{var} is not documented at the top of docker-compose.yml"


def test_healthchecks_probe_each_services_own_health_endpoint(compose: dict) -> None:
    services = compose["services"]
    metrics_port = load_yaml(CONFIGS / "collector-compose.yaml")["exporters"]["prometheus"]["endpoint"].rsplit(":")[1]
    for name in ("straggler-collector", "straggler-collector-0", "straggler-collector-1"):
        test = " ".join(services[name]["healthcheck"]["test"])
        assert f"http://127.0.0.1:{metrics_port}/healthz" in test, name
    jaeger_health = load_yaml(CONFIGS / "jaeger.yaml")["extensions"]["healthcheckv2"]["http"]["endpoint"]
    assert f":{jaeger_health.rsplit(':', 1)[1]}/status" in " ".join(services["jaeger"]["healthcheck"]["test"])
    assert "/-/ready" in " ".join(services["prometheus"]["healthcheck"]["test"])
    assert "/-/ready" in " ".join(services["alertmanager"]["healthcheck"]["test"])
    assert "/api/health" in " ".join(services["grafana"]["healthcheck"]["test"])
    for name, svc in services.items():
        if "healthcheck" in svc:
            assert svc["healthcheck"]["test"][0] == "CMD", f"{name}: exec form, no shell needed"
    for gw, collectors in (("gateway", ["straggler-collector"]),
                           ("gateway-sharded", ["straggler-collector-0", "straggler-collector-1"])):
        for col in collectors:
            assert services[gw]["depends_on"][col] == {"condition": "service_healthy"}, (gw, col)

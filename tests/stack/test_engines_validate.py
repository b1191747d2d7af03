"""Every shipped OpenTelemetry Collector and Jaeger config, validated by the real binaries (``scripts/engines``).

The configs are found where the deployments mount them: each docker-compose service whose image is the OpenTelemetry
Collector or Jaeger (the file its volume mounts as the config, with the service's environment after compose's
``${VAR:-default}`` substitution) and each Kubernetes Deployment running the collector image (its ConfigMap's data,
with the container's env). ``validate`` builds every component of every pipeline, so an unknown component, a field
the release does not know or an unset variable in an endpoint fails here as it would fail at start."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from engines_support import REPO, jaeger, otelcol

COMPOSE_FILES = sorted(REPO.glob("docker-compose*.yml"))
K8S = REPO / "deploy" / "kubernetes"
OTELCOL_IMAGE = "otel/opentelemetry-collector-contrib"
JAEGER_IMAGE = "jaegertracing/jaeger"
BUILDER_CONFIG = REPO / "engines" / "otelcol" / "builder-config.yaml"
JAEGER_GO_MOD = REPO / "engines" / "jaeger" / "go.mod"


@dataclass
class Deployed:
    """One engine config as a deployment runs it."""

    where: str  # e.g. docker-compose.yml:gateway
    engine: str  # "otelcol" or "jaeger"
    config: str
    env: dict[str, str] = field(default_factory=dict)
    image: str = ""


def _compose_value(text: str) -> str:
    """compose's interpolation with an empty environment: ${VAR:-default} -> default, ${VAR} -> ''."""
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", text)


def _compose_configs() -> list[Deployed]:
    out = []
    for path in COMPOSE_FILES:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        for name, svc in (doc.get("services") or {}).items():
            image = str(svc.get("image", ""))
            engine = ("otelcol" if image.startswith(OTELCOL_IMAGE)
                      else "jaeger" if image.startswith(JAEGER_IMAGE) else "")
            if not engine:
                continue
            cfg = next(
                (v.split(":")[0] for v in svc.get("volumes", []) if isinstance(v, str)
                 and v.split(":")[1] in {"/etc/otelcol/config.yaml", "/etc/jaeger/config.yaml"}),
                None,
            )
            assert cfg, f"{path.name}:{name} mounts no config file"
            env = {k: _compose_value(str(v)) for k, v in (svc.get("environment") or {}).items()}
            text = (path.parent / cfg).read_text(encoding="utf-8")
            out.append(Deployed(f"{path.name}:{name}", engine, text, env, image))
    return out


def _k8s_configs() -> list[Deployed]:
    docs: list[tuple[Path, dict[str, Any]]] = []
    for path in sorted(K8S.rglob("*.yaml")):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if isinstance(d, dict)]
    config_maps = {d["metadata"]["name"]: d for _, d in docs if d.get("kind") == "ConfigMap"}
    out = []
    for path, d in docs:
        if d.get("kind") not in {"Deployment", "StatefulSet", "DaemonSet"}:
            continue
        pod = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            image = c.get("image", "")
            if not image.startswith(OTELCOL_IMAGE):
                continue
            conf_arg = next(a.split("=", 1)[1] for a in c.get("args", []) if a.startswith("--config="))
            mount = next(m for m in c["volumeMounts"] if conf_arg.startswith(m["mountPath"] + "/"))
            cm = config_maps[volumes[mount["name"]]["configMap"]["name"]]
            text = cm["data"][os.path.basename(conf_arg)]
            # a value from a Secret or the downward API is set to a stand-in: what validate checks is that it is set
            env = {e["name"]: str(e.get("value", "stand-in")) for e in c.get("env", [])}
            out.append(Deployed(f"{path.relative_to(REPO)}:{d['metadata']['name']}", "otelcol", text, env, image))
    return out


DEPLOYED = _compose_configs() + _k8s_configs()


def _validate(binary: str, dep: Deployed, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(dep.config, encoding="utf-8")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), **dep.env}
    return subprocess.run([binary, "validate", f"--config={cfg}"], env=env, capture_output=True, text=True, timeout=120)


def test_every_deployment_of_an_engine_is_found() -> None:
    where = {d.where.split(":")[0] for d in DEPLOYED}
    assert {"docker-compose.yml", "deploy/kubernetes/sharded/gateway.yaml"} <= where, where
    assert {d.engine for d in DEPLOYED} == {"otelcol", "jaeger"}


@pytest.mark.parametrize("dep", DEPLOYED, ids=[d.where for d in DEPLOYED])
def test_the_real_engine_validates_the_shipped_config(dep: Deployed, tmp_path: Path) -> None:
    binary = otelcol() if dep.engine == "otelcol" else jaeger()
    res = _validate(binary, dep, tmp_path)
    assert res.returncode == 0, f"{dep.where}: {binary} validate failed:\n{res.stdout}\n{res.stderr}"


@pytest.mark.parametrize("engine", ["otelcol", "jaeger"])
def test_validate_refuses_a_broken_config(engine: str, tmp_path: Path) -> None:
    """The check can fail: a pipeline naming an exporter the distribution does not have is refused."""
    dep = next(d for d in DEPLOYED if d.engine == engine)
    doc = yaml.safe_load(dep.config)
    pipeline = next(iter(doc["service"]["pipelines"].values()))
    pipeline["exporters"] = [*pipeline["exporters"], "no_such_exporter"]
    doc.setdefault("exporters", {})["no_such_exporter"] = {}
    broken = Deployed(dep.where, engine, yaml.safe_dump(doc), dep.env)
    res = _validate(otelcol() if engine == "otelcol" else jaeger(), broken, tmp_path)
    assert res.returncode != 0
    assert "no_such_exporter" in res.stderr + res.stdout


def test_images_are_the_releases_the_suite_runs() -> None:
    """The deployments pull the collector release the suite builds (engines/otelcol) and the Jaeger release of
    the module it builds (engines/jaeger: module v1.75.0 is Jaeger v2.12.0)."""
    dist_version = yaml.safe_load(BUILDER_CONFIG.read_text(encoding="utf-8"))["dist"]["version"]
    assert "github.com/jaegertracing/jaeger v1.75.0" in JAEGER_GO_MOD.read_text(encoding="utf-8")
    expected = {"otelcol": f"{OTELCOL_IMAGE}:{dist_version}", "jaeger": f"{JAEGER_IMAGE}:2.12.0"}
    wrong = [(d.where, d.image) for d in DEPLOYED if d.image != expected[d.engine]]
    assert not wrong, f"images other than the tested releases {expected}: {wrong}"

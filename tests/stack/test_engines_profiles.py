"""Every deployment profile forwards a step's stage spans and its verdict span to the trace stores, on the real
engines (the OpenTelemetry Collector distribution and Jaeger v2 of ``scripts/engines``) with the straggler
collector.

Each profile runs with its own configuration files and environment, read from where the deployment sets them;
only host names, ports and the evidence path are mapped to this machine (``jaeger:4317`` -> the local Jaeger,
``tempo:4317`` -> the Tempo stand-in, a Service or compose name -> 127.0.0.1 and a free port, ``0.0.0.0`` ->
127.0.0.1):

- ``compose``: the ``gateway`` service (``configs/otelcol-gateway.yaml``) in front of ``straggler-collector``
  (``configs/collector-compose.yaml``), each with its ``environment`` from ``docker-compose.yml``.
- ``k8s-single``: the ``straggler-collector`` Deployment of ``deploy/kubernetes/single``: its ``--config`` files
  resolved through its volume mounts to their ConfigMaps, its container ``env``.
- ``k8s-sharded``: the ``straggler-gateway`` Deployment and one pod of the ``straggler-collector-shards``
  StatefulSet of ``deploy/kubernetes/sharded``, resolved the same way; the gateway's DNS resolver names the shard's
  address in place of the headless Service.
- ``slurm``: ``deploy/slurm/train.sbatch`` itself, with ``scontrol`` and ``srun`` stood in for (no Slurm here:
  ``srun`` runs its command on this machine, and for the collector task maps the script's 0.0.0.0 listen address to
  127.0.0.1); the training command is the test's node, which reads the endpoint, job id and token the script
  exports. It forwards to one trace store (``OTEL_STRAGGLER_TRACES_ENDPOINT``): Jaeger.

A job of four data-parallel ranks (one cohort), rank 2 slow in forward-compute from step 5, each rank exporting
through the stock OTel SDK (``engine_node.py``). The straggler settings are the profile's (the shipped defaults),
so the node sends steps until the verdict is in Jaeger. Tempo (AGPL, not run here) is an in-test OTLP sink.
One Jaeger serves every profile; each profile has a job of its own, so its traces are its own."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from engines_support import REPO, Jaeger, run_jaeger, run_otelcol
from stack_support import TraceSink, http_get, process, require_collector, tail, wait_until

import otel_straggler_schema as s
from otel_straggler_demo.run import free_ports

pytestmark = pytest.mark.slow

NODE_SCRIPT = Path(__file__).with_name("engine_node.py")
# the Kubernetes Secret otel-straggler-auth, as docs/deployment.md makes it
AUTH_SECRET = "otel-straggler-auth"
AUTH = {"job-secret": "test-job-secret-0123456789abcdef0123456789", "metrics-token": "test-metrics-token",
        "gateway-token": "test-gateway-token"}
RANKS, SLOW_RANK, SLOW_FROM = 4, 2, 5
STAGE_NAMES = ("forward-compute", "backward-compute", "all-grads-sync")
FIRST_STEPS, MAX_STEP = 40, 120
K8S = REPO / "deploy" / "kubernetes"


# --- a profile's own files and environment ------------------------------------------------------------------


def remap(obj: Any, subs: dict[str, str]) -> Any:
    """``obj`` (parsed YAML) with every occurrence of each key of ``subs`` in its strings replaced."""
    if isinstance(obj, dict):
        return {k: remap(v, subs) for k, v in obj.items()}
    if isinstance(obj, list):
        return [remap(v, subs) for v in obj]
    if isinstance(obj, str):
        for old, new in subs.items():
            obj = obj.replace(old, new)
    return obj


def compose_service(name: str) -> dict[str, Any]:
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text(encoding="utf-8"))["services"]
    return services[name]


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    """A compose service's ``environment`` as compose interpolates it with none of the variables set."""
    env = service.get("environment") or {}
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


def compose_config(service: dict[str, Any], mount: str) -> str:
    """The text of the host file a compose service mounts at ``mount``."""
    for vol in service["volumes"]:
        host, target = vol.split(":")[:2]
        if target == mount:
            return (REPO / host).read_text(encoding="utf-8")
    raise AssertionError(f"nothing mounted at {mount}: {service['volumes']}")


def k8s_docs(profile: str) -> list[dict[str, Any]]:
    """Every object the profile's kustomization lists (the base's too)."""
    def load(d: Path) -> list[dict[str, Any]]:
        out = []
        for res in yaml.safe_load((d / "kustomization.yaml").read_text(encoding="utf-8"))["resources"]:
            p = (d / res).resolve()
            out += load(p) if p.is_dir() else [x for x in yaml.safe_load_all(p.read_text(encoding="utf-8")) if x]
        return out
    return load(K8S / profile)


def k8s_container(docs: list[dict[str, Any]], workload: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(its config files' texts in ``--config`` order, its env (literal values and keys of the Secret
    ``AUTH_SECRET``), and {mount path: ConfigMap or Secret key text}) of the first container of
    Deployment/StatefulSet ``workload``."""
    obj = next(d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == workload)
    pod = obj["spec"]["template"]["spec"]
    c = pod["containers"][0]
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    maps[AUTH_SECRET] = AUTH
    volumes = {v["name"]: v["configMap"]["name"] if "configMap" in v else v["secret"]["secretName"]
               for v in pod["volumes"] if "configMap" in v or v.get("secret", {}).get("secretName") == AUTH_SECRET}
    files = {}
    for m in c["volumeMounts"]:
        if m["name"] in volumes:
            for key, text in maps[volumes[m["name"]]].items():
                files[f"{m['mountPath']}/{key}"] = text
    args = " ".join(c.get("args", [])).replace("--config=", "--config ").split()
    configs = [files[args[i + 1]] for i, a in enumerate(args) if a == "--config"]
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    env.update({e["name"]: AUTH[ref["key"]] for e in c.get("env", [])
                if (ref := e.get("valueFrom", {}).get("secretKeyRef")) and ref["name"] == AUTH_SECRET})
    return configs, env, files


def secret_files(files: dict[str, str], tmp: Path) -> dict[str, str]:
    """The Secret's files of ``k8s_container`` written under ``tmp``: {their mount directory: where they are}."""
    moved = {}
    for path, text in files.items():
        mount, _, key = path.rpartition("/")
        if key in AUTH:
            (tmp / "auth").mkdir(exist_ok=True)
            (tmp / "auth" / key).write_text(text, encoding="utf-8")
            moved[mount] = str(tmp / "auth")
    return moved


def job_env(job: str) -> dict[str, str]:
    """A training pod's environment: its job's own token (training/env.yaml), read by the OTel SDK exporter."""
    from otel_straggler.job_token import header

    return {**os.environ, "OTEL_EXPORTER_OTLP_HEADERS": header(s.job_token(AUTH["job-secret"], job))}


# --- the engines and the job --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jaeger_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    with run_jaeger(tmp_path_factory.mktemp("jaeger")) as j:
        yield j


def straggler_collector(tmp: Path, configs: list[str], subs: dict[str, str], env: dict[str, str],
                        metrics: int, stack: contextlib.ExitStack) -> None:
    """The straggler collector with ``configs`` (texts, in order) remapped by ``subs``, ready on /healthz."""
    argv = require_collector()
    for i, text in enumerate(configs):
        path = tmp / f"collector{i}.yaml"
        path.write_text(yaml.safe_dump(remap(yaml.safe_load(text), subs)), encoding="utf-8")
        argv += ["--config", str(path)]
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    log = tmp / "collector.log"
    proc = stack.enter_context(process(argv, log, env={**base, **env}))

    def ready() -> bool:
        assert proc.poll() is None, tail(log)
        return http_get(f"http://127.0.0.1:{metrics}/healthz")[0] == 200

    wait_until(ready, 120, what="the straggler collector's /healthz")


class Node:
    """The job's one node process (``engine_node.py``): the test writes the last step to send, the node reports
    the last step sent and flushed."""

    def __init__(self, tmp: Path) -> None:
        self.control, self.done, self.log = tmp / "node.control", tmp / "node.done", tmp / "node.log"
        self.control.write_text("-1")
        self.t0_ns = time.time_ns() - 900 * 10**9  # steps 1 s apart, all in the past
        self.step = -1

    def argv(self, endpoint: str, job: str) -> list[str]:
        return [sys.executable, str(NODE_SCRIPT), "--endpoint", endpoint, "--job", job,
                "--ranks", ",".join(str(r) for r in range(RANKS)), "--dp", str(RANKS), "--gpus-per-node", str(RANKS),
                "--slow-rank", str(SLOW_RANK), "--slow-from", str(SLOW_FROM), "--slow-factor", "2.0",
                "--t0-ns", str(self.t0_ns), "--host-name", "node-0", "--control", str(self.control),
                "--done", str(self.done)]

    def advance(self, to_step: int, alive: Any) -> None:
        self.control.write_text(str(to_step))

        def flushed() -> bool:
            assert alive(), tail(self.log)
            return self.done.exists() and int(self.done.read_text() or -1) >= to_step

        wait_until(flushed, 120, interval_s=0.1, what=f"the node's step {to_step} flushed\n{tail(self.log)}")
        self.step = to_step

    def stop(self) -> None:
        self.control.write_text("stop")


def verdict_trace(jaeger: Jaeger, job: str, node: Node, alive: Any) -> str:
    """Sends steps until Jaeger holds a verdict span in one of the job's step traces; that trace's id (hex)."""
    ours = {f"{s.trace_id_for_step(job, step):032x}" for step in range(MAX_STEP + 1)}
    start_us = (node.t0_ns - 3600 * 10**9) // 1000
    to = FIRST_STEPS
    while True:
        node.advance(to, alive)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            code, body = jaeger.get(f"/api/traces?service=otel-straggler-collector&limit=1000&start={start_us}"
                                    f"&end={(time.time_ns() + 3600 * 10**9) // 1000}")
            if code == 200:
                found = sorted(t["traceID"] for t in json.loads(body).get("data") or [] if t["traceID"] in ours)
                if found:
                    return found[0]
            time.sleep(0.5)
        if to >= MAX_STEP:
            raise AssertionError(f"no verdict span of job {job} in Jaeger by step {to}")
        to = min(to + 20, MAX_STEP)


def assert_whole_step(spans: list[tuple[str, str, str]], where: str) -> None:
    """(name, span id, parent span id or "") of one step's trace: every rank's rank-step and stage spans, the
    step's root, the verdict span, and no span whose parent is missing."""
    names = [n for n, _, _ in spans]
    missing = {f"{n} x{RANKS}" for n in (*STAGE_NAMES, s.SPAN_RANK_STEP) if names.count(n) != RANKS}
    missing |= {n for n in (s.SPAN_JOB_STEP, s.SPAN_VERDICT) if n not in names}
    assert not missing, f"{where}: missing {sorted(missing)}; has {sorted(set(names))}"
    ids = {sid for _, sid, _ in spans}
    orphans = [(n, parent) for n, _, parent in spans if parent and parent not in ids]
    assert not orphans, f"{where}: spans whose parent is not in the trace: {orphans}"


def check_stores(jaeger: Jaeger, sink: TraceSink | None, trace_id: str) -> None:
    def jaeger_spans() -> list[tuple[str, str, str]]:
        return [(sp["operationName"], sp["spanID"], next((r["spanID"] for r in sp.get("references", [])
                                                          if r["refType"] == "CHILD_OF"), ""))
                for sp in jaeger.trace(trace_id)]

    # the stage spans of the verdict's step were sent before the verdict: every one is in by now
    assert_whole_step(jaeger_spans(), f"Jaeger trace {trace_id}")
    if sink is not None:
        tempo = [(sp.name, sp.span_id.hex(), sp.parent_span_id.hex()) for _, sp in sink.spans()
                 if sp.trace_id.hex() == trace_id]
        assert_whole_step(tempo, f"Tempo trace {trace_id}")


# --- the profiles -------------------------------------------------------------------------------------------


def run_compose(tmp: Path, jaeger: Jaeger, sink: TraceSink, node: Node, job: str) -> None:
    gw_svc, col_svc = compose_service("gateway"), compose_service("straggler-collector")
    gw_grpc, gw_http, c_grpc, c_http, c_metrics = free_ports(5)
    stores = {"jaeger:4317": jaeger.otlp_grpc, "tempo:4317": sink.endpoint}
    with contextlib.ExitStack() as stack:
        straggler_collector(tmp, [compose_config(col_svc, "/etc/otel-straggler/collector.yaml")], {
            "0.0.0.0:4317": f"127.0.0.1:{c_grpc}", "0.0.0.0:4318": f"127.0.0.1:{c_http}",
            "0.0.0.0:9464": f"127.0.0.1:{c_metrics}", "/var/lib/otel-straggler": str(tmp)},
            remap(compose_env(col_svc), stores), c_metrics, stack)
        gw_cfg = remap(yaml.safe_load(compose_config(gw_svc, "/etc/otelcol/config.yaml")), {
            "0.0.0.0:4317": f"127.0.0.1:{gw_grpc}", "0.0.0.0:4318": f"127.0.0.1:{gw_http}",
            "straggler-collector:4317": f"127.0.0.1:{c_grpc}"})
        gw = stack.enter_context(run_otelcol(tmp, gw_cfg, env=remap(compose_env(gw_svc), stores), name="gateway"))
        proc = stack.enter_context(process(node.argv(f"127.0.0.1:{gw_grpc}", job), node.log))
        stack.callback(node.stop)
        trace_id = verdict_trace(jaeger, job, node, lambda: proc.poll() is None and gw.proc.poll() is None)
        check_stores(jaeger, sink, trace_id)


def run_k8s_single(tmp: Path, jaeger: Jaeger, sink: TraceSink, node: Node, job: str) -> None:
    configs, env, files = k8s_container(k8s_docs("single"), "straggler-collector")
    grpc, http, metrics = free_ports(3)
    with contextlib.ExitStack() as stack:
        straggler_collector(tmp, configs, {
            "0.0.0.0:4317": f"127.0.0.1:{grpc}", "0.0.0.0:4318": f"127.0.0.1:{http}",
            "0.0.0.0:9464": f"127.0.0.1:{metrics}", "/var/lib/otel-straggler": str(tmp)},
            remap(env, {"jaeger:4317": jaeger.otlp_grpc, "tempo:4317": sink.endpoint, **secret_files(files, tmp)}),
            metrics, stack)
        proc = stack.enter_context(process(node.argv(f"127.0.0.1:{grpc}", job), node.log, env=job_env(job)))
        stack.callback(node.stop)
        trace_id = verdict_trace(jaeger, job, node, lambda: proc.poll() is None)
        check_stores(jaeger, sink, trace_id)


def run_k8s_sharded(tmp: Path, jaeger: Jaeger, sink: TraceSink, node: Node, job: str) -> None:
    docs = k8s_docs("sharded")
    shard_configs, shard_env, shard_files = k8s_container(docs, "straggler-collector-shard")
    (gw_text,), gw_env, _ = k8s_container(docs, "straggler-gateway")
    grpc, http, metrics, gw_grpc, gw_http = free_ports(5)
    stores = {"jaeger:4317": jaeger.otlp_grpc, "tempo:4317": sink.endpoint}
    with contextlib.ExitStack() as stack:
        straggler_collector(tmp, shard_configs, {
            "0.0.0.0:4317": f"127.0.0.1:{grpc}", "0.0.0.0:4318": f"127.0.0.1:{http}",
            "0.0.0.0:9464": f"127.0.0.1:{metrics}", "/var/lib/otel-straggler": str(tmp)},
            remap(shard_env, {**stores, **secret_files(shard_files, tmp)}), metrics, stack)
        gw_cfg = remap(yaml.safe_load(gw_text), {"0.0.0.0:4317": f"127.0.0.1:{gw_grpc}",
                                                 "0.0.0.0:4318": f"127.0.0.1:{gw_http}"})
        dns = gw_cfg["exporters"]["load_balancing/straggler"]["resolver"]["dns"]
        assert dns["hostname"].startswith("straggler-collector-shards."), dns
        dns.update(hostname="127.0.0.1", port=str(grpc))  # the headless Service's one record: this shard
        gw = stack.enter_context(run_otelcol(tmp, gw_cfg, env=remap(gw_env, stores), name="gateway"))
        proc = stack.enter_context(process(node.argv(f"127.0.0.1:{gw_grpc}", job), node.log))
        stack.callback(node.stop)
        trace_id = verdict_trace(jaeger, job, node, lambda: proc.poll() is None and gw.proc.poll() is None)
        check_stores(jaeger, sink, trace_id)


FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] || exit 2
echo 127.0.0.1; echo node02
"""

FAKE_SRUN = """#!/bin/bash
# srun [--option=value ...] command...: runs the command here; the collector task listens on loopback
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
if [ "$1" = otel-straggler-collector ]; then
  export OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT=${OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT/0.0.0.0/127.0.0.1}
  export OTEL_STRAGGLER_OTLP_HTTP_ENDPOINT=${OTEL_STRAGGLER_OTLP_HTTP_ENDPOINT/0.0.0.0/127.0.0.1}
fi
exec "$@"
"""


def run_slurm(tmp: Path, jaeger: Jaeger, node: Node) -> str:
    collector = require_collector()
    fakebin = tmp / "bin"
    fakebin.mkdir()
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (fakebin / name).write_text(body)
        (fakebin / name).chmod(0o755)
    if len(collector) > 1:  # not installed as a script: one that runs the module
        (fakebin / "otel-straggler-collector").write_text(f'#!/bin/sh\nexec {" ".join(collector)} "$@"\n')
        (fakebin / "otel-straggler-collector").chmod(0o755)
    # the training command: the node, sending where the script tells every rank to, under the job id it sets
    train = tmp / "train.sh"
    argv = node.argv("ENDPOINT", "JOB")
    argv[argv.index("ENDPOINT")] = '"$OTEL_EXPORTER_OTLP_ENDPOINT"'
    argv[argv.index("JOB")] = '"$OTEL_STRAGGLER_JOB_ID"'
    train.write_text("#!/bin/sh\nexec " + " ".join(argv) + "\n")
    train.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SLURM_"))}
    env.update(PATH=os.pathsep.join([str(fakebin), str(Path(collector[0]).parent), env.get("PATH", "")]),
               SLURM_JOB_ID="4243", SLURM_JOB_NODELIST="node01,node02", SLURM_NNODES="2",
               OTEL_STRAGGLER_OUT=str(tmp / "out"), TRAIN_CMD=str(train),
               OTEL_STRAGGLER_TRACES_ENDPOINT=jaeger.otlp_grpc)
    job = "slurm-4243"
    with process(["bash", str(REPO / "deploy" / "slurm" / "train.sbatch")], node.log, env={**env}) as sbatch:
        try:
            trace_id = verdict_trace(jaeger, job, node, lambda: sbatch.poll() is None)
        finally:
            node.stop()
        assert sbatch.wait(timeout=60) == 0, tail(node.log) + tail(tmp / "out" / "collector.log")
    return trace_id


@pytest.mark.parametrize("profile", ["compose", "k8s-single", "k8s-sharded", "slurm"])
def test_the_profile_forwards_every_stage_span_and_the_verdict_span(
        profile: str, jaeger_store: Jaeger, tmp_path: Path) -> None:
    node = Node(tmp_path)
    job = f"profile-{profile}"
    if profile == "slurm":
        trace_id = run_slurm(tmp_path, jaeger_store, node)
        check_stores(jaeger_store, None, trace_id)
        return
    with TraceSink() as sink:
        {"compose": run_compose, "k8s-single": run_k8s_single, "k8s-sharded": run_k8s_sharded}[profile](
            tmp_path, jaeger_store, sink, node, job)


def test_the_profiles_files_are_what_the_test_reads() -> None:
    """The extraction above reads what the deployments run: the compose services mount the shipped configs, and
    the Kubernetes workloads resolve every ``--config`` to a ConfigMap key."""
    assert "otlp_grpc/straggler" in compose_config(compose_service("gateway"), "/etc/otelcol/config.yaml")
    for profile, workloads in (("single", ["straggler-collector"]),
                               ("sharded", ["straggler-collector-shard", "straggler-gateway"])):
        docs = k8s_docs(profile)
        for w in workloads:
            configs, env, _ = k8s_container(docs, w)
            assert configs and "JAEGER_OTLP_ENDPOINT" in env, (profile, w)
    assert subprocess.run(["bash", "-n", str(REPO / "deploy" / "slurm" / "train.sbatch")]).returncode == 0

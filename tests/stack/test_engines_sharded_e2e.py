"""Production-shaped, on the real engines: a TP x PP x DP job on simulated hosts -> the OpenTelemetry Collector
gateway (``load_balancing`` by ``straggler.cohort.key``) -> three straggler collector shards -> Jaeger v2, with a
real Prometheus and Alertmanager.

- 16 ranks (TP 2, PP 2, DP 4; four cohorts of four data-parallel peers) on 4 hosts. Each host is a network
  namespace with an address of its own on a bridge and a host name of its own (``SimulatedHosts``; where
  namespaces are refused, loopback and names only). Its ranks export through the stock OTel SDK
  (``BatchSpanProcessor`` + ``OTLPSpanExporter``, ``engine_node.py``).
- The gateway runs ``configs/otelcol-gateway-sharded.yaml`` (the compose profile) with the Kubernetes profile's
  DNS resolver (``deploy/kubernetes/sharded/gateway-config.yaml``): the shards' addresses come from a hosts file
  in the gateway's own mount namespace, as a headless Service's records would, so a shard removed from it is
  removed from the ring.
- Each shard runs ``configs/collector-compose.yaml`` (short windows, as the other stack tests) on its own loopback
  address and one shared port, forwarding verdict spans to Jaeger; the gateway forwards every stage span to Jaeger.
  Tempo (AGPL, not run here) is an in-test OTLP sink.
- Rank 5 (host node-1) is slow in forward-compute from step 6.

One run (module fixture): the verdict and the page, then the slow cohort's shard is killed and removed from the
records, and the run goes on until another shard judges the cohort. Each test checks one claim on that run. Waits
are generous bounds for a loaded machine, not latencies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from alerting_support import AlertStack, alert_stack
from engines_support import (
    REPO,
    Jaeger,
    Otelcol,
    SimulatedHosts,
    lb_ring_owner,
    metric_values,
    run_jaeger,
    run_otelcol,
)
from stack_support import (
    CONFIGS,
    TraceSink,
    collector_config,
    http_get,
    process,
    require_collector,
    tail,
    wait_until,
)

import otel_straggler_schema as s
from otel_straggler_demo.run import free_ports
from otel_straggler_schema.stages import STAGE_SCHEMA

pytestmark = pytest.mark.slow

JOB = "gpt 8b/run-3"
TP, PP, DP, GPUS_PER_HOST = 2, 2, 4, 4
WORLD = TP * PP * DP
HOSTS = WORLD // GPUS_PER_HOST
SLOW_RANK, SLOW_FROM = 5, 6
SLOW_HOST = f"node-{SLOW_RANK // GPUS_PER_HOST}"
SHARDS = 3
SHARD_NAME = "straggler-shards.test"
NODE_SCRIPT = Path(__file__).with_name("engine_node.py")
STAGE_NAMES = {"forward-compute", "backward-compute", "all-grads-sync"}
MAX_STEP = 160
COHORTS = [s.cohort_key(topology_epoch=0, stage_schema=STAGE_SCHEMA, tp=tp, pp=pp)
           for tp in range(TP) for pp in range(PP)]


@dataclass
class Shard:
    index: int
    address: str  # its OTLP/gRPC host:port, as the hosts file publishes it
    metrics: int
    proc: subprocess.Popen[bytes]
    log: Path

    def scrape(self) -> str:
        code, body = http_get(f"http://127.0.0.1:{self.metrics}/metrics")
        return body.decode() if code == 200 else ""

    def cohorts(self) -> set[str]:
        return {lab["cohort"] for lab, _ in metric_values(self.scrape(), s.M_RANK_DEVIATION)
                if lab.get("training_job") == JOB}

    def active_ranks(self) -> set[str]:
        return {lab["rank"] for lab, v in metric_values(self.scrape(), s.M_STRAGGLER_ACTIVE)
                if v > 0 and lab.get("training_job") == JOB and not lab.get("covered_by")}


@dataclass
class Run:
    tmp: Path
    hosts: SimulatedHosts
    jaeger: Jaeger
    gateway: Otelcol
    shards: list[Shard]
    st: AlertStack
    sink: TraceSink
    first_alert: dict[str, Any]
    owners_before: dict[str, int]  # cohort -> shard index judging it before the kill
    ring_before: dict[str, int]  # cohort -> shard index the load balancer's ring names for it, all shards up
    ring_after: dict[str, int]  # the same without the killed shard
    killed: int  # index of the shard killed
    kill_step: int
    rejudged_step: int  # first step at which a live shard held the slow rank's verdict again
    backends_after: float
    dns_isolated: bool
    notifications: list[dict[str, Any]] = field(default_factory=list)


def _shard_config(grpc: str, http_port: int, metrics: int, evidence: Path, jaeger: str, tempo: str) -> dict[str, Any]:
    cfg = collector_config(0, 0, metrics, evidence,
                           trace_endpoints={"otlp_grpc/jaeger": jaeger, "otlp_grpc/tempo": tempo})
    cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] = grpc
    cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"] = f"{grpc.rsplit(':', 1)[0]}:{http_port}"
    return cfg


def _gateway_config(listen_ip: str, grpc: int, http_port: int, shard_port: int) -> dict[str, Any]:
    cfg = yaml.safe_load((CONFIGS / "otelcol-gateway-sharded.yaml").read_text(encoding="utf-8"))
    cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] = f"{listen_ip}:{grpc}"
    cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"] = f"{listen_ip}:{http_port}"
    k8s = yaml.safe_load((REPO / "deploy/kubernetes/sharded/gateway-config.yaml").read_text(encoding="utf-8"))
    dns = yaml.safe_load(k8s["data"]["config.yaml"])["exporters"]["load_balancing/straggler"]["resolver"]["dns"]
    dns.update({"hostname": SHARD_NAME, "port": str(shard_port), "interval": "1s", "timeout": "1s"})
    cfg["exporters"]["load_balancing/straggler"]["resolver"] = {"dns": dns}
    return cfg


def _hosts_file(path: Path, shard_ips: list[str]) -> None:
    """Written in place (same inode): the gateway's bind mount keeps pointing at it."""
    lines = ["127.0.0.1 localhost"] + [f"{ip} {SHARD_NAME}" for ip in shard_ips]
    with open(path, "r+" if path.exists() else "w", encoding="utf-8") as f:
        f.seek(0)
        f.truncate()
        f.write("\n".join(lines) + "\n")


def _mount_ns_ok() -> bool:
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


class Nodes:
    """The simulated hosts' node processes and the files that drive them."""

    def __init__(self, tmp: Path, hosts: SimulatedHosts, endpoint: str, stack: contextlib.ExitStack) -> None:
        self.tmp = tmp
        self.controls, self.dones, self.logs = [], [], []
        t0_ns = time.time_ns() - 600 * 10**9  # steps 1 s apart, all in the past
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        for i in range(HOSTS):
            control, done, log = tmp / f"node{i}.control", tmp / f"node{i}.done", tmp / f"node{i}.log"
            control.write_text("-1")
            ranks = ",".join(str(r) for r in range(i * GPUS_PER_HOST, (i + 1) * GPUS_PER_HOST))
            argv = [sys.executable, str(NODE_SCRIPT), "--endpoint", endpoint, "--job", JOB, "--ranks", ranks,
                    "--tp", str(TP), "--pp", str(PP), "--dp", str(DP), "--gpus-per-node", str(GPUS_PER_HOST),
                    "--slow-rank", str(SLOW_RANK), "--slow-from", str(SLOW_FROM), "--slow-factor", "1.6",
                    "--t0-ns", str(t0_ns), "--control", str(control), "--done", str(done)]
            stack.enter_context(process(hosts.argv(i, f"node-{i}", argv), log, env=env))
            self.controls.append(control)
            self.dones.append(done)
            self.logs.append(log)
        self.step = -1

    def advance(self, to_step: int, timeout_s: float = 90.0) -> None:
        for c in self.controls:
            c.write_text(str(to_step))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = [int(d.read_text() or -1) if d.exists() else -1 for d in self.dones]
            if min(done) >= to_step:
                self.step = to_step
                return
            time.sleep(0.05)
        raise AssertionError(f"nodes did not flush step {to_step}: " + "\n".join(tail(log) for log in self.logs))

    def stop(self) -> None:
        for c in self.controls:
            c.write_text("stop")


def _firing(st: AlertStack) -> list[dict[str, Any]]:
    return st.hook.alerts("firing")


def _run_until(nodes: Nodes, pred: Any, what: str, limit: int = MAX_STEP, pause_s: float = 0.15) -> Any:
    while nodes.step < limit:
        nodes.advance(nodes.step + 1)
        got = pred()
        if got:
            return got
        time.sleep(pause_s)
    # the last steps are in; give scrapes, rule evaluation and Alertmanager time to catch up
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what}: not seen by step {nodes.step}")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("engines-sharded")
    argv = require_collector()
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(SimulatedHosts(HOSTS))
        sink = stack.enter_context(TraceSink())
        jaeger = stack.enter_context(run_jaeger(tmp))
        shard_ips = [f"127.0.0.{11 + i}" for i in range(SHARDS)]
        # the ring hashes the shards' ip:port: a port whose ring spreads the cohorts over at least two shards
        for _ in range(50):
            shard_port, gw_grpc, gw_http, *rest = free_ports(3 + 2 * SHARDS)
            ring_before = _ring([f"{ip}:{shard_port}" for ip in shard_ips])
            if len(set(ring_before.values())) >= 2:
                break
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        shards = []
        for i, ip in enumerate(shard_ips):
            http_port, metrics = rest[2 * i], rest[2 * i + 1]
            cfg = _shard_config(f"{ip}:{shard_port}", http_port, metrics, tmp / f"evidence{i}.jsonl",
                                jaeger.otlp_grpc, sink.endpoint)
            path = tmp / f"shard{i}.yaml"
            path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
            log = tmp / f"shard{i}.log"
            proc = stack.enter_context(process([*argv, "--config", str(path)], log, env=env))
            shards.append(Shard(i, f"{ip}:{shard_port}", metrics, proc, log))
        for sh in shards:
            wait_until(lambda sh=sh: (sh.proc.poll() is None and bool(sh.scrape())) or sh.proc.poll() is not None, 120,
                       what=f"shard {sh.index} /metrics")
            assert sh.proc.poll() is None, tail(sh.log)
        hosts_file = tmp / "hosts"
        _hosts_file(hosts_file, shard_ips)
        dns_isolated = _mount_ns_ok()
        wrap = (["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts_file)]
                if dns_isolated else None)
        gw_cfg = _gateway_config(hosts.gateway_ip, gw_grpc, gw_http, shard_port)
        if not dns_isolated:  # no mount namespace: the compose profile's static list (no re-routing)
            gw_cfg["exporters"]["load_balancing/straggler"]["resolver"] = {"static": {"hostnames": [
                sh.address for sh in shards]}}
        gateway = stack.enter_context(run_otelcol(tmp, gw_cfg, env={
            "JAEGER_OTLP_ENDPOINT": jaeger.otlp_grpc, "TEMPO_OTLP_ENDPOINT": sink.endpoint}, name="gateway",
            wrap=wrap))
        st = stack.enter_context(alert_stack(tmp, [sh.metrics for sh in shards], shards[0].log,
                                             extra_jobs={"otelcol-gateway": [f"127.0.0.1:{gateway.telemetry_port}"]}))
        nodes = Nodes(tmp, hosts, f"{hosts.gateway_ip}:{gw_grpc}", stack)
        stack.callback(nodes.stop)

        first = _run_until(nodes, lambda: [a for a in _firing(st) if a["labels"].get("rank") == str(SLOW_RANK)],
                           "the slow rank's StragglerDetected page")[0]
        owners: dict[str, int] = {}
        for sh in shards:
            for cohort in sh.cohorts():
                assert cohort not in owners, f"cohort {cohort} judged on shards {owners[cohort]} and {sh.index}"
                owners[cohort] = sh.index
        slow_cohort = first["labels"]["cohort"]
        victim = shards[owners[slow_cohort]]

        # the shard dies; for two steps its record is still published (as a Service's endpoints lag a pod's death)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(timeout=10)
        kill_step = nodes.step
        nodes.advance(kill_step + 2)
        _hosts_file(hosts_file, [ip for i, ip in enumerate(shard_ips) if i != victim.index])
        live = [sh for sh in shards if sh is not victim]
        ring_after = _ring([sh.address if sh is not victim else "" for sh in shards])

        def rejudged() -> int:
            return nodes.step if any(str(SLOW_RANK) in sh.active_ranks() for sh in live) else 0

        rejudged_step = _run_until(nodes, rejudged, "the slow rank judged again on a live shard",
                                   limit=kill_step + 80)
        backends = _run_until(nodes, lambda: [v for lab, v in metric_values(
            gateway.metrics(), "otelcol_loadbalancer_num_backends")] or None, "the gateway's backend count",
            limit=rejudged_step + 5)[-1]
        # let the new verdict page (or not) through Prometheus and Alertmanager
        _run_until(nodes, lambda: [a for a in _firing(st) if a["labels"].get("rank") == str(SLOW_RANK)
                                   and a["labels"].get("first_step") != first["labels"].get("first_step")],
                   "the re-judged verdict at Alertmanager", limit=rejudged_step + 40)
        nodes.advance(nodes.step + 3)
        time.sleep(3)
        yield Run(tmp, hosts, jaeger, gateway, shards, st, sink, first, owners, ring_before, ring_after,
                  victim.index, kill_step,
                  rejudged_step, backends, dns_isolated, list(st.hook.notifications))


def _ring(endpoints: list[str]) -> dict[str, int]:
    """cohort -> index in ``endpoints`` of the shard the gateway's ring sends it to ("" marks a shard not in the
    ring)."""
    live = sorted(ep for ep in endpoints if ep)
    return {c: endpoints.index(lb_ring_owner(live, {s.RES_COHORT_KEY: c})) for c in COHORTS}


def _wait_trace(jaeger: Jaeger, trace_id: str, pred: Any, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    spans: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        spans = jaeger.trace(trace_id)
        if pred(spans):
            return spans
        time.sleep(0.5)
    raise AssertionError(f"trace {trace_id} in Jaeger: {len(spans)} spans, "
                         f"{sorted({sp['operationName'] for sp in spans})}\n{tail(jaeger.log)}")


def _step_trace_complete(spans: list[dict[str, Any]]) -> bool:
    names = [sp["operationName"] for sp in spans]
    return (sum(n in STAGE_NAMES for n in names) == WORLD * len(STAGE_NAMES)
            and names.count(s.SPAN_RANK_STEP) == WORLD and s.SPAN_VERDICT in names)


def test_the_ranks_ran_on_separate_hosts(run: Run) -> None:
    if not run.hosts.isolated:
        pytest.skip("network namespaces refused here: the hosts shared loopback (names only)")
    text = run.shards[(run.killed + 1) % SHARDS].scrape() + run.shards[(run.killed + 2) % SHARDS].scrape()
    hosts_seen = {lab.get("host") for lab, _ in metric_values(text, s.M_STRAGGLER_ACTIVE)}
    assert SLOW_HOST in hosts_seen
    assert run.gateway.proc.poll() is None


def test_every_cohort_is_judged_on_exactly_one_shard(run: Run) -> None:
    """Each cohort on the one shard the gateway's consistent-hash ring names for it (``lb_ring_owner``), the
    cohorts over at least two shards (the port is chosen so)."""
    assert len(run.owners_before) == TP * PP, run.owners_before
    assert run.owners_before == run.ring_before
    assert len(set(run.owners_before.values())) >= 2, f"the ring put every cohort on one shard: {run.owners_before}"


def test_the_straggler_is_found_and_paged(run: Run) -> None:
    labels = run.first_alert["labels"]
    assert labels["rank"] == str(SLOW_RANK) and labels["host"] == SLOW_HOST, labels
    assert labels["stage"] == "forward-compute" and labels["training_job"] == JOB, labels
    wrong = {a["labels"]["rank"] for n in run.notifications for a in n["alerts"]
             if a["labels"].get("alertname") == "StragglerDetected"} - {str(SLOW_RANK)}
    assert not wrong, f"healthy ranks paged: {wrong}"


def test_the_alerts_jaeger_link_opens_the_step_trace(run: Run) -> None:
    link = run.first_alert["annotations"]["jaeger_url"]
    path = urllib.parse.urlsplit(link).path
    trace_id = run.first_alert["labels"]["trace_id"]
    assert path == f"/trace/{trace_id}", link
    assert run.jaeger.get(path)[0] == 200  # the UI's route
    spans = _wait_trace(run.jaeger, trace_id, _step_trace_complete)
    verdicts = [sp for sp in spans if sp["operationName"] == s.SPAN_VERDICT]
    ids = {sp["spanID"] for sp in spans}
    for sp in spans:  # every parent is in the trace: the UI shows one tree, no "missing span" roots
        for ref in sp.get("references", []):
            assert ref["spanID"] in ids, (sp["operationName"], ref)
    tags = {t["key"]: t["value"] for t in verdicts[0]["tags"]}
    assert str(tags.get(s.EV_RANK)) == str(SLOW_RANK), tags
    processes = {p["serviceName"] for p in json.loads(run.jaeger.get(f"/api/traces/{trace_id}")[1])["data"][0][
        "processes"].values()}
    assert {"megatron-training", "otel-straggler-collector"} <= processes


def test_the_exemplars_trace_id_opens_in_jaeger(run: Run) -> None:
    ex = run.st.exemplars(f'{s.M_GPU_LOST_SECONDS}{{training_job="{JOB}"}}')
    trace_ids = {e["labels"]["trace_id"] for series in ex for e in series["exemplars"]}
    assert trace_ids, ex
    for trace_id in trace_ids:
        _wait_trace(run.jaeger, trace_id, _step_trace_complete)


def test_a_killed_shards_cohorts_are_rerouted_and_judged_again(run: Run) -> None:
    if not run.dns_isolated:
        pytest.skip("no mount namespace for the gateway's hosts file: the static resolver cannot re-route")
    assert run.backends_after == SHARDS - 1
    gap = run.rejudged_step - run.kill_step
    assert 0 < gap <= 60, gap
    live = [sh for sh in run.shards if sh.index != run.killed]
    owners_after: dict[str, int] = {}
    for sh in live:
        for cohort in sh.cohorts():
            assert cohort not in owners_after, f"cohort {cohort} on two live shards"
            owners_after[cohort] = sh.index
    for cohort, shard in run.owners_before.items():
        if shard != run.killed:  # consistent hashing moves only the dead shard's cohorts
            assert owners_after.get(cohort) == shard, (cohort, shard, owners_after)
        else:
            assert owners_after.get(cohort) == run.ring_after[cohort], (cohort, owners_after, run.ring_after)


def test_no_duplicate_page_after_the_reroute(run: Run) -> None:
    """The re-judged verdict is a new alert (its first step and trace differ) in the same Alertmanager group as
    the first one (grouped by job and host): one page for the slow host, updated, not a second one."""
    firing = [n for n in run.notifications if n["status"] == "firing"
              and n["commonLabels"].get("alertname") == "StragglerDetected"]
    assert {n["groupKey"] for n in firing} == {firing[0]["groupKey"]}, [n["groupKey"] for n in firing]
    first_steps = {a["labels"]["first_step"] for n in firing for a in n["alerts"]}
    assert len(first_steps) >= 2, first_steps  # the verdict of the live shard paged within the same group


def test_queues_and_drops_are_visible_in_metrics(run: Run) -> None:
    gw = run.st.query('{job="otelcol-gateway", '
                      '__name__=~"otelcol_exporter_queue_size|otelcol_exporter_send_failed_spans.*"}')
    exporters = {(m["__name__"], m.get("exporter")) for m in gw}
    # the load balancer's own queue (its per-shard exporters keep none) and the trace store's
    assert {("otelcol_exporter_queue_size", "load_balancing/straggler"),
            ("otelcol_exporter_queue_size", "otlp_grpc/jaeger")} <= exporters, exporters
    outcome = run.st.query('otelcol_loadbalancer_backend_outcome{success="false"} > 0')
    if run.dns_isolated:
        assert outcome, "the exports to the killed shard are not counted as failed:\n" + "\n".join(
            line for line in run.gateway.metrics().splitlines()
            if any(w in line for w in ("fail", "drop", "queue", "outcome", "refused")))
    shards = run.st.query(f'{{job="otel-straggler-collector", __name__=~"{s.M_QUEUE_DEPTH}|{s.M_SPANS_DROPPED}"}}')
    assert {m["__name__"] for m in shards} == {s.M_QUEUE_DEPTH, s.M_SPANS_DROPPED}, shards

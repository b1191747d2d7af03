"""Scale on the real load balancer: a simulated job of ``--ranks`` ranks (the simulator's ranks, not processes)
through the real OpenTelemetry Collector gateway (``configs/otelcol-gateway-sharded.yaml``: ``load_balancing`` by
``straggler.cohort.key``, static resolver listing the shards) into ``--shards`` straggler collector shards
(``configs/collector-compose.yaml``), all on this machine.

Load: ``jobsim.load`` (the emitter's default detail, ``step``: 14 spans per rank-step), one
``ResourceSpans`` per rank and step as the rank's SDK batches it, ``--ranks-per-request`` consecutive ranks (one
host's GPUs) per OTLP/gRPC request (as a node-local agent forwards them), step by step over the whole job. One
rank is slowed in forward-compute from ``--slow-from`` on, so a verdict is expected. A refused request (the
gateway's receiver refuses when its queue is full) is retried after a back-off, as the SDK does; one that still
fails after ``--retry-s`` is counted as lost.

Measured per process (gateway, every shard, the load generator): CPU seconds (``/proc``, the whole process
group), RSS (start, peak, end), and from the components' own metrics: spans accepted, queue depths, drops,
refusals, late spans, verdicts; the gateway's per-backend outcomes, queue and send failures. Every process
shares the same cores, so the wall-clock rates are lower bounds; the extrapolation uses spans per CPU second of
each component, which does not depend on how the cores were shared.

  python bench/scale_sharded.py --shards 4                       # 131,072 ranks, as many steps as --time-limit
  python bench/scale_sharded.py --ranks 1024 --shards 2 --steps 3 --time-limit 60   # smoke

Last line: ranks=<> shards=<> steps=<> spans=<> lost=<> keeps_up=<> verdict_on_slow_rank=<> ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "stack"))

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


# --- the load generator (a process of its own) ------------------------------------------------------------------


def generate(endpoint: str, ranks: int, dp: int, steps: int, per_request: int, slow_rank: int, slow_from: int,
             slow_factor: float, time_limit_s: float, retry_s: float, senders: int) -> None:
    """Send the job's steps to ``endpoint``; one JSON line per finished step on stdout."""
    import grpc

    import otel_straggler_schema as s
    from jobsim.job import Layout
    from jobsim.load import LoadConfig, sdk_requests

    cfg = LoadConfig(Layout(dp=dp, tp=max(1, ranks // dp)), detail=s.DETAIL_STEP, slow_rank=slow_rank,
                     slow_from=slow_from, slow_factor=slow_factor)
    cfg.spans_per_request = cfg.spans_per_rank_step
    channel = grpc.insecure_channel(endpoint, options=[("grpc.max_send_message_length", 17 << 20)])
    grpc.channel_ready_future(channel).result(timeout=60)
    call = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
    work: queue.Queue[bytes | None] = queue.Queue(maxsize=4 * senders)
    counts = {"requests": 0, "retries": 0, "lost_requests": 0, "errors": 0}
    lock = threading.Lock()

    def sender() -> None:
        while True:
            raw = work.get()
            if raw is None:
                return
            give_up = time.monotonic() + retry_s
            delay = 0.05
            while True:
                try:
                    call(raw, timeout=30)
                    with lock:
                        counts["requests"] += 1
                    break
                except grpc.RpcError as e:
                    retry = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         grpc.StatusCode.DEADLINE_EXCEEDED)
                    with lock:
                        counts["retries" if retry else "errors"] += 1
                    if not retry or time.monotonic() > give_up:
                        with lock:
                            counts["lost_requests"] += 1
                        break
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(senders)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + time_limit_s
    t0 = time.monotonic()
    world = cfg.layout.world_size
    done_steps = 0
    pack: list[bytes] = []
    # one request per rank-step, round-robin over ranks: every ``world`` requests are one step of the job
    for i, raw in enumerate(sdk_requests(cfg, range(1, steps + 1)), 1):
        pack.append(raw)
        if len(pack) == per_request or i % world == 0:
            work.put(b"".join(pack))  # repeated resource_spans: requests concatenate
            pack = []
        if i % world == 0:
            done_steps += 1
            with lock:
                line = {"step": done_steps, "t": round(time.monotonic() - t0, 2),
                        "spans": done_steps * world * cfg.spans_per_rank_step, **counts}
            print(json.dumps(line), flush=True)
            if time.monotonic() > deadline:
                break
    for _ in threads:
        work.put(None)
    for t in threads:
        t.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"done": True, "steps": done_steps, "t": round(time.monotonic() - t0, 2),
                      "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024),
                      "spans": done_steps * world * cfg.spans_per_rank_step,
                      "spans_per_rank_step": cfg.spans_per_rank_step, **counts}), flush=True)


# --- measuring the processes ----------------------------------------------------------------------------------


def group_usage(pgid: int) -> tuple[float, float]:
    """(CPU seconds, RSS MiB) of every live process of process group ``pgid``."""
    cpu, rss = 0.0, 0.0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = raw[raw.rindex(")") + 2:].split()
        if int(f[2]) != pgid:
            continue
        cpu += (int(f[11]) + int(f[12])) / CLK_TCK
        rss += int(f[21]) * PAGE_KIB / 1024.0
    return cpu, rss


def total(text: str, name: str, **match: str) -> float:
    """Sum of the samples of ``name`` (or ``name_total``) whose labels include ``match``."""
    from engines_support import metric_values

    out = 0.0
    for n in {name, name + "_total"} if not name.endswith("_total") else {name}:
        out += sum(v for lab, v in metric_values(text, n) if all(lab.get(k) == x for k, x in match.items()))
    return out


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    from engines_support import metric_values

    out: dict[str, float] = {}
    for n in {name, name + "_total"} if not name.endswith("_total") else {name}:
        for lab, v in metric_values(text, n):
            out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


@dataclass
class Proc:
    """A started process (its own process group) and what was sampled of it."""

    name: str
    proc: subprocess.Popen[bytes]
    metrics_url: str
    base_rss_mb: float = 0.0
    base_cpu_s: float = 0.0
    peak_rss_mb: float = 0.0
    rss_mb: float = 0.0
    cpu_s: float = 0.0
    max_queue: float = 0.0
    last: str = ""
    samples: list[dict[str, float]] = field(default_factory=list)

    def sample(self, t: float, queue_metric: str) -> None:
        from stack_support import http_get

        cpu, rss = group_usage(self.proc.pid)
        if rss:
            self.cpu_s, self.rss_mb = cpu, rss
            self.peak_rss_mb = max(self.peak_rss_mb, rss)
        code, body = http_get(self.metrics_url, timeout=5.0) if self.metrics_url else (0, b"")
        if code == 200:
            self.last = body.decode()
            self.max_queue = max(self.max_queue, total(self.last, queue_metric))
        self.samples.append({"t": round(t, 1), "cpu_s": round(self.cpu_s, 2), "rss_mb": round(self.rss_mb, 1)})


@contextlib.contextmanager
def started(argv: list[str], log: Path, env: dict[str, str], name: str, metrics_url: str) -> Iterator[Proc]:
    """``argv`` in a process group of its own; on exit the whole group gets SIGTERM, then SIGKILL."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=ROOT)
    try:
        yield Proc(name, proc, metrics_url)
    finally:
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue


def _wait(pred: Any, timeout_s: float, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    from stack_support import tail

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: exited with {proc.returncode}\n{tail(log)}")
        if pred():
            return
        time.sleep(0.3)
    raise RuntimeError(f"{what}: not ready in {timeout_s:.0f} s\n{tail(log)}")


# --- the run ----------------------------------------------------------------------------------------------------


def shard_config(grpc: int, http_port: int, metrics: int, evidence: Path, straggler: dict[str, Any],
                 memory_limit_mib: int) -> dict[str, Any]:
    """The compose collector (the sharded profile's shard) on loopback ports, verdict-span forwarders off."""
    from stack_support import collector_config

    cfg = collector_config(grpc, http_port, metrics, evidence, straggler=straggler)
    if memory_limit_mib:
        cfg["processors"]["memory_limiter"] = {"limit_mib": memory_limit_mib,
                                               "spike_limit_mib": max(256, memory_limit_mib // 8),
                                               "check_interval": 1}
    return cfg


def gateway_config(grpc: int, http_port: int, shards: list[str], lb_batch: str = "") -> dict[str, Any]:
    """``configs/otelcol-gateway-sharded.yaml`` on loopback, its static resolver listing ``shards``, and the trace
    stores' exporters left out (their sizing is the stores' own: every span goes to them unchanged)."""
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "otelcol-gateway-sharded.yaml").read_text(encoding="utf-8"))
    cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] = f"127.0.0.1:{grpc}"
    cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"] = f"127.0.0.1:{http_port}"
    cfg["exporters"]["load_balancing/straggler"]["resolver"] = {"static": {"hostnames": shards}}
    for store in ("otlp_grpc/jaeger", "otlp_grpc/tempo"):
        del cfg["exporters"][store]
    cfg["service"]["pipelines"]["traces"]["exporters"] = ["load_balancing/straggler"]
    if lb_batch:  # the load balancer's queue batching as given (JSON), replacing the shipped setting
        cfg["exporters"]["load_balancing/straggler"]["sending_queue"]["batch"] = json.loads(lb_batch)
    return cfg


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from engines_support import otelcol
    from stack_support import http_get, require_collector

    import otel_straggler_schema as s
    from otel_straggler_demo.run import free_ports

    binary = otelcol()
    collector = require_collector()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    straggler = json.loads(args.straggler)
    ports = free_ports(3 * args.shards + 4)
    gw_grpc, gw_http, gw_health, gw_metrics = ports[-4:]
    shard_eps = [f"127.0.0.1:{ports[3 * i]}" for i in range(args.shards)]
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        import yaml

        shards: list[Proc] = []
        for i in range(args.shards):
            grpc, http_port, metrics = ports[3 * i: 3 * i + 3]
            path = tmp / f"shard{i}.yaml"
            path.write_text(yaml.safe_dump(shard_config(grpc, http_port, metrics, tmp / f"evidence{i}.jsonl",
                                                        straggler, args.shard_memory_mib)), encoding="utf-8")
            shards.append(stack.enter_context(started([*collector, "--config", str(path)], tmp / f"shard{i}.log",
                                                      env, f"shard{i}", f"http://127.0.0.1:{metrics}/metrics")))
        gw_cfg = gateway_config(gw_grpc, gw_http, shard_eps, args.lb_batch)
        gw_cfg["extensions"]["health_check"] = {"endpoint": f"127.0.0.1:{gw_health}"}
        gw_cfg["service"]["telemetry"]["metrics"]["readers"] = [
            {"pull": {"exporter": {"prometheus": {"host": "127.0.0.1", "port": gw_metrics}}}}]
        (tmp / "gateway.yaml").write_text(yaml.safe_dump(gw_cfg), encoding="utf-8")
        gateway = stack.enter_context(started([binary, f"--config={tmp / 'gateway.yaml'}"], tmp / "gateway.log",
                                              {"PATH": env.get("PATH", ""), "HOME": str(tmp)}, "gateway",
                                              f"http://127.0.0.1:{gw_metrics}/metrics"))
        for sh in shards:
            _wait(lambda sh=sh: http_get(sh.metrics_url)[0] == 200, 120, sh.name, sh.proc, tmp / f"{sh.name}.log")
        _wait(lambda: http_get(f"http://127.0.0.1:{gw_health}/")[0] == 200, 60, "gateway", gateway.proc,
              tmp / "gateway.log")
        everyone = [gateway, *shards]
        for p in everyone:
            p.sample(0.0, "")
            p.base_rss_mb = p.rss_mb
            p.base_cpu_s = p.cpu_s
            p.peak_rss_mb = p.rss_mb
        gen_log = tmp / "generator.log"
        gen_argv = [sys.executable, __file__, "--generate", f"127.0.0.1:{gw_grpc}", "--ranks", str(args.ranks),
                    "--dp", str(args.dp), "--steps", str(args.steps), "--ranks-per-request",
                    str(args.ranks_per_request), "--slow-rank", str(args.slow_rank), "--slow-from",
                    str(args.slow_from), "--slow-factor", str(args.slow_factor), "--time-limit",
                    str(args.time_limit), "--retry-s", str(args.retry_s), "--senders", str(args.senders)]
        gen = stack.enter_context(started(gen_argv, gen_log, env, "generator", ""))
        t0 = time.monotonic()
        hard_stop = t0 + args.time_limit + args.drain_s + 120

        def sample_all() -> None:
            t = time.monotonic() - t0
            for p in everyone:
                p.sample(t, s.M_QUEUE_DEPTH if p is not gateway else "otelcol_exporter_queue_size")
            gen.sample(t, "")

        while gen.proc.poll() is None and time.monotonic() < hard_stop:
            sample_all()
            time.sleep(args.sample_s)
        t_sent = time.monotonic() - t0
        gen.sample(t_sent, "")
        lines = [json.loads(x) for x in gen_log.read_text().splitlines() if x.startswith("{")]
        if not lines or not lines[-1].get("done"):
            raise RuntimeError(f"generator did not finish:\n{gen_log.read_text()[-3000:]}")
        gdone = lines[-1]
        # drain: every shard's accepted count settles and every queue is empty
        settled, prev = 0, None
        drain_end = time.monotonic() + args.drain_s
        while time.monotonic() < drain_end and settled < 3:
            time.sleep(args.sample_s)
            sample_all()
            now = [total(sh.last, s.M_SPANS_ACCEPTED) for sh in shards]
            queues = [total(sh.last, s.M_QUEUE_DEPTH) for sh in shards] + [
                total(gateway.last, "otelcol_exporter_queue_size")]
            settled = settled + 1 if now == prev and not any(queues) else 0
            prev = now
        t_drained = time.monotonic() - t0
        # the last steps' windows close by progress only when later steps come: wait for the verdict (bounded)
        verdict_end = time.monotonic() + args.verdict_wait_s

        def slow_rank_convicted() -> list[str]:
            return [sh.name for sh in shards if any(
                v > 0 for lab, v in _values(sh.last, s.M_STRAGGLER_ACTIVE) if lab.get("rank") == str(args.slow_rank))]

        while not slow_rank_convicted() and time.monotonic() < verdict_end:
            time.sleep(args.sample_s)
            sample_all()
        convicted = slow_rank_convicted()
        result = summarize(args, gateway, shards, gen, gdone, lines, t_sent, t_drained, convicted)
        result["setup_s"] = round(t0 - t_start, 1)
        return result


def _values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    from engines_support import metric_values

    return metric_values(text, name)


def summarize(args: argparse.Namespace, gateway: Proc, shards: list[Proc], gen: Proc, gdone: dict[str, Any],
              lines: list[dict[str, Any]], t_sent: float, t_drained: float, convicted: list[str]) -> dict[str, Any]:
    import otel_straggler_schema as s

    spr = int(gdone["spans_per_rank_step"])
    steps = int(gdone["steps"])
    rows = []
    for sh in shards:
        m = sh.last
        accepted = total(m, s.M_SPANS_ACCEPTED)
        ranks = accepted / max(1, steps * spr)
        cpu = sh.cpu_s - sh.base_cpu_s  # the load's, not the start-up's
        rejected = {k: v for k, v in by_label(m, s.M_SPANS_REJECTED, "reason").items() if v}
        dropped = {k: v for k, v in by_label(m, s.M_SPANS_DROPPED, "reason").items() if v}
        outcomes = {k: v for k, v in by_label(m, s.M_REQUESTS, "outcome").items() if v}
        verdicts = {k: v for k, v in by_label(m, s.M_VERDICTS, "verdict").items() if v}
        final_queue = total(m, s.M_QUEUE_DEPTH)
        evictions = {k: v for k, v in by_label(m, s.M_EVICTIONS, "structure").items() if v}
        rows.append({
            "shard": sh.name, "spans": int(accepted), "ranks": round(ranks), "cpu_s": round(cpu, 1),
            "spans_per_s": round(accepted / max(t_sent, 1e-9)),
            "spans_per_cpu_s": round(accepted / max(cpu, 1e-9)),
            "base_rss_mb": round(sh.base_rss_mb), "peak_rss_mb": round(sh.peak_rss_mb), "end_rss_mb": round(sh.rss_mb),
            "kib_per_rank": round((sh.peak_rss_mb - sh.base_rss_mb) * 1024 / max(ranks, 1), 1),
            "max_queue": int(sh.max_queue), "end_queue": int(final_queue), "rejected": rejected, "dropped": dropped,
            "throttled_requests": int(outcomes.get("throttled", 0)), "verdicts": verdicts, "evictions": evictions,
            "windows_closed": int(total(m, s.M_WINDOWS_CLOSED)),
            # evicted cohorts or states (a shard over max_cohorts / max_states) judge nothing they lost
            # (metric_series: per-rank dashboard series beyond metrics.max_series, judging is not affected)
            "keeps_up": (not dropped and not rejected.get("late") and not final_queue and accepted > 0
                         and not set(evictions) - {"metric_series"}),
        })
    g = gateway.last
    lb = "load_balancing/straggler"
    gw = {
        "accepted": int(total(g, "otelcol_receiver_accepted_spans")),
        "refused": int(total(g, "otelcol_receiver_refused_spans")),
        "sent": int(total(g, "otelcol_exporter_sent_spans", exporter=lb)),
        "send_failed": int(total(g, "otelcol_exporter_send_failed_spans", exporter=lb)),
        "enqueue_failed": int(total(g, "otelcol_exporter_enqueue_failed_spans", exporter=lb)),
        "backend_failures": int(total(g, "otelcol_loadbalancer_backend_outcome", success="false")),
        "backend_successes": int(total(g, "otelcol_loadbalancer_backend_outcome", success="true")),
        "max_queue": int(gateway.max_queue), "end_queue": int(total(g, "otelcol_exporter_queue_size")),
        "cpu_s": round(gateway.cpu_s - gateway.base_cpu_s, 1), "base_rss_mb": round(gateway.base_rss_mb),
        "peak_rss_mb": round(gateway.peak_rss_mb),
    }
    gw["spans_per_cpu_s"] = round(gw["sent"] / max(gw["cpu_s"], 1e-9))
    gw["spans_per_s"] = round(gw["accepted"] / max(t_sent, 1e-9))
    sent_spans = int(gdone["spans"])
    # RSS against ranks across the shards (the ring gives them different shares): the per-rank cost without the
    # fixed part (interpreter, metric series up to their cap)
    xs, ys = [x["ranks"] for x in rows], [x["peak_rss_mb"] for x in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope_kib = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx * 1024 if sxx else float("nan")
    shard_spans = sum(r["spans"] for r in rows)
    return {"ranks": args.ranks, "dp": args.dp, "cohorts": args.ranks // args.dp, "shards": len(shards),
            "steps": steps, "spans_per_rank_step": spr, "ranks_per_request": args.ranks_per_request,
            "spans_sent": sent_spans, "spans_at_shards": shard_spans, "lost": sent_spans - shard_spans,
            "send_s": round(t_sent, 1), "drained_s": round(t_drained, 1),
            "step_s": round(t_sent / max(steps, 1), 1), "steps_log": lines,
            "generator": {k: gdone[k] for k in ("requests", "retries", "lost_requests", "errors", "cpu_s",
                                                "peak_rss_mb")},
            "gateway": gw, "per_shard": rows, "kib_per_rank_slope": round(slope_kib, 1),
            "slow_rank": args.slow_rank, "convicted_on": convicted,
            "cpus": os.cpu_count(), "load_avg_end": os.getloadavg()}


def extrapolate(r: dict[str, Any], target_ranks: int, periods: list[float], shard_mib: float,
                headroom: float, straggler: dict[str, Any], states_per_rank: int) -> list[str]:
    """Shard and gateway counts for ``target_ranks`` from the measured per-CPU-second and per-rank figures."""
    spr = r["spans_per_rank_step"]
    rows = r["per_shard"]
    shard_rate = min(x["spans_per_cpu_s"] for x in rows)  # the slowest shard's, per core
    kib = max(x["kib_per_rank"] for x in rows)
    base = max(x["base_rss_mb"] for x in rows)
    imbalance = max(x["ranks"] for x in rows) / max(1.0, sum(x["ranks"] for x in rows) / len(rows))
    from collector_processor.processor.straggler.config import Config

    cfg = Config(**straggler)
    # the processor's bounds: beyond them cohorts / states are evicted (least recently seen), and a shard whose
    # ranks report round-robin then loses every cohort before its windows close
    ranks_by_caps = min(cfg.max_cohorts * r["dp"], cfg.max_states // states_per_rank)
    ranks_by_mem = min((shard_mib - base) * 1024 / max(kib, 1e-9), ranks_by_caps)
    gw_rate = r["gateway"]["spans_per_cpu_s"]
    out = [f"extrapolation for {target_ranks} ranks x {spr} spans per rank-step; a shard is one core at "
           f"{shard_rate} spans/s (the slowest measured shard, per CPU second), loaded to {headroom:.0%}; memory "
           f"{kib} KiB per rank over a {base} MiB base, {shard_mib:g} MiB per shard, and the processor's bounds "
           f"(max_cohorts {cfg.max_cohorts} x DP {r['dp']}, max_states {cfg.max_states} / {states_per_rank} per rank: "
           f"{ranks_by_caps} ranks) -> at most {ranks_by_mem:.0f} ranks per shard; the ring's imbalance measured "
           f"here: max/mean ranks per shard = {imbalance:.2f}; "
           f"gateway {gw_rate} spans per CPU second"]
    for p in periods:
        need = target_ranks * spr / p
        by_cpu = math.ceil(need * imbalance / (shard_rate * headroom))
        by_mem = math.ceil(target_ranks * imbalance / ranks_by_mem)
        gw_cores = need / (gw_rate * headroom)
        out.append(f"step {p:g} s: {need:.0f} spans/s; shards: {max(by_cpu, by_mem)} (cpu {by_cpu}, memory and "
                   f"bounds {by_mem}); gateway cores: {gw_cores:.1f} ({math.ceil(gw_cores / 4)} gateways of 4 cores)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=131_072)
    ap.add_argument("--dp", type=int, default=128, help="data-parallel size: cohorts = ranks / dp")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1000, help="at most; --time-limit ends the load first")
    ap.add_argument("--time-limit", type=float, default=420.0, help="seconds of load (the step under way ends)")
    ap.add_argument("--ranks-per-request", type=int, default=8)
    ap.add_argument("--senders", type=int, default=4, help="concurrent requests of the generator")
    ap.add_argument("--slow-rank", type=int, default=4242)
    ap.add_argument("--slow-from", type=int, default=4)
    ap.add_argument("--slow-factor", type=float, default=1.3)
    ap.add_argument("--straggler", default="{}", help="straggler processor settings (JSON; {}: the shipped ones)")
    ap.add_argument("--shard-memory-mib", type=int, default=0, help="shards' memory_limiter limit (0: compose's)")
    ap.add_argument("--lb-batch", default="", help="the load balancer's sending_queue.batch (JSON; '': shipped)")
    ap.add_argument("--retry-s", type=float, default=60.0)
    ap.add_argument("--drain-s", type=float, default=90.0)
    ap.add_argument("--verdict-wait-s", type=float, default=75.0)
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--target-ranks", type=int, default=131_072)
    ap.add_argument("--periods", default="1,5,10", help="step periods (s) to extrapolate to")
    ap.add_argument("--shard-mib", type=float, default=768.0,
                    help="memory a shard may hold (compose's memory_limiter: 1024 MiB limit - 256 spike)")
    ap.add_argument("--states-per-rank", type=int, default=8,
                    help="detector states per rank (judged stages; 8 for the load, bench/results/scale.md)")
    ap.add_argument("--headroom", type=float, default=0.7, help="load a shard's core and the gateway's to this")
    ap.add_argument("--json", type=Path, help="write the whole result here")
    ap.add_argument("--generate", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate:
        generate(args.generate, args.ranks, args.dp, args.steps, args.ranks_per_request, args.slow_rank,
                 args.slow_from, args.slow_factor, args.time_limit, args.retry_s, args.senders)
        return 0
    with tempfile.TemporaryDirectory(prefix="scale-sharded-") as d:
        r = run(args, Path(d))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1), encoding="utf-8")
    print(f"{r['ranks']} ranks ({r['cohorts']} cohorts of DP {r['dp']}), {r['shards']} shards, {r['steps']} steps "
          f"of {r['spans_per_rank_step']} spans per rank, {r['ranks_per_request']} ranks per request; "
          f"{r['cpus']} CPUs shared by the generator, the gateway and the shards (load average at the end "
          f"{', '.join(f'{x:.1f}' for x in r['load_avg_end'])})")
    print(f"sent {r['spans_sent']} spans in {r['send_s']} s ({r['step_s']} s per step, "
          f"{r['spans_sent'] / max(r['send_s'], 1e-9):.0f} spans/s), all shards drained at {r['drained_s']} s; "
          f"at the shards {r['spans_at_shards']}, lost {r['lost']}")
    print(f"generator: {r['generator']}")
    print(f"gateway: {r['gateway']}")
    print(f"\n{'shard':>7} {'ranks':>6} {'spans':>9} {'spans/s':>8} {'cpu s':>6} {'spans/cpu-s':>11} "
          f"{'RSS base':>8} {'peak':>5} {'end':>5} {'KiB/rank':>8} {'max q':>6} {'end q':>5} {'throttled':>9} "
          f"{'closed':>6} keeps_up  rejected / dropped / evictions / verdicts")
    for x in r["per_shard"]:
        print(f"{x['shard']:>7} {x['ranks']:6d} {x['spans']:9d} {x['spans_per_s']:8d} {x['cpu_s']:6.0f} "
              f"{x['spans_per_cpu_s']:11d} {x['base_rss_mb']:8d} {x['peak_rss_mb']:5d} {x['end_rss_mb']:5d} "
              f"{x['kib_per_rank']:8.1f} {x['max_queue']:6d} {x['end_queue']:5d} {x['throttled_requests']:9d} "
              f"{x['windows_closed']:6d} {x['keeps_up']!s:>8}  {x['rejected']} / {x['dropped']} / {x['evictions']} / "
              f"{x['verdicts']}")
    print(f"slow rank {r['slow_rank']} convicted on: {r['convicted_on'] or 'none'}")
    print(f"peak RSS against ranks over the shards: {r['kib_per_rank_slope']} KiB per rank (least squares)")
    for line in extrapolate(r, args.target_ranks, [float(p) for p in args.periods.split(",")], args.shard_mib,
                            args.headroom, json.loads(args.straggler), args.states_per_rank):
        print(line)
    rows = r["per_shard"]
    fields = {"ranks": r["ranks"], "shards": r["shards"], "steps": r["steps"], "spans": r["spans_sent"],
              "lost": r["lost"], "keeps_up": all(x["keeps_up"] for x in rows) and r["lost"] == 0,
              "verdict_on_slow_rank": bool(r["convicted_on"]),
              "min_shard_spans_per_cpu_s": min(x["spans_per_cpu_s"] for x in rows),
              "max_kib_per_rank": max(x["kib_per_rank"] for x in rows), "kib_per_rank_slope": r["kib_per_rank_slope"],
              "gateway_spans_per_cpu_s": r["gateway"]["spans_per_cpu_s"],
              "gateway_backend_failures": r["gateway"]["backend_failures"], "step_s": r["step_s"]}
    print(" ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

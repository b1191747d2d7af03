"""The demo: N rank processes train over gloo, one is slowed, the collector finds it.

Everything runs on this machine over loopback: a straggler collector child process (unless
``--endpoint`` names an external one), a trace tap standing in for Jaeger/Tempo, and the rank processes.
It prints progress and verdicts as they arrive, then a summary, and writes the evidence plus an HTML/PNG
report into ``--out``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from otel_straggler import schema as s
from otel_straggler.demo.tap import TraceTap


@dataclass
class DemoOptions:
    ranks: int = 8
    steps: int = 200
    microbatches: int = 4
    forward_ms: float = 12.0
    backward_ms: float = 20.0
    optimizer_ms: float = 6.0
    inject_rank: int | None = 3
    inject_stage: str = "forward-compute"
    inject_slowdown: float = 0.10
    inject_kind: str = "host"  # host | device
    inject_from: int = 50
    inject_until: int | None = None  # step where the slowdown stops (None: never)
    endpoint: str | None = None  # external collector (OTLP gRPC); None = start one here
    protocol: str = "grpc"  # grpc | http/protobuf
    out: str = "otel-straggler-demo"
    json: bool = False
    quiet: bool = False
    model: str = "toy"  # toy | megatron:launch-bound | megatron:gpu-bound
    inject_ms: float | None = None  # absolute delay per interval (overrides slowdown x nominal time)
    gpu_turns: bool = False  # megatron mode: ranks sharing one GPU take turns (clean device intervals)
    job_id: str = field(default_factory=lambda: f"demo-{int(time.time())}")


@dataclass
class Detection:
    rank: int
    stage: str
    verdict: str
    deviation: float | None
    steps_to_detect: int | None
    attribution: str
    step: int | None
    recovered_step: int | None = None
    step_time_lost_ms: float | None = None
    gpu_seconds_per_hour: float | None = None
    host: str = ""
    gpu: str = ""


@dataclass
class DemoResult:
    detected: list[Detection]
    false_alarms: int
    verdicts: int
    injected: dict
    report_html: str | None
    report_png: str | None
    evidence: str | None
    spans_seen: int
    elapsed_s: float
    ok: bool

    def to_json(self) -> str:
        d = asdict(self)
        d["detected"] = [
            {k: v for k, v in asdict(x).items() if k in (
                "rank", "stage", "verdict", "deviation", "steps_to_detect", "attribution", "recovered_step",
                "step_time_lost_ms", "gpu_seconds_per_hour")}
            for x in self.detected
        ]
        return json.dumps(d, sort_keys=True)


def free_port() -> int:
    """A TCP port free on loopback now (the demo, its collector and the benchmarks pick ports this way)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Console:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        if not self.quiet:
            with self._lock:
                print(text, file=sys.stderr, flush=True)


def collector_config(*, grpc_port: int, http_port: int, metrics_port: int, tap_port: int,
                     evidence: Path) -> dict:
    """The embedded collector's configuration (the shipped configs/collector.yaml, on free ports)."""
    return {
        "receivers": {"otlp": {"protocols": {
            "grpc": {"endpoint": f"127.0.0.1:{grpc_port}"},
            "http": {"endpoint": f"127.0.0.1:{http_port}"},
        }}},
        "processors": {"memory_limiter": {"limit_mib": 1024, "spike_limit_mib": 256},
                       "straggler": {}},
        "exporters": {
            "otlp_grpc/tap": {"endpoint": f"127.0.0.1:{tap_port}", "tls": {"insecure": True}},
            "prometheus": {"endpoint": f"127.0.0.1:{metrics_port}"},
            "file/evidence": {"path": str(evidence), "flush_interval": "1s"},
        },
        "service": {"pipelines": {
            "traces": {"receivers": ["otlp"], "processors": ["memory_limiter", "straggler"],
                       "exporters": ["otlp_grpc/tap"]},
            "logs/verdicts": {"receivers": ["straggler"], "exporters": ["file/evidence"]},
            "metrics": {"receivers": ["otlp"], "exporters": ["prometheus"]},
        }},
    }


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def _read_verdicts(path: Path) -> list[dict]:
    out: list[dict] = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill; never expected after a drain
    return out


def summarise(verdicts: list[dict], opts: DemoOptions) -> tuple[list[Detection], int]:
    """First straggler verdict per (rank, stage); false alarms are straggler verdicts on other ranks."""
    first: dict[tuple[int, str], Detection] = {}
    recovered: dict[tuple[int, str], int] = {}
    for v in verdicts:
        key = (int(v.get("rank", -1)), str(v.get("stage", "")))
        if v.get("verdict") == s.VERDICT_STRAGGLER and key not in first:
            step = v.get("step")
            steps_to_detect = None
            if opts.inject_rank is not None and key[0] == opts.inject_rank and step is not None:
                steps_to_detect = int(step) - opts.inject_from
            first[key] = Detection(
                rank=key[0], stage=key[1], verdict=s.VERDICT_STRAGGLER, deviation=v.get("deviation"),
                steps_to_detect=steps_to_detect, attribution=str(v.get("attribution", "")),
                step=step, step_time_lost_ms=v.get("step_time_lost_ms"),
                gpu_seconds_per_hour=v.get("gpu_seconds_per_hour"), host=str(v.get("host", "")),
                gpu=str(v.get("gpu", "")))
        elif v.get("verdict") == s.VERDICT_RECOVERED and key in first and key not in recovered:
            recovered[key] = int(v.get("step") or 0)
    for key, det in first.items():
        det.recovered_step = recovered.get(key)
    detections = sorted(first.values(), key=lambda d: (d.rank != opts.inject_rank, d.step or 0))
    false_alarms = sum(1 for d in detections if d.rank != opts.inject_rank)
    return detections, false_alarms


def _rank_env(opts: DemoOptions, rank: int, endpoint: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(opts.ranks),
        "OTEL_STRAGGLER_DP_RANK": str(rank), "OTEL_STRAGGLER_DP_SIZE": str(opts.ranks),
        "OTEL_STRAGGLER_ENABLED": "1", "OTEL_STRAGGLER_JOB_ID": opts.job_id,
        "OTEL_SERVICE_NAME": env.get("OTEL_SERVICE_NAME", "otel-straggler-demo"),
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": opts.protocol,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": env.get("OTEL_BSP_SCHEDULE_DELAY", "500"),
        "OTEL_METRIC_EXPORT_INTERVAL": env.get("OTEL_METRIC_EXPORT_INTERVAL", "2000"),
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    })
    if opts.inject_rank is not None and opts.inject_slowdown > 0:
        per_interval = {"forward-compute": opts.forward_ms, "backward-compute": opts.backward_ms,
                        "optimizer-inner-step": opts.optimizer_ms}.get(opts.inject_stage, opts.forward_ms)
        delay_ms = opts.inject_ms if opts.inject_ms is not None else per_interval * opts.inject_slowdown
        env.update({
            "OTEL_STRAGGLER_INJECT_RANK": str(opts.inject_rank),
            "OTEL_STRAGGLER_INJECT_STAGE": opts.inject_stage,
            "OTEL_STRAGGLER_INJECT_FROM_STEP": str(opts.inject_from),
            ("OTEL_STRAGGLER_INJECT_DEVICE_MS" if opts.inject_kind == "device"
             else "OTEL_STRAGGLER_INJECT_HOST_MS"): f"{delay_ms:.3f}",
        })
        if opts.inject_until is not None:
            env["OTEL_STRAGGLER_INJECT_UNTIL_STEP"] = str(opts.inject_until)
    return env


def run_demo(opts: DemoOptions) -> DemoResult:
    t0 = time.monotonic()
    con = _Console(opts.quiet)
    out = Path(opts.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    evidence = out / "verdicts.jsonl"
    if evidence.exists():
        evidence.unlink()
    tap = TraceTap()
    tap_port = free_port()
    tap.start(tap_port)
    collector: subprocess.Popen | None = None
    collector_log = out / "collector.log"
    metrics_url = None
    if opts.endpoint is None:
        grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
        cfg_path = out / "collector.yaml"
        cfg_path.write_text(yaml.safe_dump(collector_config(
            grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port, tap_port=tap_port,
            evidence=evidence)), encoding="utf-8")
        log_fh = collector_log.open("w", encoding="utf-8")
        collector = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config", str(cfg_path)],
                                     stdout=log_fh, stderr=subprocess.STDOUT, start_new_session=True)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        if not _wait_http(f"http://127.0.0.1:{metrics_port}/healthz", 60.0, collector):
            collector.kill()
            tap.stop()
            raise RuntimeError(f"the collector did not start; see {collector_log}")
        endpoint = (f"http://127.0.0.1:{grpc_port}" if opts.protocol == "grpc"
                    else f"http://127.0.0.1:{http_port}")
        con.say(f"collector up: OTLP gRPC 127.0.0.1:{grpc_port}, HTTP 127.0.0.1:{http_port}, "
                f"metrics {metrics_url}")
    else:
        endpoint = opts.endpoint
        con.say(f"exporting to external collector {endpoint}")

    inj = (f"rank {opts.inject_rank} {opts.inject_stage} +{opts.inject_slowdown:.0%} ({opts.inject_kind}) "
           f"from step {opts.inject_from}" + (f" to {opts.inject_until}" if opts.inject_until else "")
           if opts.inject_rank is not None else "none")
    con.say(f"starting {opts.ranks} ranks x {opts.steps} steps; injected slowdown: {inj}")
    master_port = free_port()
    procs: list[subprocess.Popen] = []
    logs = []
    for rank in range(opts.ranks):
        log = (out / f"rank{rank}.log").open("w", encoding="utf-8")
        logs.append(log)
        cmd = [sys.executable, "-m", "otel_straggler.demo.trainer", "--steps", str(opts.steps),
               "--microbatches", str(opts.microbatches), "--forward-ms", str(opts.forward_ms),
               "--backward-ms", str(opts.backward_ms), "--optimizer-ms", str(opts.optimizer_ms),
               "--master-port", str(master_port), "--model", opts.model] + (["--gpu-turns"] if opts.gpu_turns else [])
        procs.append(subprocess.Popen(cmd, env=_rank_env(opts, rank, endpoint),
                                      stdout=subprocess.PIPE if rank == 0 else log,
                                      stderr=log, text=True))

    seen_verdicts = 0

    def _watch_progress() -> None:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            logs[0].write(line)
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "progress" in msg:
                done, total = msg["progress"], msg["steps"]
                bar = "#" * int(30 * done / total)
                con.say(f"  step {done:>5}/{total} [{bar:<30}] {time.monotonic() - t0:6.1f}s")

    watcher = threading.Thread(target=_watch_progress, daemon=True)
    watcher.start()
    step_budget_s = (opts.microbatches * (opts.forward_ms + opts.backward_ms) + opts.optimizer_ms) / 1000
    deadline = time.monotonic() + 120 + opts.steps * step_budget_s * 4
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
        current = _read_verdicts(evidence)
        for v in current[seen_verdicts:]:
            if v.get("verdict") in (s.VERDICT_STRAGGLER, s.VERDICT_RECOVERED):
                con.say(f"  >> {v.get('verdict')}: rank {v.get('rank')} {v.get('stage')} "
                        f"deviation {float(v.get('deviation') or 0):+.1%} at step {v.get('step')} "
                        f"({v.get('attribution')})")
        seen_verdicts = len(current)
    failed = [i for i, p in enumerate(procs) if p.poll() not in (0,)]
    for p in procs:
        if p.poll() is None:
            p.kill()
    watcher.join(timeout=2.0)
    for log in logs:
        log.close()
    if collector is not None:
        time.sleep(1.5)  # last batches from the ranks' exporters
        collector.send_signal(signal.SIGTERM)
        try:
            collector.wait(timeout=30)
        except subprocess.TimeoutExpired:
            collector.kill()
    tap.stop()

    verdicts = _read_verdicts(evidence)
    detections, false_alarms = summarise(verdicts, opts)
    html = png = None
    try:
        from otel_straggler.demo.report import write_report

        html, png = write_report(out, tap.snapshot(), verdicts, opts, detections)
    except Exception as exc:
        con.say(f"report not written: {exc!r}")
    ok = not failed
    if failed:
        con.say(f"ranks {failed} failed; see {out}/rank<N>.log")
    result = DemoResult(detected=detections, false_alarms=false_alarms, verdicts=len(verdicts),
                        injected={"rank": opts.inject_rank, "stage": opts.inject_stage,
                                  "slowdown": opts.inject_slowdown, "kind": opts.inject_kind,
                                  "from_step": opts.inject_from, "until_step": opts.inject_until},
                        report_html=html, report_png=png,
                        evidence=str(evidence) if evidence.exists() else None,
                        spans_seen=tap.spans, elapsed_s=round(time.monotonic() - t0, 1), ok=ok)
    _print_summary(result, opts, con)
    if opts.json:
        print(result.to_json(), flush=True)
    return result


def _print_summary(result: DemoResult, opts: DemoOptions, con: _Console) -> None:
    con.say("")
    con.say(f"== summary ({result.elapsed_s}s, {result.spans_seen} spans through the collector, "
            f"{result.verdicts} verdict records)")
    if opts.endpoint is not None:
        con.say(f"spans went to the external collector {opts.endpoint}: its evidence, metrics and events hold "
                "the verdicts")
    elif not result.detected:
        con.say("no straggler detected")
    for d in result.detected:
        who = "INJECTED" if d.rank == opts.inject_rank else "FALSE ALARM"
        cost = ""
        if d.step_time_lost_ms is not None:
            cost = f", costs ~{d.step_time_lost_ms:.1f} ms/step, {d.gpu_seconds_per_hour or 0:.0f} GPU-s/h"
        rec = f", recovered at step {d.recovered_step}" if d.recovered_step else ""
        std = f" after {d.steps_to_detect} steps" if d.steps_to_detect is not None else ""
        con.say(f"[{who}] rank {d.rank} ({d.host} {d.gpu}) stage {d.stage}: {d.verdict} "
                f"{(d.deviation or 0):+.1%} at step {d.step}{std}, {d.attribution}{cost}{rec}")
    con.say(f"false alarms: {result.false_alarms}")
    if result.report_html:
        con.say(f"report: {result.report_html}")
    if result.evidence:
        con.say(f"evidence: {result.evidence}")


def default_out_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "otel-straggler-demo")

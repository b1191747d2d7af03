"""The demo: N rank processes train over gloo, one is slowed, the collector finds it.

Everything runs on this machine over loopback: a straggler collector child process (unless
``--endpoint`` names an external one), a trace tap standing in for Jaeger/Tempo, and the rank processes.
It prints progress and verdicts as they arrive, then a summary, and writes the evidence, the collector's
metrics, every rank's stage times and an HTML/PNG report into ``--out``. The run fails (``ok`` false,
``problems`` saying why) when a rank fails, when the injected rank is not convicted, or on a false alarm.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

import otel_straggler_schema as s
from otel_straggler.export.probe import probe_otlp, redact
from otel_straggler_demo.options import (
    DemoOptions,
    DemoResult,
    check_options,
    describe_injection,
    detector_settings,
    inject_delay_ms,
    injecting,
    require_model_runtime,
    straggler_overrides,
)
from otel_straggler_demo.outcome import problems, summarise
from otel_straggler_demo.tap import StagePoint, TraceTap

__all__ = ["CollectorStartError", "DemoOptions", "DemoResult", "collector_config", "detector_settings", "free_port",
           "free_ports", "read_verdicts", "run_demo"]


class CollectorStartError(RuntimeError):
    """The embedded collector did not come up (its log is in the output folder)."""


def free_port() -> int:
    """A TCP port free on loopback now (the demo, its collector and the benchmarks pick ports this way)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on loopback now (all held until every one is picked)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class _Console:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        if not self.quiet:
            with self._lock:
                print(text, file=sys.stderr, flush=True)


def collector_config(*, grpc_port: int, http_port: int, metrics_port: int, tap_port: int,
                     evidence: Path, ranks: int = 8) -> dict:
    """The embedded collector's configuration (the shipped configs/collector.yaml, on free ports)."""
    return {
        "receivers": {"otlp": {"protocols": {
            "grpc": {"endpoint": f"127.0.0.1:{grpc_port}"},
            "http": {"endpoint": f"127.0.0.1:{http_port}"},
        }}},
        "processors": {"memory_limiter": {"limit_mib": 1024, "spike_limit_mib": 256},
                       "straggler": straggler_overrides(ranks)},
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


def yield_cpu(pid: int) -> None:
    """Lower a child's priority (niceness +10) so that it yields to the rank processes. Set from here, not in a
    ``preexec_fn``: that forces a plain fork, whose handlers make gRPC (the trace tap) log a warning."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, pid) + 10)
    except OSError:
        pass  # it runs at the demo's priority


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


def _scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=10.0) as resp:
            return resp.read().decode("utf-8", errors="replace")
    except OSError:
        return None


def read_verdicts(path: Path) -> list[dict]:
    """The verdict records of a JSONL evidence file (a line being written is skipped)."""
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


def write_stage_times(path: Path, points: list[StagePoint]) -> None:
    """Every stage time the collector passed on: one row per rank, step and stage."""
    with path.open("w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["rank", "step", "stage", "group", "host_ms", "device_ms"])
        for p in sorted(points, key=lambda p: (p.rank, p.step, p.stage)):
            w.writerow([p.rank, p.step, p.stage, p.group, "" if p.host_ms is None else f"{p.host_ms:.4f}",
                        "" if p.device_ms is None else f"{p.device_ms:.4f}"])


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
    if injecting(opts):
        env.update({
            "OTEL_STRAGGLER_INJECT_RANK": str(opts.inject_rank),
            "OTEL_STRAGGLER_INJECT_STAGE": opts.inject_stage,
            "OTEL_STRAGGLER_INJECT_FROM_STEP": str(opts.inject_from),
            ("OTEL_STRAGGLER_INJECT_DEVICE_MS" if opts.inject_kind == "device"
             else "OTEL_STRAGGLER_INJECT_HOST_MS"): f"{inject_delay_ms(opts):.3f}",
        })
        if opts.inject_until is not None:  # the knob's last slowed step is inclusive
            env["OTEL_STRAGGLER_INJECT_UNTIL_STEP"] = str(opts.inject_until - 1)
    return env


class _Ranks:
    """The rank processes, rank 0's progress lines, and the run's end: all ranks exited, one failed (the others
    are stopped at once: they would wait for it in the next collective), or no progress for a long time."""

    def __init__(self, opts: DemoOptions, out: Path, endpoint: str, con: _Console, t0: float) -> None:
        self.opts, self.con, self.t0 = opts, con, t0
        self.last_progress = time.monotonic()
        self.progress = 0
        master_port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        for rank in range(opts.ranks):
            log = (out / f"rank{rank}.log").open("w", encoding="utf-8")
            self.logs.append(log)
            cmd = [sys.executable, "-m", "otel_straggler_demo.trainer", "--steps", str(opts.steps),
                   "--microbatches", str(opts.microbatches), "--forward-ms", str(opts.forward_ms),
                   "--backward-ms", str(opts.backward_ms), "--optimizer-ms", str(opts.optimizer_ms),
                   "--master-port", str(master_port), "--model", opts.model]
            cmd += ["--gpu-turns"] if opts.gpu_turns else []
            self.procs.append(subprocess.Popen(cmd, env=_rank_env(opts, rank, endpoint),
                                               stdout=subprocess.PIPE if rank == 0 else log, stderr=log, text=True))
        self.watcher = threading.Thread(target=self._watch_progress, daemon=True)
        self.watcher.start()

    def _watch_progress(self) -> None:
        assert self.procs[0].stdout is not None
        for line in self.procs[0].stdout:
            self.logs[0].write(line)
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "progress" in msg:
                self.last_progress = time.monotonic()
                done, total = msg["progress"], msg["steps"]
                self.progress = done
                bar = "#" * int(30 * done / total)
                self.con.say(f"  step {done:>5}/{total} [{bar:<30}] {time.monotonic() - self.t0:6.1f}s")

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def failed(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p.poll() not in (None, 0)]

    def stalled(self) -> bool:
        return time.monotonic() - self.last_progress > self.opts.stall_timeout_s

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.watcher.join(timeout=5.0)
        for log in self.logs:
            log.close()


def _stop_collector(collector: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (it drains and writes its last evidence), then SIGKILL after ``timeout_s``."""
    if collector.poll() is not None:
        return
    collector.send_signal(signal.SIGTERM)
    try:
        collector.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        collector.kill()
        collector.wait(timeout=30)


def run_demo(opts: DemoOptions) -> DemoResult:
    """The whole demo. Options that cannot work raise OptionError before anything starts. Interrupted (Ctrl-C,
    or SIGTERM through the CLI), it stops the ranks and its collector (which runs in a session of its own, out
    of reach of the terminal's signals) before the interrupt goes on."""
    children: list[Any] = []  # what to stop if interrupted: the tap, the collector, the ranks
    try:
        return _run_demo(opts, children)
    except BaseException:
        for child in reversed(children):
            try:
                if isinstance(child, subprocess.Popen):
                    _stop_collector(child, 15.0)
                else:
                    child.stop()
            except Exception:
                pass
        raise


def _run_demo(opts: DemoOptions, children: list[Any]) -> DemoResult:
    det = detector_settings(opts.ranks)
    check_options(opts, det)
    require_model_runtime(opts.model)
    t0 = time.monotonic()
    con = _Console(opts.quiet)
    out = Path(opts.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    evidence = out / "verdicts.jsonl"
    for stale in (evidence, out / "metrics.prom", out / "stage-times.csv"):
        if stale.exists():
            stale.unlink()
    tap = TraceTap()
    tap_port = free_port()
    tap.start(tap_port)
    children.append(tap)
    collector: subprocess.Popen | None = None
    collector_log = out / "collector.log"
    metrics_url = None
    if opts.endpoint is None:
        grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
        cfg_path = out / "collector.yaml"
        cfg_path.write_text(yaml.safe_dump(collector_config(
            grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port, tap_port=tap_port,
            evidence=evidence, ranks=opts.ranks)), encoding="utf-8")
        log_fh = collector_log.open("w", encoding="utf-8")
        # niced: beside a real job the collector has its own host; here it must not take the ranks' cores
        collector = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config", str(cfg_path)],
                                     stdout=log_fh, stderr=subprocess.STDOUT, start_new_session=True)
        log_fh.close()  # the collector holds its own descriptor of the log
        yield_cpu(collector.pid)
        children.append(collector)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        if not _wait_http(f"http://127.0.0.1:{metrics_port}/healthz", 300.0, collector):
            raise CollectorStartError(f"the collector did not start; see {collector_log}")  # run_demo stops it
        endpoint = (f"http://127.0.0.1:{grpc_port}" if opts.protocol == "grpc"
                    else f"http://127.0.0.1:{http_port}")
        con.say(f"collector up: OTLP gRPC 127.0.0.1:{grpc_port}, HTTP 127.0.0.1:{http_port}, "
                f"metrics {metrics_url}")
        if straggler_overrides(opts.ranks):
            con.say("2 ranks: each rank is compared with its one peer (min_cohort_size 2; 3 by default)")
    else:
        endpoint = opts.endpoint
        answer = probe_otlp(endpoint, opts.protocol)
        if not answer.ok:  # the ranks' spans would reach no collector: nothing to find, nothing to say it found
            raise CollectorStartError(f"no collector takes OTLP ({opts.protocol}) exports at {redact(endpoint)}: "
                                      f"{answer.detail}")
        con.say(f"exporting to external collector {redact(endpoint)} ({answer.detail})")

    con.say(f"starting {opts.ranks} ranks x {opts.steps} steps ({opts.model}); injected slowdown: "
            f"{describe_injection(opts)}")
    ranks = _Ranks(opts, out, endpoint, con, t0)
    children.append(ranks)
    seen_verdicts = 0
    stalled = False
    while ranks.running():
        time.sleep(0.5)
        if ranks.failed():
            break  # the others would wait for the failed rank in the next collective
        if ranks.stalled():
            stalled = True
            break
        current = read_verdicts(evidence)
        for v in current[seen_verdicts:]:
            if v.get("verdict") in (s.VERDICT_STRAGGLER, s.VERDICT_RECOVERED):
                con.say(f"  >> {v.get('verdict')}: rank {v.get('rank')} {v.get('stage')} "
                        f"deviation {float(v.get('deviation') or 0):+.1%} at step {v.get('step')} "
                        f"({v.get('attribution')})")
        seen_verdicts = len(current)
    failed = ranks.failed()
    ranks.stop()
    metrics_text = None
    if collector is not None:
        time.sleep(1.5)  # last batches from the ranks' exporters
        metrics_text = _scrape(metrics_url) if metrics_url else None
        _stop_collector(collector, 60.0)
    tap.stop()
    children.clear()  # stopped: nothing left to stop if the report is interrupted

    points = tap.snapshot()
    verdicts = read_verdicts(evidence)
    detections, false_alarms = summarise(verdicts, opts)
    issues: list[str] = []
    if failed:
        issues.append(f"rank(s) {failed} exited with an error; see {out}/rank<N>.log")
    if stalled:
        issues.append(f"no progress from rank 0 for {opts.stall_timeout_s:.0f} s (at step {ranks.progress}); "
                      "the ranks were stopped")
    if opts.endpoint is None and not failed and not stalled:
        issues += problems(verdicts, detections, opts, points, window_steps=det.window_steps,
                           absolute_floor_ms=det.absolute_floor_ms, tolerance=det.tolerance,
                           fastest_quantile=det.fastest_quantile)
    stage_times = out / "stage-times.csv"
    write_stage_times(stage_times, points)
    metrics_path = None
    if metrics_text is not None:
        metrics_path = out / "metrics.prom"
        metrics_path.write_text(metrics_text, encoding="utf-8")
    html = png = None
    try:
        from otel_straggler_demo.report import write_report

        html, png = write_report(out, points, verdicts, opts, detections, issues, det=det,
                                 external=opts.endpoint is not None)
    except Exception as exc:
        con.say(f"report not written: {exc!r}")
    result = DemoResult(detected=detections, false_alarms=false_alarms, verdicts=len(verdicts),
                        injected={"rank": opts.inject_rank if injecting(opts) else None,
                                  "stage": opts.inject_stage, "slowdown": opts.inject_slowdown,
                                  "inject_ms": opts.inject_ms, "kind": opts.inject_kind,
                                  "from_step": opts.inject_from, "until_step": opts.inject_until},
                        report_html=html, report_png=png,
                        evidence=str(evidence) if evidence.exists() else None,
                        spans_seen=tap.spans, elapsed_s=round(time.monotonic() - t0, 1), ok=not issues,
                        problems=issues, metrics=str(metrics_path) if metrics_path else None,
                        stage_times=str(stage_times), stage_points_dropped=tap.dropped)
    _print_summary(result, opts, con)
    if opts.json:
        print(result.to_json(), flush=True)
    return result


def _print_summary(result: DemoResult, opts: DemoOptions, con: _Console) -> None:
    con.say("")
    dropped = (f", {result.stage_points_dropped} stage times over the tap's cap not kept"
               if result.stage_points_dropped else "")
    con.say(f"== summary ({result.elapsed_s}s, {result.spans_seen} spans through the collector, "
            f"{result.verdicts} verdict records{dropped})")
    if opts.endpoint is not None:
        con.say(f"spans went to the external collector {redact(opts.endpoint)}: its evidence, metrics and events hold "
                "the verdicts")
    elif not result.detected:
        con.say("no straggler detected")
    for d in result.detected:
        who = "INJECTED" if d.injected else "FALSE ALARM"
        cost = ""
        if d.step_time_lost_ms is not None:
            cost = f", costs ~{d.step_time_lost_ms:.1f} ms/step, {d.gpu_seconds_per_hour or 0:.0f} GPU-s/h"
        rec = f", recovered at step {d.recovered_step}" if d.recovered_step else ""
        std = f" after {d.steps_to_detect} steps" if d.steps_to_detect is not None else ""
        con.say(f"[{who}] rank {d.rank} ({d.host} {d.gpu}) stage {d.stage}: {d.verdict} "
                f"{(d.deviation or 0):+.1%} at step {d.step}{std}, {d.attribution}{cost}{rec}")
    if opts.endpoint is None:
        con.say(f"false alarms: {result.false_alarms}")
    if result.report_html:
        con.say(f"report: {result.report_html}")
    if result.evidence:
        con.say(f"evidence: {result.evidence}")
    if result.problems:  # printed in --quiet mode too: it is why the exit status is not 0
        print("\nFAILED:\n" + "\n".join(f"  - {line}" for line in result.problems), file=sys.stderr, flush=True)
    elif opts.endpoint is None and injecting(opts):
        con.say("OK: the injected rank was found, and nobody else")

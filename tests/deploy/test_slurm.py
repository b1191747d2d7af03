"""deploy/slurm/train.sbatch: it parses, and its logic runs end to end with Slurm's environment and commands
stood in for (no Slurm here): ``scontrol`` names the job's nodes, ``srun`` runs its command on this machine. The
real collector starts on the "first node", a real rank sends its spans to it with the job's token, and the script
stops the collector (drained, metrics kept) when training ends."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import otel_straggler_schema as s
from otel_straggler_demo.run import free_ports

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "train.sbatch"

FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames <nodelist>: this machine is the job's first node
[ "$1 $2" = "show hostnames" ] || exit 2
echo "$FAKE_FIRST_NODE"; echo node02
"""

FAKE_SRUN = """#!/bin/bash
# srun [--option=value ...] command...: log the options, run the command here
opts=()
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do opts+=("$1"); shift; done
echo "srun ${opts[*]} -- $*" >>"$FAKE_SRUN_LOG"
exec "$@"
"""

RANK = """
import json, os, time
import otel_straggler
timers = otel_straggler.configure()
assert timers is not None, "OTEL_STRAGGLER_ENABLED=1 comes from the script"
for step in range(5):
    otel_straggler.step(step)
    with otel_straggler.stage("forward-compute"):
        time.sleep(0.005)
flushed = timers.flush(10.0)
otel_straggler.shutdown(10.0)
keys = ("OTEL_STRAGGLER_ENABLED", "OTEL_STRAGGLER_JOB_ID", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_HEADERS")
print(json.dumps({"flushed": flushed, **{k: os.environ.get(k) for k in keys}}), flush=True)
"""


def test_the_sbatch_script_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    text = SBATCH.read_text(encoding="utf-8")
    head = text.split("\nset -euo pipefail", 1)[0]
    assert re.search(r"^#SBATCH --nodes=\d+$", head, re.M), "directives before the first command"


@pytest.mark.slow
def test_the_sbatch_logic_starts_the_collector_on_the_first_node_and_points_the_ranks_at_it(tmp_path: Path) -> None:
    collector = Path(sys.executable).with_name("otel-straggler-collector")
    if not collector.exists():
        pytest.skip("otel-straggler-collector is not installed next to this Python")
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (fakebin / name).write_text(body)
        (fakebin / name).chmod(0o755)
    (tmp_path / "rank.py").write_text(RANK)
    grpc, http, metrics = free_ports(3)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SLURM_"))}
    env.update(PATH=os.pathsep.join([str(fakebin), str(collector.parent), env.get("PATH", "")]),
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost,node02", SLURM_NNODES="2",
               FAKE_FIRST_NODE="localhost", FAKE_SRUN_LOG=str(tmp_path / "srun.log"),
               OTEL_STRAGGLER_COLLECTOR_PORT=str(grpc), OTEL_STRAGGLER_COLLECTOR_HTTP_PORT=str(http),
               OTEL_STRAGGLER_METRICS_PORT=str(metrics), OTEL_STRAGGLER_OUT=str(out),
               TRAIN_CMD=f"{sys.executable} rank.py")
    proc = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    log = (out / "collector.log").read_text() if (out / "collector.log").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + log[-3000:]

    rank = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rank["flushed"] is True
    assert rank["OTEL_STRAGGLER_ENABLED"] == "1" and rank["OTEL_STRAGGLER_JOB_ID"] == "slurm-4242"
    assert rank["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://localhost:{grpc}"
    token = rank["OTEL_EXPORTER_OTLP_HEADERS"].removeprefix("authorization=Bearer%20")
    parts = s.job_token_parts(token)
    assert parts is not None and parts[0] == "slurm-4242", "the job's own token"
    assert token not in log and parts[1] not in log, "never logged"
    assert not (out / ".job-secret").exists(), "the job's secret goes with the job"

    srun = (tmp_path / "srun.log").read_text().splitlines()
    assert "--nodelist=localhost" in srun[0] and "--overlap" in srun[0] and srun[0].endswith("otel-straggler-collector")
    assert srun[1].startswith("srun --kill-on-bad-exit=1 -- ") and srun[1].endswith("rank.py")

    metrics_text = (out / "metrics.txt").read_text()
    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", metrics_text, re.M))

    received = total("otel_straggler_collector_spans_received_total")
    unauthenticated = total("otel_straggler_collector_unauthenticated_total")
    assert received >= 5 and unauthenticated == 0, metrics_text[:2000]
    assert "configuration: built-in" in log and "exit (drained)" in log, log[-2000:]


def test_the_slurm_collector_forwards_every_span_to_the_trace_store_it_is_given() -> None:
    """The script runs the built-in configuration: with OTEL_STRAGGLER_TRACES_ENDPOINT (named in the script's
    settings and passed to the collector's task) its traces pipeline sends every span, stage and verdict spans
    alike (no span filter), to that trace store."""
    from collector_processor.config.loader import load_text
    from collector_processor.config.validate import validate

    script = SBATCH.read_text(encoding="utf-8")
    assert 'OTEL_STRAGGLER_TRACES_ENDPOINT="${OTEL_STRAGGLER_TRACES_ENDPOINT:-}"' in script
    text = (ROOT / "collector_processor" / "config" / "collector.yaml").read_text(encoding="utf-8")
    raw, marks = load_text(text, "collector.yaml", env={"OTEL_STRAGGLER_TRACES_ENDPOINT": "jaeger-host:4317"})
    validate(raw, marks)
    traces = raw["service"]["pipelines"]["traces"]
    assert not [p for p in traces.get("processors", []) if p.startswith("filter")], traces
    (exporter,) = [e for e in traces["exporters"] if e.startswith("otlp_grpc")]
    assert raw["exporters"][exporter]["endpoint"] == "jaeger-host:4317"


RANK_SEES_REGISTRATION = """
import json, os, pathlib, time
sd = pathlib.Path(os.environ["OTEL_STRAGGLER_FILE_SD_DIR"])
deadline = time.monotonic() + 120  # both jobs run at once: wait (bounded) until both registered
while len(list(sd.glob("*.json"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.2)
seen = {p.name: json.loads(p.read_text()) for p in sd.glob("*.json")}
# neither job ends (and unregisters) before the other's rank has looked
(sd.parent / f"seen-{os.environ['SLURM_JOB_ID']}").touch()
while len(list(sd.parent.glob("seen-*"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.2)
print(json.dumps({"endpoint": os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"], "seen": seen}), flush=True)
"""


def test_two_jobs_on_one_node_pick_their_own_ports_and_register_with_prometheus(tmp_path: Path) -> None:
    """Two jobs whose first node is this machine run at once (``srun`` and ``scontrol`` stood in for; no port set):
    each collector gets free ports of its own, registers its /metrics in the file_sd directory while it runs (a
    target file Prometheus' ``file_sd_configs`` reads), unregisters at the end, and its /metrics wants the token."""
    collector = Path(sys.executable).with_name("otel-straggler-collector")
    if not collector.exists():
        pytest.skip("otel-straggler-collector is not installed next to this Python")
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (fakebin / name).write_text(body)
        (fakebin / name).chmod(0o755)
    sd = tmp_path / "file_sd"
    sd.mkdir()
    token = tmp_path / "metrics.token"
    token.write_text("metrics-s3cret\n")
    procs = {}
    for job in ("5001", "5002"):
        work = tmp_path / job
        work.mkdir()
        (work / "rank.py").write_text(RANK_SEES_REGISTRATION)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SLURM_"))}
        env.update(PATH=os.pathsep.join([str(fakebin), str(collector.parent), env.get("PATH", "")]),
                   SLURM_JOB_ID=job, SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", FAKE_FIRST_NODE="localhost",
                   FAKE_SRUN_LOG=str(work / "srun.log"), OTEL_STRAGGLER_OUT=str(work / "out"),
                   OTEL_STRAGGLER_FILE_SD_DIR=str(sd), OTEL_STRAGGLER_METRICS_TOKEN_FILE=str(token),
                   TRAIN_CMD=f"{sys.executable} rank.py")
        procs[job] = subprocess.Popen(["bash", str(SBATCH)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env, cwd=work)
    results = {}
    for job, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        log = (tmp_path / job / "out" / "collector.log").read_text(errors="replace")
        assert proc.returncode == 0, err[-3000:] + log[-3000:]
        results[job] = json.loads(out.strip().splitlines()[-1])
        assert "exit (drained)" in log
        metrics = (tmp_path / job / "out" / "metrics.txt").read_text()
        assert "otel_straggler_collector_spans_received_total" in metrics, "the final scrape sends the token"
    seen = results["5001"]["seen"]
    assert set(seen) == {"otel-straggler-5001.json", "otel-straggler-5002.json"}
    targets = {job: seen[f"otel-straggler-{job}.json"][0] for job in procs}
    assert {job: t["labels"] for job, t in targets.items()} == {job: {"slurm_job_id": job} for job in procs}
    ports = {job: int(t["targets"][0].rpartition(":")[2]) for job, t in targets.items()}
    grpc = {job: int(r["endpoint"].rpartition(":")[2]) for job, r in results.items()}
    assert len(set(ports.values()) | set(grpc.values())) == 4, (ports, grpc)
    assert not list(sd.iterdir()), "each job unregisters when it ends"

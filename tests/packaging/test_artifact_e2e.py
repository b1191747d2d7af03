"""Proof from the artifact alone: the wheel ``python -m build`` makes, installed into a fresh virtual environment
outside the checkout, runs the collector with its built-in configuration, and a 4-rank torchrun job (gloo, CPU)
with one slow rank, sending to it, gets that rank convicted and no other.

The fresh environment gets only the wheel (``--no-deps``); the dependencies (torch above all) are read from this
environment's site-packages, appended to its path by a ``.pth`` line (the way ``--system-site-packages`` would
share them, without this checkout: that line does not run the editable install's import hook). The ranks run
with every collector-only module blocked from import, so the plain install (no ``collector`` extra) is shown to be
all a training process needs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from packaging_support import ROOT, Dist

from otel_straggler_demo.run import free_ports, read_verdicts

pytestmark = pytest.mark.slow

WORLD, SLOW_RANK, STEPS = 4, 2, 60
BLOCKED = ("collector_processor", "pydantic", "yaml", "prometheus_client")

# Put in front of the ranks' path: what the collector extra adds cannot be imported by a training process.
BLOCKER = f'''
import importlib.abc, sys

class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"{{name}} is not installed (the collector extra)", name=name)
        return None

sys.meta_path.insert(0, _Blocked())
'''

TRAIN = '''
import json, os, sys, time
import torch
import torch.distributed as dist
import otel_straggler

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
otel_straggler.configure(enabled=True, dp_rank=rank, dp_size=world)
model = torch.nn.Linear(64, 64)
grad = torch.zeros(64 * 64)
for step in range(int(os.environ["STEPS"])):
    otel_straggler.step(step)
    with otel_straggler.stage("forward-compute"):
        model(torch.randn(16, 64)).sum()
        time.sleep(0.02)  # a stage long enough to stand above a loaded machine's jitter
    with otel_straggler.stage("all-grads-sync", collective=True):
        dist.all_reduce(grad)
otel_straggler.shutdown(10.0)
dist.destroy_process_group()
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(os.environ["BLOCKED"].split(",")))
os.write(1, (json.dumps({"rank": rank, "file": otel_straggler.__file__, "loaded": loaded}) + "\\n").encode())
'''


@pytest.fixture(scope="module")
def venv(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("artifact") / "venv"
    assert not home.resolve().is_relative_to(ROOT)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home)], check=True, timeout=120)
    py = home / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies of this interpreter (its site directories and those their .pth files add), never the tree
    shared = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    Path(purelib, "shared_dependencies.pth").write_text("".join(p + "\n" for p in shared))
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                           str(dist.wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return home


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHON"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def test_the_installed_wheel_is_the_one_that_runs(venv: Path) -> None:
    code = ("import json, otel_straggler, collector_processor, importlib.metadata as md; from otel_straggler import "
            "hot_path; print(json.dumps([otel_straggler.__file__, collector_processor.__file__, "
            "md.version('otel-straggler'), hot_path.NAME]))")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120,
                         env=_env(), cwd=venv)
    assert out.returncode == 0, out.stderr[-3000:]
    emitter, collector, version, hot = json.loads(out.stdout)
    assert Path(emitter).is_relative_to(venv) and Path(collector).is_relative_to(venv)
    assert version == __import__("otel_straggler").__version__
    assert hot == "python", "the pure wheel runs the Python hot path"


def test_the_installed_collector_script_without_the_extra_names_the_extra(venv: Path, tmp_path: Path) -> None:
    """The bare wheel installs ``otel-straggler-collector``; without the ``collector`` extra (its modules blocked
    from import by a ``sitecustomize``: this environment has them) it exits 2 with one line naming the extra."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.replace(repr(BLOCKED), repr(("pydantic", "yaml",
                                                                                    "prometheus_client"))))
    proc = subprocess.run([str(venv / "bin" / "otel-straggler-collector")], capture_output=True, text=True,
                          timeout=120, env=_env(PYTHONPATH=str(tmp_path)), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.endswith("pip install 'otel-straggler[collector]'") and "pyyaml" in line, line


def _wait_for_metrics(port: int, proc: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    if proc.poll() is not None:
        raise AssertionError(f"the collector exited {proc.returncode}: {proc.communicate()[1][-3000:]}")
    raise AssertionError("the collector did not come up")


def test_a_torchrun_job_with_a_slow_rank_is_caught_by_the_installed_collector(venv: Path, tmp_path: Path) -> None:
    grpc_port, http_port, metrics_port = free_ports(3)
    evidence = tmp_path / "evidence" / "verdicts.jsonl"
    collector = subprocess.Popen(
        [str(venv / "bin" / "otel-straggler-collector")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path, env=_env(OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT=f"127.0.0.1:{grpc_port}",
                               OTEL_STRAGGLER_OTLP_HTTP_ENDPOINT=f"127.0.0.1:{http_port}",
                               OTEL_STRAGGLER_METRICS_ENDPOINT=f"127.0.0.1:{metrics_port}",
                               OTEL_STRAGGLER_EVIDENCE_PATH=str(evidence)))
    try:
        _wait_for_metrics(metrics_port, collector)
        blocker = tmp_path / "blocker"
        blocker.mkdir()
        (blocker / "sitecustomize.py").write_text(BLOCKER)
        (tmp_path / "train.py").write_text(TRAIN)
        job = f"artifact-{uuid.uuid4().hex[:8]}"
        env = _env(PYTHONPATH=str(blocker), STEPS=str(STEPS), BLOCKED=",".join(BLOCKED),
                   OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{grpc_port}", OTEL_STRAGGLER_JOB_ID=job,
                   OTEL_STRAGGLER_INJECT_RANK=str(SLOW_RANK), OTEL_STRAGGLER_INJECT_STAGE="forward-compute",
                   OTEL_STRAGGLER_INJECT_HOST_MS="15", OTEL_STRAGGLER_INJECT_FROM_STEP="10")
        ranks = subprocess.run([str(venv / "bin" / "python"), "-m", "torch.distributed.run", "--standalone",
                                f"--nproc-per-node={WORLD}", "train.py"],
                               capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert ranks.returncode == 0, ranks.stderr[-4000:]
        lines = [json.loads(ln) for ln in ranks.stdout.splitlines() if ln.startswith("{")]
        assert sorted(r["rank"] for r in lines) == list(range(WORLD))
        for r in lines:
            assert Path(r["file"]).is_relative_to(venv), r
            assert r["loaded"] == [], f"a training process loaded collector modules: {r['loaded']}"

        def convicted() -> set[int]:
            return {int(v["rank"]) for v in read_verdicts(evidence)
                    if v.get("verdict") == "straggler" and v.get("job") == job}

        deadline = time.monotonic() + 60
        while SLOW_RANK not in convicted() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        collector.send_signal(signal.SIGTERM)
        _out, err = collector.communicate(timeout=60)
    assert collector.returncode == 0, err[-3000:]
    assert "configuration: built-in" in err
    assert convicted() == {SLOW_RANK}, (read_verdicts(evidence), err[-3000:])

"""The README's code, run as a user runs it: the torchrun + DDP ``train.py`` block saved as it is, and the bash
block that starts the collector (its built-in configuration) and the job, in one shell.

Only what a test machine needs is changed in the bash block: the collector listens on a free loopback port instead
of every interface's 4317, ``collector-host`` becomes that address, its other ports are free ones (the config's
own environment variables), and it runs niced as the demo's does (beside a real job it has cores of its own);
``--nproc_per_node=8`` becomes 3 (two CPU cores). One rank is made slow from outside the script, by a
``sitecustomize`` on its path: 30 ms of sleep inside its forward (``torch.nn.Linear.forward``), then, in a second
torchrun from the same shell (same ``OTEL_STRAGGLER_JOB_ID``: a re-run), before its ``loss.backward()``. Each run
must be found, in its stage, and nobody else.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import otel_straggler_schema as schema
from otel_straggler_demo.run import free_port, read_verdicts, yield_cpu

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SLOW_RANK = 2
RANKS = 3  # the README says 8; on two CPU cores 3 ranks leave the healthy ones little to wait for

SITECUSTOMIZE = """
import os

_stage = os.environ.get("README_SLOW_STAGE")
if _stage and os.environ.get("RANK") == os.environ.get("README_SLOW_RANK"):
    import time

    import torch

    _s = float(os.environ["README_SLOW_MS"]) / 1000.0
    if _stage == "forward":
        _forward = torch.nn.Linear.forward

        def _slow_forward(self, x):
            time.sleep(_s)
            return _forward(self, x)

        torch.nn.Linear.forward = _slow_forward
    else:
        _backward = torch.Tensor.backward

        def _slow_backward(self, *args, **kwargs):
            time.sleep(_s)
            return _backward(self, *args, **kwargs)

        torch.Tensor.backward = _slow_backward
"""


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def ddp_example() -> str:
    (example,) = [b for b in blocks("python") if "torch.distributed" in b]
    return example


def launch_block() -> list[str]:
    (block,) = [b for b in blocks("bash") if b.startswith("OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT=0.0.0.0:4317 ")]
    return [ln.split("#")[0].strip() for ln in block.splitlines() if ln.split("#")[0].strip()]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read()


@pytest.mark.slow
def test_the_readme_job_finds_a_rank_slow_in_forward_then_one_slow_in_backward_in_a_re_run(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    lines = launch_block()
    assert lines[0] == "OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT=0.0.0.0:4317 otel-straggler-collector"  # built-in config
    assert lines[-1] == "torchrun --nproc_per_node=8 train.py"
    exports = lines[1:-1]
    assert [ln.split("=")[0] for ln in exports] == ["export OTEL_STRAGGLER_JOB_ID",
                                                    "export OTEL_EXPORTER_OTLP_ENDPOINT"]

    bindir = Path(sys.executable).parent
    grpc, http, metrics = free_port(), free_port(), free_port()
    evidence = tmp_path / "evidence" / "verdicts.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCHELASTIC_"))}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT=f"127.0.0.1:{grpc}",
               OTEL_STRAGGLER_OTLP_HTTP_ENDPOINT=f"127.0.0.1:{http}",
               OTEL_STRAGGLER_METRICS_ENDPOINT=f"127.0.0.1:{metrics}",
               OTEL_STRAGGLER_EVIDENCE_PATH=str(evidence))
    # as written, on loopback: every interface is for ranks on other hosts
    collector = subprocess.Popen(["bash", "-c", lines[0].replace("0.0.0.0:4317", f"127.0.0.1:{grpc}")],
                                 cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield_cpu(collector.pid)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert collector.poll() is None, collector.stdout.read() if collector.stdout else ""
            try:
                _get(f"http://127.0.0.1:{metrics}/healthz")
                break
            except OSError:
                assert time.monotonic() < deadline, "the collector did not come up"
                time.sleep(0.5)

        work = tmp_path / "job"
        (work / "site").mkdir(parents=True)
        (work / "train.py").write_text(ddp_example(), encoding="utf-8")
        (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        torchrun = lines[-1].replace("--nproc_per_node=8", f"--nproc_per_node={RANKS}")
        script = "\n".join([
            "set -e",
            *(ln.replace("collector-host:4317", f"127.0.0.1:{grpc}") for ln in exports),
            f"README_SLOW_STAGE=forward {torchrun}",
            f"README_SLOW_STAGE=backward {torchrun}",
        ])
        shutil.copy(work / "train.py", tmp_path / "train.py.as-run")
        job_env = {**env, "PYTHONPATH": str(work / "site"), "README_SLOW_RANK": str(SLOW_RANK),
                   "README_SLOW_MS": "30"}
        job = subprocess.run(["bash", "-c", script], cwd=work, env=job_env, capture_output=True, text=True,
                             timeout=1200)
        assert job.returncode == 0, job.stderr[-4000:]
        assert "Warning" not in job.stderr.replace("OMP_NUM_THREADS", ""), job.stderr[-4000:]

        # both runs' last windows close by grace once their ranks have exited
        deadline = time.monotonic() + 90
        while True:
            verdicts = read_verdicts(evidence)
            runs: dict[str, list[dict]] = {}
            for v in verdicts:
                runs.setdefault(schema.cohort_run(v["cohort"]), []).append(v)
            found = [{(v["rank"], v["stage"]) for v in vs if v["verdict"] == schema.VERDICT_STRAGGLER}
                     for vs in runs.values()]
            if (len(found) == 2 and all(found)) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert len({v["job"] for v in verdicts}) == 1, "both runs are one job id"
        assert len(runs) == 2 and "" not in runs, list(runs)  # two runs, each with a run id of its own
        assert found == [{(SLOW_RANK, "forward-compute")}, {(SLOW_RANK, "backward-compute")}], found
        rejected = _get(f"http://127.0.0.1:{metrics}/metrics").decode()
        late = re.search(r'spans_rejected_total\{reason="late"\} (\S+)', rejected)
        assert late is None or float(late.group(1)) == 0.0, late.group(0)
    finally:
        collector.terminate()
        try:
            collector.wait(30)
        except subprocess.TimeoutExpired:
            collector.kill()

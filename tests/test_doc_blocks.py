"""Every code block of the README and of the docs it links, checked the way it can be run here.

* The README's Megatron block runs as written, after a prelude that binds its free names to real megatron-core
  objects (``ModelParallelConfig``, ``OptimizerConfig``) and a ``train_step`` that times its stages through
  ``model_config.timers`` as Megatron's schedules do; its spans reach a trace receiver.
* Python blocks elsewhere are fragments of a user's loop (``net``, ``loader``): each compiles, and every
  ``otel_straggler.<name>(...)`` call in it binds to the real function's signature.
* Bash blocks: ``promtool``/``amtool`` lines run as written; ``otel-straggler-collector --config F`` runs with
  ``--validate``; ``otel-straggler demo [...]``'s options are the CLI's; ``./scripts/*`` exist and are executable.
  ``pip install`` names this package and its extras. ``docker compose``, ``kubectl``, ``sbatch`` cannot run here
  (no Docker, cluster or Slurm): ``tests/stack`` and ``tests/deploy`` validate what they would run.
  The torchrun + DDP job runs in ``tests/test_readme_examples.py``.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import otel_straggler

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def linked_docs() -> list[Path]:
    pages = [README]
    for link in re.findall(r"\]\((docs/[^)#]+\.md)", README.read_text(encoding="utf-8")):
        if (ROOT / link) not in pages:
            pages.append(ROOT / link)
    return pages


def blocks(lang: str) -> list[tuple[Path, str]]:
    return [(p, b) for p in linked_docs()
            for b in re.findall(rf"```{lang}\n(.*?)```", p.read_text(encoding="utf-8"), re.S)]


def test_the_pages_have_the_blocks_this_file_checks() -> None:
    assert len(linked_docs()) >= 8
    assert len(blocks("python")) >= 4 and len(blocks("bash")) >= 6


MEGATRON_PRELUDE = """
import os
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer import OptimizerConfig

model_config, optimizer_config = ModelParallelConfig(), OptimizerConfig()
start, end, tokens_this_rank = 0, 4, 4096

def train_step(*args):
    timers = model_config.timers  # what Megatron's forward_backward_func and optimizer read
    timers("forward-backward", log_level=1).start()
    timers("forward-compute", log_level=2).start()
    timers("forward-compute").stop()
    timers("backward-compute", log_level=2).start()
    timers("backward-compute").stop()
    timers("forward-backward").stop()
    assert optimizer_config.timers is timers
"""


@pytest.mark.slow
def test_the_megatron_block_runs_with_real_megatron_core_configs(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    import otel_straggler_schema as schema
    from otel_straggler_demo.run import free_port
    from otel_straggler_demo.tap import TraceTap

    (block,) = [b for p, b in blocks("python") if p == README and "install_megatron" in b]
    script = tmp_path / "megatron_loop.py"
    script.write_text(MEGATRON_PRELUDE + block + "\notel_straggler.shutdown()\n", encoding="utf-8")
    tap, port = TraceTap(), free_port()
    tap.start(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_STRAGGLER_ENABLED="1", OTEL_STRAGGLER_JOB_ID="megatron-readme",
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}")
    try:
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
        points = tap.snapshot()
    finally:
        tap.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = {(p.stage, p.step) for p in points}
    assert {("forward-compute", s) for s in range(4)} <= seen, sorted(seen)
    assert {("backward-compute", s) for s in range(4)} <= seen
    assert schema.RES_RUN_ID  # the spans carry the run (checked in test_readme_examples)


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "otel_straggler"]


def test_every_python_block_compiles_and_calls_the_real_api() -> None:
    for page, block in blocks("python"):
        tree = ast.parse(block, filename=str(page))
        compile(tree, str(page), "exec")
        for call in _calls(tree):
            name = call.func.attr  # type: ignore[attr-defined]
            assert hasattr(otel_straggler, name), f"{page.name}: otel_straggler.{name} does not exist"
            sig = inspect.signature(getattr(otel_straggler, name))
            args = [object()] * len(call.args)
            kwargs = {kw.arg: object() for kw in call.keywords if kw.arg is not None}
            sig.bind(*args, **kwargs)  # raises TypeError when the block's call would


def _bash_lines() -> list[tuple[Path, str]]:
    out = []
    for page, block in blocks("bash"):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("[") and out:  # a synopsis continued on the next line
                out[-1] = (page, f"{out[-1][1]} {line}")
            elif line and not line.startswith("#"):
                out.append((page, line))
    return out


def _tool(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in (Path("/usr/bin") / name,) if p.exists()), None)


def test_every_bash_line_is_known_and_the_runnable_ones_run_as_written() -> None:
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    demo_help = subprocess.run([str(bindir / "otel-straggler"), "demo", "--help"], capture_output=True, text=True,
                               env=env, timeout=120).stdout
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    ran = 0
    for page, line in _bash_lines():
        where = f"{page.name}: {line}"
        if line.startswith("(") and line.endswith(")"):
            line = line[1:-1].replace("&&", ";")
        while re.match(r"^[A-Z_]+=\S*\s", line):  # VAR=value before the command
            line = line.split(None, 1)[1]
        first = line.split()[0]
        if first in ("promtool", "amtool") or line.startswith("cd "):
            if _tool("promtool") is None:
                continue
            cmd = line.replace("amtool", _tool("amtool") or "amtool")
            p = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
            assert p.returncode == 0, f"{where}\n{p.stdout}\n{p.stderr}"
            ran += 1
        elif first == "otel-straggler-collector":
            p = subprocess.run([*shlex.split(line), "--validate"], cwd=ROOT, capture_output=True, text=True, env=env,
                               timeout=120)
            assert p.returncode == 0, f"{where}\n{p.stderr}"
            ran += 1
        elif first == "otel-straggler" and line.split()[1] == "demo":
            for opt in re.findall(r"--[a-z][a-z-]+", line):
                assert opt in demo_help, f"{where}: {opt} is not an option of otel-straggler demo"
        elif first.startswith("./scripts/") or first == "scripts/engines":
            assert (ROOT / first).stat().st_mode & 0o111, where
        elif first == "otel-straggler" and line.split()[1] == "doctor":
            continue  # tests/emitter/test_doctor.py
        elif first == "pip" and line.split()[1] == "install":
            for req in shlex.split(line)[2:]:  # the package and the extras it names are this project's
                name, _, extras = req.partition("[")
                assert name == "otel-straggler", where
                for extra in filter(None, extras.rstrip("]").split(",")):
                    assert extra in optional, f"{where}: no extra {extra!r} in pyproject.toml"
        elif first in ("docker", "export", "torchrun", "kubectl", "sbatch") or "opentelemetry-instrument" in line:
            # no Docker, cluster or Slurm here: tests/stack, tests/deploy and test_instrumentation.py check what
            # these run; the launch block runs in test_readme_examples.py
            continue
        else:
            raise AssertionError(f"{where}: no check knows this command")
    assert ran >= 3

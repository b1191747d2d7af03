"""The README stays short and true: its two set-up commands exist and CI runs the test command; its links
resolve; its torchrun + DDP example runs as written (2 ranks on CPU) and times each stage on every rank with
the collective in a stage of its own. docs/configuration.md documents every emitter setting and every
straggler processor key."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from collector_processor.processor.straggler.config import Config
from otel_straggler.config import EmitterConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _ddp_example() -> str:
    (example,) = [b for b in _python_blocks(README) if "torch.distributed" in b]
    return example


def test_every_emitter_setting_is_documented() -> None:
    names = [f.name for f in dataclasses.fields(EmitterConfig) if f.name != "config_errors"]
    missing = [n for n in names if f"OTEL_STRAGGLER_{n.upper()}" not in CONFIGURATION]
    assert not missing, missing


def test_every_straggler_processor_key_is_documented() -> None:
    missing = [k for k in Config.model_fields if f"`{k}`" not in CONFIGURATION and f"`{k}." not in CONFIGURATION]
    assert not missing, missing


def test_the_two_commands_exist_and_ci_runs_the_test_command() -> None:
    for cmd in ("./scripts/demo", "./scripts/test"):
        assert cmd in README
        assert (ROOT / cmd).stat().st_mode & 0o111
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if ln.strip() and not ln.lstrip().startswith("#")]
    assert ci[-1] == "exec ./scripts/test", ci


def test_readme_is_short_and_its_links_resolve() -> None:
    assert len(README.splitlines()) < 160, "task-first: settings, costs and internals live in docs/"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert len(links) >= 8
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link
    for doc in ("docs/configuration.md", "docs/costs.md", "docs/demo.md", "docs/architecture.md"):
        assert doc in README, doc


def test_doc_pages_links_resolve() -> None:
    for page in ("configuration.md", "costs.md", "demo.md", "architecture.md"):
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if not link.startswith("http"):
                assert (ROOT / "docs" / link).resolve().exists(), (page, link)


def test_the_ddp_example_keeps_the_collective_out_of_the_compute_stages() -> None:
    example = _ddp_example()
    compile(example, "train.py", "exec")
    stages = re.findall(r'otel_straggler\.stage\("([^"]+)"\)', example)
    assert stages == ["forward-compute", "backward-compute", "all-grads-sync", "optimizer"]
    from otel_straggler_schema.stages import stage_group

    # compute stages are judged; the all-reduce is in a grad-sync stage, which the detector never judges
    assert [stage_group(s) for s in stages] == ["forward", "backward", "grad-sync", "optimizer"]
    assert "grad-sync" not in Config().judged_groups
    assert "no_sync()" in example and "dp_rank=rank, dp_size=world" in example
    assert "OTEL_STRAGGLER_JOB_ID" in README and "torchrun --nproc_per_node" in README


@pytest.mark.slow
def test_the_ddp_example_runs_under_torchrun_and_every_rank_reports_every_stage(tmp_path: Path) -> None:
    """2 ranks on CPU (gloo) exporting to a trace receiver on loopback: every rank sends every stage of
    every step."""
    pytest.importorskip("torch")
    from otel_straggler_demo.run import free_port
    from otel_straggler_demo.tap import TraceTap

    script = tmp_path / "train.py"
    script.write_text(_ddp_example().replace("steps: int = 100", "steps: int = 12"), encoding="utf-8")
    tap, port = TraceTap(), free_port()
    tap.start(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_STRAGGLER_JOB_ID=f"readme-{uuid.uuid4().hex[:8]}",
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(script)], capture_output=True, text=True, timeout=1200, env=env, cwd=tmp_path)
        points = tap.snapshot()
    finally:
        tap.stop()
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = {(p.rank, p.stage, p.step) for p in points}
    for rank in (0, 1):
        for stage in ("forward-compute", "backward-compute", "all-grads-sync", "optimizer"):
            assert {st for r, s, st in seen if r == rank and s == stage} == set(range(12)), (rank, stage)


def test_the_see_it_section_forwards_every_span_to_a_local_jaeger_beside_the_collector() -> None:
    """"See it": the collector line, with its variables, runs the shipped configuration so that it forwards the
    traces pipeline (stage and verdict spans, no filter) to Jaeger's OTLP port and binds none of Jaeger's ports
    (4317, 4318, 16686); the ranks send to the collector's moved port."""
    import shlex

    from collector_processor.config.loader import load_text
    from collector_processor.config.validate import validate

    section = README.split("## See it", 1)[1].split("\n## ", 1)[0]
    (line,) = [ln for ln in section.splitlines() if "otel-straggler-collector" in ln and "=" in ln.split()[0]]
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=", 1)[0].isupper())
    assert words[-1] == "otel-straggler-collector"
    text = (ROOT / "collector_processor" / "config" / "collector.yaml").read_text(encoding="utf-8")
    raw, marks = load_text(text, "collector.yaml", env=env)
    cfg = validate(raw, marks)
    traces = raw["service"]["pipelines"]["traces"]
    assert not [p for p in traces.get("processors", []) if p.startswith("filter")]
    (exporter,) = [e for e in traces["exporters"] if e.startswith("otlp_grpc")]
    assert raw["exporters"][exporter]["endpoint"] == "127.0.0.1:4317"
    bound = {int(e.rpartition(":")[2]) for e in env.values() if e.startswith("127.0.0.1:") and e != "127.0.0.1:4317"}
    assert bound and not bound & {4317, 4318, 16686}
    assert cfg is not None
    grpc = env["OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT"]
    assert f"OTEL_EXPORTER_OTLP_ENDPOINT=http://{grpc}" in section
    assert "16686/trace/" in section and "grafana-alerting" in section

"""Two installs from one distribution: the emitter (what a training image needs) and the collector (the
``collector`` extra). Neither package loads the other at runtime; the contract they share (the package
``otel_straggler_schema``) loads nothing but the standard library, and the demo application
(``otel_straggler_demo``) is imported by no library package. The collector runs its built-in configuration
without flags, and both command lines say what runs (``--version``)."""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml
from packaging_support import ROOT

import otel_straggler
from otel_straggler_demo.run import free_ports

COLLECTOR_DEPS = ("collector_processor", "pydantic", "yaml", "prometheus_client")


def _python(code: str, **env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=full,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PROJECT = ("otel_straggler", "collector_processor", "torch", "opentelemetry")


def test_the_shared_contract_loads_nothing_but_the_standard_library() -> None:
    out = _python("import json, sys; import otel_straggler_schema, otel_straggler_schema.stages; "
                  f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({PROJECT!r}))))")
    assert out == ["otel_straggler_schema", "otel_straggler_schema.stages"]
    stdlib = _python("import json, sys; before = set(sys.modules); import otel_straggler_schema.stages; "
                     "print(json.dumps(sorted(m for m in set(sys.modules) - before "
                     "if m.split('.')[0] not in sys.stdlib_module_names)))")
    assert stdlib == ["otel_straggler_schema", "otel_straggler_schema.stages"]


def test_the_emitter_s_schema_module_is_the_contract_re_exported() -> None:
    import otel_straggler_schema
    import otel_straggler_schema.stages
    from otel_straggler import schema, stages

    public = {n for n in vars(otel_straggler_schema) if (n.isupper() and not n.startswith("_")) or n in {
        "trace_id_for_step", "job_step_span_id", "rank_step_span_id", "run_cohort", "cohort_run", "cohort_key"}}
    assert len(public) > 150
    assert all(getattr(schema, n) is getattr(otel_straggler_schema, n) for n in public)
    assert stages.stage_group is otel_straggler_schema.stages.stage_group


def test_the_running_collector_loads_no_emitter_module() -> None:
    """Everything a running collector imports (CLI, config, service with the shipped configuration's components,
    the straggler processor) loads the contract and no module of ``otel_straggler``."""
    code = """
import json, sys
import collector_processor, collector_processor.cli as cli, collector_processor.service as service
import collector_processor.components, collector_processor.processor.straggler.processor
with cli.default_config_path() as p:
    cfg = cli.load_config([str(p)])
svc = service.Service(cfg)
print(json.dumps(sorted(m for m in sys.modules if m.startswith(('otel_straggler', 'torch', 'opentelemetry.sdk')))))
"""
    assert _python(code) == ["otel_straggler_schema", "otel_straggler_schema.stages"]


def test_the_collector_cli_validating_a_configuration_loads_no_emitter_module(tmp_path: Path) -> None:
    code = """
import json, sys
from collector_processor import cli
with cli.default_config_path() as p:
    try:
        rc = cli.main(["--config", str(p), "--validate"])
    except SystemExit as exc:
        rc = exc.code
print(json.dumps({"rc": rc, "loaded": sorted(m for m in sys.modules if m.startswith(('otel_straggler', 'torch')))}))
"""
    out = _python(code)
    assert out["rc"] == 0
    assert [m for m in out["loaded"] if not m.startswith("otel_straggler_schema")] == []


def test_the_emitter_loads_no_collector_module_or_dependency() -> None:
    """Every library module of the emitter, imported and wired (configure + a step), loads neither the collector
    nor its dependencies. (``otel_straggler_demo`` is the demo application, started by ``otel-straggler demo``,
    and needs the ``collector`` extra; no library module imports it.)"""
    code = f"""
import importlib, json, pkgutil, sys
import otel_straggler
mods = [m.name for m in pkgutil.walk_packages(otel_straggler.__path__, "otel_straggler.")
        if not m.name.startswith(("otel_straggler_demo", "otel_straggler.cli"))]
for name in mods:
    importlib.import_module(name)
from otel_straggler.interval import NullSink
t = otel_straggler.configure(enabled=True, sink=NullSink(), register_lifecycle=False)
otel_straggler.step(0)
with otel_straggler.stage("forward-compute"):
    pass
otel_straggler.shutdown(2.0)
demo = [m for m in sys.modules if m.startswith("otel_straggler_demo")]
import otel_straggler.cli  # the command line loads the demo only when ``demo`` runs
print(json.dumps({{"n": len(mods), "demo": demo,
                  "loaded": sorted({{m.split(".")[0] for m in sys.modules}} & set({list(COLLECTOR_DEPS)!r}))}}))
"""
    out = _python(code)
    assert out["n"] >= 25 and out["demo"] == [] and out["loaded"] == []


def test_import_otel_straggler_loads_neither_the_collector_nor_the_demo() -> None:
    out = _python("import json, sys; import otel_straggler, otel_straggler.cli, otel_straggler.schema; "
                  "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
                  "{'collector_processor', 'otel_straggler_demo', 'pydantic', 'prometheus_client', 'yaml'})))")
    assert out == []


def test_no_library_package_imports_the_demo() -> None:
    """No library module names the demo, the command line included (``otel-straggler demo`` is an
    ``otel_straggler.commands`` entry point)."""
    for package in ("otel_straggler", "otel_straggler_schema", "collector_processor"):
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            assert "otel_straggler_demo" not in path.read_text(encoding="utf-8"), rel


def test_the_contract_imports_only_the_standard_library_and_itself() -> None:
    imported = set()
    for path in (ROOT / "otel_straggler_schema").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) <= {"otel_straggler_schema"}


def test_otel_straggler_demo_dispatches_to_the_demo_application() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run([sys.executable, "-m", "otel_straggler.cli", "demo", "--help"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: otel-straggler demo") and "--inject-rank" in proc.stdout
    top = subprocess.run([sys.executable, "-m", "otel_straggler.cli", "--help"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert top.returncode == 0 and "{demo,token,doctor}" in top.stdout and "slow one" in top.stdout


def test_version_says_which_hot_path_runs() -> None:
    cli = [sys.executable, "-m", "otel_straggler.cli", "--version"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    py = subprocess.run(cli, capture_output=True, text=True, timeout=60,
                        env={**env, "OTEL_STRAGGLER_HOT_PATH": "python"})
    assert py.returncode == 0, py.stderr
    assert py.stdout.strip().startswith(f"otel-straggler {otel_straggler.__version__} (hot path: python ("), py.stdout
    assert "OTEL_STRAGGLER_HOT_PATH=python" in py.stdout
    from otel_straggler import hot_path

    if hot_path.NAME == "native":  # the development install builds the C path
        native = subprocess.run(cli, capture_output=True, text=True, timeout=60,
                                env={**env, "OTEL_STRAGGLER_HOT_PATH": "native"})
        assert "(hot path: native (C extension)" in native.stdout, native.stdout
    col = subprocess.run([sys.executable, "-m", "collector_processor", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert col.stdout.strip() == f"otel-straggler-collector {otel_straggler.__version__}"


def test_the_hot_path_is_logged_once_at_info() -> None:
    code = """
import io, json, logging
buf = io.StringIO()
logging.basicConfig(stream=buf, level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
import otel_straggler
from otel_straggler.interval import NullSink
for _ in range(2):
    otel_straggler.configure(enabled=True, sink=NullSink(), register_lifecycle=False)
otel_straggler.shutdown(1.0)
print(json.dumps([ln for ln in buf.getvalue().splitlines() if "hot path" in ln]))
"""
    lines = _python(code, OTEL_STRAGGLER_HOT_PATH="python")
    assert lines == [f"INFO otel_straggler.hot_path otel-straggler {otel_straggler.__version__}: hot path python "
                     "(OTEL_STRAGGLER_HOT_PATH=python)"]


def _collector_env(tmp: Path, ports: list[int], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT=f"127.0.0.1:{ports[0]}",
               OTEL_STRAGGLER_OTLP_HTTP_ENDPOINT=f"127.0.0.1:{ports[1]}",
               OTEL_STRAGGLER_METRICS_ENDPOINT=f"127.0.0.1:{ports[2]}",
               OTEL_STRAGGLER_EVIDENCE_PATH=str(tmp / "evidence" / "verdicts.jsonl"), **extra)
    return env


def test_print_config_shows_the_built_in_configuration_with_the_environment(tmp_path: Path) -> None:
    ports = free_ports(3)
    env = _collector_env(tmp_path, ports, OTEL_STRAGGLER_TOKEN="s3cret-token")
    proc = subprocess.run([sys.executable, "-m", "collector_processor", "--print-config"], capture_output=True,
                          text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == f"127.0.0.1:{ports[0]}"
    assert cfg["exporters"]["prometheus"]["endpoint"] == f"127.0.0.1:{ports[2]}"
    assert set(cfg["service"]["pipelines"]) == {"traces", "logs/verdicts", "metrics"}
    assert "s3cret-token" not in proc.stdout and cfg["receivers"]["otlp"]["auth"]["bearer_token"] == "<redacted>"
    bad = tmp_path / "bad.yaml"
    bad.write_text("exporters: {nope: {}}\n")
    invalid = subprocess.run([sys.executable, "-m", "collector_processor", "--config", bad.name, "--print-config"],
                             capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert invalid.returncode == 2 and invalid.stdout == ""


def test_the_collector_runs_its_built_in_configuration_without_flags(tmp_path: Path) -> None:
    ports = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "collector_processor"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_collector_env(tmp_path, ports), cwd=tmp_path)
    try:
        deadline, body = time.monotonic() + 60, b""
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[2]}/metrics", timeout=2) as r:
                    body = r.read()
                break
            except OSError:
                time.sleep(0.2)
        assert b"otel_straggler_collector_spans_received_total" in body
        listening = False  # the receivers start after the exporters: /metrics can answer first
        while not listening and time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", ports[0]), timeout=2):
                    listening = True  # OTLP gRPC listens
            except OSError:
                time.sleep(0.2)
        assert listening
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "configuration: built-in" in err


EXTRA_BLOCKER = '''
import importlib.abc, sys

class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"yaml", "pydantic", "prometheus_client"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Blocked())
'''


def test_without_the_collector_extra_the_collector_says_so_in_one_line(tmp_path: Path) -> None:
    """The install without the ``collector`` extra: its modules blocked from import (a ``sitecustomize``), the rest
    of this environment as it is. ``python -m collector_processor`` runs the console script's entry point."""
    (tmp_path / "sitecustomize.py").write_text(EXTRA_BLOCKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "collector_processor", "--validate"], capture_output=True,
                          text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "otel-straggler-collector: needs the collector extra, missing pyyaml, pydantic, prometheus-client: "
        "pip install 'otel-straggler[collector]'"], proc.stderr
    assert "Traceback" not in proc.stderr

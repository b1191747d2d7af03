"""README command 1's job, end to end, on a machine whose every core is busy with a competing job: the demo
with its default model and its default +10 % slowdown finds the injected rank and stage, nobody else, and
sees it recover; the collector's /metrics after that real traffic passes ``promtool check metrics``. A run
that cannot convict the injected rank exits 1 and says why; bad options exit 2 before anything starts.

Bounds here are in steps, never in seconds: wall-clock limits are generous timeouts against a hang.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
HANG_S = 1800  # a hang, not a latency: the run takes minutes on a loaded 2-core machine


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "otel_straggler.cli", "demo", *args], capture_output=True,
                          text=True, timeout=HANG_S, env={**os.environ, "COLUMNS": "1000"})  # help unwrapped


@pytest.fixture(scope="module")
def loaded_run(tmp_path_factory: pytest.TempPathFactory, cpu_load: int) -> tuple[subprocess.CompletedProcess[str],
                                                                                   dict, Path]:
    """8 ranks (default), default stage sizes and +10 % on rank 3's forward-compute from step 50 until 90,
    while ``cpu_load`` busy loops compete for every core."""
    out = tmp_path_factory.mktemp("demo") / "out"
    proc = _demo("--steps", "120", "--inject-until", "90", "--out", str(out), "--json")
    summary = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    return proc, summary, out


def test_demo_under_load_detects_the_injected_rank_and_nobody_else(loaded_run) -> None:  # type: ignore[no-untyped-def]
    proc, summary, out = loaded_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert summary["ok"] is True and summary["problems"] == []
    assert summary["false_alarms"] == 0, summary
    first = summary["detected"][0]
    assert (first["rank"], first["stage"], first["verdict"]) == (3, "forward-compute", "straggler")
    assert all(d["rank"] == 3 for d in summary["detected"]), summary["detected"]
    assert 0 <= first["steps_to_detect"] <= 40  # steps after onset, whatever the machine's speed
    assert first["attribution"] == "host_only_stall"  # CPU ranks: host timing only
    assert first["deviation"] > 0.05 and first["step_time_lost_ms"] > 5.0  # clear of the 5 ms floor
    assert first["recovered_step"] is not None and first["recovered_step"] >= 90
    assert (out / "report.html").stat().st_size > 1000 and (out / "report.png").stat().st_size > 1000
    assert "Found: rank 3 forward-compute" in (out / "report.html").read_text(encoding="utf-8")
    verdicts = [json.loads(x) for x in (out / "verdicts.jsonl").read_text().splitlines()]
    assert any(v["verdict"] == "straggler" and v["rank"] == 3 for v in verdicts)
    with (out / "stage-times.csv").open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert {int(r["rank"]) for r in rows} == set(range(8))
    assert {int(r["step"]) for r in rows if r["stage"] == "forward-compute"} >= set(range(1, 121))
    assert "summary" in proc.stderr and "OK: the injected rank was found" in proc.stderr


def test_collector_metrics_after_the_demo_pass_promtool(loaded_run) -> None:  # type: ignore[no-untyped-def]
    """The real collector's /metrics, scraped at the end of the demo (straggler series, collector self-metrics,
    every rank's emitter self-metrics over OTLP), passes Prometheus' own lint."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; scripts/test installs it)")
    _, summary, out = loaded_run
    text = (out / "metrics.prom").read_text(encoding="utf-8")
    assert summary["metrics"] == str(out / "metrics.prom")
    for name in ("otel_straggler_active", "otel_straggler_collector_spans_received_total",
                 "otel_straggler_emitter_intervals_total", "otel_straggler_emitter_readout_lag_seconds"):
        assert f"\n{name}{{" in text or f"\n{name} " in text, name
    assert "\notel_straggler_emitter_readout_lag{" not in text  # the unit is part of the name
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), f"promtool check metrics:\n{r.stdout}{r.stderr}"


def test_every_counter_a_dashboard_or_alert_rates_exists_after_the_demo(loaded_run) -> None:  # type: ignore[no-untyped-def]
    """rate() and increase() need a sample before the first event: every counter they read is on /metrics
    (at 0 when nothing happened) once the job has run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stack"))
    from stack_support import alert_exprs, dashboard_exprs

    _, _, out = loaded_run
    present = {m.group(0) for ln in (out / "metrics.prom").read_text(encoding="utf-8").splitlines()
               if ln and not ln.startswith("#") and (m := re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", ln))}
    rated = {m.group(1) for _, expr in dashboard_exprs() + alert_exprs()
             for m in re.finditer(r"\b(?:rate|irate|increase)\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", expr)}
    assert len(rated) >= 15
    missing = sorted(rated - present)
    assert not missing, missing


def test_demo_exits_1_and_says_why_when_the_injected_rank_is_not_convicted(tmp_path: Path) -> None:
    """Two slowed steps inside one 5-step window leave its median at par: nothing can be convicted, and the
    demo must not pass it off as a success."""
    out = tmp_path / "demo"
    proc = _demo("--ranks", "3", "--steps", "70", "--inject-rank", "1", "--inject-from", "52", "--inject-until",
                 "54", "--out", str(out), "--json")
    assert proc.returncode == 1, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is False
    assert any(p.startswith("not detected: rank 1 forward-compute") for p in summary["problems"]), summary
    assert "FAILED:" in proc.stderr and "not detected: rank 1 forward-compute" in proc.stderr
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "FAILED: not detected" in page


@pytest.mark.parametrize(("args", "message"), [
    (["--ranks", "4", "--inject-rank", "9"], "--inject-rank 9 is not below --ranks 4"),
    (["--model", "foo"], "invalid choice: 'foo'"),
    (["--steps", "40"], "--steps 40 ends before --inject-from 50"),
    (["--steps", "60"], "the detector needs at least 15"),
    (["--microbatches", "1"], "too close to the detector's absolute floor"),
    (["--inject-stage", "all-grads-sync"], "is never judged"),
    (["--inject-from", "60", "--inject-until", "60"], "--inject-until 60 must be after --inject-from 60"),
])
def test_demo_rejects_bad_options_before_starting(tmp_path: Path, args: list[str], message: str) -> None:
    proc = _demo(*args, "--out", str(tmp_path / "never"))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "never").exists()  # nothing started


def test_megatron_model_without_cuda_is_refused_before_ranks_start(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _demo("--model", "megatron:launch-bound", "--out", str(tmp_path / "never"))
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr, proc.stderr
    assert not (tmp_path / "never").exists()


def test_help_lists_every_model_and_both_programs_have_a_version() -> None:
    from otel_straggler_demo.options import MODELS

    helptext = _demo("--help").stdout
    assert len(MODELS) == 5 and all(model in helptext for model in MODELS), helptext
    from importlib.metadata import version

    v = version("otel-straggler")
    for argv in ([sys.executable, "-m", "otel_straggler.cli", "--version"],
                 [sys.executable, "-m", "collector_processor", "--version"]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=HANG_S)
        assert r.returncode == 0 and v in r.stdout, (argv, r.stdout, r.stderr)


def test_every_verdict_reason_has_plain_words() -> None:
    import otel_straggler_schema as schema
    from otel_straggler_demo.outcome import REASON_TEXT

    assert set(REASON_TEXT) == set(schema.REASONS)

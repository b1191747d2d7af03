"""README command 1's job, end to end: the demo finds the injected rank and stage, and nobody else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_demo_detects_the_injected_rank_with_json_summary(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "otel_straggler.cli", "demo", "--ranks", "4", "--steps", "75", "--inject-rank", "1",
         "--inject-from", "25", "--inject-until", "55", "--inject-slowdown", "0.4", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] is True
    assert summary["false_alarms"] == 0, summary
    first = summary["detected"][0]
    assert (first["rank"], first["stage"], first["verdict"]) == (1, "forward-compute", "straggler")
    assert 0 <= first["steps_to_detect"] <= 15
    assert first["attribution"] == "host_only_stall"  # CPU ranks: host timing only
    assert first["deviation"] > 0.1 and first["recovered_step"] is not None and first["recovered_step"] >= 55
    assert (out / "report.html").stat().st_size > 1000 and (out / "report.png").stat().st_size > 1000
    lines = (out / "verdicts.jsonl").read_text().splitlines()
    assert any(json.loads(x)["verdict"] == "straggler" for x in lines)
    assert "step" in proc.stderr and "summary" in proc.stderr  # progress and summary for a person


def test_demo_rejects_bad_options() -> None:
    proc = subprocess.run([sys.executable, "-m", "otel_straggler.cli", "demo", "--ranks", "4", "--inject-rank", "9"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--inject-rank 9 is not below --ranks 4" in proc.stderr

"""A collector that never comes up: run_demo raises CollectorStartError with the tap and the collector child
stopped, and the CLI says so and exits 1 (any other error is not reported as "did not start")."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from otel_straggler import cli
from otel_straggler_demo import run
from otel_straggler_demo.options import DemoOptions

HANG_S = 120.0


def _never_up(monkeypatch: pytest.MonkeyPatch) -> tuple[list[subprocess.Popen], list[object]]:
    collectors: list[subprocess.Popen] = []
    taps: list[object] = []
    monkeypatch.setattr(run, "_wait_http", lambda url, timeout_s, proc=None: collectors.append(proc) or False)
    stop = run.TraceTap.stop

    def tap_stop(self: run.TraceTap) -> None:
        taps.append(self)
        stop(self)

    monkeypatch.setattr(run.TraceTap, "stop", tap_stop)
    return collectors, taps


def test_run_demo_stops_the_tap_and_the_collector_when_it_does_not_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    collectors, taps = _never_up(monkeypatch)
    with pytest.raises(run.CollectorStartError, match="the collector did not start"):
        run.run_demo(DemoOptions(ranks=2, inject_rank=None, out=str(tmp_path / "out"), quiet=True))
    (collector,) = collectors
    assert collector.wait(timeout=HANG_S) is not None  # stopped, not left running
    assert len(taps) == 1  # stopped once


def test_cli_reports_a_collector_that_did_not_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _never_up(monkeypatch)
    rc = cli.main(["demo", "--ranks", "2", "--inject-rank", "-1", "--quiet", "--out", str(tmp_path / "out")])
    assert rc == 1 and "the collector did not start" in capsys.readouterr().err


def test_cli_does_not_call_other_runtime_errors_a_collector_start(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(opts: DemoOptions) -> None:
        raise RuntimeError("something else")

    monkeypatch.setattr(run, "run_demo", broken)
    with pytest.raises(RuntimeError, match="something else"):
        cli.main(["demo", "--ranks", "2", "--inject-rank", "-1", "--quiet", "--out", str(tmp_path / "out")])

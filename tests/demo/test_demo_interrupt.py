"""Ctrl-C on the demo (the terminal sends SIGINT to the demo's foreground process group), or SIGTERM to that
group. The demo's collector child runs in a session of its own (``start_new_session=True`` in
``otel_straggler_demo/run.py``), so it never sees that signal; the demo must stop it itself, or it is left
running with its ports bound. The demo says it was interrupted and exits 130.

Bounds are generous timeouts against a hang, never latencies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
HANG_S = 600


def _pids_running(needle: str) -> list[int]:
    """Processes whose command line contains ``needle`` (zombies excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_demo_leaves_no_collector_behind(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "out"
    demo = subprocess.Popen([sys.executable, "-m", "otel_straggler.cli", "demo", "--ranks", "2", "--steps", "400",
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a terminal's foreground job
    needle = str(out / "collector.yaml")
    try:
        assert demo.stderr is not None
        deadline = time.monotonic() + HANG_S
        for line in demo.stderr:
            if line.startswith("collector up") or time.monotonic() > deadline:
                break
        assert _pids_running(needle), "the demo's collector did not start"
        os.killpg(demo.pid, sig)  # Ctrl-C: SIGINT to the foreground group; a scheduler's stop: SIGTERM
        _, err = demo.communicate(timeout=HANG_S)
        assert demo.returncode == 130 and "interrupted" in err, (demo.returncode, err[-2000:])
        deadline = time.monotonic() + 60.0  # the collector's own shutdown bound is 10 s
        while _pids_running(needle) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _pids_running(needle) == [], "the collector outlived the interrupted demo"
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(timeout=30)
        for pid in _pids_running(needle):
            os.kill(pid, signal.SIGTERM)

"""Background CPU load for the demo's tests: ``scripts/cpu-load`` (one busy loop per core) for as long as the
fixture is held, stopped with its whole process group. Under ``scripts/test-under-load``, which already keeps
every core busy (``OTEL_STRAGGLER_CPU_LOAD``), the fixture adds nothing: the load is one busy loop per core
either way."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cpu_load() -> Iterator[int]:
    n = os.cpu_count() or 2
    if os.environ.get("OTEL_STRAGGLER_CPU_LOAD"):
        yield int(os.environ["OTEL_STRAGGLER_CPU_LOAD"])
        return
    proc = subprocess.Popen([str(ROOT / "scripts" / "cpu-load"), str(n)], start_new_session=True,
                            stderr=subprocess.DEVNULL)
    try:
        yield n
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)

"""Builds the sdist and the default wheel once per session, as a release would (``python -m build``)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Dist:
    sdist: Path
    wheel: Path
    log: str


def build_env(**extra: str) -> dict[str, str]:
    """The environment without any build switch of ours (the default build), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("OTEL_STRAGGLER_BUILD_NATIVE", "CIBUILDWHEEL")}
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """``python -m build`` (sdist, then the wheel built from the sdist). No isolation: the build uses this
    environment's setuptools instead of downloading one."""
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600, env=build_env(), cwd=out)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Dist(sdist, wheel, proc.stdout + proc.stderr)

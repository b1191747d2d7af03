"""Builds the sdist and the default wheel once per session, as a release would (``python -m build``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from packaging_support import ROOT, Dist, build_env


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

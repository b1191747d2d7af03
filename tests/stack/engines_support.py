"""The real engines: the OpenTelemetry Collector distribution and Jaeger v2 that ``scripts/engines`` builds.

``scripts/test`` builds them and exports their paths (``OTEL_STRAGGLER_OTELCOL``, ``OTEL_STRAGGLER_JAEGER``). A run
without those variables asks ``scripts/engines`` for cached binaries (no build). Where neither finds them, a test
skips with the command that builds them, except under CI (``CI=true``), where a missing engine fails the test."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENGINES_SCRIPT = REPO / "scripts" / "engines"
ENV_OTELCOL = "OTEL_STRAGGLER_OTELCOL"
ENV_JAEGER = "OTEL_STRAGGLER_JAEGER"


def _cached() -> dict[str, str]:
    """The cached binaries' paths for the current pins, or {} when either is not built (builds nothing)."""
    try:
        check = subprocess.run([str(ENGINES_SCRIPT), "--check"], capture_output=True, timeout=60)
        if check.returncode != 0:
            return {}
        out = subprocess.run([str(ENGINES_SCRIPT)], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def engine(var: str) -> str:
    """Path of an engine binary by its variable (ENV_OTELCOL, ENV_JAEGER); skip or, under CI, fail without it."""
    path = os.environ.get(var) or _cached().get(var)
    if path and os.access(path, os.X_OK):
        return path
    why = f"{var} is not set and scripts/engines has no cached build for the current pins (run scripts/engines)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"the engine is missing under CI: {why}")
    pytest.skip(why)


def otelcol() -> str:
    """The OpenTelemetry Collector distribution of engines/otelcol."""
    return engine(ENV_OTELCOL)


def jaeger() -> str:
    """Jaeger v2 of engines/jaeger."""
    return engine(ENV_JAEGER)

"""Shared by the packaging tests: the checkout, the built artifacts, the build environment."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

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

"""The README documents every emitter setting and every straggler processor key, and its two
set-up commands exist and are what CI runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from collector_processor.processor.straggler.config import Config
from otel_straggler.config import EmitterConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_emitter_setting_is_in_the_readme() -> None:
    names = [f.name for f in dataclasses.fields(EmitterConfig) if f.name != "config_errors"]
    missing = [n for n in names if f"OTEL_STRAGGLER_{n.upper()}" not in README]
    assert not missing, missing


def test_every_straggler_processor_key_is_in_the_readme() -> None:
    missing = [k for k in Config.model_fields if f"`{k}`" not in README and f"`{k}." not in README]
    assert not missing, missing


def test_the_two_commands_exist_and_ci_runs_the_test_command() -> None:
    for cmd in ("./scripts/demo", "./scripts/test"):
        assert cmd in README
        assert (ROOT / cmd).stat().st_mode & 0o111
    assert "./scripts/test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")

"""Factory of the ``straggler`` processor (the service builds pipelines from these)."""

from __future__ import annotations

from collections.abc import Callable

from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.model import Verdict
from collector_processor.processor.straggler.processor import StragglerProcessor
from collector_processor.telemetry import Telemetry

TYPE = "straggler"

__all__ = ["TYPE", "Config", "StragglerProcessor", "create_default_config", "create_processor"]


def create_default_config() -> Config:
    return Config()


def create_processor(config: Config, telemetry: Telemetry,
                     emit_verdicts: Callable[[list[Verdict]], None]) -> StragglerProcessor:
    return StragglerProcessor(config, telemetry, emit_verdicts)

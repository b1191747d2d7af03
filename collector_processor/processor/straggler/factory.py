"""Factories of the straggler plugin: the ``straggler`` processor (traces in, verdict spans appended, verdicts
emitted beside the data) and the ``straggler`` connector (traces -> logs: those verdicts as events).

``create_processor`` builds the processor alone, without a collector (tests, benchmarks); ``PROCESSOR`` and
``CONNECTOR`` are what a collector distribution registers (``collector_processor.components``).
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict

from collector_processor.component import Forward
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.events import VerdictEvents
from collector_processor.processor.straggler.model import Verdict
from collector_processor.processor.straggler.processor import StragglerProcessor
from collector_processor.registry import BuildContext, Factory
from collector_processor.telemetry import Telemetry

TYPE = "straggler"
VERDICTS = "verdicts"  # the side output the processor emits and the connector carries

__all__ = ["CONNECTOR", "PROCESSOR", "TYPE", "Config", "ConnectorConfig", "StragglerProcessor", "VerdictConnector",
           "create_default_config", "create_processor"]


def create_default_config() -> Config:
    return Config()


def create_processor(config: Config, telemetry: Telemetry, emit_verdicts: Callable[[list[Verdict]], None],
                     tenant_of: Callable[[str], str] | None = None) -> StragglerProcessor:
    return StragglerProcessor(config, telemetry, emit_verdicts, tenant_of=tenant_of)


class ConnectorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VerdictConnector:
    """The exporter of a traces pipeline that runs a straggler processor and the receiver of ``logs`` pipelines:
    the verdicts that processor emits (at a window's close, on ``tick``, at shutdown) become one event each. The
    spans themselves are left to the pipeline's other exporters."""

    def __init__(self, cid: str, forward: Forward) -> None:
        self.id = cid
        self._forward = forward

    def consume(self, items: list[Verdict]) -> None:
        if items:
            self._forward(VerdictEvents(items))

    def start(self) -> None:
        return

    def shutdown(self, timeout_s: float = 5.0) -> None:
        return


def _processor(ctx: BuildContext, cid: str, cfg: Config) -> StragglerProcessor:
    return create_processor(cfg, ctx.telemetry, ctx.emit_for(cid), ctx.tenant_of)


def _connector(ctx: BuildContext, cid: str, cfg: ConnectorConfig) -> VerdictConnector:
    return VerdictConnector(cid, ctx.forward_for(cid))


PROCESSOR = Factory("processor", TYPE, Config, _processor, signals=frozenset({"traces"}), emits=VERDICTS)
CONNECTOR = Factory("connector", TYPE, ConnectorConfig, _connector, signals=frozenset({"traces"}),
                    outputs=frozenset({"logs"}), consumes=VERDICTS)

"""``debug`` exporter: one log line per event (a connector's, e.g. a verdict) at the event's level and, per OTLP
request, its item count (``detailed``: the request itself) on stderr."""

from __future__ import annotations

import logging
import sys
from typing import Literal

from google.protobuf.message import Message

from collector_processor.component import EventBatch
from collector_processor.config.types import Strict
from collector_processor.receiver.decode import count_items
from collector_processor.registry import BuildContext, Factory
from collector_processor.telemetry import Telemetry

_events = logging.getLogger("otel-straggler-collector.events")


class Config(Strict):
    verbosity: Literal["basic", "normal", "detailed"] = "basic"


class DebugExporter:
    def __init__(self, eid: str, cfg: Config, telemetry: Telemetry, stream=None) -> None:
        self.id = eid
        self.cfg = cfg
        self.t = telemetry
        self.stream = stream

    def _write(self, text: str) -> None:
        out = self.stream or sys.stderr
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            self.t.export_failures.labels(self.id).inc()

    def export_events(self, batch: EventBatch) -> None:
        """Each event through the ``otel-straggler-collector.events`` logger at its level (a straggler verdict
        WARNING, a recovery INFO, an uncertain window DEBUG): ``--log-level`` decides what shows."""
        for level, line in batch.console_lines():
            _events.log(level, "[%s] %s", self.id, line)

    def _summary(self, signal: str, msg: Message) -> None:
        text = f"[{self.id}] {signal}: {count_items(signal, msg)} items\n"
        if self.cfg.verbosity == "detailed":
            text += str(msg) + "\n"
        self._write(text)

    def export_traces(self, request: Message) -> None:
        self._summary("traces", request)

    def export_logs(self, request: Message) -> None:
        self._summary("logs", request)

    def export_metrics(self, request: Message) -> None:
        self._summary("metrics", request)

    def start(self) -> None:
        pass

    def shutdown(self, timeout_s: float = 5.0) -> None:
        pass


def _create(ctx: BuildContext, cid: str, cfg: Config) -> DebugExporter:
    return DebugExporter(cid, cfg, ctx.telemetry)


FACTORY = Factory("exporter", "debug", Config, _create)

"""``debug`` exporter: one line per verdict (``basic``) or per log record / span (``detailed``) on stderr."""

from __future__ import annotations

import sys
from typing import Literal

from google.protobuf.message import Message

from collector_processor.config.types import Strict
from collector_processor.processor.straggler.model import Verdict
from collector_processor.receiver.decode import count_items
from collector_processor.telemetry import Telemetry


class Config(Strict):
    verbosity: Literal["basic", "normal", "detailed"] = "basic"


def create_default_config() -> Config:
    return Config()


def verdict_line(v: Verdict) -> str:
    dev = "n/a" if v.deviation is None else f"{v.deviation:+.1%}"
    return (f"verdict={v.verdict} reason={v.reason} job={v.job} rank={v.rank} host={v.host} stage={v.stage} "
            f"deviation={dev} window={v.window_start}..{v.window_end} attribution={v.attribution} "
            f"lost_ms_per_step={v.step_time_lost_ms:.1f}")


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

    def export_verdicts(self, verdicts: list[Verdict]) -> None:
        self._write("".join(f"[{self.id}] {verdict_line(v)}\n" for v in verdicts))

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

"""``file`` exporter: a connector's events (e.g. verdicts) as JSON lines, the evidence trail of every decision.

Lines are buffered in memory (capped; overflow counted in ``evictions_total{structure="evidence_buffer"}``) and
written + flushed by a background thread at least every ``flush_interval``, so a SIGKILL loses at most one interval.
Each write is whole lines, so every line in the file is complete JSON. The file rotates at ``max_bytes``
(``verdicts.jsonl`` -> ``verdicts.jsonl.1`` -> ...), keeping ``max_files`` files in all.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from pydantic import Field

from collector_processor.component import EventBatch
from collector_processor.config.types import Duration, Strict
from collector_processor.registry import BuildContext, Factory
from collector_processor.telemetry import Telemetry

log = logging.getLogger(__name__)


class Config(Strict):
    path: str = "./straggler-evidence/verdicts.jsonl"
    flush_interval: Duration = 2.0
    max_bytes: int = Field(100 * 1024 * 1024, ge=1024)
    max_files: int = Field(5, ge=1, le=1000)
    max_buffered_lines: int = Field(100_000, ge=1)
    fsync: bool = False  # also fsync on every flush (survives power loss, costs a disk sync)


class EvidenceExporter:
    def __init__(self, eid: str, cfg: Config, telemetry: Telemetry) -> None:
        self.id = eid
        self.cfg = cfg
        self.t = telemetry
        self.path = Path(cfg.path)
        self._buf: list[str] = []
        self._lock = threading.Lock()  # guards _buf only
        self._io_lock = threading.Lock()  # one writer at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"evidence-{eid}", daemon=True)
        self._f = None
        self._size = 0
        telemetry.component_errors.labels(eid)  # at 0 from the start
        telemetry.evictions.labels("evidence_buffer")

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open()
        self._thread.start()
        log.info("evidence %s -> %s", self.id, self.path)

    def _open(self) -> None:
        self._f = open(self.path, "a", encoding="utf-8")
        self._size = self._f.tell()

    def export_events(self, batch: EventBatch) -> None:
        lines = []
        for rec in batch.records():
            try:
                lines.append(json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n")
            except (TypeError, ValueError):
                self.t.component_errors.labels(self.id).inc()
        with self._lock:
            room = self.cfg.max_buffered_lines - len(self._buf)
            if len(lines) > room:
                self.t.evictions.labels("evidence_buffer").inc(len(lines) - max(room, 0))
                lines = lines[: max(room, 0)]
            self._buf.extend(lines)

    def _rotate(self) -> None:
        assert self._f is not None
        self._f.close()
        n = self.cfg.max_files
        oldest = self.path.with_name(f"{self.path.name}.{n - 1}")
        if n == 1:
            self.path.unlink(missing_ok=True)
        else:
            oldest.unlink(missing_ok=True)
            for i in range(n - 2, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._open()

    def flush(self) -> None:
        with self._io_lock:
            with self._lock:
                lines, self._buf = self._buf, []
            if not lines or self._f is None:
                return
            try:
                for line in lines:
                    size = len(line.encode())
                    if self._size and self._size + size > self.cfg.max_bytes:
                        self._f.flush()
                        self._rotate()
                    self._f.write(line)
                    self._size += size
                self._f.flush()
                if self.cfg.fsync:
                    os.fsync(self._f.fileno())
                self.t.evidence_lines.inc(len(lines))
            except OSError:
                log.exception("evidence %s: write failed; %d lines lost", self.id, len(lines))
                self.t.export_failures.labels(self.id).inc()

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.flush_interval):
            self.flush()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.flush()
        with self._io_lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def _create(ctx: BuildContext, cid: str, cfg: Config) -> EvidenceExporter:
    return EvidenceExporter(cid, cfg, ctx.telemetry)


FACTORY = Factory("exporter", "file", Config, _create, signals=frozenset({"logs"}), events_only=True)

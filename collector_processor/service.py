"""The collector service: builds receivers, pipelines, processors and exporters from a validated config, starts them
and drains them in order on shutdown.

Data flow: receiver threads decode and ``submit`` to each pipeline of the signal (bounded queue, refusal when full
or over the memory limit) -> one worker thread per pipeline runs the processors and hands results to exporters (which
queue internally). A processor that emits verdicts (``straggler``) feeds every ``logs`` pipeline that lists its id
among its receivers; the OTel Collector would model it as a traces->logs connector.

Shutdown (SIGTERM): receivers stop accepting and finish in-flight requests -> traces pipelines drain -> processors
shut down (flushing open windows into verdicts) -> logs and metrics pipelines drain -> exporters flush -> servers
close. Every step has a share of ``service.shutdown_timeout``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from collector_processor.config.model import MIB
from collector_processor.config.types import split_host_port
from collector_processor.config.validate import CollectorConfig
from collector_processor.exporter.prometheus import MetricsHTTPServer, PrometheusExporter
from collector_processor.pipeline import Pipeline, Stage
from collector_processor.processor.memory_limiter import MemoryLimiter
from collector_processor.processor.straggler.model import Verdict
from collector_processor.receiver.auth import BearerAuth
from collector_processor.receiver.common import Config as ReceiverConfig
from collector_processor.receiver.common import Dispatcher
from collector_processor.receiver.otlp_grpc import OtlpGrpcReceiver
from collector_processor.receiver.otlp_http import OtlpHttpReceiver
from collector_processor.registry import BuildContext
from collector_processor.telemetry import Telemetry

log = logging.getLogger(__name__)


class Service:
    def __init__(self, cfg: CollectorConfig, telemetry: Telemetry | None = None) -> None:
        assert cfg.service is not None
        self.cfg = cfg
        self.t = telemetry or Telemetry()
        self._running = False
        self._stopping = False
        self._lock = threading.Lock()
        self.processors: dict[str, Stage] = {}
        self.exporters: dict[str, Any] = {}
        self.pipelines: dict[str, Pipeline] = {}
        self.receivers: list[OtlpGrpcReceiver | OtlpHttpReceiver] = []
        self.metrics_server: MetricsHTTPServer | None = None
        self._verdict_routes: dict[str, list[Pipeline]] = {}
        self._build()

    # ---- build ------------------------------------------------------------------------------------------------
    def healthy(self) -> bool:
        return self._running and not self._stopping

    def _emit_for(self, source_id: str):
        def emit(verdicts: list[Verdict]) -> None:
            if not verdicts:
                return
            for p in self._verdict_routes.get(source_id, ()):
                p.submit_verdicts(list(verdicts))

        return emit

    def _build(self) -> None:
        cfg, svc = self.cfg, self.cfg.service
        assert svc is not None
        ctx = BuildContext(self.t, self._emit_for, self.healthy)
        used = svc.used_ids()
        for pid, comp in cfg.processors.items():
            if pid in used:
                self.processors[pid] = Stage(pid, comp.factory.create(ctx, pid, comp.config))
        for eid, comp in cfg.exporters.items():
            if eid in used:
                self.exporters[eid] = comp.factory.create(ctx, eid, comp.config)
        for pid, pc in svc.pipelines.items():
            stages, admit = [], []
            for xid in pc.processors:
                st = self.processors[xid]
                if isinstance(st.impl, MemoryLimiter):
                    admit.append(st.impl.admit)
                else:
                    stages.append(st)
            pipe = Pipeline(pid, self.t, max_items=pc.queue.max_items, max_bytes=int(pc.queue.max_bytes_mib * MIB),
                            processors=stages, exporters=[(e, self.exporters[e]) for e in pc.exporters], admit=admit)
            self.pipelines[pid] = pipe
            for rid in pc.receivers:
                if rid in self.processors:
                    self._verdict_routes.setdefault(rid, []).append(pipe)
        for rid, comp in cfg.receivers.items():
            if rid not in used:
                continue
            rc: ReceiverConfig = comp.config  # type: ignore[assignment]
            by_signal: dict[str, list[Pipeline]] = {}
            for pid, pc in svc.pipelines.items():
                if rid in pc.receivers:
                    pipe = self.pipelines[pid]
                    by_signal.setdefault(pipe.signal, []).append(pipe)
            auth = BearerAuth(rc.auth)
            if rc.protocols.grpc is not None:
                d = Dispatcher(f"{rid}/grpc", self.t, by_signal, rc.wait_for_processing)
                self.receivers.append(OtlpGrpcReceiver(rid, rc, rc.protocols.grpc, d, self.t, auth, self.healthy))
            if rc.protocols.http is not None:
                d = Dispatcher(f"{rid}/http", self.t, by_signal, rc.wait_for_processing)
                self.receivers.append(OtlpHttpReceiver(rid, rc, rc.protocols.http, d, self.t, auth))
        addr = svc.telemetry.metrics.address.strip()
        if addr:
            prom_eps = {split_host_port(e.server.host + ":" + str(e.server.port))
                        for e in self.exporters.values() if isinstance(e, PrometheusExporter)}
            if split_host_port(addr, 9464) not in prom_eps:
                self.metrics_server = MetricsHTTPServer(addr, [self.t.registry], BearerAuth(None), self.t,
                                                        self.healthy, label="telemetry")

    # ---- run --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        started: list[Any] = []
        try:
            for e in self.exporters.values():
                e.start()
                started.append(e)
            for st in self.processors.values():
                st.impl.start()
                started.append(st.impl)
            for p in self.pipelines.values():
                p.start()
            if self.metrics_server is not None:
                self.metrics_server.start()
                started.append(self.metrics_server)
            for r in self.receivers:
                r.start()
                started.append(r)
        except Exception:
            for c in reversed(started):
                try:
                    c.shutdown(1.0)
                except Exception:
                    log.exception("cleanup after a failed start")
            raise
        self._running = True

    def endpoints(self) -> list[str]:
        out = []
        for r in self.receivers:
            scheme = "grpc" if isinstance(r, OtlpGrpcReceiver) else "http"
            out.append(f"{r.id} OTLP/{scheme.upper()} {r.host}:{r.port}")
        for eid, e in self.exporters.items():
            if isinstance(e, PrometheusExporter):
                out.append(f"{eid} metrics http://{e.server.host}:{e.server.port}/metrics (health: /healthz)")
        if self.metrics_server is not None:
            m = self.metrics_server
            out.append(f"telemetry metrics http://{m.host}:{m.port}/metrics (health: /healthz)")
        return out

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Drain and stop everything within ``timeout_s`` (default ``service.shutdown_timeout``). True when all
        queues drained in time."""
        with self._lock:
            if self._stopping:
                return True
            self._stopping = True
        assert self.cfg.service is not None
        total = timeout_s if timeout_s is not None else self.cfg.service.shutdown_timeout
        t_end = time.monotonic() + total

        def budget(frac: float) -> float:
            return max(0.05, min(total * frac, t_end - time.monotonic()))

        clean = True
        for r in self.receivers:
            try:
                r.stop_accepting(budget(0.15))
            except Exception:
                log.exception("stopping receiver %s", r.id)
        traces = [p for p in self.pipelines.values() if p.signal == "traces"]
        others = [p for p in self.pipelines.values() if p.signal != "traces"]
        dl = time.monotonic() + budget(0.3)
        for p in traces:
            clean &= p.close(dl)
        for st in self.processors.values():
            try:
                with st.lock:
                    st.impl.shutdown(budget(0.15))
            except Exception:
                log.exception("shutting down processor %s", st.id)
        dl = time.monotonic() + budget(0.15)
        for p in others:
            clean &= p.close(dl)
        n = max(1, len(self.exporters))
        for eid, e in self.exporters.items():
            try:
                e.shutdown(budget(0.2 / n) if not isinstance(e, PrometheusExporter) else 1.0)
            except Exception:
                log.exception("shutting down exporter %s", eid)
        if self.metrics_server is not None:
            self.metrics_server.shutdown(1.0)
        self._running = False
        log.info("collector stopped%s", "" if clean else " (some queued data was not processed in time)")
        return clean

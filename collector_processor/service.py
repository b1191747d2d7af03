"""The collector service: builds receivers, pipelines, processors, connectors and exporters from a validated config,
starts them and drains them in order on shutdown. It knows components only by the capabilities they declare
(``collector_processor.component``).

Data flow: receiver threads decode and ``submit`` to each pipeline of the signal (bounded queue, refusal when full or
refused by an ``Admission`` processor) -> one worker thread per pipeline runs the processors and hands results to the
exporters (which queue internally). What a processor emits beside its data (``BuildContext.emit_for``, e.g. the
straggler processor's verdicts) goes to the connectors among the exporters of the pipelines that list the
processor; a connector forwards it as events into the pipelines it is a receiver of.

Shutdown (SIGTERM): receivers stop accepting and finish in-flight requests -> pipelines that feed a connector drain
-> processors shut down (which may emit their last side output, e.g. verdicts of the windows still open) -> the
other pipelines drain -> exporters flush -> servers close. Every step has a share of ``service.shutdown_timeout``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from collector_processor.component import Admission, Component, Connector, Endpoint, EventBatch, Receiver, Serving
from collector_processor.config.model import MIB
from collector_processor.config.types import split_host_port
from collector_processor.config.validate import CollectorConfig
from collector_processor.exporter.prometheus import MetricsHTTPServer
from collector_processor.pipeline import Pipeline, Stage
from collector_processor.receiver.auth import BearerAuth
from collector_processor.registry import BuildContext
from collector_processor.telemetry import Telemetry
from collector_processor.tenancy import ALL_JOBS, JOB_TOKENS, from_receivers

log = logging.getLogger(__name__)



def _start(cid: str, c: Component) -> None:
    """Start ``c``; an address it cannot listen on is named with the component (``Address already in use`` alone
    says neither which port nor whose)."""
    try:
        c.start()
    except (OSError, RuntimeError) as e:  # grpc says RuntimeError("Failed to bind to address ...")
        where = ", ".join(f"{ep.what} {ep.host}:{ep.port}" for ep in c.endpoints()) if isinstance(c, Serving) else ""
        raise OSError(getattr(e, "errno", None), f"{cid}{f' ({where})' if where else ''}: "
                                                 f"{getattr(e, 'strerror', None) or e}") from e

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
        self.connectors: dict[str, Any] = {}
        self.pipelines: dict[str, Pipeline] = {}
        self.receivers: dict[str, Any] = {}
        self.metrics_server: MetricsHTTPServer | None = None
        self._side_routes: dict[str, list[Any]] = {}  # processor id -> connectors downstream of it
        self._forward_routes: dict[str, list[Pipeline]] = {}  # connector id -> pipelines it feeds
        self._build()

    # ---- build ------------------------------------------------------------------------------------------------
    def healthy(self) -> bool:
        return self._running and not self._stopping

    def _emit_for(self, processor_id: str):  # type: ignore[no-untyped-def]
        def emit(items: list[Any]) -> None:
            if not items:
                return
            for conn in self._side_routes.get(processor_id, ()):
                try:
                    conn.consume(list(items))
                except Exception:
                    log.exception("connector failed on the output of %s", processor_id)
                    self.t.component_errors.labels(processor_id).inc()

        return emit

    def _forward_for(self, connector_id: str):  # type: ignore[no-untyped-def]
        def forward(batch: EventBatch) -> None:
            for p in self._forward_routes.get(connector_id, ()):
                p.submit_events(batch)

        return forward

    def _consumers_for(self, receiver_id: str) -> dict[str, list[Pipeline]]:
        assert self.cfg.service is not None
        out: dict[str, list[Pipeline]] = {}
        for pid, pc in self.cfg.service.pipelines.items():
            if receiver_id in pc.receivers:
                pipe = self.pipelines[pid]
                out.setdefault(pipe.signal, []).append(pipe)
        return out

    @staticmethod
    def _create(ctx: BuildContext, cid: str, comp: Any, role: type | None = None) -> Any:
        """Build a component; it must have start/shutdown (and ``role``'s methods when given)."""
        built = comp.factory.create(ctx, cid, comp.config)
        for proto in (Component, role):
            if proto is not None and not isinstance(built, proto):
                raise TypeError(f"{comp.factory.kind} {cid}: its factory built {type(built).__name__}, which lacks "
                                f"the {proto.__name__} methods")
        return built

    def _build(self) -> None:
        cfg, svc = self.cfg, self.cfg.service
        assert svc is not None
        tenancy = from_receivers(comp.config for comp in cfg.receivers.values())
        ctx = BuildContext(self.t, self.healthy, self._emit_for, self._forward_for, self._consumers_for, tenancy)
        for name in (ALL_JOBS, *tenancy.names, *((JOB_TOKENS,) if tenancy.per_job else ())):
            for structure in ("cohorts", "windows", "metric_series", "memory",
                              *(f"queue:{pid}" for pid in svc.pipelines)):
                self.t.tenant_evictions.labels(tenant=name, structure=structure)
        used = svc.used_ids()
        for eid, comp in cfg.exporters.items():
            if eid in used:
                self.exporters[eid] = self._create(ctx, eid, comp)
        for cid, comp in cfg.connectors.items():
            if cid in used:
                self.connectors[cid] = self._create(ctx, cid, comp, Connector)
        for pid, comp in cfg.processors.items():
            if pid in used:
                self.processors[pid] = Stage(pid, self._create(ctx, pid, comp))
        for pid, pc in svc.pipelines.items():
            stages = [self.processors[x] for x in pc.processors]
            admission = [st.impl for st in stages if isinstance(st.impl, Admission)]
            exporters = [(e, self.exporters[e]) for e in pc.exporters if e in self.exporters]
            self.pipelines[pid] = Pipeline(pid, self.t, max_items=pc.queue.max_items,
                                           max_bytes=int(pc.queue.max_bytes_mib * MIB), processors=stages,
                                           exporters=exporters, admission=admission)
            for cid in pc.exporters:
                if cid in self.connectors:
                    for x in pc.processors:
                        routes = self._side_routes.setdefault(x, [])
                        if self.connectors[cid] not in routes:
                            routes.append(self.connectors[cid])
            for cid in pc.receivers:
                if cid in self.connectors:
                    self._forward_routes.setdefault(cid, []).append(self.pipelines[pid])
        for rid, comp in cfg.receivers.items():
            if rid in used:
                self.receivers[rid] = self._create(ctx, rid, comp, Receiver)
        addr = svc.telemetry.metrics.address.strip()
        if addr:
            served = {(e.host, e.port) for e in self.listening() if e.serves_telemetry}
            if split_host_port(addr, 9464) not in served:
                self.metrics_server = MetricsHTTPServer(addr, [self.t.registry], BearerAuth(None), self.t,
                                                        self.healthy, label="telemetry")

    # ---- run --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        started: list[Component] = []
        try:
            for group in (self.exporters.items(), self.connectors.items(),
                          ((pid, st.impl) for pid, st in self.processors.items())):
                for cid, c in group:
                    _start(cid, c)
                    started.append(c)
            for p in self.pipelines.values():
                p.start()
            if self.metrics_server is not None:
                _start("service.telemetry.metrics", self.metrics_server)
                started.append(self.metrics_server)
            for rid, r in self.receivers.items():
                _start(rid, r)
                started.append(r)
        except Exception:
            for c in reversed(started):
                try:
                    c.shutdown(1.0)
                except Exception:
                    log.exception("cleanup after a failed start")
            raise
        self._running = True

    def listening(self) -> list[Endpoint]:
        out: list[Endpoint] = []
        for c in (*self.receivers.values(), *self.exporters.values(), self.metrics_server):
            if c is not None and isinstance(c, Serving):
                out.extend(c.endpoints())
        return out

    def endpoints(self) -> list[str]:
        """What is listening where, one line each (logged at start as ``listening: ...``)."""
        return [str(e) for e in self.listening()]

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
        for rid, r in self.receivers.items():
            try:
                r.stop_accepting(budget(0.15))
            except Exception:
                log.exception("stopping receiver %s", rid)
        upstream = [p for pid, p in self.pipelines.items()
                    if any(e in self.connectors for e in self.cfg.service.pipelines[pid].exporters)]
        rest = [p for p in self.pipelines.values() if p not in upstream]
        dl = time.monotonic() + budget(0.3)
        for p in upstream:
            clean &= p.close(dl)
        for st in self.processors.values():
            wait = budget(0.15)
            if not st.lock.acquire(timeout=wait):  # its pipeline's worker is still inside it (a long request)
                log.warning("processor %s still busy after %.1f s: not shut down, its last state is not flushed",
                            st.id, wait)
                self.t.component_errors.labels(st.id).inc()
                clean = False
                continue
            try:
                st.impl.shutdown(budget(0.15))
            except Exception:
                log.exception("shutting down processor %s", st.id)
            finally:
                st.lock.release()
        dl = time.monotonic() + budget(0.15)
        for p in rest:
            clean &= p.close(dl)
        n = max(1, len(self.exporters) + len(self.connectors))
        for cid, c in (*self.connectors.items(), *self.exporters.items()):
            try:
                c.shutdown(budget(0.2 / n))
            except Exception:
                log.exception("shutting down %s", cid)
        if self.metrics_server is not None:
            self.metrics_server.shutdown(1.0)
        self._running = False
        log.info("collector stopped%s", "" if clean else " (some queued data was not processed in time)")
        return clean

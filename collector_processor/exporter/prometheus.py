"""``prometheus`` exporter: ``/metrics`` and ``/healthz`` over HTTP.

``/metrics`` serves the collector's shared registry (self-telemetry and the straggler processor's series) plus the
emitter self-metrics that ranks send over OTLP metrics, re-exported with labels ``{training_job,run,rank,reason}``
under their Prometheus names (``prometheus_names``: the OTel instrument name with dots as underscores, the unit as
a suffix, ``_total`` on counters): ``otel_straggler.emitter.dropped`` (unit ``1``) is
``otel_straggler_emitter_dropped_total``, the gauge ``otel_straggler.emitter.readout.lag`` (unit ``s``) is
``otel_straggler_emitter_readout_lag_seconds``. ``reason`` is the data point's ``reason`` attribute (or ``where``
for faults), left out when absent (as is any label whose value is empty); the instrument's description is the
HELP text. New series past ``max_series`` are not created and are counted in
``evictions_total{structure="metric_series"}``.

``/metrics`` answers in the OpenMetrics text format when the scraper asks for it (``Accept:
application/openmetrics-text``, as Prometheus does), with exemplars (``trace_id`` on the verdict counter and the
GPU-seconds-lost counter), else in the Prometheus text format.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1 import metrics_pb2
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from pydantic import Field, model_validator

import otel_straggler_schema as s
from collector_processor.component import Endpoint
from collector_processor.config.types import MetricsListen, Strict, is_loopback, split_host_port
from collector_processor.exporter.prometheus_names import prometheus_name
from collector_processor.receiver.auth import AuthConfig, BearerAuth
from collector_processor.registry import BuildContext, Factory
from collector_processor.telemetry import Telemetry, add_sample

log = logging.getLogger(__name__)
OTEL_PREFIX = "otel_straggler.emitter."
LABELS = (s.L_TRAINING_JOB, s.L_RUN, "rank", "reason")
_OM_EOF = b"# EOF\n"
DEFAULT_HELP = "Emitter self-metric re-exported from OTLP"


class Config(Strict):
    endpoint: MetricsListen = "127.0.0.1:9464"
    max_series: int = Field(20000, ge=1, le=10_000_000)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    # /metrics names every job's ids, hosts, GPUs, ranks, verdicts and trace ids: beyond loopback it needs a token
    # (``auth``) or this explicit opt-in (a network only the scraper reaches)
    allow_unauthenticated: bool = False

    @model_validator(mode="after")
    def _guarded(self) -> Config:
        if self.auth.job_secret or self.auth.job_secret_file:
            raise ValueError("auth.job_secret: a job token writes its own job and never reads /metrics (every "
                             "job's series); give the scraper bearer_token or bearer_token_file")
        host, _port = split_host_port(self.endpoint, 9464)
        if not is_loopback(host) and not self.auth.enabled and not self.allow_unauthenticated:
            raise ValueError(f"endpoint {self.endpoint!r} is beyond loopback and /metrics shows every job's ids, "
                             "hosts, GPUs and verdicts: set auth.bearer_token or auth.bearer_token_file (the "
                             "scraper sends it), or allow_unauthenticated: true")
        return self


def _attrs(kvs) -> dict[str, str]:
    out = {}
    for kv in kvs:
        v = kv.value
        which = v.WhichOneof("value")
        if which in ("string_value", "int_value", "bool_value", "double_value"):
            out[kv.key] = str(getattr(v, which))
    return out


def _num(dp) -> float:
    return float(dp.as_int) if dp.WhichOneof("value") == "as_int" else float(dp.as_double)


class EmitterMetrics(Collector):
    """Capped store of emitter self-metrics, collected on each scrape."""

    def __init__(self, telemetry: Telemetry, max_series: int) -> None:
        self.t = telemetry
        self.max_series = max_series
        self._lock = threading.Lock()
        # (kind, name, job, run, rank, reason)
        self._series: dict[tuple[str, str, str, str, str, str], float] = {}
        self._help: dict[tuple[str, str], str] = {}  # (kind, name) -> HELP, for families with a series

    def update(self, req: ExportMetricsServiceRequest) -> None:
        with self._lock:
            for rm in req.resource_metrics:
                res = _attrs(rm.resource.attributes)
                job, rank = res.get(s.RES_JOB_ID, ""), res.get(s.RES_RANK, "")
                run = res.get(s.RES_RUN_ID, "")
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name.startswith(OTEL_PREFIX):
                            self._metric(m, job, run, rank)

    def _metric(self, m: metrics_pb2.Metric, job: str, run: str, rank: str) -> None:
        kind = m.WhichOneof("data")
        if kind == "sum":
            monotonic = m.sum.is_monotonic
            delta = m.sum.aggregation_temporality == metrics_pb2.AGGREGATION_TEMPORALITY_DELTA
            pts, prom_kind = m.sum.data_points, "counter" if monotonic else "gauge"
        elif kind == "gauge":
            pts, prom_kind, delta = m.gauge.data_points, "gauge", False
        else:
            return  # histograms are not part of the emitter's self-metrics
        name = prometheus_name(m.name, m.unit, counter=prom_kind == "counter")
        for dp in pts:
            a = _attrs(dp.attributes)
            reason = a.get(s.SM_REASON_ATTR) or a.get("where", "")
            key = (prom_kind, name, job, run, rank, reason)
            if key not in self._series and len(self._series) >= self.max_series:
                self.t.evictions.labels("metric_series").inc()
                continue
            v = _num(dp)
            self._series[key] = self._series.get(key, 0.0) + v if delta else v
            if m.description or (prom_kind, name) not in self._help:
                self._help[(prom_kind, name)] = m.description or DEFAULT_HELP

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            items = sorted(self._series.items())
            helps = dict(self._help)
        fams: dict[tuple[str, str], Metric] = {}
        for (kind, name, job, run, rank, reason), v in items:
            fam = fams.get((kind, name))
            if fam is None:
                doc = helps.get((kind, name), DEFAULT_HELP)
                if kind == "counter":
                    fam = CounterMetricFamily(name, doc)  # name ends in _total: kept once
                else:
                    fam = GaugeMetricFamily(name, doc)
                fams[(kind, name)] = fam
            add_sample(fam, LABELS, (job, run, rank, reason), v)
        yield from fams.values()


def render(registries: list[CollectorRegistry], accept: str | None) -> tuple[bytes, str]:
    """The registries one after the other in the format ``accept`` asks for (OpenMetrics: one ``# EOF`` at the
    end), and its content type."""
    encoder, ctype = choose_encoder(accept or "")
    parts = [encoder(r) for r in registries]
    if parts and parts[-1].endswith(_OM_EOF):
        parts = [p.removesuffix(_OM_EOF) for p in parts] + [_OM_EOF]
    return b"".join(parts), ctype


class MetricsHTTPServer:
    """``/metrics`` (registries rendered one after the other) and ``/healthz`` on a threaded HTTP server."""

    def __init__(self, endpoint: str, registries: list[CollectorRegistry], auth: BearerAuth,
                 telemetry: Telemetry, healthy: Callable[[], bool] = lambda: True, label: str = "metrics") -> None:
        self.host, self.port = split_host_port(endpoint, 9464)
        self.registries = registries
        self.auth = auth
        self.t = telemetry
        self.healthy = healthy
        self.label = label
        telemetry.unauthenticated.labels(label)  # at 0 from the start
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30

            def log_message(self, format: str, *args: object) -> None:
                log.debug(format, *args)

            def _send(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    ok = outer.healthy()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"unhealthy\n")
                    return
                if path != "/metrics":
                    self._send(404, b"not found\n")
                    return
                if not outer.auth.check(self.headers.get("Authorization")):
                    outer.t.unauthenticated.labels(outer.label).inc()
                    self._send(401, b"unauthorized\n")
                    return
                body, ctype = render(outer.registries, self.headers.get("Accept"))
                self._send(200, body, ctype)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128  # listen backlog (socketserver's 5 stalls bursts of scrapers)

        self._server = Server((self.host, self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"http-{self.label}", daemon=True)
        self._thread.start()
        log.info("metrics (%s) on http://%s:%d/metrics", self.label, self.host, self.port)

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(self.label, "metrics", self.host, self.port,
                         url=f"http://{self.host}:{self.port}/metrics (health: /healthz)",
                         serves_telemetry=any(r is self.t.registry for r in self.registries))]

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout_s)
            self._server = None


class PrometheusExporter:
    def __init__(self, eid: str, cfg: Config, telemetry: Telemetry, healthy: Callable[[], bool] = lambda: True):
        self.id = eid
        self.t = telemetry
        self.emitter = EmitterMetrics(telemetry, cfg.max_series)
        own = CollectorRegistry(auto_describe=False)
        own.register(self.emitter)
        self.server = MetricsHTTPServer(cfg.endpoint, [telemetry.registry, own], BearerAuth(cfg.auth), telemetry,
                                        healthy, label=eid)

    @property
    def port(self) -> int:
        return self.server.port

    def export_metrics(self, request: ExportMetricsServiceRequest) -> None:
        self.emitter.update(request)

    def endpoints(self) -> list[Endpoint]:
        return self.server.endpoints()

    def start(self) -> None:
        self.server.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.server.shutdown(timeout_s)


def _create(ctx: BuildContext, cid: str, cfg: Config) -> PrometheusExporter:
    return PrometheusExporter(cid, cfg, ctx.telemetry, ctx.healthy)


FACTORY = Factory("exporter", "prometheus", Config, _create, signals=frozenset({"metrics"}))

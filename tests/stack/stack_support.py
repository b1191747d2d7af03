"""Shared helpers of the stack tests: repository paths, PromQL metric names, the metric names the collector
exports (from the schema contract), a real collector subprocess, and a real OTel SDK feed of one straggler."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from engine_node import emit_step, planned_ids

import otel_straggler_schema as s
from otel_straggler_demo.run import free_ports

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
DASHBOARDS = CONFIGS / "grafana" / "dashboards"
GRAFANA_PROVISIONING = CONFIGS / "grafana" / "provisioning"
PROM_RULES = CONFIGS / "prometheus" / "rules" / "straggler.rules.yml"
GRAFANA_ALERTS = GRAFANA_PROVISIONING / "alerting" / "straggler-alerts.yaml"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def require_binary(name: str) -> str:
    """Path of a Debian-packaged tool (prometheus, promtool, amtool, prometheus-alertmanager), else skip."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian packages prometheus / prometheus-alertmanager; "
                    "scripts/test installs them)")
    return path


# --- metric names -------------------------------------------------------------------------------------------

_PROMQL_FUNCTIONS = {
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "count_over_time", "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp",
    "floor", "histogram_quantile", "histogram_count", "histogram_sum", "histogram_fraction", "holt_winters",
    "hour", "idelta", "increase", "irate", "label_join", "label_replace", "last_over_time", "ln", "log10",
    "log2", "max_over_time", "min_over_time", "minute", "month", "predict_linear", "present_over_time",
    "quantile_over_time", "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt",
    "stddev_over_time", "stdvar_over_time", "sum_over_time", "time", "timestamp", "vector", "year",
}
_PROMQL_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                        "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
_PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                    "offset", "bool", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MODIFIER_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\(|\{|\[|\)|\s|$|,|[-+*/^%<>=!])")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers that are not functions, aggregations, keywords,
    label names inside ``{...}`` / ``by (...)`` lists, durations or Grafana variables."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^{}]*\}", "{}", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "[]", text)  # ranges and subqueries
    text = _MODIFIER_LIST.sub(" ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables outside strings
    names = set()
    for m in _IDENT.finditer(text):
        ident, follow = m.group(1), m.group(2)
        low = ident.lower()
        if follow == "(" or low in _PROMQL_FUNCTIONS or low in _PROMQL_AGGREGATIONS or low in _PROMQL_KEYWORDS:
            continue
        names.add(ident)
    if "__name__" in expr:
        raise AssertionError(f"select metrics by name, not by __name__ matchers: {expr}")
    return names


_EMITTER_PREFIX = "otel_straggler.emitter."


def _emitter_instruments() -> dict[str, tuple[str, str]]:
    """Every emitter self-metric instrument (``SM_`` constants) with its kind and unit, from the contract table in
    docs/schema.md."""
    text = (REPO / "docs" / "schema.md").read_text(encoding="utf-8")
    rows = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(
        r"^\|\s*`(otel_straggler\.emitter\.[a-z0-9_.]+)`\s*\|\s*(counter|gauge)\s*\|\s*`([^`]+)`\s*\|", text, re.M)}
    names = {value for attr in dir(s) if attr.startswith("SM_") and isinstance(value := getattr(s, attr), str)
             and value.startswith(_EMITTER_PREFIX)}
    assert names <= set(rows), f"emitter instruments without a row in docs/schema.md: {sorted(names - set(rows))}"
    return {name: rows[name] for name in names}


# Prometheus suffix of each unit the emitter uses (OTel -> Prometheus naming: unit words, counters _total)
_UNIT_SUFFIX = {"1": "", "s": "_seconds"}


def emitter_metric_names() -> set[str]:
    """Prometheus names of the emitter self-metrics re-exported by the collector: the unit as a suffix
    (``s`` -> ``_seconds``, ``1`` none), counters end in ``_total``."""
    names = set()
    for name, (kind, unit) in _emitter_instruments().items():
        base = s.M_EMITTER_PREFIX + name[len(_EMITTER_PREFIX):].replace(".", "_") + _UNIT_SUFFIX[unit]
        names.add(base + "_total" if kind == "counter" else base)
    return names


# series Prometheus writes itself for every target, which rules may query (StragglerCollectorDown)
SCRAPE_SERIES = frozenset({"up"})


def exported_metric_names() -> set[str]:
    """Every Prometheus metric name the straggler collector exports, per ``otel_straggler_schema``."""
    names = set()
    for attr in dir(s):
        value = getattr(s, attr)
        if attr.startswith("M_") and attr != "M_EMITTER_PREFIX" and isinstance(value, str):
            names.add(value)
    names |= {s.M_PROCESSING_SECONDS + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names | emitter_metric_names()


def _walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _walk_panels(p.get("panels", []))


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def load_dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def dashboard_panels(path: Path) -> list[dict[str, Any]]:
    return list(_walk_panels(load_dashboard(path)["panels"]))


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard panel query and templating query."""
    out = []
    for path in dashboard_files():
        dash = load_dashboard(path)
        for p in _walk_panels(dash["panels"]):
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"{path.name}: {p['title']} / {t['refId']}", t["expr"]))
        for v in dash.get("templating", {}).get("list", []):
            q = v.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            m = re.match(r"label_values\((.*),\s*\w+\)\s*$", q or "")
            if v.get("type") == "query" and m:
                out.append((f"{path.name}: variable {v['name']}", m.group(1)))
    return out


def annotation_metric_names() -> list[tuple[str, str]]:
    """(where, metric) of metrics queried inside Prometheus rule annotation templates (``query`` function)."""
    out = []
    for g in load_yaml(PROM_RULES)["groups"]:
        for r in g["rules"]:
            for key, text in r.get("annotations", {}).items():
                for m in re.finditer(r"\b(otel_straggler_\w+)\{", text):
                    out.append((f"prometheus rule {r['alert']} annotation {key}", m.group(1)))
    return out


def alert_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) of every Prometheus alerting rule and every Grafana alert rule's Prometheus query (the
    recording rule of the links' base URLs is a constant, ``vector(1)``)."""
    out = []
    for g in load_yaml(PROM_RULES)["groups"]:
        for r in g["rules"]:
            if "alert" in r:
                out.append((f"prometheus rule {r['alert']}", r["expr"]))
    for g in load_yaml(GRAFANA_ALERTS)["groups"]:
        for r in g["rules"]:
            for d in r["data"]:
                if d["datasourceUid"] != "__expr__":
                    out.append((f"grafana rule {r['title']} / {d['refId']}", d["model"]["expr"]))
    return out


# --- processes and ports ------------------------------------------------------------------------------------



def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answers (refused, reset, timed out)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def wait_until(pred: Any, timeout_s: float, interval_s: float = 0.2, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = pred()
            if value:
                return value
        except (OSError, ValueError) as e:
            last_exc = e
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}"
                         + (f" (last error: {last_exc})" if last_exc else ""))


@contextlib.contextmanager
def process(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """A subprocess with stdout+stderr in ``log_path``; SIGTERM then SIGKILL on exit."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-n:]
    except OSError:
        return ""


def require_collector() -> list[str]:
    """argv prefix that runs the real straggler collector, or skip if it is not installed in this checkout."""
    for mod in ("collector_processor.cli", "collector_processor.service",
                "collector_processor.processor.straggler.factory", "collector_processor.exporter.prometheus"):
        try:
            importlib.import_module(mod)
        except ImportError as e:
            pytest.skip(f"straggler collector not available: cannot import {mod} ({e})")
    exe = shutil.which("otel-straggler-collector", path=str(Path(sys.executable).parent) + os.pathsep
                       + os.environ.get("PATH", ""))
    return [exe] if exe else [sys.executable, "-m", "collector_processor"]


@dataclass
class Collector:
    otlp_grpc: int
    otlp_http: int
    metrics: int
    proc: subprocess.Popen
    log: Path
    evidence: Path

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics}/metrics"

    def scrape(self) -> str:
        code, body = http_get(self.metrics_url)
        if code != 200:
            raise ValueError(f"/metrics answered {code}")
        return body.decode()


QUICK_STRAGGLER = {"window_steps": 2, "warmup_windows": 0, "persistence_windows": 1, "grace_s": 0.5,
                   "tolerance": 0.05, "absolute_floor_ms": 1.0, "min_cohort_size": 3}


TRACE_EXPORTERS = ("otlp_grpc/jaeger", "otlp_grpc/tempo")  # the compose collector's verdict-span forwarders


def collector_config(grpc_port: int, http_port: int, metrics_port: int, evidence: Path,
                     straggler: dict[str, Any] | None = None,
                     trace_endpoints: dict[str, str] | None = None) -> dict[str, Any]:
    """configs/collector-compose.yaml on loopback ports, evidence in ``evidence``, and by default short windows
    so a straggler is judged within a few steps (window of 2 steps, no warm-up, one window of persistence);
    ``straggler`` replaces those processor settings (``{}``: the shipped defaults). The verdict-span forwarders
    (Jaeger, Tempo) send to ``trace_endpoints`` (exporter id -> host:port), else are disabled."""
    cfg = load_yaml(CONFIGS / "collector-compose.yaml")
    for exporter in TRACE_EXPORTERS:
        cfg["exporters"][exporter]["endpoint"] = (trace_endpoints or {}).get(exporter, "")
    cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] = f"127.0.0.1:{grpc_port}"
    cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"] = f"127.0.0.1:{http_port}"
    cfg["processors"]["straggler"] = dict(QUICK_STRAGGLER if straggler is None else straggler)
    cfg["exporters"]["prometheus"]["endpoint"] = f"127.0.0.1:{metrics_port}"
    cfg["exporters"]["file/evidence"]["path"] = str(evidence)
    return cfg


@contextlib.contextmanager
def run_collector(tmp: Path, straggler: dict[str, Any] | None = None,
                  trace_endpoints: dict[str, str] | None = None) -> Iterator[Collector]:
    argv = require_collector()
    grpc_port, http_port, metrics_port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}  # ${env:...} defaults apply
    cfg_path = tmp / "collector.yaml"
    cfg = collector_config(grpc_port, http_port, metrics_port, tmp / "evidence" / "verdicts.jsonl", straggler,
                           trace_endpoints)
    cfg_path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    log = tmp / "collector.log"
    with process([*argv, "--config", str(cfg_path)], log, env=env) as proc:
        col = Collector(grpc_port, http_port, metrics_port, proc, log, tmp / "evidence" / "verdicts.jsonl")

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"collector exited with {proc.returncode}:\n{tail(log)}")
            return http_get(col.metrics_url)[0] == 200

        wait_until(ready, 120, what=f"collector /metrics on {col.metrics_url}")
        yield col


# --- a real OTel SDK feed -----------------------------------------------------------------------------------

JOB_ID = "stack-test-job"
RANKS = 8
SLOW_RANK = 3
STAGE = "forward-compute"


class StragglerFeed:
    """``ranks`` ranks (8 by default; one Resource + TracerProvider each, as in docs/schema.md) of training job
    ``job`` exporting through the real ``OTLPSpanExporter`` over gRPC; ``step()`` emits one training step for every
    rank, rank 0 the job-level ``train-step`` root of the step's trace."""

    def __init__(self, grpc_port: int, base_ms: float = 100.0, ranks: int = RANKS, job: str = JOB_ID) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        self.base_ms = base_ms
        self.ranks = ranks
        self.job = job
        self.t_ns = time.time_ns() - 3600 * 10**9
        cohort = s.cohort_key(topology_epoch=0, stage_schema="megatron-v1")
        self.cohort = cohort
        self.providers, self.tracers, self.ids = [], [], []
        for rank in range(ranks):
            res = Resource.create({
                s.RES_SERVICE_NAME: "megatron-training", s.RES_HOST_NAME: f"node-{rank // 4}",
                s.RES_PROCESS_PID: 1000 + rank, s.RES_RANK: rank, s.RES_WORLD_SIZE: ranks,
                s.RES_LOCAL_RANK: rank % 4, s.RES_DP_RANK: rank, s.RES_DP_SIZE: ranks,
                s.RES_TP_RANK: 0, s.RES_TP_SIZE: 1, s.RES_PP_RANK: 0, s.RES_PP_SIZE: 1,
                s.RES_JOB_ID: job, s.RES_GPU_UUID: f"GPU-{rank:04d}", s.RES_GPU_INDEX: rank % 4,
                s.RES_COHORT_KEY: cohort, s.RES_TOPOLOGY_EPOCH: 0, s.RES_STAGE_SCHEMA: "megatron-v1",
                s.RES_SCHEMA_VERSION: s.SCHEMA_VERSION,
            })
            ids = planned_ids()
            tp = TracerProvider(resource=res, id_generator=ids, shutdown_on_exit=False)
            tp.add_span_processor(SimpleSpanProcessor(
                OTLPSpanExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True, timeout=5)))
            self.providers.append(tp)
            self.tracers.append(tp.get_tracer(s.SCOPE_NAME))
            self.ids.append(ids)

    def step(self, step: int, slow_factor: float = 1.0) -> None:
        def stages(rank: int) -> list[tuple[str, str, float]]:
            factor = slow_factor if rank == SLOW_RANK else 1.0
            # a gradient all-reduce too: the dashboards' collective panels need a ring to judge
            return [(STAGE, "forward", self.base_ms * factor), ("backward-compute", "backward", self.base_ms * 1.5),
                    ("all-grads-sync", "grad-sync", self.base_ms * 0.2)]

        emit_step(dict(enumerate(self.tracers)), dict(enumerate(self.ids)), self.job, step,
                  self.t_ns + step * 10**9, self.base_ms * 3, stages)

    def shutdown(self) -> None:
        for tp in self.providers:
            tp.shutdown()


def send_emitter_metrics(grpc_port: int, rank: int = 0, job: str = JOB_ID) -> None:
    """One export of every emitter self-metric instrument through the real ``OTLPMetricExporter``."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    reader = PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=f"127.0.0.1:{grpc_port}", insecure=True, timeout=5),
        export_interval_millis=3_600_000)
    mp = MeterProvider(resource=Resource.create({s.RES_JOB_ID: job, s.RES_RANK: rank}),
                       metric_readers=[reader], shutdown_on_exit=False)
    meter = mp.get_meter(s.SCOPE_NAME)
    for name, (kind, unit) in _emitter_instruments().items():
        if kind == "counter":
            meter.create_counter(name, unit=unit).add(2, {s.SM_REASON_ATTR: "queue_full"})
        else:
            meter.create_gauge(name, unit=unit).set(3.0)
    assert mp.force_flush(10_000), "emitter metrics were not exported"
    mp.shutdown()


class TraceSink:
    """A real OTLP/gRPC trace backend on 127.0.0.1 (a stand-in for Jaeger or Tempo) that keeps every span."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor
        from threading import Lock

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        outer = self
        self._lock = Lock()
        self._resource_spans: list[Any] = []

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # type: ignore[no-untyped-def]
                with outer._lock:
                    outer._resource_spans.extend(request.resource_spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"

    def __enter__(self) -> TraceSink:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0.5).wait(5)

    def spans(self) -> list[tuple[str, Any]]:
        """(service.name, span) of every span received."""
        with self._lock:
            rss = list(self._resource_spans)
        out = []
        for rs in rss:
            service = next((kv.value.string_value for kv in rs.resource.attributes
                            if kv.key == s.RES_SERVICE_NAME), "")
            out.extend((service, sp) for ss in rs.scope_spans for sp in ss.spans)
        return out

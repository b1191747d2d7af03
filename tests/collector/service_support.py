"""Helpers for the collector service tests: a started ``Service`` from YAML text, processor doubles, and tiny
in-test OTLP backends (gRPC Trace/Logs services, an HTTP sink) that record what the collector forwards.

The processor doubles stand in for the straggler processor where a test needs a controlled behaviour (slow,
rejecting, emitting one verdict per request); end-to-end tests use the real straggler processor.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import otel_straggler_schema as s
from collector_processor.config.loader import load_text
from collector_processor.config.types import Duration, Strict
from collector_processor.config.validate import validate
from collector_processor.processor.straggler.model import Verdict
from collector_processor.registry import BuildContext, Factory
from collector_processor.service import Service
from collector_processor.telemetry import Telemetry

# ---- processor doubles ---------------------------------------------------------------------------------------


class Config(Strict):
    delay: Duration = 0.0  # sleep per request (a slow processor)
    reject: int = 0  # spans reported rejected per request (last_rejected)
    verdicts: bool = False  # emit one verdict per request


def create_default_config() -> Config:
    return Config()


def make_verdict(rank: int = 3, step: int = 10) -> Verdict:
    return Verdict(job="job-1", cohort="c0", rank=rank, host="node0", gpu="GPU-3", stage="forward-compute",
                   group="forward", verdict=s.VERDICT_STRAGGLER, reason="slower_than_reference", deviation=0.25,
                   value_ms=75.0, reference_rank=1, reference_ms=60.0, measurement=s.MEASUREMENT_DEVICE,
                   window_start=step - 9, window_end=step, step=step, attribution=s.ATTRIBUTION_GPU,
                   step_time_lost_ms=15.0, gpu_seconds_per_hour=1440.0, cohort_size=8, collective_evidence="",
                   trace_id=bytes(range(16)), emitted_unix_ns=time.time_ns())


class DoubleProcessor:
    """Records what it is given; optionally slow, rejecting or verdict-emitting. Checks it is never re-entered."""

    instances: ClassVar[list[DoubleProcessor]] = []

    def __init__(self, cfg: Config, emit: Callable[[list[Verdict]], None]) -> None:
        self.cfg = cfg
        self.emit = emit
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.ticks = 0
        self.last_rejected = 0
        self.shutdown_called = False
        self.concurrent = 0
        self.max_concurrent = 0
        DoubleProcessor.instances.append(self)

    def start(self) -> None:
        pass

    def process_traces(self, req):  # type: ignore[no-untyped-def]
        self.concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            if self.cfg.delay:
                time.sleep(self.cfg.delay)
            self.requests.append(req)
            self.last_rejected = self.cfg.reject
            if self.cfg.verdicts:
                self.emit([make_verdict(step=len(self.requests))])
            return req
        finally:
            self.concurrent -= 1

    def tick(self, now_s: float) -> None:
        self.ticks += 1

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.shutdown_called = True
        if self.cfg.verdicts:
            self.emit([make_verdict(step=9999)])


def create_double(ctx: BuildContext, cid: str, cfg: Config) -> DoubleProcessor:
    return DoubleProcessor(cfg, ctx.emit_for(cid))


def double_factories() -> tuple[Factory, Factory]:
    """Processor type ``double`` (emits verdicts like the straggler processor) and connector type ``double``
    (the straggler connector under another name)."""
    import dataclasses

    from collector_processor.processor.straggler import factory as straggler

    return (Factory("processor", "double", Config, create_double, signals=frozenset({"traces"}),
                    emits=straggler.VERDICTS),
            dataclasses.replace(straggler.CONNECTOR, type="double"))


# ---- service from YAML -----------------------------------------------------------------------------------------

BASE_RECEIVER = """
receivers:
  otlp:
    protocols:
      grpc: {endpoint: 127.0.0.1:0}
      http: {endpoint: 127.0.0.1:0}
"""
# the traces pipeline of receiver tests: otlp -> the recording test double -> debug
DOUBLE_TRACES = """processors:
  double: {}
exporters:
  debug: {}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [double], exporters: [debug]}
"""


class Running:
    def __init__(self, svc: Service) -> None:
        self.svc = svc
        self.t: Telemetry = svc.t

    def port(self, kind: str) -> int:
        for e in self.svc.listening():
            if e.what == f"OTLP/{kind.upper()}":
                return e.port
        raise KeyError(kind)

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.port('grpc')}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port('http')}"

    def sample(self, name: str, **labels: str) -> float:
        v = self.t.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v


def start_from_yaml(yaml_text: str, env: dict[str, str] | None = None) -> Running:
    raw, marks = load_text(yaml_text, "test.yaml", env or {})
    svc = Service(validate(raw, marks))
    svc.start()
    return Running(svc)


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """GET a /metrics page and parse it with prometheus_client's parser into {name{labels}: value}."""
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            key = smp.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items())) + "}"
                              if smp.labels else "")
            out[key] = smp.value
    return out


def wait_for(pred: Callable[[], object], timeout: float = 60.0, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


# ---- in-test OTLP backends ---------------------------------------------------------------------------------------


class GrpcSink(trace_service_pb2_grpc.TraceServiceServicer, logs_service_pb2_grpc.LogsServiceServicer):
    """A real gRPC server implementing TraceService and LogsService that records every request."""

    def __init__(self) -> None:
        self.traces: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.logs: list[logs_service_pb2.ExportLogsServiceRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    delay_s = 0.0  # a slow trace store: each call waits this long before it answers
    reject = 0  # spans refused per trace request (a partial success)

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        self.metadata.append(dict(context.invocation_metadata()))
        if self.delay_s:
            time.sleep(self.delay_s)
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.traces.append(request)
            answer = trace_service_pb2.ExportTraceServiceResponse()
            if self.reject:
                answer.partial_success.rejected_spans = self.reject
                answer.partial_success.error_message = "refused by the sink"
            return answer
        self.logs.append(request)
        return logs_service_pb2.ExportLogsServiceResponse()

    def stop(self) -> None:
        self.server.stop(0.5).wait(2)


class HttpSink:
    """A real HTTP server recording (path, headers, body) of every POST; answers ``status`` (default 200)."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, str], bytes]] = []
        self.status = 200
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with outer.lock:
                    outer.posts.append((self.path, dict(self.headers), body))
                self.send_response(outer.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]



def make_spans(n: int = 5, rank: int = 0, job: str = "job-1"):  # type: ignore[no-untyped-def]
    """``n`` finished SDK spans (ReadableSpan) from a real TracerProvider with a rank's resource."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mem = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create({s.RES_RANK: rank, s.RES_JOB_ID: job}), shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tr = tp.get_tracer(s.SCOPE_NAME)
    for i in range(n):  # in the step trace the schema derives, as the emitter sends them
        tid = s.trace_id_for_step(job, i, "", s.trace_block(rank))
        parent = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
            tid, s.step_root_span_id(tid), is_remote=True, trace_flags=trace.TraceFlags(1))))
        with tr.start_as_current_span("forward-compute", context=parent, attributes={
                s.ATTR_STAGE: "forward-compute", s.ATTR_ITERATION: i}):
            pass
    tp.shutdown()
    return list(mem.get_finished_spans())

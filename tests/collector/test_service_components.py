"""The core is generic: it builds pipelines from the capabilities components declare and imports no plugin; the
straggler plugin plugs in through its factories (a processor that emits verdicts, a connector that carries them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from service_support import BASE_RECEIVER, DoubleProcessor, double_factories, wait_for

from collector_processor.config.loader import load_text
from collector_processor.config.validate import validate
from collector_processor.exporter import debug, evidence
from collector_processor.receiver import otlp
from collector_processor.registry import Factories
from collector_processor.service import Service

REPO = Path(__file__).resolve().parents[2]
CORE = ["collector_processor.service", "collector_processor.pipeline", "collector_processor.registry",
        "collector_processor.component", "collector_processor.config.validate", "collector_processor.cli",
        "collector_processor.receiver.otlp", "collector_processor.processor.memory_limiter",
        "collector_processor.exporter.debug", "collector_processor.exporter.evidence",
        "collector_processor.exporter.otlp", "collector_processor.exporter.prometheus"]


def _request() -> trace_service_pb2.ExportTraceServiceRequest:
    req = trace_service_pb2.ExportTraceServiceRequest()
    req.resource_spans.add().scope_spans.add().spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="x")
    return req


def test_core_modules_import_no_plugin() -> None:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in CORE)
            + "print(sorted(m for m in sys.modules if m.startswith('collector_processor.processor.straggler')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_build_without_the_straggler_plugin_runs_pipelines_and_connectors(tmp_path: Path) -> None:
    """Factories holding only the OTLP receiver, two exporters and a test processor + connector: the straggler
    type is unknown to this build, and the service still routes data and side output."""
    path = tmp_path / "events.jsonl"
    text = BASE_RECEIVER + f"""
processors:
  double: {{verdicts: true}}
connectors:
  double: {{}}
exporters:
  file/events: {{path: "{path}", flush_interval: 1h}}
  debug: {{}}
service:
  pipelines:
    traces: {{receivers: [otlp], processors: [double], exporters: [debug, double]}}
    logs: {{receivers: [double], exporters: [file/events]}}
"""
    factories = Factories([otlp.FACTORY, debug.FACTORY, evidence.FACTORY, *double_factories()])
    assert factories.lookup("processor", "straggler") is None
    raw, marks = load_text(text, "t.yaml", {})
    svc = Service(validate(raw, marks, factories))
    svc.start()
    try:
        port = next(e.port for e in svc.listening() if e.what == "OTLP/GRPC")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = trace_service_pb2_grpc.TraceServiceStub(ch)
            for _ in range(2):
                stub.Export(_request(), timeout=5)
        assert wait_for(lambda: len(DoubleProcessor.instances[0].requests) == 2)
    finally:
        assert svc.shutdown(5.0)
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines()]
    assert steps == [1, 2, 9999]  # per request, then the one emitted at shutdown

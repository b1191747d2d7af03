"""A small OTLP/gRPC trace receiver the demo uses to see what the collector passes on.

The collector forwards every span it received (plus its verdict spans) to this tap, exactly as it would
to Jaeger or Tempo; the demo's report is drawn from what arrives here.
"""

from __future__ import annotations

import os
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

import otel_straggler_schema as s


@dataclass(slots=True)
class StagePoint:
    rank: int
    stage: str
    group: str
    step: int
    host_ms: float | None
    device_ms: float | None


_NICED = threading.local()


def _yield_cpu_once() -> None:
    """The tap stands in for a trace backend on another host: its server threads run at niceness +10 here
    (Linux schedules threads as tasks), so parsing every span does not take the ranks' cores."""
    if getattr(_NICED, "done", False):
        return
    _NICED.done = True
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class TraceTap(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps stage points (bounded) and counts verdict spans."""

    def __init__(self, max_points: int = 2_000_000) -> None:
        self._lock = threading.Lock()
        self.points: list[StagePoint] = []
        self.verdict_spans = 0
        self.spans = 0
        self.dropped = 0
        self._max = max_points
        self._server: grpc.Server | None = None

    def Export(self, request, context):
        _yield_cpu_once()
        batch: list[StagePoint] = []
        verdicts = spans = 0
        for rs in request.resource_spans:
            rank = -1
            for kv in rs.resource.attributes:
                if kv.key == s.RES_RANK:
                    rank = int(_value(kv.value))
            for ss in rs.scope_spans:
                for span in ss.spans:
                    spans += 1
                    if span.name == s.SPAN_VERDICT:
                        verdicts += 1
                        continue
                    attrs = {kv.key: _value(kv.value) for kv in span.attributes}
                    stage = attrs.get(s.ATTR_STAGE)
                    step = attrs.get(s.ATTR_ITERATION)
                    if stage is None or step is None or rank < 0:
                        continue
                    batch.append(StagePoint(rank, str(stage), str(attrs.get(s.ATTR_STAGE_GROUP, "other")),
                                            int(step), attrs.get(s.ATTR_HOST_MS), attrs.get(s.ATTR_DEVICE_MS)))
        with self._lock:
            self.spans += spans
            self.verdict_spans += verdicts
            room = self._max - len(self.points)
            self.points.extend(batch[: max(0, room)])
            self.dropped += max(0, len(batch) - max(0, room))
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self, port: int) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1.0).wait(2.0)

    def snapshot(self) -> list[StagePoint]:
        with self._lock:
            return list(self.points)

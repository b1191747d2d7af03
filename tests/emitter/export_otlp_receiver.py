"""A real OTLP receiver for the export tests: gRPC (trace + metrics services) or HTTP/protobuf on 127.0.0.1.

Stores every decoded request; helpers flatten spans with their resource and metric data points.
"""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def any_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attr_map(kvs: Any) -> dict[str, tuple[str, Any]]:
    """key -> (protobuf value kind, python value), so tests can assert the wire type."""
    return {kv.key: (kv.value.WhichOneof("value"), any_value(kv.value)) for kv in kvs}


@dataclass
class ReceivedSpan:
    name: str
    trace_id: int
    span_id: int
    parent_span_id: int
    start_ns: int
    end_ns: int
    attrs: dict[str, tuple[str, Any]]
    resource: dict[str, tuple[str, Any]]
    scope: str

    def a(self, key: str) -> Any:
        return self.attrs[key][1] if key in self.attrs else None

    def r(self, key: str) -> Any:
        return self.resource[key][1] if key in self.resource else None


class Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []

    def spans(self) -> list[ReceivedSpan]:
        out = []
        with self.lock:
            reqs = list(self.trace_requests)
        for req in reqs:
            for rs in req.resource_spans:
                res = attr_map(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        out.append(
                            ReceivedSpan(
                                name=sp.name,
                                trace_id=int.from_bytes(sp.trace_id, "big"),
                                span_id=int.from_bytes(sp.span_id, "big"),
                                parent_span_id=int.from_bytes(sp.parent_span_id, "big") if sp.parent_span_id else 0,
                                start_ns=sp.start_time_unix_nano,
                                end_ns=sp.end_time_unix_nano,
                                attrs=attr_map(sp.attributes),
                                resource=res,
                                scope=ss.scope.name,
                            )
                        )
        return out

    def metric_points(self) -> list[tuple[dict[str, Any], str, dict[str, Any], float]]:
        """(resource attrs, metric name, point attrs, value) for every sum/gauge data point."""
        out = []
        with self.lock:
            reqs = list(self.metric_requests)
        for req in reqs:
            for rm in req.resource_metrics:
                res = {k: v[1] for k, v in attr_map(rm.resource.attributes).items()}
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        if kind not in ("sum", "gauge"):
                            continue
                        for dp in getattr(m, kind).data_points:
                            value = dp.as_int if dp.WhichOneof("value") == "as_int" else dp.as_double
                            out.append((res, m.name, {k: v[1] for k, v in attr_map(dp.attributes).items()}, value))
        return out

    def wait_for(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return True
            time.sleep(0.05)
        return pred()


class _Trace(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: Store) -> None:
        self.store = store

    def Export(self, request: Any, context: Any) -> Any:
        with self.store.lock:
            self.store.trace_requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, store: Store) -> None:
        self.store = store

    def Export(self, request: Any, context: Any) -> Any:
        with self.store.lock:
            self.store.metric_requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class GrpcReceiver:
    def __init__(self) -> None:
        self.store = Store()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Trace(self.store), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self.store), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=0)


class HttpReceiver:
    def __init__(self) -> None:
        self.store = Store()
        store = self.store

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    req: Any = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                    resp: Any = trace_service_pb2.ExportTraceServiceResponse()
                    with store.lock:
                        store.trace_requests.append(req)
                elif self.path == "/v1/metrics":
                    req = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
                    resp = metrics_service_pb2.ExportMetricsServiceResponse()
                    with store.lock:
                        store.metric_requests.append(req)
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                raw = resp.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: Any) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

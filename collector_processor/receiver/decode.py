"""Decoding of OTLP request bodies: protobuf or JSON (hex trace/span ids), optionally gzip-compressed; and the OTLP
addresses per signal that the receivers and the OTLP exporters share."""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import zlib
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

REQUEST_TYPES: dict[str, type[Message]] = {
    "traces": ExportTraceServiceRequest,
    "metrics": ExportMetricsServiceRequest,
    "logs": ExportLogsServiceRequest,
}
# gRPC service of each signal (method ``/<service>/Export``) and its OTLP/HTTP path
GRPC_SERVICES = {
    "traces": "opentelemetry.proto.collector.trace.v1.TraceService",
    "metrics": "opentelemetry.proto.collector.metrics.v1.MetricsService",
    "logs": "opentelemetry.proto.collector.logs.v1.LogsService",
}
HTTP_PATHS = {"traces": "/v1/traces", "metrics": "/v1/metrics", "logs": "/v1/logs"}
RETRY_INFO_KEY = "google.rpc.retryinfo-bin"  # gRPC trailer carrying google.rpc.RetryInfo
CT_PROTOBUF = "application/x-protobuf"
CT_JSON = "application/json"
_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})


class DecodeFailure(ValueError):
    """The body is not a valid OTLP request (-> HTTP 400 / gRPC INVALID_ARGUMENT)."""


class TooLarge(ValueError):
    """The (decompressed) body is over the configured limit (-> HTTP 413 / gRPC RESOURCE_EXHAUSTED)."""


def gunzip_bounded(body: bytes, limit: int) -> bytes:
    """Decompress without ever holding more than ``limit`` bytes (a gzip bomb is refused, not expanded)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(body, limit + 1)
        if len(out) > limit:
            raise TooLarge(f"decompressed body exceeds {limit} bytes")
        if not d.eof:
            raise DecodeFailure("truncated gzip body")
        if d.unused_data and d.unused_data.strip(b"\0"):
            # concatenated gzip members are legal; decode them all but keep the bound
            rest = gzip.decompress(d.unused_data)
            if len(out) + len(rest) > limit:
                raise TooLarge(f"decompressed body exceeds {limit} bytes")
            out += rest
    except (zlib.error, OSError, EOFError) as e:
        raise DecodeFailure(f"bad gzip body: {e}") from e
    return out


def _hex_ids_to_base64(obj: Any) -> Any:
    """OTLP/JSON carries ids as hex; protobuf's JSON parser expects base64 for bytes fields."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k in _ID_KEYS and isinstance(v, str):
                if v == "":
                    out[k] = ""
                    continue
                try:
                    raw = bytes.fromhex(v)
                except ValueError as e:
                    raise DecodeFailure(f"{k} is not hex: {v[:40]!r}") from e
                if len(raw) not in (8, 16):
                    raise DecodeFailure(f"{k} has {len(raw)} bytes; trace ids have 16 and span ids 8")
                out[k] = base64.b64encode(raw).decode("ascii")
            else:
                out[k] = _hex_ids_to_base64(v)
        return out
    if isinstance(obj, list):
        return [_hex_ids_to_base64(x) for x in obj]
    return obj


def decode(signal: str, body: bytes, content_type: str = CT_PROTOBUF) -> Message:
    cls = REQUEST_TYPES[signal]
    ct = (content_type or CT_PROTOBUF).split(";", 1)[0].strip().lower()
    msg = cls()
    if ct == CT_PROTOBUF:
        try:
            msg.ParseFromString(body)
        except (DecodeError, RuntimeError, ValueError) as e:
            raise DecodeFailure(f"invalid protobuf {cls.__name__}: {e}") from e
        return msg
    if ct == CT_JSON:
        try:
            obj = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # nesting beyond the stack
            raise DecodeFailure(f"invalid JSON: {type(e).__name__}") from e
        if not isinstance(obj, dict):
            raise DecodeFailure("the JSON body must be an object")
        try:
            json_format.ParseDict(_hex_ids_to_base64(obj), msg, ignore_unknown_fields=True)
        except (json_format.ParseError, binascii.Error, ValueError, TypeError, RecursionError) as e:
            raise DecodeFailure(f"invalid OTLP/JSON {cls.__name__}: {e}") from e
        return msg
    raise DecodeFailure(f"unsupported content type {content_type!r}; use {CT_PROTOBUF} or {CT_JSON}")


def count_items(signal: str, msg: Message) -> int:
    """Spans, log records or metric data points in a request."""
    n = 0
    if signal == "traces":
        for rs in msg.resource_spans:  # type: ignore[attr-defined]
            for ss in rs.scope_spans:
                n += len(ss.spans)
    elif signal == "logs":
        for rl in msg.resource_logs:  # type: ignore[attr-defined]
            for sl in rl.scope_logs:
                n += len(sl.log_records)
    else:
        for rm in msg.resource_metrics:  # type: ignore[attr-defined]
            for sm in rm.scope_metrics:
                n += len(sm.metrics)
    return n

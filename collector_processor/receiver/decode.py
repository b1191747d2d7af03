"""Decoding of OTLP request bodies: protobuf or JSON (hex trace/span ids), optionally gzip-compressed; and the OTLP
addresses per signal that the receivers and the OTLP exporters share."""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Callable
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


INFLATE_CHUNK = 1 << 20


def gunzip_bounded(body: bytes | bytearray, limit: int, grow: Callable[[int], None] | None = None) -> bytearray:
    """Decompress every gzip member of ``body`` (concatenated members are legal) without ever holding more than
    ``limit`` inflated bytes in all: a bomb of many members is refused as soon as their total passes the limit.
    Output grows in chunks of ``INFLATE_CHUNK``; ``grow(total)`` is told each new total before the chunk is kept
    (it may raise to stop)."""
    out = bytearray()
    data: bytes | bytearray = body
    try:
        while True:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            while not d.eof:
                chunk = d.decompress(data, min(INFLATE_CHUNK, limit + 1 - len(out)))
                progressed = bool(chunk) or len(d.unconsumed_tail) < len(data)
                data = d.unconsumed_tail
                if chunk:
                    if len(out) + len(chunk) > limit:
                        raise TooLarge(f"decompressed body exceeds {limit} bytes")
                    if grow is not None:
                        grow(len(out) + len(chunk))
                    out += chunk
                if not d.eof and not progressed:
                    raise DecodeFailure("truncated gzip body")
            data = d.unused_data
            if not data.strip(b"\0"):  # trailing zero padding after the last member is tolerated
                return out
    except zlib.error as e:
        raise DecodeFailure(f"bad gzip body: {e}") from e


# What decoding may take, as an upper estimate measured on the costliest bodies per byte (bench/hostile.py
# --expansion; bench/results/hostile.md). Protobuf: every embedded message costs up to ~200 bytes once parsed
# (an empty Span: 176); a message shorter than 8 bytes is a one-byte tag of a length-delimited field (every
# such field of OTLP has a number below 16: a tag 0x0a..0x7a) followed by a length byte below 8, so those
# pairs bound the number of small messages (pairs cannot overlap: a tag byte is at least 10); longer messages
# take at least 9 bytes each. JSON: the parser builds one object per container and string besides the text.
PROTOBUF_BYTES_PER_BYTE = 24
PROTOBUF_BYTES_PER_SMALL_MESSAGE = 200
JSON_BYTES_PER_BYTE = 16
JSON_BYTES_PER_CONTAINER = 160
JSON_BYTES_PER_STRING = 64
# byte -> T (a tag of a length-delimited field numbered 1..15), s (a length below 8), x (anything else)
_PAIRS = bytes(ord("T") if b & 7 == 2 and 8 <= b < 128 else ord("s") if b < 8 else ord("x") for b in range(256))
_PAIR_CHUNK = 1 << 20  # bodies are translated a chunk at a time: a bounded copy


def small_messages(body: bytes | bytearray) -> int:
    """The (tag, length < 8) pairs of ``body``: at least its messages shorter than 8 bytes."""
    if len(body) <= _PAIR_CHUNK:
        return body.translate(_PAIRS).count(b"Ts")
    n = 0
    view = memoryview(body)
    for i in range(0, len(body), _PAIR_CHUNK):
        n += bytes(view[i:i + _PAIR_CHUNK + 1]).translate(_PAIRS).count(b"Ts")  # a pair across the cut counts once
    view.release()
    return n


# A protobuf body up to this size is first reserved at the most its decoding could take, known from its length
# alone (``decode_cost_bound``: at most one small message per two bytes, the pairs cannot overlap; 124 bytes per
# byte, under 32 MiB), and scanned for ``decode_cost`` only when that much is refused: the scan costs about as much
# as parsing the body (~250 us for 100 KiB), the bound nothing.
BOUND_BYTES = 256 * 1024


def decode_cost_bound(body: bytes | bytearray, content_type: str = CT_PROTOBUF) -> int | None:
    """``decode_cost``'s most for a body of this length without reading it: a protobuf body of up to
    ``BOUND_BYTES``; None for any other (scan it)."""
    n = len(body)
    if n > BOUND_BYTES or (content_type and content_type.split(";", 1)[0].strip().lower() != CT_PROTOBUF):
        return None
    return PROTOBUF_BYTES_PER_BYTE * n + PROTOBUF_BYTES_PER_SMALL_MESSAGE * (n // 2)


# The most ``decode_cost`` gives any valid body per byte: protobuf whose every other byte starts a small message
# (124); a valid JSON body has at most one container per two bytes besides its strings (96).
WORST_BYTES_PER_BYTE = PROTOBUF_BYTES_PER_BYTE + PROTOBUF_BYTES_PER_SMALL_MESSAGE // 2


def admitted_bytes(budget: int, held_per_byte: int = 1) -> int:
    """The largest body that gates with ``budget`` bytes free admit whatever it holds: its own bytes
    (``held_per_byte`` of them per body byte while it is decoded) and the most its decoding may take."""
    return max(0, budget) // (held_per_byte + WORST_BYTES_PER_BYTE)


def decode_cost(body: bytes | bytearray, content_type: str = CT_PROTOBUF) -> int:
    """An upper estimate of the memory that decoding ``body`` takes (what admission control reserves); a few
    passes of ``bytes.count``, no parsing."""
    ct = (content_type or CT_PROTOBUF).split(";", 1)[0].strip().lower()
    if ct == CT_JSON:
        containers = body.count(b"{") + body.count(b"[")
        return (JSON_BYTES_PER_BYTE * len(body) + JSON_BYTES_PER_CONTAINER * containers
                + JSON_BYTES_PER_STRING * (body.count(b'"') // 2))
    return PROTOBUF_BYTES_PER_BYTE * len(body) + PROTOBUF_BYTES_PER_SMALL_MESSAGE * small_messages(body)


def _hex_ids_to_base64(obj: Any) -> None:
    """OTLP/JSON carries ids as hex; protobuf's JSON parser expects base64 for bytes fields. Converted in place (a
    copy of the tree would double what a JSON body costs)."""
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k in _ID_KEYS and isinstance(v, str):
                    if v:
                        node[k] = _hex_id(k, v)
                elif isinstance(v, dict | list):
                    stack.append(v)
        else:
            stack.extend(x for x in node if isinstance(x, dict | list))


def _hex_id(key: str, v: str) -> str:
    try:
        raw = bytes.fromhex(v)
    except ValueError as e:
        raise DecodeFailure(f"{key} is not hex: {v[:40]!r}") from e
    if len(raw) not in (8, 16):
        raise DecodeFailure(f"{key} has {len(raw)} bytes; trace ids have 16 and span ids 8")
    return base64.b64encode(raw).decode("ascii")


def decode(signal: str, body: bytes | bytearray, content_type: str = CT_PROTOBUF) -> Message:
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
        except (ValueError, RecursionError) as e:  # syntax, encoding, an integer of over 4300 digits, deep nesting
            raise DecodeFailure(f"invalid JSON: {type(e).__name__}: {str(e)[:80]}") from e
        if not isinstance(obj, dict):
            raise DecodeFailure("the JSON body must be an object")
        _hex_ids_to_base64(obj)
        try:
            json_format.ParseDict(obj, msg, ignore_unknown_fields=True)
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

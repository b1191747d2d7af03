"""Whether an OTLP endpoint takes trace exports: one empty ``ExportTraceServiceRequest`` sent as the ranks' exporter
would send it (gRPC ``TraceService/Export``, or HTTP POST ``/v1/traces`` with protobuf). Off the hot path: the demo
checks an external collector before it starts ranks, ``otel-straggler doctor`` checks the configured one."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # what answered, or why nothing did
    rtt_ms: float | None = None
    server_date: str | None = None  # the HTTP Date header, when the collector sent one


def _target(endpoint: str) -> tuple[str, bool]:
    """(host:port, tls) of an OTLP endpoint given as ``http(s)://host:port`` or ``host:port``."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    if not parts.hostname:
        raise ValueError(f"no host in OTLP endpoint {endpoint!r}")
    port = parts.port or (443 if parts.scheme == "https" else 4317)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}", parts.scheme == "https"


def probe_otlp(endpoint: str, protocol: str = "grpc", timeout_s: float = 5.0,
               headers: dict[str, str] | None = None) -> ProbeResult:
    """Send one empty trace export to ``endpoint``; never raises."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    body = ExportTraceServiceRequest().SerializeToString()
    t0 = time.monotonic()
    try:
        if protocol == "grpc":
            import grpc
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

            target, tls = _target(endpoint)
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials()) if tls \
                else grpc.insecure_channel(target)
            try:
                TraceServiceStub(channel).Export(ExportTraceServiceRequest(), timeout=timeout_s,
                                                 metadata=tuple((k.lower(), v) for k, v in (headers or {}).items()))
            finally:
                channel.close()
            return ProbeResult(True, f"OTLP/gRPC export accepted by {target}",
                               round((time.monotonic() - t0) * 1000, 1))
        url = endpoint.rstrip("/")
        url = url if url.endswith("/v1/traces") else url + "/v1/traces"
        req = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf", **(headers or {})})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return ProbeResult(True, f"OTLP/HTTP export accepted by {url} ({resp.status})",
                               round((time.monotonic() - t0) * 1000, 1), resp.headers.get("Date"))
    except Exception as exc:  # every failure is the answer: nothing takes exports there
        return ProbeResult(False, _why(exc))


def _why(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    status = code() if callable(code) else code  # a grpc.RpcError's status, an HTTPError's status code
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return f"{type(exc).__name__}{f' {status}' if status else ''}: {text}"

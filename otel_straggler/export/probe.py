"""Whether an OTLP endpoint takes trace exports: one empty ``ExportTraceServiceRequest`` sent as the ranks' exporter
would send it (gRPC ``TraceService/Export``, or HTTP POST ``/v1/traces`` with protobuf). Off the hot path: the demo
checks an external collector before it starts ranks, ``otel-straggler doctor`` checks the configured one."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit, urlunsplit


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # what answered, or why nothing did
    rtt_ms: float | None = None
    server: str | None = None  # who answered, when it says (HTTP Server; gRPC health check trailing metadata)
    clock_offset_s: float | None = None  # its clock minus this one's, when it says what its clock reads


@dataclass(frozen=True)
class TlsFiles:
    """The OTLP exporter's TLS files (``OTEL_EXPORTER_OTLP[_TRACES]_CERTIFICATE``, ``_CLIENT_KEY``,
    ``_CLIENT_CERTIFICATE``): a CA bundle to trust, and a client key and certificate for mutual TLS."""

    certificate: str | None = None
    client_key: str | None = None
    client_certificate: str | None = None


def redact(url: str) -> str:
    """``url`` with the password of its user info replaced (``user:***@host``), for anything printed."""
    parts = urlsplit(url if "://" in url else f"//{url}")
    if parts.password is None and "@" not in parts.netloc:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{user}:***@{host}" if parts.password is not None else f"***@{host}"
    out = urlunsplit(parts._replace(netloc=netloc))
    return out if "://" in url else out.removeprefix("//")


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _target(endpoint: str) -> tuple[str, bool]:
    """(host:port, tls) of an OTLP endpoint given as ``http(s)://host:port`` or ``host:port``."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    if not parts.hostname:
        raise ValueError(f"no host in OTLP endpoint {endpoint!r}")
    port = parts.port or (443 if parts.scheme == "https" else 4317)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}", parts.scheme == "https"


def probe_otlp(endpoint: str, protocol: str = "grpc", timeout_s: float = 5.0,
               headers: dict[str, str] | None = None, tls: TlsFiles | None = None) -> ProbeResult:
    """Send one empty trace export to ``endpoint`` (over TLS for ``https://``, trusting ``tls``'s files as the
    exporter would); never raises. No answer shows a password of the endpoint's URL."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    body = ExportTraceServiceRequest().SerializeToString()
    t0 = time.monotonic()
    try:
        if protocol == "grpc":
            import grpc
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

            target, secure = _target(endpoint)
            files = tls or TlsFiles()
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(
                _read(files.certificate), _read(files.client_key), _read(files.client_certificate))) if secure \
                else grpc.insecure_channel(target)
            try:
                md = tuple((k.lower(), v) for k, v in (headers or {}).items())
                TraceServiceStub(channel).Export(ExportTraceServiceRequest(), timeout=timeout_s, metadata=md)
                rtt = round((time.monotonic() - t0) * 1000, 1)
                server, offset = _grpc_identity(channel, timeout_s, md)
            finally:
                channel.close()
            return ProbeResult(True, f"OTLP/gRPC export accepted by {target}", rtt, server, offset)
        url = endpoint.rstrip("/")
        url = url if url.endswith("/v1/traces") else url + "/v1/traces"
        req = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf", **(headers or {})})
        context = None
        if tls is not None and url.startswith("https://"):
            import ssl

            context = ssl.create_default_context(cafile=tls.certificate or None)
            if tls.client_certificate:
                context.load_cert_chain(tls.client_certificate, tls.client_key or None)
        sent = time.time()
        with urllib.request.urlopen(req, timeout=timeout_s, context=context) as resp:
            offset = None
            date = resp.headers.get("Date")
            if date:  # one-second resolution
                offset = parsedate_to_datetime(date).timestamp() - (sent + time.time()) / 2
            return ProbeResult(True, f"OTLP/HTTP export accepted by {redact(url)} ({resp.status})",
                               round((time.monotonic() - t0) * 1000, 1), resp.headers.get("Server"), offset)
    except Exception as exc:  # every failure is the answer: nothing takes exports there
        why = _why(exc)
        return ProbeResult(False, why.replace(endpoint, redact(endpoint)) if redact(endpoint) != endpoint else why)


def _grpc_identity(channel: object, timeout_s: float, md: tuple) -> tuple[str | None, float | None]:
    """The collector's name and clock from its gRPC health check's trailing metadata (none from another server)."""
    try:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",  # type: ignore[attr-defined]
                                    request_serializer=lambda b: b, response_deserializer=lambda b: b)
        sent = time.time_ns()
        _, call = check.with_call(b"", timeout=timeout_s, metadata=md)
        got = time.time_ns()
        trail = dict(call.trailing_metadata() or ())
        server = trail.get("otel-straggler-collector")
        ns = trail.get("x-unix-time-ns")
        offset = (int(ns) - (sent + got) / 2) / 1e9 if ns else None
        return (str(server) if server else None), offset
    except Exception:  # no health service, or none that says: nothing to report
        return None, None


def _why(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    status = code() if callable(code) else code  # a grpc.RpcError's status, an HTTPError's status code
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return f"{type(exc).__name__}{f' {status}' if status else ''}: {text}"

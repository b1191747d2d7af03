"""Value types shared by component configs: durations (``1s``, ``500ms``), endpoints, TLS blocks."""

from __future__ import annotations

import ipaddress
import math
import re
import socket
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict

_DUR = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s|m|h)?\s*$")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


MAX_DURATION_S = 7 * 86400.0  # a week: no duration of the collector is meant to be longer


def parse_duration(value: object) -> float:
    """Seconds from ``1s`` / ``250ms`` / ``2m`` / a bare number of seconds; finite, at most ``MAX_DURATION_S``."""
    if isinstance(value, bool):
        raise ValueError("a duration such as 1s or 500ms is required")
    seconds: float | None = None
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError("a duration must be finite")
        if value < 0:
            raise ValueError("durations cannot be negative")
        seconds = float(value)
    elif isinstance(value, str):
        m = _DUR.match(value)
        if m and len(m.group(1)) <= 32:
            seconds = float(m.group(1)) * _UNIT[m.group(2)]
    if seconds is None:
        raise ValueError(f"not a duration: {str(value)[:40]!r} (use e.g. 1s, 500ms, 2m)")
    if not seconds <= MAX_DURATION_S:
        raise ValueError(f"a duration of at most {MAX_DURATION_S / 86400:.0f} days (7d = {MAX_DURATION_S:.0f}s)")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


def split_host_port(endpoint: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too). An empty host means loopback: nothing binds every interface by
    accident."""
    ep = endpoint.strip()
    for scheme in ("http://", "https://"):
        if ep.startswith(scheme):
            ep = ep[len(scheme):]
    ep = ep.split("/", 1)[0]
    if ep.startswith("["):
        host, _, rest = ep[1:].partition("]")
        port_s = rest.lstrip(":")
    else:
        host, sep, port_s = ep.rpartition(":")
        if not sep:
            host, port_s = ep, ""
    if not port_s:
        if default_port is None:
            raise ValueError(f"endpoint {endpoint!r} has no port")
        return host or "127.0.0.1", default_port
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"endpoint {endpoint!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"endpoint {endpoint!r}: port {port} is out of range (0-65535)")
    return host or "127.0.0.1", port


def is_loopback(host: str) -> bool:
    """``host`` is a loopback address (or ``localhost``); a name is not: it may resolve to any interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _listen(default_port: int) -> BeforeValidator:
    """An address to listen on: ``host:port`` whose port parses and is in range and whose host is an address or a
    name that resolves here (checked at ``--validate``: ``notaport``, a host without a port, is refused there, not
    at start)."""

    def check(value: object) -> object:
        if isinstance(value, str):
            host, port = split_host_port(value, default_port)
            try:
                socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            except (socket.gaierror, UnicodeError):
                raise ValueError(f"endpoint {value!r}: host {host!r} is not an address that resolves here; "
                                 "expected host:port") from None
        return value

    return BeforeValidator(check)


def _export_url(value: object) -> object:
    """An endpoint to export to: empty (disabled), ``host:port`` or ``http(s)://host[:port][/path]``."""
    if isinstance(value, str) and value.strip():
        v = value.strip()
        parts = urlsplit(v if "://" in v else f"http://{v}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"endpoint {value!r}: expected http(s)://host:port")
        try:
            parts.port  # noqa: B018 (raises on a port that is not a number or out of range)
        except ValueError as e:
            raise ValueError(f"endpoint {value!r}: {e}") from None
    return value


GrpcListen = Annotated[str, _listen(4317)]
HttpListen = Annotated[str, _listen(4318)]
MetricsListen = Annotated[str, _listen(9464)]
ExportEndpoint = Annotated[str, BeforeValidator(_export_url)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ServerTLS(Strict):
    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None  # set -> clients must present a certificate (mTLS)

    def enabled(self) -> bool:
        return bool(self.cert_file)


class ClientTLS(Strict):
    insecure: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

"""Before anything binds: every address the configuration listens on, tried at once, so a clash is reported whole,
and every one reachable beyond this host without credentials named.

A collector that starts component by component meets one taken port per attempt (and gRPC's bind failure carries no
errno). ``clashes`` binds each listening address of the raw configuration (receivers' protocol endpoints, the
``prometheus`` exporters, the service's own metrics) and releases it again; the caller refuses to start with one
message naming every address that cannot be listened on and why.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator
from typing import Any

from collector_processor.config.types import is_loopback, split_host_port


def listen_addresses(raw: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(what, ``host:port``) for every address the configuration listens on."""
    for rid, rcfg in (raw.get("receivers") or {}).items():
        for proto, pcfg in ((rcfg or {}).get("protocols") or {}).items():
            if isinstance(pcfg, dict) and pcfg.get("endpoint"):
                yield f"{rid} ({proto})", str(pcfg["endpoint"])
    for eid, ecfg in (raw.get("exporters") or {}).items():
        if eid.split("/")[0] == "prometheus" and isinstance(ecfg, dict) and ecfg.get("endpoint"):
            yield eid, str(ecfg["endpoint"])
    telemetry = ((raw.get("service") or {}).get("telemetry") or {}).get("metrics") or {}
    if isinstance(telemetry, dict) and telemetry.get("address"):
        yield "service.telemetry.metrics", str(telemetry["address"])


def _try_bind(host: str, port: int) -> str:
    """'' when ``host:port`` can be listened on now, else why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no clash
            s.bind((host, port))
            s.listen(1)
    except OSError as e:
        return os.strerror(e.errno) if e.errno else str(e) or errno.errorcode.get(e.errno or 0, "error")
    return ""


def clashes(raw: dict[str, Any]) -> list[str]:
    """``what host:port: why`` for every listening address that cannot be bound now (port 0 is never a clash)."""
    out = []
    for what, endpoint in listen_addresses(raw):
        try:
            host, port = split_host_port(endpoint, 0)
        except ValueError:
            continue  # validation reports it
        if port == 0:
            continue
        why = _try_bind(host, port)
        if why:
            out.append(f"{what} {endpoint}: {why}")
    return out


def _has_auth(section: object) -> bool:
    """A component's ``auth`` asks for credentials (a bearer token, a token file, tenants or a job secret), or its
    TLS asks for client certificates (``client_ca_file``)."""
    if not isinstance(section, dict):
        return False
    auth = section.get("auth")
    keys = ("bearer_token", "bearer_token_file", "tenants", "job_secret", "job_secret_file")
    if isinstance(auth, dict) and any(auth.get(k) for k in keys):
        return True
    tls = section.get("tls")
    return isinstance(tls, dict) and bool(tls.get("client_ca_file"))


def exposed(raw: dict[str, Any]) -> list[str]:
    """``what host:port`` for every listening address beyond loopback whose component asks no credentials: anyone
    who reaches it writes spans into any job, or reads every job's series."""
    auth = {f"{rid} ({proto})": _has_auth(rcfg) for rid, rcfg in (raw.get("receivers") or {}).items()
            for proto in ((rcfg or {}).get("protocols") or {})}
    auth.update({eid: _has_auth(ecfg) for eid, ecfg in (raw.get("exporters") or {}).items()})
    out = []
    for what, endpoint in listen_addresses(raw):
        try:
            host, _port = split_host_port(endpoint, 0)
        except ValueError:
            continue  # validation reports it
        if not is_loopback(host) and not auth.get(what, False):
            out.append(f"{what} {endpoint}")
    return out

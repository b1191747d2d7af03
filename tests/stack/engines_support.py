"""The real engines: the OpenTelemetry Collector distribution and Jaeger v2 that ``scripts/engines`` builds.

``scripts/test`` builds them and exports their paths (``OTEL_STRAGGLER_OTELCOL``, ``OTEL_STRAGGLER_JAEGER``). A run
without those variables asks ``scripts/engines`` for cached binaries (no build). Where neither finds them, a test
skips with the command that builds them, except under CI (``CI=true``), where a missing engine fails the test."""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import subprocess
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from stack_support import http_get, process, tail, wait_until

from otel_straggler_demo.run import free_ports

REPO = Path(__file__).resolve().parents[2]
ENGINES_SCRIPT = REPO / "scripts" / "engines"
ENV_OTELCOL = "OTEL_STRAGGLER_OTELCOL"
ENV_JAEGER = "OTEL_STRAGGLER_JAEGER"


def _cached() -> dict[str, str]:
    """The cached binaries' paths for the current pins, or {} when either is not built (builds nothing)."""
    try:
        check = subprocess.run([str(ENGINES_SCRIPT), "--check"], capture_output=True, timeout=60)
        if check.returncode != 0:
            return {}
        out = subprocess.run([str(ENGINES_SCRIPT)], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def engine(var: str) -> str:
    """Path of an engine binary by its variable (ENV_OTELCOL, ENV_JAEGER); skip or, under CI, fail without it."""
    path = os.environ.get(var) or _cached().get(var)
    if path and os.access(path, os.X_OK):
        return path
    why = f"{var} is not set and scripts/engines has no cached build for the current pins (run scripts/engines)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"the engine is missing under CI: {why}")
    pytest.skip(why)


def otelcol() -> str:
    """The OpenTelemetry Collector distribution of engines/otelcol."""
    return engine(ENV_OTELCOL)


def jaeger() -> str:
    """Jaeger v2 of engines/jaeger."""
    return engine(ENV_JAEGER)


# --- running them -------------------------------------------------------------------------------------------


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, what: str, timeout_s: float = 120.0) -> None:
    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode}:\n{tail(log)}")
        return http_get(url)[0] == 200

    wait_until(ready, timeout_s, what=f"{what} ready at {url}")


def _telemetry_reader(port: int) -> list[dict[str, Any]]:
    return [{"pull": {"exporter": {"prometheus": {"host": "127.0.0.1", "port": port}}}}]


@dataclass
class Jaeger:
    """A running Jaeger v2 (configs/jaeger.yaml on loopback ports)."""

    otlp_grpc: str  # host:port of its OTLP/gRPC receiver
    query_port: int  # UI and HTTP API
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.query_port}"

    def get(self, path: str) -> tuple[int, bytes]:
        return http_get(self.url + path)

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        """The spans Jaeger's query API returns for a trace id (hex), [] while it has none."""
        code, body = self.get(f"/api/traces/{trace_id}")
        if code != 200:
            return []
        data = json.loads(body).get("data") or []
        return data[0]["spans"] if data else []


def jaeger_config(otlp_grpc: int, otlp_http: int, query: int, query_grpc: int, health: int, metrics: int,
                  ui_assets: str | None = None) -> dict[str, Any]:
    """configs/jaeger.yaml with every listener on 127.0.0.1 and the given ports (the shipped storage, pipeline
    and extensions otherwise), serving the UI from ``ui_assets`` when given."""
    cfg = yaml.safe_load((REPO / "configs" / "jaeger.yaml").read_text(encoding="utf-8"))
    cfg["receivers"]["otlp"]["protocols"] = {"grpc": {"endpoint": f"127.0.0.1:{otlp_grpc}"},
                                              "http": {"endpoint": f"127.0.0.1:{otlp_http}"}}
    cfg["extensions"]["healthcheckv2"]["http"]["endpoint"] = f"127.0.0.1:{health}"
    query_cfg = cfg["extensions"]["jaeger_query"]
    query_cfg["http"] = {"endpoint": f"127.0.0.1:{query}"}
    query_cfg["grpc"] = {"endpoint": f"127.0.0.1:{query_grpc}"}
    if ui_assets:
        query_cfg["ui"] = {"assets_path": ui_assets}
    cfg["service"]["telemetry"]["metrics"]["readers"] = _telemetry_reader(metrics)
    return cfg


@contextlib.contextmanager
def run_jaeger(tmp: Path, ui_assets: str | None = None) -> Iterator[Jaeger]:
    binary = jaeger()
    ports = free_ports(6)
    cfg_path = tmp / "jaeger.yaml"
    cfg_path.write_text(yaml.safe_dump(jaeger_config(*ports, ui_assets=ui_assets)), encoding="utf-8")
    log = tmp / "jaeger.log"
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp), "JAEGER_LISTEN_HOST": "127.0.0.1"}
    with process([binary, f"--config={cfg_path}"], log, env) as proc:
        _wait_ready(proc, f"http://127.0.0.1:{ports[4]}/status", log, "jaeger")
        yield Jaeger(f"127.0.0.1:{ports[0]}", ports[2], proc, log)


@dataclass
class Otelcol:
    """A running OpenTelemetry Collector (engines/otelcol)."""

    proc: subprocess.Popen[bytes]
    log: Path
    telemetry_port: int  # its own metrics (Prometheus)

    def metrics(self) -> str:
        code, body = http_get(f"http://127.0.0.1:{self.telemetry_port}/metrics")
        return body.decode() if code == 200 else ""


@contextlib.contextmanager
def run_otelcol(tmp: Path, cfg: dict[str, Any], env: dict[str, str] | None = None, name: str = "otelcol",
                wrap: list[str] | None = None) -> Iterator[Otelcol]:
    """``cfg`` with its health_check and telemetry on free loopback ports; ``wrap`` prefixes the command (e.g.
    a mount namespace of its own)."""
    binary = otelcol()
    health, telemetry = free_ports(2)
    cfg.setdefault("extensions", {})["health_check"] = {"endpoint": f"127.0.0.1:{health}"}
    if "health_check" not in cfg["service"].setdefault("extensions", []):
        cfg["service"]["extensions"].append("health_check")
    cfg["service"].setdefault("telemetry", {}).setdefault("metrics", {})["readers"] = _telemetry_reader(telemetry)
    cfg_path = tmp / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    log = tmp / f"{name}.log"
    full_env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp), **(env or {})}
    with process([*(wrap or []), binary, f"--config={cfg_path}"], log, full_env) as proc:
        _wait_ready(proc, f"http://127.0.0.1:{health}/", log, name)
        yield Otelcol(proc, log, telemetry)


def metric_values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric ``name`` in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        labels = dict(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        out.append((labels, float(m.group(4))))
    return out


def lb_ring_owner(endpoints: list[str], routing: dict[str, str]) -> str:
    """The endpoint the ``load_balancing`` exporter (contrib v0.161.0, ``consistent_hashing.go``) sends a batch to
    whose routing attributes are ``routing`` (in the config's order), among ``endpoints`` as its resolver gives
    them (``ip:port``): 200 crc32 points per endpoint on a ring of 131,071 positions (a taken position probes up to
    10 ahead), the batch's point the crc32 of ``name=value|`` of each attribute, the owner the first point at or
    after it (wrapping). A replica for the tests to know where a cohort must be judged; the gateway decides."""
    size, weight, probes = 131071, 200, 10
    candidates = []
    for ep in endpoints:
        for i in range(weight):
            h = zlib.crc32(ep.encode() + struct.pack("<I", i))
            candidates.append((h % size, h, ep))
    candidates.sort()
    taken: set[int] = set()
    ring: list[tuple[int, str]] = []
    for pos, _, ep in candidates:
        probed = 0
        while pos in taken and probed < probes:
            pos, probed = (pos + 1) % size, probed + 1
        if probed >= probes:
            continue
        taken.add(pos)
        ring.append((pos, ep))
    ring.sort()
    point = zlib.crc32("".join(f"{k}={v}|" for k, v in routing.items()).encode()) % size
    return next((ep for pos, ep in ring if pos >= point), ring[0][1])


class SimulatedHosts:
    """``n`` simulated hosts: one network namespace each, joined by a bridge on which this host has
    ``gateway_ip`` (198.18.0.0/15, the range set aside for network tests), each host with an address of its own
    and a host name of its own (a UTS namespace). Where namespaces are refused (not root, no ``ip``), the hosts
    share loopback and differ only by name: ``isolated`` says which."""

    def __init__(self, n: int) -> None:
        self.n = n
        k = os.getpid() % 250
        self.tag = f"ost{os.getpid() % 100000}"
        self.bridge = f"{self.tag}b"
        self.netns = [f"{self.tag}n{i}" for i in range(n)]
        self.gateway_ip = f"198.18.{k}.1"
        self.addresses = [f"198.18.{k}.{10 + i}" for i in range(n)]
        self.isolated = False
        self._made: list[list[str]] = []  # undo commands

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def __enter__(self) -> SimulatedHosts:
        try:
            self._ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(["link", "del", self.bridge])
            self._ip("addr", "add", f"{self.gateway_ip}/24", "dev", self.bridge)
            self._ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.netns):
                self._ip("netns", "add", ns)
                self._made.append(["netns", "del", ns])
                host_end, ns_end = f"{self.tag}h{i}", f"{self.tag}v{i}"
                self._ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
                self._made.append(["link", "del", host_end])
                self._ip("link", "set", ns_end, "netns", ns)
                self._ip("link", "set", host_end, "master", self.bridge)
                self._ip("link", "set", host_end, "up")
                self._ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", ns_end)
                self._ip("-n", ns, "link", "set", ns_end, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
            self.isolated = True
        except (OSError, subprocess.SubprocessError):
            self.__exit__()
            self.gateway_ip = "127.0.0.1"
            self.addresses = ["127.0.0.1"] * self.n
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._made):
            subprocess.run(["ip", *undo], capture_output=True, timeout=30)
        self._made.clear()

    def argv(self, i: int, host_name: str, argv: list[str]) -> list[str]:
        """``argv`` run on host ``i`` under ``host_name``."""
        named = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host_name, *argv]
        if self.isolated:
            return ["ip", "netns", "exec", self.netns[i], *named]
        if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode == 0:
            return named
        return [*argv, "--host-name", host_name]

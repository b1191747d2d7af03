"""The standard ``OTEL_*`` settings of the export side, read and validated once in the training process.

Left to the SDK, a value it cannot parse raises inside the export child (``OTEL_BSP_MAX_QUEUE_SIZE=0``,
``OTEL_EXPORTER_OTLP_TIMEOUT=ten``, an unknown compression, an endpoint ``http://[::1``) and all telemetry
is lost. Here each value is parsed by the OpenTelemetry specification's rules; a bad one is warned about
once, replaced by its default and counted (``faults{where=config_error}``). The export side builds the
exporters, the batch span processor and the metric reader from these explicit values, and the export
child's environment no longer carries the variables read here, so the SDK never parses them again.

* ``OTEL_SDK_DISABLED`` (``false``): ``true`` turns export off (the ``NullSink``).
* ``OTEL_TRACES_EXPORTER``, ``OTEL_METRICS_EXPORTER`` (``otlp``): ``otlp`` or ``none``; another exporter is
  warned about and ``otlp`` used.
* ``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]PROTOCOL`` (``grpc``): ``grpc`` or ``http/protobuf``; ``http/json``
  is warned about and sent as ``http/protobuf`` to the same endpoint.
* ``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]ENDPOINT`` (``http://localhost:4317`` gRPC, ``:4318`` HTTP): an
  ``http``/``https`` URL with a host and a valid port (gRPC also ``host:port``, as the SDK takes it); over
  HTTP the general endpoint gets ``/v1/traces`` or ``/v1/metrics``, a per-signal one is used as is.
* ``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]TIMEOUT`` (``10000``): milliseconds, as the specification says
  (the Python SDK alone reads seconds); a value under 100 is used and warned about.
* ``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]COMPRESSION`` (``none``): ``none``, ``gzip`` or ``deflate``.
* ``OTEL_BSP_SCHEDULE_DELAY`` (fitted to the measured step time, ``batch_delay.py``): milliseconds > 0.
* ``OTEL_BSP_MAX_QUEUE_SIZE`` (``2048``): 1 .. ``MAX_QUEUE_SIZE``; ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``
  (``512``): 1 .. the queue size; ``OTEL_BSP_EXPORT_TIMEOUT`` (``30000``, kept unused by the SDK).
* ``OTEL_METRIC_EXPORT_INTERVAL`` (``60000``), ``OTEL_METRIC_EXPORT_TIMEOUT`` (``30000``): milliseconds > 0.

* ``OTEL_TRACES_SAMPLER``, ``OTEL_TRACES_SAMPLER_ARG``: not applied. The detector compares every step of every rank;
  a sampler that drops spans (``traceidratio``, ``always_off``) would starve it, so the export side samples with
  its own ``ALWAYS_ON`` and logs once that a thinning sampler of the application's is not applied to it (the
  emitter's own sampling is ``OTEL_STRAGGLER_DEVICE_EVERY``, which keeps every span).

A per-signal variable wins over the general one, as in the SDK. Headers, ``INSECURE`` and the TLS file
variables (and their per-signal variants) are left to the SDK, which never fails on them;
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` are read by ``identity`` and the SDK's resource.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from otel_straggler.config import info_once, warn_once

GRPC = "grpc"
HTTP_PROTOBUF = "http/protobuf"
HTTP_JSON = "http/json"
OTLP = "otlp"
NONE = "none"
COMPRESSIONS = ("none", "gzip", "deflate")
DEFAULT_ENDPOINTS = {GRPC: "http://localhost:4317", HTTP_PROTOBUF: "http://localhost:4318"}
SIGNAL_PATHS = {"TRACES": "v1/traces", "METRICS": "v1/metrics"}
DEFAULT_TIMEOUT_MS = 10_000.0
DEFAULT_QUEUE_SIZE = 2048
DEFAULT_BATCH_SIZE = 512
DEFAULT_BSP_EXPORT_TIMEOUT_MS = 30_000
DEFAULT_METRIC_INTERVAL_MS = 60_000
DEFAULT_METRIC_TIMEOUT_MS = 30_000
MAX_QUEUE_SIZE = 1 << 17  # spans held by the batch processor (~1-3 KB each)
MAX_DELAY_MS = 3_600_000  # any delay or timeout above one hour is a mistake
SUSPICIOUS_TIMEOUT_MS = 100.0  # below: probably meant as seconds (warned, used as milliseconds)

# Every variable this module resolves; the export child is started without them (see ``child_env``).
RESOLVED = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    *(f"OTEL_EXPORTER_OTLP_{sig}{key}" for sig in ("", "TRACES_", "METRICS_")
      for key in ("PROTOCOL", "ENDPOINT", "TIMEOUT", "COMPRESSION")),
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    "OTEL_BSP_EXPORT_TIMEOUT",
    "OTEL_METRIC_EXPORT_INTERVAL",
    "OTEL_METRIC_EXPORT_TIMEOUT",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)
# Samplers that keep every span: anything else set in OTEL_TRACES_SAMPLER is reported as not applied.
KEEP_ALL_SAMPLERS = ("always_on", "parentbased_always_on")


@dataclass(frozen=True, slots=True)
class SignalSettings:
    """How one signal (traces or metrics) is exported."""

    exporter: str = OTLP  # otlp | none
    protocol: str = GRPC  # grpc | http/protobuf
    endpoint: str = DEFAULT_ENDPOINTS[GRPC]  # as the exporter takes it (HTTP: the full signal URL)
    timeout_s: float = DEFAULT_TIMEOUT_MS / 1000.0
    compression: str = "none"


@dataclass(frozen=True, slots=True)
class OtelSettings:
    sdk_disabled: bool = False
    traces: SignalSettings = SignalSettings()
    metrics: SignalSettings = SignalSettings()
    bsp_schedule_delay_ms: int | None = None  # None: fitted to the measured step time (batch_delay.py)
    bsp_max_queue_size: int = DEFAULT_QUEUE_SIZE
    bsp_max_export_batch_size: int = DEFAULT_BATCH_SIZE
    bsp_export_timeout_ms: int = DEFAULT_BSP_EXPORT_TIMEOUT_MS
    metric_export_interval_ms: int = DEFAULT_METRIC_INTERVAL_MS
    metric_export_timeout_ms: int = DEFAULT_METRIC_TIMEOUT_MS
    errors: tuple[str, ...] = ()  # the variables that fell back to their default

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, warn: bool = True) -> OtelSettings:
        """Resolve and validate; with ``warn`` each bad variable is logged once per process."""
        return _Reader(os.environ if env is None else env, warn).settings()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OtelSettings:
        values = dict(d)
        for sig in ("traces", "metrics"):
            values[sig] = SignalSettings(**values.get(sig, {}))
        values["errors"] = tuple(values.get("errors", ()))
        return cls(**values)


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the variables resolved here: the child builds the SDK objects from the header."""
    return {k: v for k, v in env.items() if k not in RESOLVED}


class _Reader:
    def __init__(self, env: Mapping[str, str], warn: bool) -> None:
        self.env = env
        self.warn = warn
        self.errors: list[str] = []

    def _get(self, name: str) -> str | None:
        v = self.env.get(name)
        return None if v is None or not v.strip() else v.strip()

    def _bad(self, name: str, why: str, instead: Any) -> None:
        self.errors.append(name)
        if self.warn:  # the value itself is never logged: header-like values may carry secrets
            shown = instead if isinstance(instead, str) and " " in instead else f"the default {instead!r}"
            warn_once(name, f"otel-straggler: {name} is invalid ({why}); using {shown}")

    def _parse(self, name: str, parse: Callable[[str], Any], default: Any, instead: Any = None) -> Any:
        """``parse`` the variable; when it is unset or bad: ``default`` (a bad one is warned about as being
        replaced by ``instead``, by default the default)."""
        raw = self._get(name)
        if raw is None:
            return default
        try:
            return parse(raw)
        except (ValueError, TypeError, OverflowError) as exc:
            self._bad(name, str(exc) or type(exc).__name__, default if instead is None else instead)
            return default

    def _signal_var(self, sig: str, key: str) -> str:
        """The per-signal variable when it is set, else the general one (the SDK's precedence)."""
        specific = f"OTEL_EXPORTER_OTLP_{sig}_{key}"
        return specific if self._get(specific) is not None else f"OTEL_EXPORTER_OTLP_{key}"

    # --- one signal ------------------------------------------------------------------------------
    def _exporter(self, name: str) -> str:
        raw = self._get(name)
        if raw is None:
            return OTLP
        items = [x.strip().lower() for x in raw.split(",") if x.strip()]
        if items == [NONE]:
            return NONE
        if OTLP not in items or len(items) > 1:
            self._bad(name, "only otlp and none are supported here", OTLP)
        return OTLP

    def _protocol(self, name: str) -> str:
        raw = self._get(name)
        if raw is None:
            return GRPC
        value = raw.lower()
        if value in (GRPC, HTTP_PROTOBUF):
            return value
        if value == HTTP_JSON:
            self._bad(name, "http/json is not supported", "http/protobuf (same endpoint)")
            return HTTP_PROTOBUF
        self._bad(name, "must be grpc or http/protobuf", GRPC)
        return GRPC

    def _timeout_s(self, name: str) -> float:
        ms = self._parse(name, _positive_ms, DEFAULT_TIMEOUT_MS)
        if ms < SUSPICIOUS_TIMEOUT_MS and self.warn and self._get(name) is not None:
            warn_once(name + ":unit", f"otel-straggler: {name}={ms:g} is read as milliseconds (the OpenTelemetry "
                                      "specification); exports give up after that long")
        return float(ms) / 1000.0

    def _endpoint(self, sig: str, protocol: str) -> str:
        """The per-signal endpoint as is, else the general one (HTTP: plus the signal path); both validated."""
        base = self._parse("OTEL_EXPORTER_OTLP_ENDPOINT", lambda v: _url(v, protocol), DEFAULT_ENDPOINTS[protocol],
                           "the protocol's default endpoint")
        specific = self._parse(f"OTEL_EXPORTER_OTLP_{sig}_ENDPOINT", lambda v: _url(v, protocol), None,
                               "OTEL_EXPORTER_OTLP_ENDPOINT or its default")
        if specific is not None:
            return specific
        return base if protocol == GRPC else f"{base.removesuffix('/')}/{SIGNAL_PATHS[sig]}"

    def _signal(self, sig: str) -> SignalSettings:
        exporter = self._exporter(f"OTEL_{sig}_EXPORTER")
        protocol = self._protocol(self._signal_var(sig, "PROTOCOL"))
        return SignalSettings(
            exporter=exporter,
            protocol=protocol,
            endpoint=self._endpoint(sig, protocol),
            timeout_s=self._timeout_s(self._signal_var(sig, "TIMEOUT")),
            compression=self._parse(self._signal_var(sig, "COMPRESSION"), _compression, "none"),
        )

    def settings(self) -> OtelSettings:
        disabled = self._parse("OTEL_SDK_DISABLED", _bool, False)
        sampler = (self._get("OTEL_TRACES_SAMPLER") or "").lower()
        if sampler and sampler not in KEEP_ALL_SAMPLERS and self.warn:
            info_once("OTEL_TRACES_SAMPLER",
                      f"otel-straggler: OTEL_TRACES_SAMPLER={sampler} is not applied to the straggler spans (the "
                      "detector needs every step of every rank); they are sampled always_on")
        traces, metrics = self._signal("TRACES"), self._signal("METRICS")
        queue = self._parse("OTEL_BSP_MAX_QUEUE_SIZE", _int_in(1, MAX_QUEUE_SIZE), DEFAULT_QUEUE_SIZE)
        batch_default = min(DEFAULT_BATCH_SIZE, queue)
        batch = self._parse("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", _int_in(1, MAX_QUEUE_SIZE), batch_default)
        if batch > queue:
            self._bad("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "larger than OTEL_BSP_MAX_QUEUE_SIZE", batch_default)
            batch = batch_default
        return OtelSettings(
            sdk_disabled=disabled,
            traces=traces,
            metrics=metrics,
            bsp_schedule_delay_ms=self._parse("OTEL_BSP_SCHEDULE_DELAY", _int_in(1, MAX_DELAY_MS), None),
            bsp_max_queue_size=queue,
            bsp_max_export_batch_size=batch,
            bsp_export_timeout_ms=self._parse("OTEL_BSP_EXPORT_TIMEOUT", _int_in(1, MAX_DELAY_MS),
                                              DEFAULT_BSP_EXPORT_TIMEOUT_MS),
            metric_export_interval_ms=self._parse("OTEL_METRIC_EXPORT_INTERVAL", _int_in(1, MAX_DELAY_MS),
                                                  DEFAULT_METRIC_INTERVAL_MS),
            metric_export_timeout_ms=self._parse("OTEL_METRIC_EXPORT_TIMEOUT", _int_in(1, MAX_DELAY_MS),
                                                 DEFAULT_METRIC_TIMEOUT_MS),
            errors=tuple(dict.fromkeys(self.errors)),
        )


# --- value parsers (raise ValueError on a bad value) ---------------------------------------------------
def _bool(v: str) -> bool:
    s = v.lower()
    if s in ("true", "false"):
        return s == "true"
    raise ValueError("must be true or false")


def _number(v: str, kind: type[int] | type[float]) -> Any:
    try:
        return kind(v)
    except ValueError:
        raise ValueError("not a number") from None  # the message would repeat the value


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(v: str) -> int:
        x = _number(v, int)
        if not lo <= x <= hi:
            raise ValueError(f"must be an integer in [{lo}, {hi}]")
        return x

    return parse


def _positive_ms(v: str) -> float:
    x = _number(v, float)
    if not (0.0 < x <= MAX_DELAY_MS) or math.isnan(x):
        raise ValueError(f"must be milliseconds in (0, {MAX_DELAY_MS}]")
    return x


def _compression(v: str) -> str:
    s = v.lower()
    if s not in COMPRESSIONS:
        raise ValueError(f"must be one of {', '.join(COMPRESSIONS)}")
    return s


def _url(v: str, protocol: str) -> str:
    """An http(s) URL with a host and a valid port; gRPC also takes ``host:port`` (as the SDK does)."""
    probe = v if "://" in v or protocol != GRPC else f"//{v}"
    parts = urlsplit(probe)  # ValueError on e.g. an unclosed IPv6 bracket
    if "://" in v and parts.scheme not in ("http", "https"):
        raise ValueError("the scheme must be http or https")
    if "://" not in v and protocol != GRPC:
        raise ValueError("an http(s):// URL is required")
    if not parts.hostname:
        raise ValueError("no host")
    _ = parts.port  # ValueError for a port that is not a number in 0..65535
    return v

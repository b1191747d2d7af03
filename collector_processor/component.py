"""What the collector core knows of its components: the OTel Collector's kinds (receiver, processor, exporter,
connector) and the capabilities a component declares by the methods it has.

The core never asks what a component *is*, only what it *can do*: the service builds pipelines from these
Protocols (``runtime_checkable``, checked once at build time), so a plugin needs no import of, and no special case
in, the core. Requests travel as OTLP protobuf messages; a connector's output travels as an ``EventBatch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from google.protobuf.message import Message


@runtime_checkable
class Component(Protocol):
    def start(self) -> None: ...

    def shutdown(self, timeout_s: float = 5.0) -> None: ...


# ---- processors ---------------------------------------------------------------------------------------------
# A processor handles the signals it has a ``process_<signal>`` method for; the pipeline worker calls it, one call
# at a time per instance. It returns the (possibly mutated) request to pass on, or None to drop it.


@runtime_checkable
class TracesProcessor(Protocol):
    def process_traces(self, request: Message) -> Message | None: ...


@runtime_checkable
class MetricsProcessor(Protocol):
    def process_metrics(self, request: Message) -> Message | None: ...


@runtime_checkable
class LogsProcessor(Protocol):
    def process_logs(self, request: Message) -> Message | None: ...


@runtime_checkable
class Ticking(Protocol):
    """Called by the pipeline worker at least every ``pipeline.TICK_S`` with the wall-clock time."""

    def tick(self, now_s: float) -> None: ...


@runtime_checkable
class ReportsRejections(Protocol):
    """Items of the last ``process_*`` call the processor refused; the receiver reports them as a partial
    success."""

    last_rejected: int


@dataclass(frozen=True)
class Refusal:
    """Why a request is not taken now: the receiver answers 503 / UNAVAILABLE with its retry delay (``retry``) or,
    for a request that could never be taken, 413 / RESOURCE_EXHAUSTED.

    Where it is counted depends on when it comes. Before decoding (a gate's ``reserve``, a receiver out of slots)
    the items are unknown: the request is counted in ``requests_total{outcome="throttled"|"too_large"}`` only. At
    submit (``refusal``, a full queue) the request is counted in ``requests_total{outcome="throttled"}`` and, for
    traces, its spans in ``spans_dropped_total{reason}``."""

    reason: str  # the label of spans_dropped_total when refused at submit
    message: str
    retry: bool = True


@runtime_checkable
class Admission(Protocol):
    """A processor that gates what enters its pipelines (the memory limiter). ``reserve`` is asked before a
    request is read or decoded, with the memory that decoding may take; every successful ``reserve`` is followed by
    one ``release`` of the same amount once the decoded request exists (or decoding failed)."""

    def reserve(self, nbytes: int) -> Refusal | None: ...

    def refusal(self) -> Refusal | None:
        """Whether a decoded request is refused now (asked by the pipeline as it is submitted); reserves nothing."""
        ...

    def release(self, nbytes: int) -> None: ...

    def hold(self, nbytes: int) -> None:
        """Count memory a receiver is about to hold whatever the limit (it bounds that itself, by ``budget``);
        undone by ``release``."""
        ...

    def budget(self) -> int:
        """What requests in flight may take in all (bytes): a receiver sizes what it buffers by it."""
        ...


# ---- exporters ----------------------------------------------------------------------------------------------


@runtime_checkable
class TracesExporter(Protocol):
    def export_traces(self, request: Message) -> None: ...


@runtime_checkable
class MetricsExporter(Protocol):
    def export_metrics(self, request: Message) -> None: ...


@runtime_checkable
class LogsExporter(Protocol):
    def export_logs(self, request: Message) -> None: ...


@runtime_checkable
class EventBatch(Protocol):
    """Structured events a connector puts into ``logs`` pipelines: each one as a JSON-safe record, a one-line
    summary and, for OTLP exporters, an OTLP logs request."""

    def __len__(self) -> int: ...

    def records(self) -> list[dict[str, object]]: ...

    def console_lines(self) -> list[tuple[int, str]]:
        """One (logging level, line) per event: how a console shows it."""
        ...

    def to_logs(self) -> Message: ...


@runtime_checkable
class EventsExporter(Protocol):
    """An exporter that takes events as records rather than OTLP logs (JSONL evidence, console lines)."""

    def export_events(self, batch: EventBatch) -> None: ...


# ---- connectors ---------------------------------------------------------------------------------------------


@runtime_checkable
class Connector(Protocol):
    """The exporter of one pipeline and the receiver of others (otelcol's connector). It is handed what the
    processors of its upstream pipelines emit beside their data (``consume``) and forwards events downstream
    through the ``forward`` function the service gives its factory."""

    def consume(self, items: list[Any]) -> None: ...


Emit = Callable[[list[Any]], None]  # what a processor is given to emit side output (e.g. verdicts) with
Forward = Callable[[EventBatch], None]  # what a connector is given to feed its downstream pipelines with


# ---- receivers and servers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """An address a component listens on, as logged at start (``listening: <component> <what> <address>``)."""

    component: str
    what: str  # OTLP/GRPC, OTLP/HTTP, metrics
    host: str
    port: int
    url: str = ""  # shown instead of host:port when set
    serves_telemetry: bool = False  # serves the collector's own metrics registry

    def __str__(self) -> str:
        return f"{self.component} {self.what} {self.url or f'{self.host}:{self.port}'}"


@runtime_checkable
class Serving(Protocol):
    """A component that listens on the network (receivers, the prometheus exporter)."""

    def endpoints(self) -> list[Endpoint]: ...


@runtime_checkable
class Receiver(Protocol):
    def stop_accepting(self, grace_s: float) -> None:
        """Refuse new requests; let in-flight ones finish within ``grace_s``."""
        ...

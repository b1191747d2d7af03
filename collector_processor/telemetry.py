"""Self-telemetry of the collector: one Prometheus registry shared by every component.

Names come from ``otel_straggler_schema`` (the contract); components increment these instruments and
the ``prometheus`` exporter serves the registry on ``/metrics``.

Every counter exists at 0 from the start with each label value known in advance, so a ``rate()`` or
``increase()`` sees the first event: the schema's reason lists here, and each component's own id where it is built
(receivers: ``spans_received``, ``requests`` by outcome, ``unauthenticated``; ``/metrics`` servers:
``unauthenticated``; pipelines: ``export_failures`` of their exporters, ``component_errors`` of their processors,
their queue's ``evictions``; components: the structures they evict from). Nothing else is pre-created, so the
series stay bounded by the configuration.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Exemplar, Metric, Sample

import otel_straggler_schema as s


def _base(name: str) -> str:
    """prometheus_client appends ``_total`` to counters itself."""
    return name.removesuffix("_total")


EXEMPLAR_LABEL = "trace_id"


def add_sample(fam: Metric, names: Sequence[str], values: Sequence[str], value: float, trace_id: str = "") -> None:
    """One series of ``fam``: labels whose value is empty are left out (Prometheus treats an empty value as no
    label, and dashboards match on presence), ``trace_id`` becomes the sample's exemplar."""
    labels = {n: v for n, v in zip(names, values, strict=True) if v != ""}
    exemplar = Exemplar({EXEMPLAR_LABEL: trace_id}, value) if trace_id else None
    suffix = "_total" if fam.type == "counter" else ""
    fam.samples.append(Sample(fam.name + suffix, labels, value, None, exemplar))


class Telemetry:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.spans_received = Counter(_base(s.M_SPANS_RECEIVED), "Spans received", ["receiver"], registry=r)
        self.spans_accepted = Counter(_base(s.M_SPANS_ACCEPTED), "Stage spans used by the detector", registry=r)
        self.spans_rejected = Counter(_base(s.M_SPANS_REJECTED), "Spans rejected", ["reason"], registry=r)
        self.spans_dropped = Counter(_base(s.M_SPANS_DROPPED), "Spans dropped", ["reason"], registry=r)
        self.requests = Counter(_base(s.M_REQUESTS), "Requests by outcome", ["receiver", "outcome"], registry=r)
        self.queue_depth = Gauge(s.M_QUEUE_DEPTH, "Items waiting per queue", ["queue"], registry=r)
        self.evictions = Counter(_base(s.M_EVICTIONS), "Entries evicted from capped structures", ["structure"],
                                 registry=r)
        self.windows_closed = Counter(_base(s.M_WINDOWS_CLOSED), "Windows judged", registry=r)
        self.processing_seconds = Histogram(
            s.M_PROCESSING_SECONDS, "Processing time per request", registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.export_failures = Counter(_base(s.M_EXPORT_FAILURES), "Failed exports", ["exporter"], registry=r)
        self.exporter_enqueued = Counter(_base(s.M_EXPORTER_ENQUEUED), "Items taken into an exporter's queue",
                                         ["exporter", "signal"], registry=r)
        self.exporter_sent = Counter(_base(s.M_EXPORTER_SENT), "Items an exporter delivered",
                                     ["exporter", "signal"], registry=r)
        self.exporter_failed = Counter(_base(s.M_EXPORTER_FAILED), "Items an exporter did not deliver",
                                       ["exporter", "signal", "reason"], registry=r)
        self.exporter_queued = Gauge(s.M_EXPORTER_QUEUED, "Items queued or being sent by an exporter",
                                     ["exporter", "signal"], registry=r)
        self.evidence_lines = Counter(_base(s.M_EVIDENCE_LINES), "JSONL evidence lines written", registry=r)
        self.unauthenticated = Counter(_base(s.M_UNAUTHENTICATED), "Requests refused for credentials",
                                       ["endpoint"], registry=r)
        self.connections_closed = Counter(_base(s.M_CONNECTIONS_CLOSED), "Connections or calls ended by the "
                                          "connection budget", ["receiver", "reason"], registry=r)
        self.tenant_refused = Counter(_base(s.M_TENANT_REFUSED), "Requests naming a job their token may not write",
                                      ["receiver"], registry=r)
        self.duplicate_identity = Counter(_base(s.M_DUPLICATE_IDENTITY), "Requests naming an identity attribute "
                                          "twice in one resource", ["receiver"], registry=r)
        self.tenant_evictions = Counter(_base(s.M_TENANT_EVICTIONS), "State of a tenant's jobs evicted to make room",
                                        ["tenant", "structure"], registry=r)
        self.memory_bytes = Gauge(s.M_MEMORY_BYTES, "Process RSS seen by the memory limiter", registry=r)
        self.admitted_bytes = Gauge(s.M_ADMITTED_BYTES, "Largest body admitted whatever it holds, when idle",
                                    ["receiver"], registry=r)
        self.inline_deferred = Counter(_base(s.M_INLINE_DEFERRED), "Requests queued because the pipeline's budget "
                                       "for processing on a receiver's event loop was spent", ["pipeline"],
                                       registry=r)
        self.component_errors = Counter(_base(s.M_COMPONENT_ERRORS), "Exceptions caught in components",
                                        ["component"], registry=r)
        for reason in s.COLLECTOR_DROPPED_REASONS:
            self.spans_dropped.labels(reason)
        for reason in s.COLLECTOR_REJECTED_REASONS:
            self.spans_rejected.labels(reason)

    def receiver(self, label: str) -> None:
        """The series of one receiver endpoint (``otlp/grpc``), at 0."""
        self.spans_received.labels(label)
        for outcome in s.COLLECTOR_REQUEST_OUTCOMES:
            self.requests.labels(label, outcome)
        self.unauthenticated.labels(label)
        self.tenant_refused.labels(label)
        self.duplicate_identity.labels(label)
        for reason in s.COLLECTOR_CONNECTION_CLOSE_REASONS:
            self.connections_closed.labels(label, reason)

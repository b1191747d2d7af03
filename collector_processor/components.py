"""The components of this collector distribution (what otelcol's builder writes into ``components.go``): the core's
OTLP receiver, memory limiter, span filter and exporters, and the straggler plugin's processor and connector. This
is the one module that names them; the core (service, pipelines, config) only sees the ``Factories`` it returns."""

from __future__ import annotations

from collector_processor.registry import Factories


def factories() -> Factories:
    from collector_processor.exporter import debug, evidence, otlp, prometheus
    from collector_processor.processor import filter as span_filter
    from collector_processor.processor import memory_limiter
    from collector_processor.processor.straggler import factory as straggler
    from collector_processor.receiver import otlp as otlp_receiver

    return Factories([
        otlp_receiver.FACTORY,
        memory_limiter.FACTORY,
        span_filter.FACTORY,
        straggler.PROCESSOR,
        straggler.CONNECTOR,
        otlp.GRPC_FACTORY,
        otlp.HTTP_FACTORY,
        prometheus.FACTORY,
        evidence.FACTORY,
        debug.FACTORY,
    ])


_default: Factories | None = None


def default_factories() -> Factories:
    """The factories of this distribution, made on first use."""
    global _default
    if _default is None:
        _default = factories()
    return _default

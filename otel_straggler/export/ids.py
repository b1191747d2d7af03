"""Span/trace ids: the step spans carry ids derived from (job, step, rank); every other span is random.

The SDK tracer asks its ``IdGenerator`` for ids inside ``start_span``. ``PresetIdGenerator`` hands out a
queued id when the caller set one for the next span (thread-local), else a random one, so deterministic
ids go through the stock SDK path (sampler, processors, exporters) unchanged.
"""

from __future__ import annotations

import threading

from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator


class PresetIdGenerator(IdGenerator):
    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self._local = threading.local()

    def preset(self, *, span_id: int | None = None, trace_id: int | None = None) -> None:
        """Ids for the next span started on this thread (each is used once)."""
        self._local.span_id = span_id
        self._local.trace_id = trace_id

    def clear(self) -> None:
        self._local.span_id = None
        self._local.trace_id = None

    def generate_span_id(self) -> int:
        span_id = getattr(self._local, "span_id", None)
        if span_id is not None:
            self._local.span_id = None
            return span_id
        return self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        trace_id = getattr(self._local, "trace_id", None)
        if trace_id is not None:
            self._local.trace_id = None
            return trace_id
        return self._random.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return False

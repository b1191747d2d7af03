"""The valid client of the hostile benches: one OTel SDK exporter sending 20 stage spans of a valid tenant's job
every 0.25 s until stopped, each export's outcome handed to ``record(started, ended, succeeded)``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def export_valid_spans(rank: int, exporter, stop: threading.Event,  # type: ignore[no-untyped-def]
                       record: Callable[[float, float, bool], None]) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import otel_straggler_schema as s

    mem = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create({s.RES_RANK: rank, s.RES_JOB_ID: "valid-job",
                                                  s.RES_COHORT_KEY: "valid"}), shutdown_on_exit=False)
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer(s.SCOPE_NAME)
    step = 0
    while not stop.is_set():
        tid = s.trace_id_for_step("valid-job", step, "", s.trace_block(rank))  # the step's trace, as ranks send
        parent = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
            tid, s.step_root_span_id(tid), is_remote=True, trace_flags=trace.TraceFlags(1))))
        for _ in range(20):
            with tracer.start_as_current_span("forward-compute", context=parent, attributes={
                    s.ATTR_STAGE: "forward-compute", s.ATTR_ITERATION: step, s.ATTR_HOST_MS: 10.0}):
                pass
        step += 1
        spans = list(mem.get_finished_spans())
        mem.clear()
        started = time.monotonic()
        ok = exporter.export(spans) == SpanExportResult.SUCCESS
        record(started, time.monotonic(), ok)
        stop.wait(0.25)

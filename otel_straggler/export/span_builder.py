"""Span records -> SDK spans with the schema's deterministic step ids and parents.

A rank's spans of a step go in its block's step trace (``schema.trace_block``: 64 consecutive ranks a trace); the
``train-step`` root of a block other than 0 links to block 0's root, so a viewer can walk from any block to the
job's first.

Stage spans come from the stage tracer (scope ``otel-straggler``), the step spans (``train-step``,
``rank-step``) from the step tracer (scope ``otel-straggler.step``), so a collector finds the step summaries
without decoding stage spans."""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, TraceFlags

import otel_straggler_schema as schema
from otel_straggler.export.aggregate import KIND_JOB_STEP, KIND_RANK_STEP, SpanRecord
from otel_straggler.export.ids import PresetIdGenerator

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def _parent(trace_id: int, span_id: int) -> object:
    ctx = SpanContext(trace_id=trace_id, span_id=span_id, is_remote=True, trace_flags=_SAMPLED)
    return trace.set_span_in_context(NonRecordingSpan(ctx))


class SpanBuilder:
    def __init__(self, tracer: trace.Tracer, ids: PresetIdGenerator, *, job_id: str, rank: int,
                 step_tracer: trace.Tracer, run_id: str = "") -> None:
        self._tracer = tracer
        self._step_tracer = step_tracer
        self._ids = ids
        self.job_id = str(job_id)
        self.run_id = str(run_id)
        self.rank = int(rank)
        self.block = schema.trace_block(self.rank)
        self._step_cache: tuple[int, int, int, int] | None = None  # step, trace id, job span, rank span

    def _step_ids(self, step: int) -> tuple[int, int, int]:
        cached = self._step_cache
        if cached is not None and cached[0] == step:
            return cached[1], cached[2], cached[3]
        job, run = self.job_id, self.run_id
        tid = schema.trace_id_for_step(job, step, run, self.block)
        jid = schema.step_root_span_id(tid)
        rid = schema.rank_step_span_id(job, step, self.rank, run)
        self._step_cache = (step, tid, jid, rid)
        return tid, jid, rid

    def _first_block_root(self, step: int) -> Link:
        tid = schema.trace_id_for_step(self.job_id, step, self.run_id)
        return Link(SpanContext(trace_id=tid, span_id=schema.step_root_span_id(tid), is_remote=True,
                                trace_flags=_SAMPLED))

    def build(self, records: Iterable[SpanRecord]) -> int:
        n = 0
        for rec in records:
            tid, jid, rid = self._step_ids(rec.step)
            tracer = self._step_tracer
            links: list[Link] | None = None
            if rec.kind == KIND_JOB_STEP:
                self._ids.preset(span_id=jid, trace_id=tid)
                ctx = trace.set_span_in_context(trace.INVALID_SPAN)  # a root: ignore any ambient context
                if self.block:
                    links = [self._first_block_root(rec.step)]
            elif rec.kind == KIND_RANK_STEP:
                self._ids.preset(span_id=rid)
                ctx = _parent(tid, jid)
            else:
                self._ids.clear()
                ctx = _parent(tid, rid)
                tracer = self._tracer
            try:
                span = tracer.start_span(
                    rec.name, context=ctx, start_time=rec.start_ns, attributes=rec.attributes, links=links
                )
                span.end(end_time=max(rec.end_ns, rec.start_ns))
            finally:
                self._ids.clear()
            n += 1
        return n

"""Span building through the real SDK (ThreadSink, in-memory and failing exporters): ids, parents,
resource, and the silent SDK drops made visible."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import pytest
from export_rank_driver import identity, make_intervals
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_straggler_schema as schema
from otel_straggler.config import DEFAULTS
from otel_straggler.export.thread_sink import ThreadSink


def sink_for(rank: int, exporter: SpanExporter, job: str = "job-a", world: int = 4, **settings) -> ThreadSink:
    """A ThreadSink of ``rank`` of ``world``; ``settings`` are ``EmitterConfig`` fields."""
    ident = identity(rank, world, job)
    return ThreadSink(ident.resource_attributes(), rank=rank, job_id=job, config=replace(DEFAULTS, **settings),
                      span_exporter=exporter, metric_exporter=None)


@pytest.fixture(autouse=True)
def _no_metrics_export(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")


def test_ids_parents_and_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,dl.rank=99")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    mem0, mem2 = InMemorySpanExporter(), InMemorySpanExporter()
    s0, s2 = sink_for(0, mem0), sink_for(2, mem2)
    for step in (10, 11):
        s0.submit(make_intervals(0, step))
        s2.submit(make_intervals(2, step))
    assert s0.flush(5.0) and s2.flush(5.0)
    spans0, spans2 = mem0.get_finished_spans(), mem2.get_finished_spans()
    assert [s.name for s in spans2].count(schema.SPAN_JOB_STEP) == 0
    for step in (10, 11):
        tid = schema.trace_id_for_step("job-a", step)
        (root,) = [s for s in spans0 if s.name == schema.SPAN_JOB_STEP and s.attributes[schema.ATTR_ITERATION] == step]
        assert root.context.trace_id == tid and root.context.span_id == schema.job_step_span_id("job-a", step)
        assert root.parent is None
        for rank, spans in ((0, spans0), (2, spans2)):
            mine = [
                s for s in spans if s.attributes.get(schema.ATTR_ITERATION) == step and s.name != schema.SPAN_JOB_STEP
            ]
            (rs,) = [s for s in mine if s.name == schema.SPAN_RANK_STEP]
            assert rs.context.span_id == schema.rank_step_span_id("job-a", step, rank)
            assert rs.parent.span_id == root.context.span_id and rs.context.trace_id == tid
            stages = [s for s in mine if s.name != schema.SPAN_RANK_STEP]
            assert sorted(s.name for s in stages) == ["backward-compute", "forward-compute", "optimizer"]
            for s in stages:
                assert s.context.trace_id == tid and s.parent.span_id == rs.context.span_id
                assert s.start_time >= rs.start_time and s.end_time <= rs.end_time
    res = spans2[0].resource.attributes
    assert res[schema.RES_RANK] == 2  # identity wins over OTEL_RESOURCE_ATTRIBUTES
    assert res["deployment.environment"] == "test"
    assert res[schema.RES_SERVICE_NAME] == "megatron-training"
    assert res[schema.RES_STEP_SUMMARY] is True
    scopes = {s.name: s.instrumentation_scope.name for s in spans2}
    assert scopes[schema.SPAN_RANK_STEP] == schema.SCOPE_STEP_NAME
    assert {v for k, v in scopes.items() if k != schema.SPAN_RANK_STEP} == {schema.SCOPE_NAME}
    s0.shutdown(2.0)
    s2.shutdown(2.0)


def test_a_step_is_one_trace_per_block_of_64_ranks_each_rooted_by_its_first_rank() -> None:
    """Ranks 0, 63, 64 and 130 of a 256-rank job: ranks 0-63 share block 0's trace under rank 0's root; rank 64
    roots block 1's trace (linked to block 0's root) and rank 130 sits in block 2's, whose root another rank sends."""
    ranks = (0, 63, 64, 130)
    mems = {r: InMemorySpanExporter() for r in ranks}
    sinks = {r: sink_for(r, mems[r], world=256) for r in ranks}
    for r, sink in sinks.items():
        sink.submit(make_intervals(r, 5))
    for sink in sinks.values():
        assert sink.flush(5.0)
    spans = {r: mems[r].get_finished_spans() for r in ranks}
    roots = {r: [sp for sp in spans[r] if sp.name == schema.SPAN_JOB_STEP] for r in ranks}
    assert [len(roots[r]) for r in ranks] == [1, 0, 1, 0]
    for r in ranks:
        block = schema.trace_block(r)
        tid = schema.trace_id_for_step("job-a", 5, block=block)
        root_id = schema.job_step_span_id("job-a", 5, block=block)
        assert {sp.context.trace_id for sp in spans[r]} == {tid}, r
        (rs,) = [sp for sp in spans[r] if sp.name == schema.SPAN_RANK_STEP]
        assert rs.parent.span_id == root_id and rs.context.span_id == schema.rank_step_span_id("job-a", 5, r)
        for root in roots[r]:
            assert root.context.span_id == root_id and root.parent is None
            assert root.attributes[schema.ATTR_TRACE_BLOCK] == block
    assert not roots[0][0].links
    (link,) = roots[64][0].links
    assert (link.context.trace_id, link.context.span_id) == (schema.trace_id_for_step("job-a", 5),
                                                             schema.job_step_span_id("job-a", 5))
    assert len({schema.trace_id_for_step("job-a", 5, block=b) for b in (0, 1, 2)}) == 3
    for sink in sinks.values():
        sink.shutdown(2.0)


def test_service_name_env_and_interval_detail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-train")
    mem = InMemorySpanExporter()
    sink = sink_for(1, mem, detail=schema.DETAIL_INTERVAL)
    sink.submit(make_intervals(1, 0))
    sink.flush(5.0)
    spans = mem.get_finished_spans()
    stages = [s for s in spans if s.name == "forward-compute"]
    assert sorted(s.attributes[schema.ATTR_MICROBATCH_ID] for s in stages) == [0, 1, 2]
    assert all(s.attributes[schema.ATTR_DETAIL] == schema.DETAIL_INTERVAL for s in stages)
    assert spans[0].resource.attributes[schema.RES_SERVICE_NAME] == "my-train"
    sink.shutdown(2.0)


@pytest.mark.parametrize(
    ("service_env", "expected"),
    [({"OTEL_RESOURCE_ATTRIBUTES": "team=llm,service.name=from%20attrs"}, "from attrs"),
     ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs", "OTEL_SERVICE_NAME": "from-name"}, "from-name"),
     ({"OTEL_RESOURCE_ATTRIBUTES": "team=llm"}, "megatron-training")],
)
def test_service_name_follows_the_specification(monkeypatch: pytest.MonkeyPatch, service_env: dict,
                                                 expected: str) -> None:
    """OTEL_SERVICE_NAME, else service.name in OTEL_RESOURCE_ATTRIBUTES, else the built-in default: in the
    identity resolved in the training process and on the exported resource."""
    from otel_straggler.identity import resolve_identity

    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    for k, v in service_env.items():
        monkeypatch.setenv(k, v)
    ident = resolve_identity(rank=0, world_size=1, job_id="svc", use_parallel_state=False)
    assert ident.service_name == expected
    mem = InMemorySpanExporter()
    sink = ThreadSink(ident.resource_attributes(), rank=0, job_id="svc", span_exporter=mem, metric_exporter=None)
    sink.submit(make_intervals(0, 0))
    assert sink.flush(5.0)
    assert {s.resource.attributes[schema.RES_SERVICE_NAME] for s in mem.get_finished_spans()} == {expected}
    sink.shutdown(2.0)


class BlockingExporter(SpanExporter):
    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(10)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def test_queue_full_drops_are_counted_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A span that finds the batch queue full is dropped and counted; every span is either exported or
    counted (the SDK's queue itself never overflows, where it would evict unseen). A fixed schedule delay:
    a fitted one may swap the SDK processor mid-test, and the retiring one holds its own batches (the swap is
    ``test_batch_delay.py``'s)."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "16")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "5000")
    exp = BlockingExporter()
    sink = sink_for(1, exp, detail=schema.DETAIL_INTERVAL)
    for step in range(10):  # 10 steps x (7 stage + 1 rank-step) = 80 spans, queue 16, exporter stuck
        sink.submit(make_intervals(1, step))
    sink.pipeline.close_steps()
    dropped = sink.counters.get("dropped_queue_full")
    assert sink.pipeline.providers.processor.swaps == 0
    assert 80 - 16 - 4 <= dropped <= 80 - 16  # the worker may hold one batch outside the queue
    exp.release.set()
    assert sink.flush(5.0)
    assert exp.exported + dropped == 80
    assert sink.counters.get("spans_exported") == exp.exported
    sink.shutdown(2.0)


class RaisingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        raise RuntimeError("exporter bug")

    def shutdown(self) -> None:
        return None


def test_raising_exporter_is_counted_and_caller_unaffected() -> None:
    sink = sink_for(0, RaisingExporter())
    for step in range(3):
        sink.submit(make_intervals(0, step))  # must not raise
    sink.flush(5.0)
    c = sink.counters.snapshot()
    assert c["dropped_export_failed"] == 3 * 5  # per step: train-step, rank-step, 3 stages
    assert c["faults_export"] >= 1 and c.get("spans_exported", 0) == 0
    t0 = time.monotonic()
    sink.shutdown(2.0)
    assert time.monotonic() - t0 < 2.0 + 20  # bounded (generous slack for a loaded machine)


def test_an_unreachable_endpoint_gets_one_line_from_this_package_pointing_at_doctor(
        caplog: pytest.LogCaptureFixture) -> None:
    """The real OTLP/gRPC exporter towards a port nobody listens on (1 s timeout): one warning from this package
    that names the endpoint and ``otel-straggler doctor``, however many batches fail; a working export again says
    so once."""
    import logging
    import socket

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    from otel_straggler.export.provider import Counters, CountingSpanExporter

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inner = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=1)
    counting = CountingSpanExporter(inner, Counters())
    caplog.set_level(logging.WARNING, logger="otel_straggler")
    tracer_spans = _two_spans()
    for _ in range(2):
        assert counting.export(tracer_spans) == SpanExportResult.FAILURE
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("otel_straggler")]
    assert len(ours) == 1, ours
    assert f"127.0.0.1:{port}" in ours[0] and "otel-straggler doctor" in ours[0]
    inner.shutdown()


def _two_spans() -> list:
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider()
    spans = []
    for name in ("a", "b"):
        with provider.get_tracer("t").start_as_current_span(name) as sp:
            spans.append(sp)
    return spans

"""End to end: several rank processes feed Intervals to real sinks that export through the real OTLP
exporters to a real receiver in the test (gRPC, and one run over OTLP/HTTP). Host-only timing: the
CUDA side cannot run here, so the Intervals are built directly (or come from the real Timers on CPU)."""

from __future__ import annotations

import importlib.util
import uuid

import pytest
from export_e2e_support import check_metrics, check_spans, otlp_env, run_ranks
from export_otlp_receiver import GrpcReceiver, HttpReceiver

import otel_straggler_schema as schema

pytestmark = pytest.mark.slow

WORLD = 3
STEPS = 4


@pytest.fixture
def grpc_receiver():
    rcv = GrpcReceiver()
    yield rcv
    rcv.stop()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_ranks_export_over_grpc(grpc_receiver: GrpcReceiver, mode: str) -> None:
    job = f"e2e-{mode}-{uuid.uuid4().hex[:6]}"
    results = run_ranks(otlp_env(grpc_receiver.endpoint), WORLD, job_id=job, mode=mode, steps=STEPS)
    for res in results:
        assert res["flush"] is True
        assert res["max_submit_ms"] < 5000  # never blocks (generous bound; latency: bench/emitter_cost.py)
        assert (res["child_pid"] is not None) == (mode == "process")
    check_spans(grpc_receiver.store, job, WORLD, STEPS)
    check_metrics(grpc_receiver.store, job, WORLD, STEPS)


def test_interval_detail_over_http_protobuf() -> None:
    rcv = HttpReceiver()
    try:
        job = f"e2e-http-{uuid.uuid4().hex[:6]}"
        env = otlp_env(rcv.endpoint, "http/protobuf")
        results = run_ranks(env, 2, job_id=job, mode="process", steps=2, detail=schema.DETAIL_INTERVAL)
        assert all(r["flush"] for r in results)
        check_spans(rcv.store, job, 2, 2, detail=schema.DETAIL_INTERVAL)
    finally:
        rcv.stop()


@pytest.mark.skipif(
    importlib.util.find_spec("otel_straggler.timers") is None,
    reason="otel_straggler.timers (training-thread side) is not in the tree",
)
def test_real_timers_end_to_end(grpc_receiver: GrpcReceiver) -> None:
    """The training side's real Timers (host-only on CPU: ``no_cuda``) -> readout -> ProcessSink -> OTLP.
    (Thread mode shares everything after the sink with the synthetic runs above.)"""
    mode = "process"
    job = f"e2e-timers-{mode}-{uuid.uuid4().hex[:6]}"
    world, steps = 2, 3
    results = run_ranks(otlp_env(grpc_receiver.endpoint), world, job_id=job, mode=mode, steps=steps, scenario="timers")
    assert all(r["shutdown_s"] < 5.0 + 20 for r in results)  # bounded by the 5 s shutdown timeout (+ load slack)
    spans = [s for s in grpc_receiver.store.spans() if s.r(schema.RES_JOB_ID) == job]
    for step in range(steps):
        tid = schema.trace_id_for_step(job, step)
        in_step = [s for s in spans if s.trace_id == tid]
        roots = [s for s in in_step if s.name == schema.SPAN_JOB_STEP]
        assert len(roots) == 1 and roots[0].span_id == schema.job_step_span_id(job, step)
        for rank in range(world):
            mine = [s for s in in_step if s.r(schema.RES_RANK) == rank and s.name != schema.SPAN_JOB_STEP]
            (rs,) = [s for s in mine if s.name == schema.SPAN_RANK_STEP]
            assert rs.span_id == schema.rank_step_span_id(job, step, rank) and rs.parent_span_id == roots[0].span_id
            stages = {s.name: s for s in mine if s.name != schema.SPAN_RANK_STEP}
            assert set(stages) == {"forward-backward", "forward-compute", "backward-compute", "optimizer"}
            for s in stages.values():
                assert s.parent_span_id == rs.span_id
                assert s.a(schema.ATTR_MEASUREMENT) == schema.MEASUREMENT_HOST_ONLY
                assert s.a(schema.ATTR_DEGRADED_REASON) == "no_cuda"
                assert s.a(schema.ATTR_WORKLOAD_TOKENS) == 1024 * (rank + 1)
            fwd, bwd = stages["forward-compute"], stages["backward-compute"]
            assert fwd.a(schema.ATTR_COUNT) == 3 and bwd.a(schema.ATTR_COUNT) == 3
            assert fwd.a(schema.ATTR_HOST_MS) >= 3 * 1.0 and bwd.a(schema.ATTR_HOST_MS) >= 3 * 2.0
            assert fwd.a(schema.ATTR_STAGE_GROUP) == "forward" and bwd.a(schema.ATTR_STAGE_GROUP) == "backward"
            assert stages["forward-backward"].a(schema.ATTR_HOST_MS) >= fwd.a(schema.ATTR_HOST_MS)
    for rank in range(world):
        assert grpc_receiver.store.wait_for(
            lambda r=rank: any(
                res.get(schema.RES_JOB_ID) == job
                and res.get(schema.RES_RANK) == r
                and name == schema.SM_INTERVALS
                and value == steps * 8
                for res, name, _, value in grpc_receiver.store.metric_points()
            ),
            10.0,
        ), rank

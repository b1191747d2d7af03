"""Shared helpers of the export end-to-end tests: run simulated ranks, check what a receiver got."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from export_otlp_receiver import ReceivedSpan, Store
from export_rank_driver import MICROBATCHES, make_intervals, stats_for

import otel_straggler_schema as schema

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DRIVER = HERE / "export_rank_driver.py"

INT_RESOURCE = {
    schema.RES_PROCESS_PID,
    schema.RES_RANK,
    schema.RES_WORLD_SIZE,
    schema.RES_LOCAL_RANK,
    schema.RES_GPU_INDEX,
    schema.RES_MODEL_CHUNK,
    schema.RES_TOPOLOGY_EPOCH,
    schema.RES_DP_RANK,
    schema.RES_DP_SIZE,
    *(k for pair in schema.COHORT_DIMENSIONS for k in pair),
}
STR_RESOURCE = {
    schema.RES_SERVICE_NAME,
    schema.RES_HOST_NAME,
    schema.RES_JOB_ID,
    schema.RES_GPU_UUID,
    schema.RES_GPU_PCI_BUS_ID,
    schema.RES_COHORT_KEY,
    schema.RES_STAGE_SCHEMA,
    schema.RES_SCHEMA_VERSION,
    schema.RES_HOT_PATH,
}


def otlp_env(endpoint: str, protocol: str = "grpc", **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
        OTEL_METRIC_EXPORT_INTERVAL="300",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_EXPORTER_OTLP_TIMEOUT="2000",  # milliseconds
        PYTHONPATH=str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
    )
    env.update(extra)
    return env


def start_rank(env: dict[str, str], **args: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(DRIVER), json.dumps(args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_ranks(env: dict[str, str], world: int, **args: Any) -> list[dict[str, Any]]:
    procs = [start_rank(env, rank=r, world=world, **args) for r in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def expected_stage(rank: int, step: int, name: str) -> dict[str, Any]:
    ivs = [i for i in make_intervals(rank, step) if i.name == name]
    host = sum((i.host_end_ns - i.host_start_ns) / 1e6 for i in ivs)
    dev = [i.device_ms for i in ivs if i.device_ms is not None]
    # a repeat degraded for another reason than sampling makes the stage host-only; repeats only sampled out leave
    # the measured ones' sum, scaled to every repeat
    other = next((i.degraded for i in ivs if i.device_ms is None and i.degraded != "sampled_out"), None)
    device = None if other or not dev else sum(dev) * len(ivs) / len(dev)
    return {
        "count": len(ivs),
        "host_ms": host,
        "device_ms": device,
        "device_repeats": len(dev),
        "degraded": other or (None if device is not None else "sampled_out"),
        "start": min(i.host_start_ns for i in ivs),
        "end": max(i.host_end_ns for i in ivs),
        "injected": any(i.injected for i in ivs),
    }


def check_resource(span: ReceivedSpan, rank: int, world: int, job: str, scope: str = schema.SCOPE_NAME) -> None:
    for key in INT_RESOURCE:
        assert span.resource[key][0] == "int_value", key
    for key in STR_RESOURCE:
        assert span.resource[key][0] == "string_value", key
    assert span.r(schema.RES_RANK) == rank and span.r(schema.RES_WORLD_SIZE) == world
    assert span.r(schema.RES_JOB_ID) == job and span.r(schema.RES_SERVICE_NAME) == "megatron-training"
    assert span.r(schema.RES_STEP_SUMMARY) is True
    assert span.scope == scope


def check_summary(rs: ReceivedSpan, rank: int, step: int) -> None:
    """The rank-step span's step summary: one entry per timer of the step, per-step aggregates (in both
    details), -1 for device time that not every interval of the entry had."""
    names = rs.a(schema.ATTR_SUMMARY_STAGES)
    assert rs.attrs[schema.ATTR_SUMMARY_STAGES][0] == "array_value"
    assert sorted(names) == sorted({i.name for i in make_intervals(rank, step)})
    groups = rs.a(schema.ATTR_SUMMARY_GROUPS)
    devs = rs.a(schema.ATTR_SUMMARY_DEVICE_MS)
    hosts = rs.a(schema.ATTR_SUMMARY_HOST_MS)
    counts = rs.a(schema.ATTR_SUMMARY_COUNTS)
    assert len(groups) == len(devs) == len(hosts) == len(counts) == len(names)
    for i, name in enumerate(names):
        exp = expected_stage(rank, step, name)
        assert counts[i] == exp["count"]
        assert hosts[i] == pytest.approx(exp["host_ms"])
        if exp["device_ms"] is None:
            assert devs[i] == schema.SUMMARY_NOT_MEASURED
        else:
            assert devs[i] == pytest.approx(exp["device_ms"])
        assert groups[i] == next(iv.group for iv in make_intervals(rank, step) if iv.name == name)


def check_spans(store: Store, job: str, world: int, steps: int, detail: str = schema.DETAIL_STEP) -> None:
    spans = [s for s in store.spans() if s.r(schema.RES_JOB_ID) == job]
    per_rank_stage = 2 * MICROBATCHES + 1 if detail == schema.DETAIL_INTERVAL else 3
    expected_total = steps + world * steps * (1 + per_rank_stage)
    assert len(spans) == expected_total, f"{len(spans)} != {expected_total}"
    for step in range(steps):
        tid = schema.trace_id_for_step(job, step)
        in_step = [s for s in spans if s.trace_id == tid]
        assert len(in_step) == 1 + world * (1 + per_rank_stage)
        (root,) = [s for s in in_step if s.name == schema.SPAN_JOB_STEP]
        assert root.r(schema.RES_RANK) == 0 and root.parent_span_id == 0
        assert root.span_id == schema.job_step_span_id(job, step)
        assert root.attrs[schema.ATTR_ITERATION] == ("int_value", step)
        assert root.attrs[schema.ATTR_STAGE_GROUP] == ("string_value", "step")
        assert root.scope == schema.SCOPE_STEP_NAME
        for rank in range(world):
            mine = [s for s in in_step if s.r(schema.RES_RANK) == rank and s.name != schema.SPAN_JOB_STEP]
            (rs,) = [s for s in mine if s.name == schema.SPAN_RANK_STEP]
            check_resource(rs, rank, world, job, schema.SCOPE_STEP_NAME)
            ivs = make_intervals(rank, step)
            check_summary(rs, rank, step)
            assert rs.span_id == schema.rank_step_span_id(job, step, rank)
            assert rs.parent_span_id == root.span_id
            assert rs.start_ns == min(i.host_start_ns for i in ivs) and rs.end_ns == max(i.host_end_ns for i in ivs)
            assert rs.attrs[schema.ATTR_STAGE] == ("string_value", schema.SPAN_RANK_STEP)
            assert rs.attrs[schema.ATTR_HOST_MS][0] == "double_value"
            assert rs.a(schema.ATTR_HOST_MS) == pytest.approx((rs.end_ns - rs.start_ns) / 1e6)
            assert rs.attrs[schema.ATTR_WORKLOAD_TOKENS] == ("int_value", ivs[-1].tokens)
            if rank == 0:
                assert (root.start_ns, root.end_ns) == (rs.start_ns, rs.end_ns)
            stages = [s for s in mine if s.name != schema.SPAN_RANK_STEP]
            for s in stages:
                check_resource(s, rank, world, job)
                assert s.parent_span_id == rs.span_id
                assert s.attrs[schema.ATTR_STAGE] == ("string_value", s.name)
                assert s.attrs[schema.ATTR_STAGE_GROUP][0] == "string_value"
                assert s.attrs[schema.ATTR_STAGE_LEVEL][0] == "int_value"
                assert s.attrs[schema.ATTR_ITERATION] == ("int_value", step)
                assert s.attrs[schema.ATTR_HOST_MS][0] == "double_value"
                assert s.attrs[schema.ATTR_COUNT][0] == "int_value"
                assert s.attrs[schema.ATTR_DETAIL] == ("string_value", detail)
                assert s.attrs[schema.ATTR_MEASUREMENT][0] == "string_value"
                for key in (
                    schema.ATTR_WORKLOAD_TOKENS,
                    schema.ATTR_WORKLOAD_SEQUENCES,
                    schema.ATTR_WORKLOAD_MICROBATCHES,
                ):
                    assert s.attrs[key][0] == "int_value"
                if schema.ATTR_DEVICE_MS in s.attrs:
                    assert s.attrs[schema.ATTR_DEVICE_MS][0] == "double_value"
                    assert s.a(schema.ATTR_MEASUREMENT) == schema.MEASUREMENT_DEVICE
                else:
                    assert s.a(schema.ATTR_MEASUREMENT) == schema.MEASUREMENT_HOST_ONLY
                    assert s.attrs[schema.ATTR_DEGRADED_REASON] == ("string_value", "sampled_out")
                if schema.ATTR_INJECTED in s.attrs:
                    assert s.attrs[schema.ATTR_INJECTED] == ("bool_value", True)
            if detail == schema.DETAIL_STEP:
                assert sorted(s.name for s in stages) == ["backward-compute", "forward-compute", "optimizer"]
                for s in stages:
                    exp = expected_stage(rank, step, s.name)
                    assert s.a(schema.ATTR_COUNT) == exp["count"]
                    assert s.a(schema.ATTR_HOST_MS) == pytest.approx(exp["host_ms"])
                    assert s.attrs.get(schema.ATTR_DEVICE_REPEATS, ("int_value", exp["count"])) == (
                        "int_value", exp["device_repeats"] if exp["device_ms"] is not None else exp["count"])
                    if exp["device_ms"] is None:
                        assert schema.ATTR_DEVICE_MS not in s.attrs
                    else:
                        assert s.a(schema.ATTR_DEVICE_MS) == pytest.approx(exp["device_ms"])
                    assert (s.start_ns, s.end_ns) == (exp["start"], exp["end"])
                    assert (schema.ATTR_INJECTED in s.attrs) == exp["injected"]
                    assert s.a(schema.ATTR_WORKLOAD_TOKENS) == ivs[-1].tokens
            else:
                keys = sorted((s.name, s.a(schema.ATTR_MICROBATCH_ID)) for s in stages)
                assert keys == sorted((i.name, i.repeat) for i in ivs)
                assert all(s.a(schema.ATTR_COUNT) == 1 for s in stages)


def check_metrics(store: Store, job: str, world: int, steps: int) -> None:
    def latest(rank: int) -> dict[tuple[str, tuple], float]:
        out: dict[tuple[str, tuple], float] = {}
        for res, name, attrs, value in store.metric_points():
            if res.get(schema.RES_JOB_ID) == job and res.get(schema.RES_RANK) == rank:
                out[(name, tuple(sorted(attrs.items())))] = value
        return out

    stats = stats_for(steps)
    for rank in range(world):
        assert store.wait_for(lambda r=rank: (schema.SM_SPANS_EXPORTED, ()) in latest(r), 10.0), rank
        m = latest(rank)
        assert m[(schema.SM_INTERVALS, ())] == stats["intervals"]
        assert m[(schema.SM_DROPPED, (("reason", "ring_full"),))] == stats["dropped_ring_full"]
        assert m[(schema.SM_DEGRADED, (("reason", "sampled_out"),))] == stats["degraded_sampled_out"]
        assert m[(schema.SM_BARRIERS_SKIPPED, ())] == stats["barriers_skipped"]
        assert m[(schema.SM_FAULTS, (("where", "training"),))] == stats["faults"]
        assert m[(schema.SM_POOL_HIGH_WATER, ())] == stats["pool_high_water"]
        assert m[(schema.SM_READOUT_LAG, ())] == pytest.approx(stats["readout_lag_ms"] / 1000.0)  # seconds
        spans_of_rank = steps * (1 + 3) + (steps if rank == 0 else 0)
        assert m[(schema.SM_SPANS_EXPORTED, ())] == spans_of_rank

"""Sharding by cohort: processor instances behind a splitter keyed by ``straggler.cohort.key`` (each request's
ResourceSpans split by a stable hash of the key) reach exactly the verdicts of one instance, because cohorts
are judged independently (windows, references, states are all per cohort). This is what lets a job of
thousands of ranks run on several collector processes."""

from __future__ import annotations

import zlib

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory
from collector_processor.telemetry import Telemetry
from jobsim.faults import COMPUTE_STAGES, Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, SimConfig


def shard_of(rs, shards: int) -> int:  # type: ignore[no-untyped-def]
    for kv in rs.resource.attributes:
        if kv.key == s.RES_COHORT_KEY:
            return zlib.crc32(kv.value.string_value.encode()) % shards
    return 0


def split(req: ExportTraceServiceRequest, shards: int) -> list[ExportTraceServiceRequest]:
    out = [ExportTraceServiceRequest() for _ in range(shards)]
    for rs in req.resource_spans:
        out[shard_of(rs, shards)].resource_spans.append(rs)
    return out


def _key(v) -> tuple:  # type: ignore[no-untyped-def]
    return (v.job, v.cohort, v.rank, v.stage, v.verdict, v.reason, v.step, v.attribution,
            None if v.deviation is None else round(v.deviation, 9), v.reference_rank, v.cohort_size)


def test_two_instances_split_by_cohort_give_the_verdicts_of_one() -> None:
    layout = Layout(tp=4, dp=8)  # 4 cohorts of 8 DP ranks
    faults = [Fault("device", 5, ("forward-compute",), 0.10, 40, 100),
              Fault("host", 14, ("forward-compute",), 0.3, 50, None),
              Fault("workload", 22, COMPUTE_STAGES, 0.15, 1)]
    cfg = SimConfig(layout=layout, steps=120, seed=3)

    single: list = []
    one = factory.create_processor(factory.create_default_config(), Telemetry(), single.extend)
    sharded: list[list] = [[], []]
    shards = [factory.create_processor(factory.create_default_config(), Telemetry(), sharded[i].extend)
              for i in range(2)]
    for p in (one, *shards):
        p.start()
    cohorts_per_shard: list[set[str]] = [set(), set()]
    stream = JobStream(cfg, faults)
    for _step, req in stream:
        parts = split(req, 2)
        for i, part in enumerate(parts):
            for rs in part.resource_spans:
                cohorts_per_shard[i].add(next(kv.value.string_value for kv in rs.resource.attributes
                                              if kv.key == s.RES_COHORT_KEY))
            if part.resource_spans:
                shards[i].process_traces(part)
        one.process_traces(req)
    for p in (one, *shards):
        p.shutdown(5.0)

    # the split is real: both shards hold cohorts, and no cohort is on both
    assert all(cohorts_per_shard) and not (cohorts_per_shard[0] & cohorts_per_shard[1])
    got = sorted(_key(v) for v in sharded[0] + sharded[1])
    want = sorted(_key(v) for v in single)
    assert got == want
    # and the scenario is not trivial: stragglers and uncertain verdicts, in more than one cohort
    kinds = {v.verdict for v in single}
    assert {s.VERDICT_STRAGGLER, s.VERDICT_UNCERTAIN} <= kinds
    assert {v.rank for v in single if v.verdict == s.VERDICT_STRAGGLER} >= {5, 14}
    assert len({v.cohort for v in single}) >= 2

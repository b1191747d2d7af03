"""A cohort that publishes its DP size is not judged before all of its ranks have reported.

A first request can carry many steps of a single rank (an exporter's batch after a restart, or short steps
with a long export interval); closing windows by that rank's progress alone would judge windows before its
peers arrive and reject their spans as late (bench/results/scale.md saw 30-45 % at 8k ranks)."""

from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory
from collector_processor.telemetry import Telemetry
from jobsim.faults import Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, Noise, SimConfig


def _per_rank_requests(stream: JobStream) -> dict[int, ExportTraceServiceRequest]:
    """All steps of each rank in one request per rank."""
    out: dict[int, ExportTraceServiceRequest] = {}
    for _step, req in stream:
        for rs in req.resource_spans:
            rank = next(kv.value.int_value for kv in rs.resource.attributes if kv.key == s.RES_RANK)
            out.setdefault(rank, ExportTraceServiceRequest()).resource_spans.append(rs)
    return out


def test_windows_wait_for_every_published_rank_before_closing_by_progress() -> None:
    cfg = SimConfig(layout=Layout(dp=6), steps=38, noise=Noise(late_ranks=0, missing_prob=0.0), seed=3)
    stream = JobStream(cfg, [Fault("device", 2, ("forward-compute",), 0.3, 12)])
    per_rank = _per_rank_requests(stream)
    verdicts: list = []
    proc = factory.create_processor(factory.create_default_config(), Telemetry(), verdicts.extend)
    proc.start()
    for rank in sorted(per_rank):  # rank 0's whole run arrives before anyone else's
        proc.process_traces(per_rank[rank])
    proc.shutdown(5.0)
    stats = proc.stats()
    assert stats["rejected_late"] == 0, stats
    assert stats["progress_close_deferred"] > 0
    stragglers = {(v.rank, v.stage) for v in verdicts if v.verdict == s.VERDICT_STRAGGLER}
    assert stragglers == {(2, "forward-compute")}

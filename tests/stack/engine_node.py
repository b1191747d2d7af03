"""One simulated training node of a Megatron-shaped job: its ranks' stage spans, as docs/schema.md specifies them,
through the stock OTel SDK (one Resource and TracerProvider per rank, ``BatchSpanProcessor`` + ``OTLPSpanExporter``
over gRPC), to an OTLP endpoint.

The test drives it through two files: it writes the last step to emit into ``--control`` ("stop" ends the node),
and the node writes the last step it has emitted and flushed into ``--done``. ``host.name`` is this host's name, as
the emitter takes it (the test gives every node a UTS namespace of its own).

Run as a script: ``python engine_node.py --endpoint H:P --ranks 4,5,6,7 ...``."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import otel_straggler_schema as s
from otel_straggler_schema.stages import STAGE_SCHEMA, stage_group

# (stage, nominal device ms) of one rank-step: compute stages and the data-parallel gradient all-reduce
STAGES = (("forward-compute", 40.0), ("backward-compute", 80.0), ("all-grads-sync", 12.0))
SLOW_STAGE = "forward-compute"


def layout_of(rank: int, tp: int, pp: int, dp: int) -> dict[str, int]:
    """Megatron's default order: TP fastest, then DP, PP slowest."""
    return {"tp": rank % tp, "dp": (rank // tp) % dp, "pp": rank // (tp * dp)}


def resource_attrs(rank: int, args: argparse.Namespace, host: str) -> dict[str, Any]:
    pos = layout_of(rank, args.tp, args.pp, args.dp)
    world = args.tp * args.pp * args.dp
    local = rank % args.gpus_per_node
    return {
        s.RES_SERVICE_NAME: "megatron-training", s.RES_HOST_NAME: host, s.RES_PROCESS_PID: os.getpid(),
        s.RES_RANK: rank, s.RES_WORLD_SIZE: world, s.RES_LOCAL_RANK: local,
        s.RES_DP_RANK: pos["dp"], s.RES_DP_SIZE: args.dp, s.RES_TP_RANK: pos["tp"], s.RES_TP_SIZE: args.tp,
        s.RES_PP_RANK: pos["pp"], s.RES_PP_SIZE: args.pp, s.RES_JOB_ID: args.job,
        s.RES_GPU_UUID: f"GPU-{host}-{local}", s.RES_GPU_INDEX: local,
        s.RES_COHORT_KEY: s.cohort_key(topology_epoch=0, stage_schema=STAGE_SCHEMA, tp=pos["tp"], pp=pos["pp"]),
        s.RES_TOPOLOGY_EPOCH: 0, s.RES_STAGE_SCHEMA: STAGE_SCHEMA, s.RES_SCHEMA_VERSION: s.SCHEMA_VERSION,
    }


def planned_ids() -> Any:
    """An IdGenerator handing out the schema's deterministic ids for the spans that have them (the step's root,
    rank-step spans), random ids otherwise."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class PlannedIds(RandomIdGenerator):
        def __init__(self) -> None:
            self.next_span_id: int | None = None
            self.next_trace_id: int | None = None

        def generate_span_id(self) -> int:
            sid, self.next_span_id = self.next_span_id, None
            return sid if sid is not None else super().generate_span_id()

        def generate_trace_id(self) -> int:
            tid, self.next_trace_id = self.next_trace_id, None
            return tid if tid is not None else super().generate_trace_id()

        def is_trace_id_random(self) -> bool:
            return False

    return PlannedIds()


def emit_step(tracers: dict[int, Any], ids: dict[int, Any], job: str, step: int, t0: int, step_ms: float,
              stages: Any) -> None:
    """One training step of the given ranks as docs/schema.md shapes it: rank 0 the job-level root of the step's
    trace, each rank a ``rank-step`` span under it and one span per stage under that. ``stages(rank)`` gives the
    rank's (stage, stage group, device ms); every value carries a little jitter that is the same in every run."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    trace_id = s.trace_id_for_step(job, step)
    root_id = s.job_step_span_id(job, step)
    root_ctx = trace.set_span_in_context(NonRecordingSpan(SpanContext(
        trace_id, root_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))))
    for rank, tracer in tracers.items():
        if rank == 0:
            ids[rank].next_trace_id, ids[rank].next_span_id = trace_id, root_id
            root = tracer.start_span(s.SPAN_JOB_STEP, context=trace.set_span_in_context(trace.INVALID_SPAN),
                                     start_time=t0, attributes={s.ATTR_ITERATION: step, s.ATTR_STAGE_GROUP: "step"})
            root.end(end_time=t0 + int(step_ms * 1e6))
        ids[rank].next_span_id = s.rank_step_span_id(job, step, rank)
        rank_step = tracer.start_span(s.SPAN_RANK_STEP, context=root_ctx, start_time=t0, attributes={
            s.ATTR_ITERATION: step, s.ATTR_STAGE: s.SPAN_RANK_STEP, s.ATTR_STAGE_GROUP: "step",
            s.ATTR_HOST_MS: step_ms, s.ATTR_WORKLOAD_TOKENS: 4096})
        in_rank = trace.set_span_in_context(rank_step)
        t = t0
        for stage, group, ms in stages(rank):
            device_ms = ms * (1.0 + 0.002 * ((rank * 7 + step) % 5))
            sp = tracer.start_span(stage, context=in_rank, start_time=t, attributes={
                s.ATTR_STAGE: stage, s.ATTR_STAGE_GROUP: group, s.ATTR_STAGE_LEVEL: 1,
                s.ATTR_ITERATION: step, s.ATTR_DEVICE_MS: device_ms, s.ATTR_HOST_MS: device_ms + 0.3,
                s.ATTR_MEASUREMENT: s.MEASUREMENT_DEVICE, s.ATTR_COUNT: 1, s.ATTR_DETAIL: s.DETAIL_STEP})
            t += int(device_ms * 1e6)
            sp.end(end_time=t)
        rank_step.end(end_time=t0 + int(step_ms * 1e6))


class Node:
    def __init__(self, args: argparse.Namespace) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.args = args
        host = args.host_name or socket.gethostname()
        self.ranks = [int(r) for r in args.ranks.split(",")]
        self.providers: list[Any] = []
        self.tracers: dict[int, Any] = {}
        self.ids: dict[int, Any] = {}
        for rank in self.ranks:
            ids = planned_ids()
            tp = TracerProvider(resource=Resource.create(resource_attrs(rank, args, host)), id_generator=ids,
                                shutdown_on_exit=False)
            tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=args.endpoint, insecure=True)))
            self.providers.append(tp)
            self.tracers[rank] = tp.get_tracer(s.SCOPE_NAME)
            self.ids[rank] = ids

    def step(self, step: int) -> None:
        def stages(rank: int) -> list[tuple[str, str, float]]:
            out = []
            for stage, nominal in STAGES:
                slow = rank == self.args.slow_rank and stage == SLOW_STAGE and step >= self.args.slow_from
                out.append((stage, stage_group(stage), nominal * (self.args.slow_factor if slow else 1.0)))
            return out

        emit_step(self.tracers, self.ids, self.args.job, step, self.args.t0_ns + step * 10**9,
                  sum(ms for _, ms in STAGES) * 1.6, stages)

    def flush(self) -> bool:
        return all(tp.force_flush(30_000) for tp in self.providers)

    def shutdown(self) -> None:
        for tp in self.providers:
            tp.shutdown()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--ranks", required=True, help="comma-separated global ranks on this node")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-from", type=int, default=0)
    p.add_argument("--slow-factor", type=float, default=1.5)
    p.add_argument("--t0-ns", type=int, required=True)
    p.add_argument("--host-name", default="")
    p.add_argument("--control", type=Path, required=True)
    p.add_argument("--done", type=Path, required=True)
    args = p.parse_args(argv)
    node = Node(args)
    emitted = -1
    try:
        while True:
            try:
                target = args.control.read_text().strip()
            except OSError:
                target = ""
            if target == "stop":
                return 0
            if target.isdigit() and int(target) > emitted:
                for step in range(emitted + 1, int(target) + 1):
                    node.step(step)
                emitted = int(target)
                if node.flush():
                    tmp = args.done.with_suffix(".tmp")
                    tmp.write_text(str(emitted))
                    tmp.replace(args.done)
            time.sleep(0.05)
    finally:
        node.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

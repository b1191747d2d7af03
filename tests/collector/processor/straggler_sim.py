"""A Megatron-like job rendered as real OTLP ``ExportTraceServiceRequest``s (what the emitter sends).

Every rank exports, per step, one stage span per timer (per-step sums), one ``rank-step`` span, and rank 0
the job-level ``train-step``. Device times follow the stage's base with Gaussian noise; host times of the
compute stages are launch times (a fraction of the device time) unless a host stall is simulated. Ranks
wait for the slowest in ``grads-all-reduce`` (the straggler waits least there). CUDA cannot run here, so
device times are synthetic numbers in the attributes the emitter would set.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

import otel_straggler_schema as s
from collector_processor.otlp_values import key_value
from jobsim.arrival import SimClock
from otel_straggler_schema.stages import STAGE_SCHEMA

COHORT = s.cohort_key(topology_epoch=0, stage_schema=STAGE_SCHEMA)

# (timer name, group, device base ms)
STAGES: tuple[tuple[str, str, float], ...] = (
    ("batch-generator", "data", 0.8),  # sub-floor stage
    ("forward-compute", "forward", 60.0),
    ("backward-compute", "backward", 120.0),
    ("grads-all-reduce", "grad-sync", 18.0),
    ("optimizer", "optimizer", 14.0),
    ("params-all-gather", "param-gather", 6.0),
)
COMPUTE = ("forward-compute", "backward-compute")

Factor = Callable[[int, str, int], float]  # (rank, stage, step) -> multiplier


def _one(rank: int, stage: str, step: int) -> float:
    return 1.0


kv = key_value


@dataclass
class Sim:
    ranks: int = 8
    job: str = "job-1"
    run: str = ""  # straggler.run.id: one launch of the job ("" sends none)
    cohort: str = COHORT
    seed: int = 1
    noise: float = 0.02
    device_every: int = 1  # device time measured every Nth step (others host_only, sampled_out)
    device: bool = True  # False: no CUDA, host-only everywhere
    device_factor: Factor = _one
    host_factor: Factor = _one
    spike_prob: float = 0.0  # heavy-tail: a sample x3 with this probability
    tokens: Callable[[int, int], int | None] = lambda rank, step: 8192
    stage_tokens: bool = False  # the tokens on every stage span too, not only the rank-step span
    step_time_unix_ns: int = 1_700_000_000_000_000_000
    cohort_of: Callable[[int], str] | None = None
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _noisy(self, base: float) -> float:
        v = base * (1.0 + self.rng.gauss(0.0, self.noise))
        if self.spike_prob and self.rng.random() < self.spike_prob:
            v *= 3.0
        return max(v, 0.0)

    def resource(self, rank: int) -> Resource:
        cohort = self.cohort_of(rank) if self.cohort_of else self.cohort
        return Resource(attributes=[
            kv(s.RES_SERVICE_NAME, "megatron-training"), kv(s.RES_RANK, rank), kv(s.RES_WORLD_SIZE, self.ranks),
            kv(s.RES_HOST_NAME, f"node{rank // 4}"), kv(s.RES_GPU_UUID, f"GPU-{rank:04d}"),
            kv(s.RES_JOB_ID, self.job), kv(s.RES_COHORT_KEY, cohort),
            *([kv(s.RES_RUN_ID, self.run)] if self.run else []),
        ])

    def step_spans(self, step: int, ranks: list[int] | None = None) -> dict[int, list[Span]]:
        """Spans of one step for each rank (ranks default: all)."""
        ranks = list(range(self.ranks)) if ranks is None else ranks
        measured = self.device and step % self.device_every == 0
        trace = s.trace_id_for_step(self.job, step, self.run).to_bytes(16, "big")
        t0 = self.step_time_unix_ns + step * 300_000_000
        compute: dict[int, dict[str, tuple[float, float]]] = {}
        for r in range(self.ranks):
            per = {}
            for name, _group, base in STAGES:
                if name == "grads-all-reduce":
                    continue
                dev = self._noisy(base) * self.device_factor(r, name, step)
                if self.device:
                    # async launches: the host interval is launch time, whether or not events were read
                    launch = 0.3 if name in COMPUTE else 1.0
                    host = self._noisy(base * launch) * self.host_factor(r, name, step)
                else:
                    host = dev * self.host_factor(r, name, step)  # no CUDA: the host interval is the work
                per[name] = (dev, host)
            compute[r] = per
        busy = {r: sum((d if self.device else h) for n, (d, h) in compute[r].items() if n in COMPUTE)
                for r in compute}
        slowest = max(busy.values())
        out: dict[int, list[Span]] = {}
        for r in ranks:
            wait = slowest - busy[r]
            comm = self._noisy(STAGES[3][2]) + wait
            spans: list[Span] = []
            rank_step_id = s.rank_step_span_id(self.job, step, r, self.run).to_bytes(8, "big")
            total = 0.0
            for name, group, _base in STAGES:
                dev, host = (comm, comm) if name == "grads-all-reduce" else compute[r][name]
                total += dev if self.device else host
                attrs = [kv(s.ATTR_STAGE, name), kv(s.ATTR_STAGE_GROUP, group), kv(s.ATTR_STAGE_LEVEL, 2),
                         kv(s.ATTR_ITERATION, step), kv(s.ATTR_HOST_MS, float(host)), kv(s.ATTR_COUNT, 4),
                         kv(s.ATTR_DETAIL, s.DETAIL_STEP)]
                if self.stage_tokens and (tok := self.tokens(r, step)) is not None:
                    attrs.append(kv(s.ATTR_WORKLOAD_TOKENS, tok))  # as the emitter's stage spans carry it
                if measured:
                    attrs.append(kv(s.ATTR_DEVICE_MS, float(dev)))
                    attrs.append(kv(s.ATTR_MEASUREMENT, s.MEASUREMENT_DEVICE))
                else:
                    attrs.append(kv(s.ATTR_MEASUREMENT, s.MEASUREMENT_HOST_ONLY))
                    attrs.append(kv(s.ATTR_DEGRADED_REASON, "sampled_out" if self.device else "no_cuda"))
                spans.append(Span(trace_id=trace, span_id=self.rng.randbytes(8), parent_span_id=rank_step_id,
                                  name=name, start_time_unix_nano=t0, end_time_unix_nano=t0 + int(host * 1e6),
                                  attributes=attrs))
            rs_attrs = [kv(s.ATTR_STAGE, s.SPAN_RANK_STEP), kv(s.ATTR_STAGE_GROUP, "step"),
                        kv(s.ATTR_ITERATION, step), kv(s.ATTR_HOST_MS, float(total))]
            tok = self.tokens(r, step)
            if tok is not None:
                rs_attrs.append(kv(s.ATTR_WORKLOAD_TOKENS, tok))
            spans.append(Span(trace_id=trace, span_id=rank_step_id,
                              parent_span_id=s.job_step_span_id(self.job, step, self.run).to_bytes(8, "big"),
                              name=s.SPAN_RANK_STEP, start_time_unix_nano=t0,
                              end_time_unix_nano=t0 + int(total * 1e6), attributes=rs_attrs))
            if r == 0:
                job_span = s.job_step_span_id(self.job, step, self.run).to_bytes(8, "big")
                spans.append(Span(trace_id=trace, span_id=job_span,
                                  name=s.SPAN_JOB_STEP, start_time_unix_nano=t0,
                                  end_time_unix_nano=t0 + int(total * 1e6),
                                  attributes=[kv(s.ATTR_ITERATION, step), kv(s.ATTR_STAGE_GROUP, "step")]))
            out[r] = spans
        return out

    def request(self, steps: list[int], ranks: list[int] | None = None) -> ExportTraceServiceRequest:
        """One request holding the given steps of the given ranks (one ResourceSpans per rank)."""
        per_rank: dict[int, list[Span]] = {}
        for step in steps:
            for r, spans in self.step_spans(step, ranks).items():
                per_rank.setdefault(r, []).extend(spans)
        return ExportTraceServiceRequest(resource_spans=[
            ResourceSpans(resource=self.resource(r), scope_spans=[
                ScopeSpans(scope=InstrumentationScope(name=s.SCOPE_NAME), spans=spans)])
            for r, spans in per_rank.items()
        ])


def make_processor(config=None, clock: SimClock | None = None):  # type: ignore[no-untyped-def]
    """A processor on a fresh registry; returns (processor, emitted verdict list, telemetry)."""
    from collector_processor.processor.straggler.factory import create_default_config
    from collector_processor.processor.straggler.processor import StragglerProcessor
    from collector_processor.telemetry import Telemetry

    telemetry = Telemetry()
    emitted: list = []
    proc = StragglerProcessor(config or create_default_config(), telemetry, emitted.extend,
                              clock=clock or SimClock())
    proc.start()
    return proc, emitted, telemetry


def run(proc, sim: Sim, steps: range, per_request_steps: int = 1, clock: SimClock | None = None,  # type: ignore[no-untyped-def]
        dt: float = 0.3) -> None:
    """Feed the steps, one request per ``per_request_steps`` steps of every rank; advance the clock."""
    batch: list[int] = []
    for step in steps:
        batch.append(step)
        if len(batch) == per_request_steps:
            proc.process_traces(sim.request(batch))
            batch = []
            if clock is not None:
                clock.t += dt * per_request_steps
    if batch:
        proc.process_traces(sim.request(batch))

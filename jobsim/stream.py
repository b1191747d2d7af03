"""Generate the OTLP span stream a simulated job sends: one ExportTraceServiceRequest per step.

Per rank and step: one stage span per Megatron timer (microbatch repeats aggregated, as the emitter's
default ``step`` detail does), ``forward-backward`` enclosing the compute and the DP grad sync (whose
wait equalises the cohort, as a real all-reduce does), and a ``rank-step`` span carrying the step summary
in the step scope, as the emitter sends them (``step_summary=False``: a schema-1 emitter, stage spans only,
for the collector's stage-span path). ``ddp``: plain PyTorch DDP instead, the gradient all-reduce inside
``backward-compute`` (no grad-sync stage): the wait for the cohort's slowest rank and the all-reduce itself
land in each rank's backward device time (the compute stream waits for the all-reduce), and
``collective_marked`` marks that stage collective as ``stage("backward-compute", collective=True)`` does.
``mp_sync``: the ranks of one model-parallel group (same DP replica and pipeline stage: TP/CP/EP peers) run
the tensor-parallel all-reduces inside ``forward-compute`` and ``backward-compute``, so each member's device
time there is the group's slowest member's (each with its own small jitter on top): a slow GPU holds its
peers inside their compute timers; the optimizer's inner step holds no collective of the group. ``pp_sync``:
the pipeline stages of one DP replica wait for the slowest in ``forward-recv`` (a ``p2p`` stage): each rank's
wait there is the replica's slowest compute minus its own. ``mp_optimizer_sync``: every rank of one DP replica
(TP peers and pipeline stages) waits in ``optimizer-clip-main-grad``, the grad-norm all-reduce over the
model-parallel group, for the replica's slowest compute: a healthy pipeline stage is slow there, in a judged
``optimizer`` stage, while its own work is at par. Noise: Gaussian jitter,
heavy-tail spikes on random ranks, slow warmup with per-rank skew, ranks that start late, missing spans;
device time present only on sampled steps (``device_every``).

Regimes (``SimConfig.regime``), for the compute and optimizer stages; what a fault does to the host and device
intervals follows from them (``faults.py``):

* ``launch``: the host is never blocked by the GPU. A stage's host interval is its launch time (a fraction of
  the device time, ``StageModel.host_fraction``), flat when the GPU slows; the device interval is the stream's
  time, and it cannot end before the stage's last launch, so a host stall longer than the queued work (device
  time minus launch time) starves the stream and stretches it.
* ``gpu_bound``: the launch queue is full and the host blocks on it, so a stage's host interval tracks its
  device interval (plus the launch time's jitter): a slow GPU stretches both alike; a host stall shorter than
  the queued work is absorbed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Span

import otel_straggler_schema as s
from collector_processor.otlp_values import key_value
from jobsim.faults import Fault
from jobsim.job import Layout, RankInfo, StageModel, StepModel, ranks_of, timers
from otel_straggler_schema.stages import STAGE_SCHEMA, stage_group

REGIME_LAUNCH = "launch"
REGIME_GPU_BOUND = "gpu_bound"
REGIMES = (REGIME_LAUNCH, REGIME_GPU_BOUND)
_QUEUED_GROUPS = ("forward", "backward", "optimizer")  # stages whose launches queue on the stream
_TOKEN_GROUPS = ("forward", "backward")  # stages whose work follows the rank's tokens (token_spread)
_DEVICE_FAULTS = ("device", "intermittent", "flapping", "ramp", "node", "periodic", "burst")


@dataclass
class Noise:
    # Gaussian sigma of device (CUDA event) time per stage and step, relative. 1 %: stage spans are per-step
    # sums over microbatches of fixed-shape kernels; the detection defaults are shown against 0.5-2 % in
    # docs/detection-defaults.md.
    jitter: float = 0.01
    host_jitter: float | None = 0.03  # same for host (launch) time, noisier (scheduling); None: as jitter
    spike_prob: float = 0.004  # per rank-step: one stage x U(1.3, 3.0)
    warmup_steps: int = 12  # slow warmup for every rank
    warmup_skew: float = 0.3  # extra per-rank warmup skew (lazy CUDA events, allocator)
    late_ranks: int = 1  # ranks whose spans start late
    late_by_steps: int = 15
    missing_prob: float = 0.001  # each span independently lost
    # Gaussian sigma of a per-step factor on every rank's device times alike (the job's step time jitters with
    # it: clocks, shared network and storage). 0 by default: the per-step comparison cancels it exactly.
    step_jitter: float = 0.0


@dataclass
class SimConfig:
    layout: Layout = field(default_factory=Layout)
    steps: int = 150
    step_model: StepModel = field(default_factory=StepModel)
    noise: Noise = field(default_factory=Noise)
    device_every: int = 1
    tokens_per_step: int = 8 * 4096
    job: str = "sim-job"
    seed: int = 0
    start_unix_ns: int = 1_800_000_000_000_000_000
    step_summary: bool = True
    ddp: bool = False  # the DP gradient all-reduce (and the wait for the slowest) inside backward-compute
    collective_marked: bool = False  # with ddp: backward-compute marked collective (straggler.stage.collective)
    regime: str = REGIME_LAUNCH  # launch | gpu_bound (module docstring)
    # Each rank's tokens per step x U(1 - token_spread, 1 + token_spread), drawn per rank and step (MoE routing,
    # packed sequences); the forward and backward stages' device and launch time follow the tokens. 0: every
    # rank-step the same tokens.
    token_spread: float = 0.0
    mp_sync: bool = False  # the TP/CP/EP peers of a DP replica and pipeline stage end each compute stage together
    pp_sync: bool = False  # the pipeline stages of a DP replica wait for the slowest in forward-recv (p2p)
    # every rank of a DP replica (TP peers and pipeline stages) waits in optimizer-clip-main-grad (the grad-norm
    # all-reduce over the model-parallel group) for the replica's slowest compute
    mp_optimizer_sync: bool = False
    # every rank-step carries an NVML sample (otel_straggler/nvml.py): SM clock 1,980 MHz at 60 C, a rank under a
    # device fault its clock divided by the slowdown at 85 C, with sw_thermal_slowdown; a rank under a link fault its
    # PCIe replay errors growing by 12 a step
    nvml: bool = False

    def __post_init__(self) -> None:
        if self.regime not in REGIMES:
            raise ValueError(f"regime must be one of {REGIMES}, not {self.regime!r}")


_kv = key_value
MP_SYNC_STAGES = timers("forward-compute", "backward-compute")  # with SimConfig.mp_sync: stages holding TP all-reduces
# with SimConfig.pp_sync: the p2p stage that holds the wait for the slowest stage; with SimConfig.mp_optimizer_sync:
# the model-parallel all-reduce; with SimConfig.ddp: the stage that holds the gradient all-reduce; without: the
# grad sync; the step's forward and backward
PP_WAIT_STAGE, MP_OPT_WAIT_STAGE, DDP_STAGE, GRAD_SYNC_STAGE, FORWARD_BACKWARD = timers(
    "forward-recv", "optimizer-clip-main-grad", "backward-compute", "all-grads-sync", "forward-backward")
MP_OPT_WAIT_MS = 1.0  # MP_OPT_WAIT_STAGE's time when every member arrives together


Row = tuple[str, str, int, float, float, int]  # stage, group, level, device ms, host ms, count


@dataclass
class _Plan:
    """What the faults make of the job for its whole run."""

    faulty: set[int]  # ranks not counted healthy
    node_of: dict[int, str]  # a node fault's rank -> its host
    cohort_faulty: set[str]
    links: list[tuple[str, Fault]]  # (cohort, link fault)


@dataclass
class _StepTimes:
    """One step's times, per rank, before encoding."""

    step: int
    per_rank: dict[int, list[Row]] = field(default_factory=dict)
    arrival: dict[int, float] = field(default_factory=dict)  # at the grad sync
    tokens: dict[int, int] = field(default_factory=dict)
    slowed: dict[int, float] = field(default_factory=dict)  # rank -> its device slowdown at this step (nvml)
    step_ms: float = 0.0


def resource_for(info: RankInfo, cfg: SimConfig) -> Resource:
    lay = cfg.layout
    attrs = {
        s.RES_SERVICE_NAME: "sim-training", s.RES_HOST_NAME: info.host, s.RES_RANK: info.rank,
        s.RES_WORLD_SIZE: lay.world_size, s.RES_LOCAL_RANK: info.rank % 8, s.RES_DP_RANK: info.dp_rank,
        s.RES_DP_SIZE: lay.dp, s.RES_PP_RANK: info.pp_rank, s.RES_PP_SIZE: lay.pp, s.RES_TP_SIZE: lay.tp,
        s.RES_JOB_ID: cfg.job, s.RES_GPU_UUID: info.gpu, s.RES_COHORT_KEY: info.cohort,
        s.RES_TOPOLOGY_EPOCH: 0, s.RES_STAGE_SCHEMA: STAGE_SCHEMA,
        s.RES_SCHEMA_VERSION: s.SCHEMA_VERSION if cfg.step_summary else "1", s.RES_STEP_SUMMARY: cfg.step_summary,
    }
    return Resource(attributes=[_kv(k, v) for k, v in attrs.items()])


class JobStream:
    """Iterates (step, request) for the whole job."""

    def __init__(self, cfg: SimConfig, faults: list[Fault]) -> None:
        self.cfg = cfg
        self.faults = faults
        self.rng = random.Random(cfg.seed)
        self.ranks = ranks_of(cfg.layout)
        self.resources = {r.rank: resource_for(r, cfg) for r in self.ranks}
        late = self.rng.sample(range(len(self.ranks)), min(cfg.noise.late_ranks, len(self.ranks)))
        self.start_step = {r.rank: (cfg.noise.late_by_steps if i in late else 1) for i, r in enumerate(self.ranks)}
        self.warm_skew = {r.rank: 1.0 + self.rng.uniform(0.0, cfg.noise.warmup_skew) for r in self.ranks}
        self.healthy_rank_steps = 0
        # its own stream: the per-rank draws are the same with and without step jitter
        self._step_rng = random.Random(cfg.seed ^ 0x5EED)
        self._token_rng = random.Random(cfg.seed ^ 0x70C5)  # its own stream too (token_spread)
        self._sync_rng = random.Random(cfg.seed ^ 0x5C)  # its own stream too (mp_sync)
        self._contention_rng = random.Random(cfg.seed ^ 0xC0)  # its own stream too (contention faults)
        self.mp_groups: dict[tuple[int, int], list[int]] = {}  # (DP replica, pipeline stage) -> ranks
        self.replicas: dict[int, list[int]] = {}  # DP replica -> ranks
        for r in self.ranks:
            self.mp_groups.setdefault((r.dp_rank, r.pp_rank), []).append(r.rank)
            self.replicas.setdefault(r.dp_rank, []).append(r.rank)

    def _sync(self, per_rank: dict[int, list[Row]],
              arrival: dict[int, float]) -> None:
        """``mp_sync`` and ``pp_sync`` (module docstring): the waits inside one DP replica, in place."""
        cfg = self.cfg
        jitter = cfg.noise.jitter / 2
        if cfg.mp_sync:
            for members in self.mp_groups.values():
                for name in MP_SYNC_STAGES:
                    idx = [next((i for i, row in enumerate(per_rank[r]) if row[0] == name), -1) for r in members]
                    if any(i < 0 for i in idx):
                        continue
                    slowest = max(per_rank[r][i][3] for r, i in zip(members, idx, strict=True))
                    for r, i in zip(members, idx, strict=True):
                        n, g, lv, dev, host, cnt = per_rank[r][i]
                        new = max(dev, slowest * (1.0 + self._sync_rng.gauss(0.0, jitter)))
                        if cfg.regime == REGIME_GPU_BOUND:
                            host += new - dev
                        per_rank[r][i] = (n, g, lv, new, host, cnt)
        if cfg.pp_sync:
            for members in self.replicas.values():
                compute = {r: sum(row[3] for row in per_rank[r] if row[0] in MP_SYNC_STAGES) for r in members}
                slowest = max(compute.values())
                for r in members:
                    wait = slowest - compute[r]
                    per_rank[r].append((PP_WAIT_STAGE, stage_group(PP_WAIT_STAGE), 2, wait, wait, 1))
        if cfg.mp_optimizer_sync:
            for members in self.replicas.values():
                compute = {r: sum(row[3] for row in per_rank[r] if row[0] in MP_SYNC_STAGES) for r in members}
                slowest = max(compute.values())
                for r in members:
                    wait = slowest - compute[r] + MP_OPT_WAIT_MS * (1.0 + self._sync_rng.gauss(0.0, jitter * 4))
                    per_rank[r].append((MP_OPT_WAIT_STAGE, stage_group(MP_OPT_WAIT_STAGE), 1, wait, wait, 1))
        for r, rows in per_rank.items():
            arrival[r] = sum(max(dev, host if group == "data" else 0.0) if group in ("data", "forward", "backward")
                             else (dev if group == "p2p" else 0.0) for _n, group, _lv, dev, host, _c in rows)

    def _factor(self, step: int, rank: int, host: bool = False) -> float:
        n = self.cfg.noise
        sigma = n.host_jitter if (host and n.host_jitter is not None) else n.jitter
        f = 1.0 + self.rng.gauss(0.0, sigma)
        if step <= n.warmup_steps:
            f *= 1.0 + 0.6 * (n.warmup_steps - step + 1) / n.warmup_steps * self.warm_skew[rank]
        return f

    def _plan(self) -> _Plan:
        node_of = {f.rank: self.ranks[f.rank].host for f in self.faults if f.kind == "node"}
        faulty = {f.rank for f in self.faults if f.kind not in ("cohort", "node")}
        faulty |= {r.rank for r in self.ranks if r.host in node_of.values()}
        return _Plan(faulty=faulty, node_of=node_of,
                     cohort_faulty={self.ranks[f.rank].cohort for f in self.faults if f.kind == "cohort"},
                     links=[(self.ranks[f.rank].cohort, f) for f in self.faults if f.kind == "link"])

    def __iter__(self) -> Iterator[tuple[int, ExportTraceServiceRequest]]:
        cfg = self.cfg
        t = cfg.start_unix_ns
        plan = self._plan()
        replays: dict[int, int] = {}  # rank -> cumulative PCIe replay errors (link faults, nvml)
        for step in range(1, cfg.steps + 1):
            common = 1.0 + self._step_rng.gauss(0.0, cfg.noise.step_jitter) if cfg.noise.step_jitter else 1.0
            times = _StepTimes(step)
            for info in self.ranks:
                self._rank_times(times, info, common, plan)
            if cfg.mp_sync or cfg.pp_sync or cfg.mp_optimizer_sync:
                self._sync(times.per_rank, times.arrival)
            self._grad_sync(times, plan, replays)
            request = self._request(times, t, plan, replays)
            t += int(times.step_ms * 1e6)
            yield step, request

    def _work(self, step: int, info: RankInfo) -> tuple[float, int]:
        """The rank's work factor and tokens at ``step`` (workload and cohort faults)."""
        work = 1.0
        tok = self.cfg.tokens_per_step
        for f in self.faults:
            if f.kind == "workload" and f.rank == info.rank and f.active(step, 0.0):
                work *= 1.0 + f.size
                tok = int(tok * (1.0 + f.size))
            if f.kind == "cohort" and info.cohort == self.ranks[f.rank].cohort and f.active(step, 0.0):
                work *= 1.0 + f.size
        return work, tok

    def _rank_times(self, times: _StepTimes, info: RankInfo, common: float, plan: _Plan) -> None:
        """One rank's stage rows, its arrival at the grad sync and its tokens, into ``times``."""
        cfg = self.cfg
        sm = cfg.step_model
        spike_stage = (self.rng.randrange(len(sm.stages))
                       if self.rng.random() < cfg.noise.spike_prob else -1)
        work, tok = self._work(times.step, info)
        per_token = 1.0
        if cfg.token_spread:
            per_token = self._token_rng.uniform(1.0 - cfg.token_spread, 1.0 + cfg.token_spread)
            tok = int(tok * per_token)
        times.tokens[info.rank] = tok
        rows: list[Row] = []
        before_sync = 0.0
        for i, st in enumerate(sm.stages):
            w = work * per_token if st.group in _TOKEN_GROUPS else work
            dev, host = self._stage_time(times, info, st, w, common, i == spike_stage, plan)
            rows.append((st.name, st.group, st.level, dev, host, st.count))
            if st.group in ("data", "forward", "backward"):
                before_sync += max(dev, host if st.group == "data" else 0.0)
        times.per_rank[info.rank] = rows
        times.arrival[info.rank] = before_sync

    def _stage_time(self, times: _StepTimes, info: RankInfo, st: StageModel, w: float, common: float,
                    spiked: bool, plan: _Plan) -> tuple[float, float]:
        """(device ms, host ms) of one stage of one rank: noise, a spike, the faults, the regime."""
        step = times.step
        dev = st.device_ms * w * self._factor(step, info.rank) * common
        nominal_launch = st.device_ms * st.host_fraction * w
        host = nominal_launch * self._factor(step, info.rank, host=True)
        launch_noise = host - nominal_launch
        if st.group == "data":
            host = dev
        if spiked:
            k = self.rng.uniform(1.3, 3.0)
            dev *= k
            host *= k
        rv = self.rng.random()
        for f in self.faults:
            dev, host = self._fault_effect(f, times, info, st, dev, host, rv, plan)
        if st.group in _QUEUED_GROUPS:
            # the stream cannot end before the stage's last launch: a host stall longer than the
            # queued work starves it
            dev = max(dev, host)
            if self.cfg.regime == REGIME_GPU_BOUND:
                host = dev + launch_noise  # the host blocks on the full launch queue
        return dev, host

    def _fault_effect(self, f: Fault, times: _StepTimes, info: RankInfo, st: StageModel, dev: float, host: float,
                      rv: float, plan: _Plan) -> tuple[float, float]:
        """(device ms, host ms) of the stage with fault ``f`` applied (unchanged where it does not hit)."""
        step = times.step
        if f.kind == "contention":
            if info.host == self.ranks[f.rank].host and f.active(step, 0.0):
                duty = min(1.0, f.duty * (3.0 if info.rank == f.rank else 1.0))
                if self._contention_rng.random() < duty:
                    host += f.size * st.device_ms * self._contention_rng.random()
            return dev, host
        hit = info.host == plan.node_of[f.rank] if f.kind == "node" else f.rank == info.rank
        if not hit or st.name not in f.stages or not f.active(step, rv):
            return dev, host
        if f.kind in _DEVICE_FAULTS:
            dev *= 1.0 + f.slowdown(step)
            times.slowed[info.rank] = max(times.slowed.get(info.rank, 0.0), f.slowdown(step))
        elif f.kind == "host":
            host += f.stall_ms if f.stall_ms is not None else f.size * st.device_ms
        elif f.kind == "dataloader":
            extra = f.size * self.cfg.step_model.stages[1].device_ms
            host += extra
            dev += extra
        return dev, host

    def _grad_sync(self, times: _StepTimes, plan: _Plan, replays: dict[int, int]) -> None:
        """Each rank's wait for its cohort in the grad sync (or, with ``ddp``, inside backward), its
        ``forward-backward``, and the step's period (``times.step_ms``)."""
        cfg = self.cfg
        sm = cfg.step_model
        step = times.step
        by_cohort: dict[str, float] = {}
        for info in self.ranks:
            by_cohort[info.cohort] = max(by_cohort.get(info.cohort, 0.0), times.arrival[info.rank])
        ring_slow = {cohort: f.size for cohort, f in plan.links if f.active(step, 0.0)}
        for _cohort, f in plan.links:
            if f.active(step, 0.0):
                replays[f.rank] = replays.get(f.rank, 0) + 12
        for info in self.ranks:
            arrival = times.arrival[info.rank]
            wait = by_cohort[info.cohort] - arrival + sm.grad_sync_ms * self._factor(step, info.rank)
            wait += sm.grad_sync_ms * ring_slow.get(info.cohort, 0.0)  # the ring waits for its slowest link
            rows = times.per_rank[info.rank]
            if cfg.ddp:
                i = next(i for i, row in enumerate(rows) if row[0] == DDP_STAGE)
                name, group, level, dev, host, count = rows[i]
                rows[i] = (name, group, level, dev + wait, host, count)
            else:
                rows.append((GRAD_SYNC_STAGE, stage_group(GRAD_SYNC_STAGE), 1, wait, wait, 1))
            fb = arrival + wait
            rows.append((FORWARD_BACKWARD, stage_group(FORWARD_BACKWARD), 1, fb, fb, 1))
            total = fb + sum(r[3] for r in rows if r[1] == "optimizer") + sm.step_overhead_ms
            times.step_ms = max(times.step_ms, total)

    def _request(self, times: _StepTimes, t: int, plan: _Plan, replays: dict[int, int]) -> ExportTraceServiceRequest:
        """The step's request: per rank that has started, its resource, stage spans and ``rank-step`` span."""
        cfg = self.cfg
        step = times.step
        request = ExportTraceServiceRequest()
        blocks: dict[int, tuple[bytes, bytes]] = {}  # trace block -> (trace id, train-step root id)
        for info in self.ranks:
            if step < self.start_step[info.rank]:
                continue
            block = s.trace_block(info.rank)
            if block not in blocks:
                tid = s.trace_id_for_step(cfg.job, step, block=block)
                blocks[block] = (tid.to_bytes(16, "big"), s.step_root_span_id(tid).to_bytes(8, "big"))
            trace_id, root_id = blocks[block]
            if info.rank not in plan.faulty and info.cohort not in plan.cohort_faulty:
                self.healthy_rank_steps += 1
            rs = request.resource_spans.add()
            rs.resource.CopyFrom(self.resources[info.rank])
            ss = rs.scope_spans.add()
            ss.scope.name = s.SCOPE_NAME
            parent = s.rank_step_span_id(cfg.job, step, info.rank).to_bytes(8, "big")
            kept = self._stage_spans(ss, times, info, trace_id, parent, t)
            if cfg.step_summary:
                step_ss = rs.scope_spans.add()
                step_ss.scope.name = s.SCOPE_STEP_NAME
                rsp = step_ss.spans.add()
            else:
                rsp = ss.spans.add()
            rsp.trace_id = trace_id
            rsp.span_id = parent
            rsp.parent_span_id = root_id
            self._rank_step_span(rsp, times, info, t, kept, replays.get(info.rank, 0))
        return request

    def _stage_spans(self, ss: ScopeSpans, times: _StepTimes, info: RankInfo, trace_id: bytes, parent: bytes,
                     t: int) -> list[tuple[str, str, float, float, int]]:
        """The rank's stage spans (each lost with ``missing_prob``), back to back from ``t``; returns what was
        kept as (name, group, device ms or not measured, host ms, count)."""
        cfg = self.cfg
        device_on = times.step % cfg.device_every == 0
        marked = cfg.ddp and cfg.collective_marked
        cursor = t
        kept = []
        for name, group, level, dev, host, count in times.per_rank[info.rank]:
            if self.rng.random() < cfg.noise.missing_prob:
                continue
            kept.append((name, group, dev if device_on else s.SUMMARY_NOT_MEASURED, host, count))
            span = ss.spans.add()
            span.trace_id = trace_id
            span.span_id = self.rng.getrandbits(64).to_bytes(8, "big")
            span.parent_span_id = parent
            span.name = name
            span.kind = Span.SPAN_KIND_INTERNAL
            dur = int(max(dev, host) * 1e6)
            span.start_time_unix_nano = cursor
            span.end_time_unix_nano = cursor + dur
            attrs = [_kv(s.ATTR_STAGE, name), _kv(s.ATTR_STAGE_GROUP, group), _kv(s.ATTR_STAGE_LEVEL, level),
                     _kv(s.ATTR_ITERATION, times.step), _kv(s.ATTR_HOST_MS, float(host)),
                     _kv(s.ATTR_COUNT, count), _kv(s.ATTR_DETAIL, s.DETAIL_STEP),
                     _kv(s.ATTR_WORKLOAD_TOKENS, times.tokens[info.rank])]
            if marked and name == DDP_STAGE:
                attrs.append(_kv(s.ATTR_STAGE_COLLECTIVE, True))
            if device_on:
                attrs += [_kv(s.ATTR_DEVICE_MS, float(dev)), _kv(s.ATTR_MEASUREMENT, s.MEASUREMENT_DEVICE)]
            else:
                attrs += [_kv(s.ATTR_MEASUREMENT, s.MEASUREMENT_HOST_ONLY),
                          _kv(s.ATTR_DEGRADED_REASON, "sampled_out")]
            span.attributes.extend(attrs)
            if group not in ("step",):
                cursor += dur
        return kept

    def _rank_step_span(self, rsp: Span, times: _StepTimes, info: RankInfo, t: int,
                        kept: list[tuple[str, str, float, float, int]], replays: int) -> None:
        """The ``rank-step`` span's name, period and attributes: with ``step_summary`` the summary of the kept
        stages (and with ``nvml`` the NVML sample)."""
        cfg = self.cfg
        step_ms = times.step_ms
        rsp.name = s.SPAN_RANK_STEP
        rsp.kind = Span.SPAN_KIND_INTERNAL
        rsp.start_time_unix_nano = t
        rsp.end_time_unix_nano = t + int(step_ms * 1e6)
        rsp.attributes.extend([_kv(s.ATTR_STAGE, s.SPAN_RANK_STEP), _kv(s.ATTR_STAGE_GROUP, "step"),
                               _kv(s.ATTR_ITERATION, times.step), _kv(s.ATTR_HOST_MS, float(step_ms)),
                               _kv(s.ATTR_WORKLOAD_TOKENS, times.tokens[info.rank])])
        if not cfg.step_summary:
            return
        rsp.attributes.extend([
            _kv(s.ATTR_SUMMARY_STAGES, [k[0] for k in kept]),
            _kv(s.ATTR_SUMMARY_GROUPS, [k[1] for k in kept]),
            _kv(s.ATTR_SUMMARY_DEVICE_MS, [float(k[2]) for k in kept]),
            _kv(s.ATTR_SUMMARY_HOST_MS, [float(k[3]) for k in kept]),
            _kv(s.ATTR_SUMMARY_COUNTS, [k[4] for k in kept])])
        if cfg.ddp and cfg.collective_marked and any(k[0] == DDP_STAGE for k in kept):
            rsp.attributes.append(_kv(s.ATTR_SUMMARY_COLLECTIVE, [DDP_STAGE]))
        if cfg.nvml:
            slow = times.slowed.get(info.rank, 0.0)
            rsp.attributes.extend([
                _kv(s.ATTR_GPU_SM_CLOCK_MHZ, round(1980 / (1.0 + slow))),
                _kv(s.ATTR_GPU_SM_CLOCK_MAX_MHZ, 1980),
                _kv(s.ATTR_GPU_TEMPERATURE_C, 85 if slow else 60),
                _kv(s.ATTR_GPU_CLOCK_REASONS, ["sw_thermal_slowdown"] if slow else []),
                _kv(s.ATTR_GPU_PCIE_REPLAYS, replays)])

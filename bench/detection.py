"""Detection quality of the straggler processor on simulated Megatron span streams with labelled faults.

Feeds the real processor in-process (``--otlp N`` also sends N runs through a real collector subprocess over
OTLP/gRPC and checks that its evidence JSONL holds the same verdicts) and scores verdicts against the labels:
recall per fault type and size, false alarms per 1e5 healthy rank-steps, steps from onset to detection
(median, p95), stage and device-vs-host attribution accuracy, recovery latency.

Target scenario (the issue's wording): a sustained +5 % device slowdown of one rank on a 20 ms stage
(forward-compute of a smaller model), cohorts of 8 (DP 8 x TP 2): recall >= 0.99 within 15 steps (p95),
0 false alarms per 1e5 healthy rank-steps, attribution >= 0.95.

  python bench/detection.py --quick                  # < 1 minute on 2 cores
  python bench/detection.py --plot bench/results/detection-sensitivity.png --otlp 3
  python bench/detection.py --device-every 4         # sampled device timing (emitter default)
  python bench/detection.py --shapes-only            # the shapes below alone (the target's keys then read 0)
  python bench/detection.py --quick --pair-ddp-only  # only the DP = 2 and DDP scenarios
  python bench/detection.py --beyond-only            # only the variable-workload and bad-node scenarios
  python bench/detection.py --groups-only            # only the model-parallel group (culprit) scenarios
  python bench/detection.py --tpxpp-only             # only the TP x PP x DP scenarios
  python bench/detection.py --contention-only        # only the host-contention scenarios
  python bench/detection.py --intermittent-only      # only the intermittent (periodic spike) scenarios
  python bench/detection.py --collective-only        # only the collective-signal scenarios

Shapes (``shape_scenarios``, their own random stream so the other scenarios' runs are the same with and
without them): device faults in the GPU-bound regime (the host blocked on a full launch queue: host time
tracks device time; the other scenarios run in the launch regime, host time flat), a host-only stall in a
compute stage (device flat) and one long enough to starve the stream, a slow thermal ramp (scored from the
step it reaches +5 %; ``flap`` counts recoveries while it still runs), and ~70 ms steps whose spans reach the
collector as the OTel SDK's batching sends them (5 s schedule delay; ``late%``: step samples rejected late).

Variable workload and bad node (``beyond_scenarios``), their own table and line (``beyond: ...``) after the
``pair_ddp:`` line, drawn from their own random stream: ``moe:*`` give every rank +-30 % tokens per step with
forward and backward time proportional (MoE routing, packed sequences; judged per unit, ``per_unit`` in
docs/detector.md); ``node:*`` slow every rank of one host (8 GPUs: half of each DP 8 cohort), detected by the
node verdict naming it (``node.py``); a rank verdict on another host is a false alarm. ``--beyond-reps 0``
leaves them out.

Model-parallel groups (``group_scenarios``), their own table and line (``groups: ...``) after the ``beyond:``
line, from their own random stream: TP 4 x DP 8, TP 2 x CP 2 x DP 6 and PP 2 x TP 2 x DP 4 jobs whose TP/CP
peers end each compute stage together (``mp_sync``) and whose pipeline stages wait in ``p2p`` (``pp_sync``);
one GPU slowed: ``culprit`` (its whole GPU, found by the verdict naming it), ``group`` (its compute stages
only: found by the group verdict); ``vict``: victims convicted, a straggler verdict on another rank of the
replica without ``victim_of``. ``--group-reps 0`` leaves them out, ``--groups-only`` runs them alone.

TP x PP x DP (``tpxpp_scenarios``), their own table and line (``tpxpp: ...``) after the ``groups:`` line, from
their own random stream: a replica's ranks wait for its slowest compute in the optimizer's grad-norm all-reduce
over the model-parallel group (``mp_optimizer_sync``); a bad node (the other pipeline stage of its replicas waits
on a healthy host), a culprit GPU, a group-only fault, healthy. Per shape: recall, steps to detect, false pages
(``FA``, and per 1e5 healthy rank-steps), victims named (``vict``). ``--tpxpp-reps 0`` leaves them out.

Host contention (``contention_scenarios``), the same table and a ``contention: ...`` line after it, from their
own random stream: an 8-rank DDP job on one host whose CPUs are oversubscribed (each rank descheduled on 30 %
of its stage-steps for up to 1x or 3x the stage's time, one rank three times as often), timed on the host only
or on the device too: every straggler verdict is a false page. ``--contention-reps 0`` leaves them out.

Intermittent (``intermittent_scenarios``), the same table and an ``intermittent: ...`` line after the
``contention:`` line, from their own random stream: DP 8 x TP 2, 200 steps; one rank slowed on one step in
every P (a periodic background job), +30 % every 8 steps of forward-compute (3.75 % of it per step), +50 % every
5 of both compute stages, +100 % every 16 of forward: found by ``intermittent_excess``, steps to detect counted
from the first spike; one spike (+200 %, a GC pause) and one 5-step burst (+100 %, one rank's checkpoint step):
any straggler verdict is a false page; +10 % every 10 steps (1 %, below what a steady straggler is convicted at):
a verdict optional. ``--intermittent-reps 0`` leaves them out.

Collective signal (``collective_scenarios``), their own table and a ``collective: ...`` line after the
``intermittent:`` line, from their own random stream: DP 8 x TP 2, 150 steps; one rank's link slows its ring's
gradient all-reduce (``all-grads-sync``) for every member, compute normal (+50 %, +20 %; +50 % with NVML samples,
where the rank's PCIe replay errors grow); a compute straggler (+30 % forward-compute), healthy jobs, and a TP 4 x
PP 2 x DP 4 job with a bad node (its other pipeline stage waits in the optimizer's model-parallel all-reduce).
Per shape: ``signal`` (a ``collective_slow`` event on the slowed ring), steps to it, ``named`` (the event names the
rank whose link it is) and ``wrong`` (names another), ``FA`` (straggler verdicts no fault explains: every one in a
link shape) and ``false sig`` (events on another ring or without a link fault) per 1e5 healthy rank-steps.
``--collective-reps 0`` leaves them out.

DP = 2 and DDP scenarios (``pair`` and ``collective_wait`` in docs/detector.md), their own table and line
(``pair_ddp: ...``) before the last line, drawn from their own random stream so the scenarios above keep their
draws: ``dp2:*`` are DP 2 x TP 2 jobs (two 2-rank cohorts) unless ``tp1`` (one cohort); ``from-start`` is slow
from its first step (no history of the pair at par); ``dp2:healthy`` runs ``--pair-healthy-steps`` steps for the
false-alarm rate. ``ddp:*`` are DP 8 (``ddp2``: DP 2) jobs under plain PyTorch DDP: the gradient all-reduce,
and the wait for the slowest rank, inside ``backward-compute``; ``marked`` marks that stage collective.
Scenarios whose slow rank cannot be told apart (``expect`` False: the rank's slowdown hidden inside the stage
that holds the wait, or a DP 2 DDP pair without the mark) show their recall as nan; a verdict on any other rank
is a false alarm there too.

Last line: recall=<target> recall_within_15=<> p95_steps_to_detect=<> false_alarms_per_1e5=<>
attribution_accuracy=<> ... attribution_accuracy_gpu_bound=<> shapes_recall_within_15=<> flaps=<>
late_share=<>
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

import otel_straggler_schema as s  # noqa: E402
from collector_processor.processor.straggler import factory  # noqa: E402
from collector_processor.processor.straggler.model import Verdict  # noqa: E402
from collector_processor.processor.straggler.processor import StragglerProcessor  # noqa: E402
from collector_processor.telemetry import Telemetry  # noqa: E402
from jobsim.arrival import Batching, SimClock, batched, drive  # noqa: E402
from jobsim.faults import COMPUTE_STAGES, Fault  # noqa: E402
from jobsim.job import Layout, StepModel  # noqa: E402
from jobsim.score import RunScore, median, percentile, score_run  # noqa: E402
from jobsim.stream import REGIME_GPU_BOUND, REGIME_LAUNCH, JobStream, Noise, SimConfig  # noqa: E402
from otel_straggler_demo.run import free_port  # noqa: E402

TARGET = "target:device:20ms-stage:+5%"
TARGET_STAGE_MS = 20.0
DETECT_WITHIN = 15
SENS_SIZES = (0.02, 0.03, 0.04, 0.05, 0.07, 0.10, 0.30)


@dataclass
class Run:
    name: str
    fault: Fault | None
    forward_ms: float = 48.0
    regime: str = REGIME_LAUNCH
    steps: int | None = None  # None: --steps
    batching: Batching | None = None  # None: one request per step, judged as it comes
    layout: Layout | None = None  # None: --dp, --tp
    ddp: bool = False  # the gradient all-reduce inside backward-compute (SimConfig.ddp)
    marked: bool = False  # that stage marked collective
    token_spread: float = 0.0  # SimConfig.token_spread: tokens per rank-step x U(1 -+ this)
    mp_sync: bool = False  # SimConfig.mp_sync: TP/CP peers of a replica end each compute stage together
    pp_sync: bool = False  # SimConfig.pp_sync: pipeline stages wait for the slowest in p2p
    expect_group: bool | None = None  # scored by culprit (False) or group (True) verdict; None: as before
    mp_optimizer_sync: bool = False  # SimConfig.mp_optimizer_sync: a replica's ranks wait in the grad-norm all-reduce
    device_every: int | None = None  # None: --device-every
    nvml: bool = False  # SimConfig.nvml: every rank-step carries an NVML sample


def run_one(cfg: SimConfig, fault: Fault | None, proc_overrides: dict | None = None,
            sink: Callable[[object], None] | None = None, batching: Batching | None = None,
            stats: dict | None = None, expect_group: bool | None = None) -> tuple[RunScore, list[Verdict]]:
    """One simulated job through a fresh in-process processor; ``sink`` also receives every request. With
    ``batching`` the requests arrive as each rank's SDK batches them (``simulate/arrival.py``), on a simulated
    clock ticked every 0.25 s as the collector's pipeline does; ``stats`` receives the processor's counters."""
    verdicts: list[Verdict] = []
    pcfg = factory.create_default_config()
    if proc_overrides:
        pcfg = pcfg.model_copy(update=proc_overrides)
    stream = JobStream(cfg, [fault] if fault else [])
    sent = 0  # rank-step summaries sent
    if batching is None:
        proc = factory.create_processor(pcfg, Telemetry(), verdicts.extend)
        proc.start()
        for _step, req in stream:
            if sink is not None:
                sink(req.SerializeToString())
            sent += _rank_steps(req)
            proc.process_traces(req)
            proc.tick(time.time())
    else:
        clock = SimClock()
        proc = StragglerProcessor(pcfg, Telemetry(), verdicts.extend, clock=clock)
        proc.start()

        def process(req: ExportTraceServiceRequest) -> None:
            nonlocal sent
            if sink is not None:
                sink(req.SerializeToString())
            sent += _rank_steps(req)
            proc.process_traces(req)

        drive(batched(stream, batching, seed=cfg.seed), process, proc.tick, clock)
    proc.shutdown(5.0)
    if stats is not None:
        stats.update(proc.stats(), rank_steps_sent=sent)
    node_host = stream.ranks[fault.rank].host if fault is not None and fault.kind == "node" else None
    group = None
    if fault is not None and expect_group is not None:
        group = set(stream.replicas[stream.ranks[fault.rank].dp_rank])
    return score_run(fault, verdicts, stream.healthy_rank_steps, node_host, group, bool(expect_group)), verdicts


def scenarios(reps: int, target_reps: int, quick: bool, rng: random.Random, layout: Layout) -> list[Run]:
    out: list[Run] = []

    def onset() -> int:
        return rng.randint(40, 60)

    world = layout.world_size

    def dev(stages: tuple[str, ...], size: float, forward_ms: float, name: str) -> Run:
        on = onset()
        return Run(name, Fault("device", rng.randrange(world), stages, size, on, on + 60), forward_ms)

    for _ in range(target_reps):
        out.append(dev(("forward-compute",), 0.05, TARGET_STAGE_MS, TARGET))
    sens = max(1, reps // 2)
    for size in SENS_SIZES:
        if size == 0.05:
            continue  # the target scenario is this point
        for _ in range(sens):
            out.append(dev(("forward-compute",), size, TARGET_STAGE_MS, f"device:fwd-20ms:+{size:.0%}"))
    for size in (0.03, 0.05, 0.10, 0.30):
        n = reps if size in (0.05, 0.10) else sens
        for _ in range(n):
            out.append(dev(("forward-compute",), size, 48.0, f"device:fwd-48ms:+{size:.0%}"))
            out.append(dev(COMPUTE_STAGES, size, 48.0, f"device:all-compute:+{size:.0%}"))
    k = max(1, reps // 2)
    for _ in range(k):
        on = onset()
        out.append(Run("host:forward-compute", Fault("host", rng.randrange(world), ("forward-compute",), 0.3, on,
                                                     on + 60)))
        on = onset()
        out.append(Run("dataloader", Fault("dataloader", rng.randrange(world), ("batch-generator",), 0.5, on,
                                           on + 60)))
        out.append(Run("intermittent", Fault("intermittent", rng.randrange(world), COMPUTE_STAGES, 0.3, onset(),
                                             None, duty=0.3)))
        out.append(Run("flapping", Fault("flapping", rng.randrange(world), COMPUTE_STAGES, 0.3, onset(), None,
                                         period=20)))
        out.append(Run("cohort-slowed", Fault("cohort", rng.randrange(world), COMPUTE_STAGES, 0.1, onset())))
        out.append(Run("unequal-workload", Fault("workload", rng.randrange(world), COMPUTE_STAGES, 0.15, 1)))
    for _ in range(reps if not quick else max(3, reps // 2)):
        out.append(Run("healthy", None))
        out.append(Run("healthy:20ms", None, TARGET_STAGE_MS))
    return out


def _rank_steps(req: object) -> int:
    """The rank-step summaries in a request (the step scope's spans)."""
    return sum(len(ss.spans) for rs in req.resource_spans  # type: ignore[attr-defined]
               for ss in rs.scope_spans if ss.scope.name == s.SCOPE_STEP_NAME)


SHAPES_SEED = 0x5A4E5  # the shapes' random stream: args.seed ^ this


def shape_scenarios(reps: int, rng: random.Random, layout: Layout) -> list[Run]:
    """The shapes of the module docstring, as separate entries; ``gpu-bound:*`` device faults give
    ``attribution_accuracy_gpu_bound``."""
    out: list[Run] = []
    world = layout.world_size
    sens = max(1, reps // 2)

    def onset(lo: int = 40, hi: int = 60) -> int:
        return rng.randint(lo, hi)

    def dev(stages: tuple[str, ...], size: float, forward_ms: float, name: str) -> Run:
        on = onset()
        return Run(name, Fault("device", rng.randrange(world), stages, size, on, on + 60), forward_ms,
                   REGIME_GPU_BOUND)

    for _ in range(reps):
        out.append(dev(("forward-compute",), 0.05, TARGET_STAGE_MS, "gpu-bound:device:fwd-20ms:+5%"))
        out.append(dev(COMPUTE_STAGES, 0.10, 48.0, "gpu-bound:device:all-compute:+10%"))
    for _ in range(sens):
        out.append(dev(("forward-compute",), 0.10, 48.0, "gpu-bound:device:fwd-48ms:+10%"))
        out.append(Run("gpu-bound:healthy", None, TARGET_STAGE_MS, REGIME_GPU_BOUND))
        on = onset()
        out.append(Run("host-stall:fwd-48ms:+30ms", Fault("host", rng.randrange(world), ("forward-compute",), 0.0,
                                                          on, on + 60, stall_ms=30.0)))
        on = onset()
        out.append(Run("host-starves:fwd-48ms:+60ms", Fault("host", rng.randrange(world), ("forward-compute",),
                                                            0.0, on, on + 60, stall_ms=60.0)))
        out.append(Run("ramp:fwd-20ms:+5%/150-steps", Fault("ramp", rng.randrange(world), ("forward-compute",),
                                                            0.05, onset(), None, ramp_steps=150),
                       TARGET_STAGE_MS, steps=260))
        on = onset(100, 140)
        fault = Fault("device", rng.randrange(world), ("forward-compute",), 0.10, on, on + 120)
        out.append(Run("late:70ms-steps:device:fwd-12ms:+10%", fault, 12.0, steps=300, batching=Batching()))
        out.append(Run("late:70ms-steps:healthy", None, 12.0, steps=300, batching=Batching()))
        on = onset(100, 140)
        fault = Fault("device", rng.randrange(world), ("forward-compute",), 0.10, on, on + 120)
        out.append(Run("late:delay-10s:device:fwd-12ms:+10%", fault, 12.0, steps=300,
                       batching=Batching(schedule_delay_s=10.0, max_batch=2048)))
    return out


PAIR_DDP_SEED = 0xD9_2DD9  # the DP = 2 / DDP scenarios' random stream: args.seed ^ this


def pair_ddp_scenarios(reps: int, healthy_steps: int, rng: random.Random) -> list[Run]:
    """DP = 2 (``pair``) and DDP (``collective_wait``, marked collective stages) scenarios."""
    out: list[Run] = []
    dp2 = Layout(tp=2, dp=2)
    dp2_tp1 = Layout(tp=1, dp=2)
    ddp8 = Layout(tp=1, dp=8)

    def onset() -> int:
        return rng.randint(40, 60)

    def dev(name: str, layout: Layout, stage: str, size: float, *, start: int | None = None, ddp: bool = False,
            marked: bool = False, expect: bool | None = None) -> Run:
        on = start if start is not None else onset()
        end = None if start is not None else on + 60
        return Run(name, Fault("device", rng.randrange(layout.world_size), (stage,), size, on, end, expect=expect),
                   layout=layout, ddp=ddp, marked=marked)

    fwd, bwd = "forward-compute", "backward-compute"
    for _ in range(reps):
        for size in (0.05, 0.10, 0.30):
            out.append(dev(f"dp2:device:fwd-48ms:+{size:.0%}", dp2, fwd, size))
        out.append(dev("dp2:tp1:device:fwd-48ms:+10%", dp2_tp1, fwd, 0.10))
        out.append(dev("dp2:from-start:fwd-48ms:+10%", dp2, fwd, 0.10, start=1))
        out.append(dev("dp2:tp1:from-start:fwd-48ms:+10%", dp2_tp1, fwd, 0.10, start=1, expect=False))
        out.append(Run("dp2:healthy", None, layout=dp2, steps=healthy_steps))
        for size in (0.10, 0.30):
            out.append(dev(f"ddp:device:fwd-48ms:+{size:.0%}", ddp8, fwd, size, ddp=True))
            out.append(dev(f"ddp:marked:device:fwd-48ms:+{size:.0%}", ddp8, fwd, size, ddp=True, marked=True))
        out.append(dev("ddp:device:bwd-96ms:+30%", ddp8, bwd, 0.30, ddp=True, expect=False))
        out.append(dev("ddp2:device:fwd-48ms:+30%", dp2_tp1, fwd, 0.30, ddp=True, expect=False))
        out.append(dev("ddp2:marked:device:fwd-48ms:+30%", dp2_tp1, fwd, 0.30, ddp=True, marked=True))
        out.append(Run("ddp:healthy", None, layout=ddp8, ddp=True))
    return out


BEYOND_SEED = 0xB3_0D0E  # the variable-workload and bad-node scenarios' random stream: args.seed ^ this


def beyond_scenarios(reps: int, rng: random.Random, layout: Layout) -> list[Run]:
    """Variable workload (``moe:*``: every rank's tokens x U(0.7, 1.3) per step, forward and backward time
    proportional; judged per unit, ``per_unit.py``) and a bad node (``node:*``: every rank of one host slowed,
    found by its node verdict, ``node.py``)."""
    out: list[Run] = []
    world = layout.world_size

    def onset() -> int:
        return rng.randint(40, 60)

    for _ in range(reps):
        for size, stages, label in ((0.10, COMPUTE_STAGES, "all-compute"), (0.05, COMPUTE_STAGES, "all-compute"),
                                    (0.10, ("forward-compute",), "fwd-48ms")):
            on = onset()
            out.append(Run(f"moe:+-30%:device:{label}:+{size:.0%}",
                           Fault("device", rng.randrange(world), stages, size, on, on + 60), token_spread=0.3))
        out.append(Run("moe:+-30%:healthy", None, token_spread=0.3))
        on = onset()
        out.append(Run("node:device:all-compute:+10%", Fault("node", rng.randrange(world), COMPUTE_STAGES, 0.10, on,
                                                            on + 60)))
        on = onset()
        out.append(Run("node:device:fwd-48ms:+5%", Fault("node", rng.randrange(world), ("forward-compute",), 0.05,
                                                        on, on + 60)))
    return out


def _beyond(args: argparse.Namespace, overrides: dict, t0: float) -> str:
    """Run ``beyond_scenarios`` (their own random stream: the other runs keep their draws), print their table,
    and return their ``beyond:`` line ('' when there are none)."""
    rng = random.Random(args.seed ^ BEYOND_SEED)
    reps = args.beyond_reps if args.beyond_reps is not None else (2 if args.quick else 6)
    runs = beyond_scenarios(reps, rng, Layout(tp=args.tp, dp=args.dp))
    if not runs:
        return ""
    seeds = [rng.getrandbits(32) for _ in runs]
    results: dict[str, list[RunScore]] = defaultdict(list)
    for i, (run, seed) in enumerate(zip(runs, seeds, strict=True)):
        score, _ = run_one(sim_config(args, run, seed), run.fault, overrides)
        results[run.name].append(score)
        if (i + 1) % 10 == 0 or i + 1 == len(runs):
            print(f"  variable workload / node: {i + 1}/{len(runs)} runs, {time.monotonic() - t0:.0f}s",
                  file=sys.stderr, flush=True)
    print("\nVariable workload (moe) and bad node (node) scenarios (see beyond_scenarios)")
    print(f"{'scenario':37} {'runs':>4} {'recall':>6} {'<=15':>6} {'med st':>6} {'p95 st':>6} {'stage':>5} "
          f"{'attr':>5} {'recov':>5} {'FA':>4}")
    fa = healthy = 0
    by_kind: dict[str, list[RunScore]] = defaultdict(list)
    for key in sorted(results):
        rs = results[key]
        fa += sum(r.false_alarms for r in rs)
        healthy += sum(r.healthy_rank_steps for r in rs)
        expect = rs[0].fault is not None and rs[0].fault.expect_straggler
        if expect:
            by_kind[key.split(":")[0]].extend(rs)
        print(f"{key:37} {_row(rs, expect)}")
    parts = [f"false_alarms={fa}", f"false_alarms_per_1e5={fa / max(1, healthy) * 1e5:.2f}",
             f"healthy_rank_steps={healthy}"]
    for kind, rs in sorted(by_kind.items()):
        st = [float(r.steps_to_detect) for r in rs if r.detected and r.steps_to_detect is not None]
        parts += [f"{kind}_recall={sum(r.detected for r in rs) / len(rs):.4g}",
                  f"{kind}_recall_within_15={sum(within(r) for r in rs) / len(rs):.4g}",
                  f"{kind}_p95_steps_to_detect={percentile(st, 0.95):.1f}"]
    return "beyond: " + " ".join(parts) + f" runs={len(runs)}"


GROUP_SEED = 0x6_0C_1D  # the model-parallel group scenarios' random stream: args.seed ^ this
GPU_WIDE = (*COMPUTE_STAGES, "optimizer-inner-step")  # a slow GPU: its collective-free optimizer step too


def group_scenarios(reps: int, rng: random.Random) -> list[Run]:
    """TP/CP/PP waits with a culprit (``culprit.py``): one GPU of a model-parallel group slowed while its peers
    wait inside their compute timers (``mp_sync``) or in ``p2p`` (``pp_sync``). ``culprit`` faults slow the
    rank's whole GPU (its collective-free optimizer step too): scored on the verdict naming it; ``group``
    faults are confined to the compute stages that hold the group's all-reduces, where no timer tells the
    members apart: scored on the group verdict naming its group. Victims convicted: straggler verdicts on the
    replica's other ranks without ``victim_of``."""
    out: list[Run] = []
    tp4 = Layout(tp=4, dp=8)
    tp2cp2 = Layout(tp=2, cp=2, dp=6)
    pp2 = Layout(tp=2, pp=2, dp=4)

    def onset() -> int:
        return rng.randint(40, 60)

    def fault(layout: Layout, stages: tuple[str, ...], size: float) -> Fault:
        on = onset()
        return Fault("device", rng.randrange(layout.world_size), stages, size, on, on + 60)

    for _ in range(reps):
        out.append(Run("tp4:culprit:gpu:+15%", fault(tp4, GPU_WIDE, 0.15), layout=tp4, mp_sync=True,
                       expect_group=False))
        out.append(Run("tp4:culprit:gpu:+5%", fault(tp4, GPU_WIDE, 0.05), layout=tp4, mp_sync=True,
                       expect_group=False))
        out.append(Run("tp4:group:all-compute:+15%", fault(tp4, COMPUTE_STAGES, 0.15), layout=tp4, mp_sync=True,
                       expect_group=True))
        out.append(Run("tp2cp2:culprit:gpu:+15%", fault(tp2cp2, GPU_WIDE, 0.15), layout=tp2cp2, mp_sync=True,
                       expect_group=False))
        out.append(Run("pp2tp2:culprit:gpu:+15%", fault(pp2, GPU_WIDE, 0.15), layout=pp2, mp_sync=True,
                       pp_sync=True, expect_group=False))
        out.append(Run("tp4:healthy", None, layout=tp4, mp_sync=True))
    return out


def _groups(args: argparse.Namespace, overrides: dict, t0: float) -> str:
    """Run ``group_scenarios`` (their own random stream), print their table, return their ``groups:`` line."""
    rng = random.Random(args.seed ^ GROUP_SEED)
    reps = args.group_reps if args.group_reps is not None else (2 if args.quick else 6)
    runs = group_scenarios(reps, rng)
    if not runs:
        return ""
    seeds = [rng.getrandbits(32) for _ in runs]
    results: dict[str, list[RunScore]] = defaultdict(list)
    for i, (run, seed) in enumerate(zip(runs, seeds, strict=True)):
        score, _ = run_one(sim_config(args, run, seed), run.fault, overrides, expect_group=run.expect_group)
        results[run.name].append(score)
        if (i + 1) % 6 == 0 or i + 1 == len(runs):
            print(f"  model-parallel groups: {i + 1}/{len(runs)} runs, {time.monotonic() - t0:.0f}s",
                  file=sys.stderr, flush=True)
    print("\nModel-parallel groups: culprit versus victims (see group_scenarios)")
    print(f"{'scenario':37} {'runs':>4} {'recall':>6} {'<=15':>6} {'med st':>6} {'p95 st':>6} {'stage':>5} "
          f"{'attr':>5} {'recov':>5} {'FA':>4} {'vict':>4}")
    fa = healthy = victims = 0
    found: list[RunScore] = []
    for key in sorted(results):
        rs = results[key]
        fa += sum(r.false_alarms for r in rs)
        healthy += sum(r.healthy_rank_steps for r in rs)
        victims += sum(r.victims_convicted for r in rs)
        expect = rs[0].fault is not None
        if expect:
            found.extend(rs)
        print(f"{key:37} {_row(rs, expect)} {sum(r.victims_convicted for r in rs):4d}")
    st = [float(r.steps_to_detect) for r in found if r.detected and r.steps_to_detect is not None]
    return (f"groups: false_alarms={fa} false_alarms_per_1e5={fa / max(1, healthy) * 1e5:.2f} "
            f"healthy_rank_steps={healthy} victims_convicted={victims} "
            f"recall={sum(r.detected for r in found) / max(1, len(found)):.4g} "
            f"recall_within_15={sum(within(r) for r in found) / max(1, len(found)):.4g} "
            f"p95_steps_to_detect={percentile(st, 0.95):.1f} runs={len(runs)}")


TPXPP_SEED = 0x7_9_9  # the TP x PP shapes' random stream: args.seed ^ this


def tpxpp_scenarios(reps: int, rng: random.Random) -> list[Run]:
    """TP x PP x DP jobs whose replica's ranks (TP peers and pipeline stages) wait for the replica's slowest
    compute in the optimizer's grad-norm all-reduce over the model-parallel group (``mp_optimizer_sync``), TP
    peers inside their compute timers (``mp_sync``). ``node``: every GPU of one host slowed (its TP groups
    with it); the other pipeline stage of the same replicas, on a healthy host, waits in the optimizer: a
    verdict on any other host is a false page. ``culprit``: one GPU slowed (its collective-free optimizer
    step too): found by the verdict naming it; ``group``: confined to its compute stages, found by the group
    verdict. ``vict``: a straggler verdict on another rank of the replica without ``victim_of`` (a victim
    paged, or named culprit)."""
    out: list[Run] = []
    tp4pp2 = Layout(tp=4, pp=2, dp=4)
    tp2pp2 = Layout(tp=2, pp=2, dp=8)

    def onset() -> int:
        return rng.randint(40, 60)

    def fault(kind: str, layout: Layout, stages: tuple[str, ...], size: float) -> Fault:
        on = onset()
        return Fault(kind, rng.randrange(layout.world_size), stages, size, on, on + 60)

    for _ in range(reps):
        out.append(Run("tp4pp2:node:all-compute:+10%", fault("node", tp4pp2, COMPUTE_STAGES, 0.10), layout=tp4pp2,
                       mp_sync=True, mp_optimizer_sync=True))
        out.append(Run("tp4pp2:node:gpu:+10%", fault("node", tp4pp2, GPU_WIDE, 0.10), layout=tp4pp2,
                       mp_sync=True, mp_optimizer_sync=True))
        out.append(Run("tp2pp2:culprit:gpu:+15%", fault("device", tp2pp2, GPU_WIDE, 0.15), layout=tp2pp2,
                       mp_sync=True, mp_optimizer_sync=True, expect_group=False))
        out.append(Run("tp2pp2:culprit:gpu:+5%", fault("device", tp2pp2, GPU_WIDE, 0.05), layout=tp2pp2,
                       mp_sync=True, mp_optimizer_sync=True, expect_group=False))
        out.append(Run("tp2pp2:group:all-compute:+15%", fault("device", tp2pp2, COMPUTE_STAGES, 0.15),
                       layout=tp2pp2, mp_sync=True, mp_optimizer_sync=True, expect_group=True))
        out.append(Run("tp4pp2:healthy", None, layout=tp4pp2, mp_sync=True, mp_optimizer_sync=True))
    return out


CONTENTION_SEED = 0xC0_4E  # the host-contention shapes' random stream: args.seed ^ this
HOST_ONLY = 10**9  # device_every: never timed on the device (a CPU job)


def contention_scenarios(reps: int, rng: random.Random) -> list[Run]:
    """Host contention (``contention`` faults, ``host_contention`` in docs/detector.md): an 8-rank DDP job on one
    host whose CPUs are oversubscribed, one rank descheduled three times as often as the others; timed on the
    host only (a CPU job) or on the device too. Any straggler verdict is a false page."""
    out: list[Run] = []
    ddp8 = Layout(tp=1, dp=8)
    stages = ("batch-generator", *COMPUTE_STAGES, "optimizer-inner-step")

    def fault(size: float) -> Fault:
        return Fault("contention", rng.randrange(ddp8.world_size), stages, size, 1, duty=0.3)

    for _ in range(reps):
        out.append(Run("contention:ddp8:host-only:x1", fault(1.0), layout=ddp8, ddp=True, device_every=HOST_ONLY))
        out.append(Run("contention:ddp8:host-only:x3", fault(3.0), layout=ddp8, ddp=True, device_every=HOST_ONLY))
        out.append(Run("contention:ddp8:device:x1", fault(1.0), layout=ddp8, ddp=True))
        out.append(Run("contention:ddp8:device:x3", fault(3.0), layout=ddp8, ddp=True))
    return out


INTERMITTENT_SEED = 0x1_7E_4  # the intermittent shapes' random stream: args.seed ^ this


def intermittent_scenarios(reps: int, rng: random.Random) -> list[Run]:
    """Periodic spikes of one rank (``periodic`` faults, ``intermittent_excess`` in docs/detector.md) and single
    spikes or one burst (``burst`` faults: any straggler verdict is a false page), DP 8 x TP 2, 200 steps."""
    out: list[Run] = []
    layout = Layout(tp=2, dp=8)
    fwd = ("forward-compute",)

    def fault(kind: str, stages: tuple[str, ...], size: float, period: int, expect: bool | None = None) -> Fault:
        on = rng.randint(40, 60)
        return Fault(kind, rng.randrange(layout.world_size), stages, size, on,
                     on + 100 if kind == "periodic" else None, period=period, expect=expect)

    for _ in range(reps):
        out.append(Run("intermittent:periodic:fwd-48ms:+30%/8", fault("periodic", fwd, 0.30, 8), layout=layout,
                       steps=200))
        out.append(Run("intermittent:periodic:all-compute:+50%/5", fault("periodic", COMPUTE_STAGES, 0.50, 5),
                       layout=layout, steps=200))
        out.append(Run("intermittent:periodic:fwd-48ms:+100%/16", fault("periodic", fwd, 1.0, 16), layout=layout,
                       steps=200))
        out.append(Run("intermittent:cheap:fwd-48ms:+10%/10", fault("periodic", fwd, 0.10, 10, expect=False),
                       layout=layout, steps=200))
        out.append(Run("intermittent:spike:fwd-48ms:+200%/1", fault("burst", fwd, 2.0, 1), layout=layout, steps=200))
        out.append(Run("intermittent:burst:all-compute:+100%/5", fault("burst", COMPUTE_STAGES, 1.0, 5),
                       layout=layout, steps=200))
        out.append(Run("intermittent:healthy", None, layout=layout, steps=200))
    return out


def _intermittent(args: argparse.Namespace, overrides: dict, t0: float) -> str:
    """``intermittent_scenarios``: their table and ``intermittent:`` line."""
    reps = args.intermittent_reps if args.intermittent_reps is not None else (2 if args.quick else 6)
    rng = random.Random(args.seed ^ INTERMITTENT_SEED)
    return _shape_table(args, overrides, t0, "intermittent", intermittent_scenarios(reps, rng), rng,
                        "Intermittent: periodic spikes of one rank, single spikes (see intermittent_scenarios)")


COLLECTIVE_SEED = 0xC0_11  # the collective-signal shapes' random stream: args.seed ^ this


def collective_scenarios(reps: int, rng: random.Random) -> list[Run]:
    """One rank's slow link in its DP ring (``link`` faults, the collective signal in docs/detector.md), a compute
    straggler, healthy jobs and a TP x PP bad node: see the module docstring."""
    out: list[Run] = []
    layout = Layout(tp=2, dp=8)
    tp4pp2 = Layout(tp=4, pp=2, dp=4)

    def fault(kind: str, size: float, stages: tuple[str, ...] = (), lay: Layout = layout) -> Fault:
        on = rng.randint(40, 60)
        return Fault(kind, rng.randrange(lay.world_size), stages, size, on, on + 60)

    for _ in range(reps):
        out.append(Run("collective:link:grad-sync:+50%", fault("link", 0.5), layout=layout))
        out.append(Run("collective:link:grad-sync:+20%", fault("link", 0.2), layout=layout))
        out.append(Run("collective:link:grad-sync:+50%:nvml", fault("link", 0.5), layout=layout, nvml=True))
        out.append(Run("collective:compute:fwd-48ms:+30%", fault("device", 0.3, ("forward-compute",)), layout=layout))
        out.append(Run("collective:healthy", None, layout=layout))
        out.append(Run("collective:healthy:nvml", None, layout=layout, nvml=True))
        out.append(Run("collective:tp4pp2:node:gpu:+10%", fault("node", 0.1, GPU_WIDE, tp4pp2), layout=tp4pp2,
                       mp_sync=True, mp_optimizer_sync=True))
    return out


def _collective(args: argparse.Namespace, overrides: dict, t0: float) -> str:
    """``collective_scenarios``: their table and ``collective:`` line ('' when there are none)."""
    from jobsim.job import ranks_of

    reps = args.collective_reps if args.collective_reps is not None else (2 if args.quick else 6)
    rng = random.Random(args.seed ^ COLLECTIVE_SEED)
    runs = collective_scenarios(reps, rng)
    if not runs:
        return ""
    seeds = [rng.getrandbits(32) for _ in runs]
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    for i, (run, seed) in enumerate(zip(runs, seeds, strict=True)):
        cfg = sim_config(args, run, seed)
        score, verdicts = run_one(cfg, run.fault, overrides)
        f = run.fault
        ring = ranks_of(cfg.layout)[f.rank].cohort if f is not None and f.kind == "link" else None
        signals = [v for v in verdicts if v.reason == "collective_slow"]
        hits = sorted((v for v in signals if ring is not None and v.cohort == ring and v.stage == "all-grads-sync"
                       and (v.step or 0) >= f.onset), key=lambda v: v.step or 0)  # type: ignore[union-attr]
        slow = [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER]
        rows[run.name].append({
            "signal": float(bool(hits)),
            "steps": float((hits[0].step or 0) - f.onset) if hits and f is not None else float("nan"),
            "named": float(bool(hits) and hits[0].link_rank == f.rank) if f is not None else 0.0,
            "wrong": float(sum(1 for v in signals if v.link_rank is not None and (f is None or v.link_rank != f.rank))),
            "fa": float(len(slow) if ring is not None else score.false_alarms),
            "false_sig": float(len(signals) - len(hits)),
            "healthy": float(score.healthy_rank_steps),
            "link": float(ring is not None),
        })
        if (i + 1) % 7 == 0 or i + 1 == len(runs):
            print(f"  collective: {i + 1}/{len(runs)} runs, {time.monotonic() - t0:.0f}s", file=sys.stderr,
                  flush=True)
    print("\nCollective signal: one rank's slow link in its DP ring (see collective_scenarios)")
    print(f"{'scenario':37} {'runs':>4} {'signal':>6} {'med st':>6} {'p95 st':>6} {'named':>5} {'wrong':>5} "
          f"{'FA':>4} {'false sig':>9} {'/1e5':>6}")
    tot = defaultdict(float)
    link_runs: list[dict[str, float]] = []
    for key in sorted(rows):
        rs = rows[key]
        n = len(rs)
        link = rs[0]["link"] > 0
        st = [r["steps"] for r in rs if r["signal"]]
        healthy = sum(r["healthy"] for r in rs)
        fs = sum(r["false_sig"] for r in rs)
        for k in ("fa", "false_sig", "healthy", "wrong"):
            tot[k] += sum(r[k] for r in rs)
        if link:
            link_runs.extend(rs)
        signal = sum(r["signal"] for r in rs) / n if link else float("nan")
        named = sum(r["named"] for r in rs) / n if link else float("nan")
        print(f"{key:37} {n:4d} {signal:6.3f} {median(st):6.1f} {percentile(st, 0.95):6.1f} {named:5.2f} "
              f"{int(sum(r['wrong'] for r in rs)):5d} {int(sum(r['fa'] for r in rs)):4d} {int(fs):9d} "
              f"{fs / max(1.0, healthy) * 1e5:6.2f}")
    st = [r["steps"] for r in link_runs if r["signal"]]
    return (f"collective: signal_recall={sum(r['signal'] for r in link_runs) / max(1, len(link_runs)):.4g} "
            f"p95_steps_to_signal={percentile(st, 0.95):.1f} wrong_names={int(tot['wrong'])} "
            f"false_pages={int(tot['fa'])} false_signals={int(tot['false_sig'])} "
            f"false_signals_per_1e5={tot['false_sig'] / max(1.0, tot['healthy']) * 1e5:.2f} "
            f"healthy_rank_steps={int(tot['healthy'])} runs={len(runs)}")


def _tpxpp(args: argparse.Namespace, overrides: dict, t0: float) -> str:
    """``tpxpp_scenarios``: their table and ``tpxpp:`` line."""
    reps = args.tpxpp_reps if args.tpxpp_reps is not None else (2 if args.quick else 6)
    rng = random.Random(args.seed ^ TPXPP_SEED)
    return _shape_table(args, overrides, t0, "tpxpp", tpxpp_scenarios(reps, rng), rng,
                        "TP x PP x DP: waits in the optimizer's model-parallel all-reduce (see tpxpp_scenarios)")


def _contention(args: argparse.Namespace, overrides: dict, t0: float) -> str:
    """``contention_scenarios``: their table and ``contention:`` line."""
    reps = args.contention_reps if args.contention_reps is not None else (2 if args.quick else 6)
    rng = random.Random(args.seed ^ CONTENTION_SEED)
    return _shape_table(args, overrides, t0, "contention", contention_scenarios(reps, rng), rng,
                        "Host contention on one machine (see contention_scenarios)")


def _shape_table(args: argparse.Namespace, overrides: dict, t0: float, label: str, runs: list[Run],
                 rng: random.Random, title: str) -> str:
    """Run ``runs`` (seeds from ``rng``), print their table per shape (recall, steps to detect, false pages per
    1e5 healthy rank-steps, victims named), return their ``<label>:`` line ('' when there are none)."""
    if not runs:
        return ""
    seeds = [rng.getrandbits(32) for _ in runs]
    results: dict[str, list[RunScore]] = defaultdict(list)
    expects = {run.name: run.fault is not None and (run.fault.expect_straggler or run.expect_group is not None)
               for run in runs}
    for i, (run, seed) in enumerate(zip(runs, seeds, strict=True)):
        score, _ = run_one(sim_config(args, run, seed), run.fault, overrides, expect_group=run.expect_group)
        results[run.name].append(score)
        if (i + 1) % 6 == 0 or i + 1 == len(runs):
            print(f"  {label}: {i + 1}/{len(runs)} runs, {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    print(f"\n{title}")
    print(f"{'scenario':37} {'runs':>4} {'recall':>6} {'<=15':>6} {'med st':>6} {'p95 st':>6} {'stage':>5} "
          f"{'attr':>5} {'recov':>5} {'FA':>4} {'FA/1e5':>7} {'vict':>4}")
    fa = healthy = victims = 0
    found: list[RunScore] = []
    for key in sorted(results):
        rs = results[key]
        n_fa = sum(r.false_alarms for r in rs)
        n_h = sum(r.healthy_rank_steps for r in rs)
        fa += n_fa
        healthy += n_h
        victims += sum(r.victims_convicted for r in rs)
        expect = expects[key]
        if expect:
            found.extend(rs)
        print(f"{key:37} {_row(rs, expect)} {n_fa / max(1, n_h) * 1e5:7.2f} {sum(r.victims_convicted for r in rs):4d}")
    st = [float(r.steps_to_detect) for r in found if r.detected and r.steps_to_detect is not None]
    return (f"{label}: false_alarms={fa} false_alarms_per_1e5={fa / max(1, healthy) * 1e5:.2f} "
            f"healthy_rank_steps={healthy} victims_convicted={victims} "
            f"recall={sum(r.detected for r in found) / len(found) if found else float('nan'):.4g} "
            f"recall_within_15={sum(within(r) for r in found) / len(found) if found else float('nan'):.4g} "
            f"p95_steps_to_detect={percentile(st, 0.95):.1f} runs={len(runs)}")


def sim_config(args: argparse.Namespace, run: Run, seed: int, job: str = "sim-job") -> SimConfig:
    return SimConfig(layout=run.layout or Layout(tp=args.tp, dp=args.dp), steps=run.steps or args.steps,
                     step_model=StepModel.with_forward_ms(run.forward_ms),
                     noise=Noise(jitter=args.jitter, host_jitter=args.host_jitter,
                                 step_jitter=args.step_jitter),
                     device_every=run.device_every or args.device_every, seed=seed, job=job, regime=run.regime,
                     ddp=run.ddp,
                     collective_marked=run.marked, token_spread=run.token_spread, mp_sync=run.mp_sync,
                     pp_sync=run.pp_sync, mp_optimizer_sync=run.mp_optimizer_sync, nvml=run.nvml)


def within(r: RunScore) -> bool:
    return r.detected and r.steps_to_detect is not None and r.steps_to_detect <= DETECT_WITHIN


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repetitions (< 1 minute)")
    ap.add_argument("--reps", type=int, default=None, help="runs per scenario (default 12, quick 4)")
    ap.add_argument("--target-reps", type=int, default=None, help="runs of the target scenario (default 120, quick 16)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device-every", type=int, default=1)
    ap.add_argument("--jitter", type=float, default=Noise.jitter, help="device time noise per stage-step (sigma)")
    ap.add_argument("--host-jitter", type=float, default=Noise.host_jitter, help="host time noise (sigma)")
    ap.add_argument("--step-jitter", type=float, default=Noise.step_jitter,
                    help="step time noise common to every rank of a step (sigma, on device times)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="override a processor config default (JSON value), e.g. --set tolerance=0.05")
    ap.add_argument("--plot", default=None, help="write the sensitivity plot (PNG) here")
    ap.add_argument("--otlp", type=int, default=0, metavar="N",
                    help="also send N runs through a real collector subprocess over OTLP/gRPC and compare verdicts")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--no-shapes", action="store_true", help="leave out the shape scenarios (shape_scenarios)")
    ap.add_argument("--shapes-only", action="store_true", help="run the shape scenarios alone (target_runs=0)")
    ap.add_argument("--pair-ddp-reps", type=int, default=None,
                    help="runs per DP = 2 / DDP scenario (default 6, quick 2; 0: none)")
    ap.add_argument("--pair-healthy-steps", type=int, default=600, help="steps of each dp2:healthy run")
    ap.add_argument("--pair-ddp-only", action="store_true", help="only the DP = 2 / DDP scenarios")
    ap.add_argument("--beyond-only", action="store_true", help="only the variable-workload / bad-node scenarios")
    ap.add_argument("--groups-only", action="store_true", help="only the model-parallel group scenarios")
    ap.add_argument("--tpxpp-only", action="store_true", help="only the TP x PP x DP scenarios")
    ap.add_argument("--contention-only", action="store_true", help="only the host-contention scenarios")
    ap.add_argument("--collective-only", action="store_true", help="only the collective-signal scenarios")
    ap.add_argument("--collective-reps", type=int, default=None,
                    help="runs per collective-signal scenario (default 6, quick 2; 0: none)")
    ap.add_argument("--intermittent-only", action="store_true", help="only the intermittent scenarios")
    ap.add_argument("--intermittent-reps", type=int, default=None,
                    help="runs per intermittent scenario (default 6, quick 2; 0: none)")
    ap.add_argument("--contention-reps", type=int, default=None,
                    help="runs per host-contention scenario (default 6, quick 2; 0: none)")
    ap.add_argument("--tpxpp-reps", type=int, default=None,
                    help="runs per TP x PP x DP scenario (default 6, quick 2; 0: none)")
    ap.add_argument("--group-reps", type=int, default=None,
                    help="runs per model-parallel group scenario (default 6, quick 2; 0: none)")
    ap.add_argument("--beyond-reps", type=int, default=None,
                    help="runs per variable-workload / bad-node scenario (default 6, quick 2; 0: none)")
    args = ap.parse_args()
    reps = args.reps or (4 if args.quick else 12)
    target_reps = args.target_reps or (16 if args.quick else 120)
    overrides = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    rng = random.Random(args.seed)
    layout = Layout(tp=args.tp, dp=args.dp)
    runs = scenarios(reps, target_reps, args.quick, rng, layout)
    seeds = [rng.getrandbits(32) for _ in runs]
    if args.shapes_only:
        runs, seeds = [], []
    shapes: list[Run] = []
    if not args.no_shapes:
        shape_rng = random.Random(args.seed ^ SHAPES_SEED)
        shapes = shape_scenarios(reps, shape_rng, layout)
        runs += shapes
        seeds += [shape_rng.getrandbits(32) for _ in shapes]
    if args.pair_ddp_only:
        runs, seeds, shapes = [], [], []
    t0 = time.monotonic()
    if args.beyond_only:
        print(_beyond(args, overrides, t0))
        return 0
    if args.groups_only:
        print(_groups(args, overrides, t0))
        return 0
    if args.tpxpp_only:
        print(_tpxpp(args, overrides, t0))
        return 0
    if args.contention_only:
        print(_contention(args, overrides, t0))
        return 0
    if args.intermittent_only:
        print(_intermittent(args, overrides, t0))
        return 0
    if args.collective_only:
        print(_collective(args, overrides, t0))
        return 0
    pair_line = _pair_ddp(args, overrides, t0)
    if args.pair_ddp_only:
        print(pair_line)
        return 0
    beyond_line = _beyond(args, overrides, t0)
    groups_line = _groups(args, overrides, t0)
    tpxpp_line = _tpxpp(args, overrides, t0)
    contention_line = _contention(args, overrides, t0)
    intermittent_line = _intermittent(args, overrides, t0)
    collective_line = _collective(args, overrides, t0)
    results: dict[str, list[RunScore]] = defaultdict(list)
    late_share: dict[str, list[float]] = defaultdict(list)  # scenario -> per run: late / offered step samples
    for i, (run, seed) in enumerate(zip(runs, seeds, strict=True)):
        stats: dict = {}
        score, _ = run_one(sim_config(args, run, seed), run.fault, overrides, batching=run.batching, stats=stats)
        results[run.name].append(score)
        late_share[run.name].append(stats["rejected_late"] / max(1, stats["rank_steps_sent"]))
        if (i + 1) % 25 == 0 or i + 1 == len(runs):
            print(f"  {i + 1}/{len(runs)} runs, {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)

    common = f" + {args.step_jitter:.1%} common to a step's ranks" if args.step_jitter else ""
    print(f"\ndevice jitter {args.jitter:.1%}/step{common}, host jitter {args.host_jitter or args.jitter:.1%}, "
          f"device every {args.device_every}, DP {args.dp} x TP {args.tp}, {args.steps} steps, overrides {overrides}")
    print(f"{'scenario':37} {'runs':>4} {'recall':>6} {'<=15':>6} {'med st':>6} {'p95 st':>6} {'stage':>5} "
          f"{'attr':>5} {'recov':>5} {'FA':>4} {'flap':>4} {'late%':>6}")
    all_fa = 0
    healthy_rs = 0
    attr: list[bool] = []
    attr_gpu_bound: list[bool] = []
    shapes_within: list[bool] = []
    flaps = 0
    late_all: list[float] = []
    shape_names = {r.name for r in shapes}
    stage_ok: list[bool] = []
    recov: list[float] = []
    for key in sorted(results):
        rs = results[key]
        all_fa += sum(r.false_alarms for r in rs)
        healthy_rs += sum(r.healthy_rank_steps for r in rs)
        expect = rs[0].fault is not None and rs[0].fault.expect_straggler
        det = [r for r in rs if r.detected]
        rc = [float(r.recovered_after) for r in det if r.recovered_after is not None]
        late = late_share[key]
        print(f"{key:37} {_row(rs, expect)} {sum(r.flaps for r in rs):4d} {100 * sum(late) / len(late):6.2f}")
        fault = rs[0].fault
        big = fault is not None and (fault.size >= 0.05 or fault.stall_ms is not None)
        if expect and big:
            (attr_gpu_bound if key.startswith("gpu-bound:") else attr).extend(
                bool(r.attribution_correct) for r in det)
            stage_ok.extend(bool(r.stage_correct) for r in det)
            recov.extend(rc)
        if key in shape_names:
            if expect:
                shapes_within.extend(within(r) for r in rs)
            flaps += sum(r.flaps for r in rs)
            if key.startswith("late:"):
                late_all.extend(late)
    target = results.get(TARGET, [])
    st5 = [float(r.steps_to_detect) for r in target if r.detected and r.steps_to_detect is not None]
    summary: dict[str, object] = {
        "recall": round(sum(r.detected for r in target) / max(1, len(target)), 4),
        "recall_within_15": round(sum(within(r) for r in target) / max(1, len(target)), 4),
        "p95_steps_to_detect": round(percentile(st5, 0.95), 1),
        "median_steps_to_detect": round(median(st5), 1),
        "false_alarms_per_1e5": round(all_fa / max(1, healthy_rs) * 1e5, 2),
        "false_alarms": all_fa,
        "attribution_accuracy": round(sum(attr) / max(1, len(attr)), 4),
        "stage_accuracy": round(sum(stage_ok) / max(1, len(stage_ok)), 4),
        "median_recovery_steps": round(median(recov), 1), "target_runs": len(target), "runs": len(runs),
        "healthy_rank_steps": healthy_rs, "device_every": args.device_every, "jitter": args.jitter,
        **({"step_jitter": args.step_jitter} if args.step_jitter else {}),
    }
    if not args.no_shapes:
        summary.update({
            "attribution_accuracy_gpu_bound": round(sum(attr_gpu_bound) / max(1, len(attr_gpu_bound)), 4),
            "shapes_recall_within_15": round(sum(shapes_within) / max(1, len(shapes_within)), 4),
            "flaps": flaps,
            "late_share": round(sum(late_all) / max(1, len(late_all)), 5),
        })
    if args.otlp:
        picks = [i for i, r in enumerate(runs) if r.name == TARGET][: max(1, args.otlp - args.otlp // 3)]
        picks += [i for i, r in enumerate(runs) if r.name in ("healthy:20ms", "host:forward-compute")][
            : args.otlp - len(picks)]
        ok, detail = compare_otlp(args, [(runs[i], seeds[i]) for i in picks], overrides)
        print(f"OTLP check: {detail}")
        summary["otlp_runs"] = len(picks)
        summary["otlp_equal"] = ok
    summary["seconds"] = round(time.monotonic() - t0, 1)
    if args.plot:
        _plot(results, args.plot, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    if pair_line:
        print(pair_line)
    if beyond_line:
        print(beyond_line)
    if groups_line:
        print(groups_line)
    if tpxpp_line:
        print(tpxpp_line)
    if contention_line:
        print(contention_line)
    if intermittent_line:
        print(intermittent_line)
    if collective_line:
        print(collective_line)
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


def _row(rs: list[RunScore], expect: bool) -> str:
    """One scenario's cells from ``runs`` to ``FA``: recall and within-15 are nan where no verdict is expected."""
    det = [r for r in rs if r.detected]
    st = [float(r.steps_to_detect) for r in det if r.steps_to_detect is not None]
    rc = [float(r.recovered_after) for r in det if r.recovered_after is not None]
    recall = len(det) / len(rs) if expect else float("nan")
    rec15 = sum(within(r) for r in rs) / len(rs) if expect else float("nan")
    return (f"{len(rs):4d} {recall:6.3f} {rec15:6.3f} {median(st):6.1f} {percentile(st, 0.95):6.1f} "
            f"{sum(bool(r.stage_correct) for r in det) / max(1, len(det)):5.2f} "
            f"{sum(bool(r.attribution_correct) for r in det) / max(1, len(det)):5.2f} "
            f"{median(rc):5.1f} {sum(r.false_alarms for r in rs):4d}")


def _pair_ddp(args: argparse.Namespace, overrides: dict, t0: float) -> str:
    """Run the DP = 2 / DDP scenarios (their own random stream: the other runs keep their draws), print their
    table, and return their ``pair_ddp:`` line ('' when there are none)."""
    rng = random.Random(args.seed ^ PAIR_DDP_SEED)
    reps = args.pair_ddp_reps if args.pair_ddp_reps is not None else (2 if args.quick else 6)
    runs = pair_ddp_scenarios(reps, args.pair_healthy_steps, rng)
    if not runs:
        return ""
    seeds = [rng.getrandbits(32) for _ in runs]
    results: dict[str, list[RunScore]] = defaultdict(list)
    for i, (run, seed) in enumerate(zip(runs, seeds, strict=True)):
        score, _ = run_one(sim_config(args, run, seed), run.fault, overrides)
        results[run.name].append(score)
        if (i + 1) % 25 == 0 or i + 1 == len(runs):
            print(f"  DP = 2 / DDP: {i + 1}/{len(runs)} runs, {time.monotonic() - t0:.0f}s", file=sys.stderr,
                  flush=True)
    print("\nDP = 2 and DDP scenarios (their own layouts, see the module docstring)")
    print(f"{'scenario':34} {'runs':>4} {'recall':>6} {'<=15':>6} {'med st':>6} {'p95 st':>6} {'stage':>5} "
          f"{'attr':>5} {'recov':>5} {'FA':>4}")
    fa = healthy = 0
    expected: list[RunScore] = []
    stage_ok: list[bool] = []
    for key in sorted(results):
        rs = results[key]
        fa += sum(r.false_alarms for r in rs)
        healthy += sum(r.healthy_rank_steps for r in rs)
        expect = rs[0].fault is not None and rs[0].fault.expect_straggler
        if expect:
            expected.extend(rs)
            stage_ok.extend(bool(r.stage_correct) for r in rs if r.detected)
        print(f"{key:34} {_row(rs, expect)}")
    n = max(1, len(expected))
    return (f"pair_ddp: false_alarms={fa} false_alarms_per_1e5={fa / max(1, healthy) * 1e5:.2f} "
            f"healthy_rank_steps={healthy} recall={sum(r.detected for r in expected) / n:.4g} "
            f"recall_within_15={sum(within(r) for r in expected) / n:.4g} "
            f"stage_accuracy={sum(stage_ok) / max(1, len(stage_ok)):.4g} runs={len(runs)}")


# --- through a real collector over OTLP/gRPC ---------------------------------------------------------------------
def _verdict_key(job: str, rank: int, stage: str, verdict: str, reason: str, step: int | None,
                 attribution: str, deviation: float | None) -> tuple:
    return (job, rank, stage, verdict, reason, step, attribution,
            None if deviation is None else round(deviation, 6))


def compare_otlp(args: argparse.Namespace, picked: list[tuple[Run, int]], overrides: dict) -> tuple[bool, str]:
    """Send each picked run (its own job id) through ``python -m collector_processor`` over OTLP/gRPC, stop it
    with SIGTERM (which judges every open window), and compare its evidence JSONL with in-process verdicts."""
    import grpc
    import yaml
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    expected: set[tuple] = set()
    requests: list[bytes] = []
    for i, (run, seed) in enumerate(picked):
        cfg = sim_config(args, run, seed, job=f"otlp-{i}")
        _, verdicts = run_one(cfg, run.fault, overrides, sink=requests.append)
        expected |= {_verdict_key(v.job, v.rank, v.stage, v.verdict, v.reason, v.step, v.attribution, v.deviation)
                     for v in verdicts}
    with tempfile.TemporaryDirectory() as tmp:
        evidence = Path(tmp) / "verdicts.jsonl"
        port = free_port()
        conf = {
            "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"127.0.0.1:{port}"}}}},
            "processors": {"straggler": overrides},
            "exporters": {"debug": {"verbosity": "basic"},
                          "file/evidence": {"path": str(evidence), "flush_interval": "0.2s"}},
            "service": {"pipelines": {
                "traces": {"receivers": ["otlp"], "processors": ["straggler"], "exporters": ["debug"]},
                "logs/verdicts": {"receivers": ["straggler"], "exporters": ["file/evidence"]},
            }},
        }
        cfg_path = Path(tmp) / "collector.yaml"
        cfg_path.write_text(yaml.safe_dump(conf))
        log = (Path(tmp) / "collector.log").open("w")
        proc = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config", str(cfg_path),
                                 "--log-level", "WARNING"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            for raw in requests:
                stub.Export(ExportTraceServiceRequest.FromString(raw), timeout=30)
            channel.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            log.close()
        got: set[tuple] = set()
        if evidence.exists():
            for line in evidence.read_text().splitlines():
                d = json.loads(line)
                got.add(_verdict_key(d["job"], d["rank"], d["stage"], d["verdict"], d["reason"], d["step"],
                                     d["attribution"], d["deviation"]))
    missing, extra = expected - got, got - expected
    n_str = sum(1 for k in expected if k[3] == "straggler")
    detail = (f"{len(picked)} runs, {len(requests)} requests, {len(expected)} verdicts in-process "
              f"({n_str} straggler), {len(got)} from the collector's evidence JSONL: "
              f"{'EQUAL' if not missing and not extra else f'{len(missing)} missing, {len(extra)} extra'}")
    return not missing and not extra, detail


def _plot(results: dict[str, list[RunScore]], path: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = (("device:fwd-20ms", "forward-compute 20 ms", "C0"),
              ("device:fwd-48ms", "forward-compute 48 ms", "C1"),
              ("device:all-compute", "forward+backward 48+96 ms", "C2"))
    for prefix, label, color in series:
        xs, ys, y15 = [], [], []
        for size in SENS_SIZES:
            key = TARGET if (prefix == "device:fwd-20ms" and size == 0.05) else f"{prefix}:+{size:.0%}"
            rs = results.get(key)
            if rs:
                xs.append(size * 100)
                ys.append(sum(r.detected for r in rs) / len(rs))
                y15.append(sum(within(r) for r in rs) / len(rs))
        ax.plot(xs, ys, marker="o", color=color, label=f"{label}: detected")
        ax.plot(xs, y15, marker="x", ls="--", color=color, label=f"{label}: within {DETECT_WITHIN} steps")
    ax.axhline(0.99, color="grey", ls=":", lw=0.8)
    ax.axvline(5, color="grey", ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.minorticks_off()
    ticks = [size * 100 for size in SENS_SIZES]
    ax.set_xticks(ticks, [f"+{t:g}%" for t in ticks])
    ax.set_ylim(-0.02, 1.05)
    ax.set_xlabel("injected device slowdown of one rank")
    ax.set_ylabel("detection rate")
    ax.set_title(f"Sensitivity (device jitter {args.jitter:.1%}/step, device every {args.device_every}, "
                 f"DP {args.dp} x TP {args.tp})", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())

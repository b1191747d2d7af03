"""The demo's options, their checks, and the records a run produces (shared by ``run`` and ``report``).

Every check runs before anything starts, so a bad combination is an error message, not a run that cannot
show what it was asked to show.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from otel_straggler_demo.megatron_gpt import SIZES

if TYPE_CHECKING:
    from collector_processor.processor.straggler.config import Config

TOY = "toy"
MEGATRON_MODELS = tuple(f"megatron:{name}" for name in SIZES)
MODELS = (TOY, *MEGATRON_MODELS)

# Timers of the toy trainer's loop the detector judges, and each one's nominal time per interval (an
# attribute of DemoOptions; batch-generator has none: it is only the tiny batch fetch).
TOY_STAGES = {"forward-compute": "forward_ms", "backward-compute": "backward_ms",
              "optimizer-inner-step": "optimizer_ms", "batch-generator": None}
PER_MICROBATCH = ("forward-compute", "backward-compute", "batch-generator")
# Megatron timers that are never judged: collectives (the peers wait there for a straggler) and the step.
NOT_JUDGED = ("forward-backward", "all-grads-sync", "params-all-gather")

DEFAULT_INJECT_RANK = 3
FLOOR_MARGIN = 1.5  # the injected gap per step must be at least this multiple of the detector's absolute floor


class OptionError(ValueError):
    """A demo option (or combination) that cannot work; the message says why and what to do."""


@dataclass
class DemoOptions:
    ranks: int = 8
    steps: int = 200
    microbatches: int = 4
    # Toy model: "accelerator time" per microbatch (forward, backward) and per step (optimizer). Sized so
    # the default +10 % stands clear of host jitter on a loaded 2-core machine and of the detector's
    # absolute floor: bench/results/demo-under-load.md.
    forward_ms: float = 50.0
    backward_ms: float = 25.0
    optimizer_ms: float = 6.0
    inject_rank: int | None = DEFAULT_INJECT_RANK
    inject_stage: str = "forward-compute"
    inject_slowdown: float = 0.10
    inject_kind: str = "host"  # host | device
    inject_from: int = 50
    inject_until: int | None = None  # first step back at par (None: never)
    endpoint: str | None = None  # external collector (OTLP); None = start one here
    protocol: str = "grpc"  # grpc | http/protobuf
    out: str = "otel-straggler-demo"
    json: bool = False
    quiet: bool = False
    model: str = TOY  # one of MODELS
    inject_ms: float | None = None  # absolute delay per interval (overrides slowdown x nominal time)
    gpu_turns: bool = False  # megatron mode: ranks sharing one GPU take turns (clean device intervals)
    stall_timeout_s: float = 900.0  # no progress from rank 0 for this long: the run is stopped and fails
    job_id: str = field(default_factory=lambda: f"demo-{int(time.time())}")


def default_inject_rank(ranks: int) -> int:
    """Rank 3 when the job has one, else the last rank."""
    return min(DEFAULT_INJECT_RANK, ranks - 1)


def nominal_stage_ms(opts: DemoOptions) -> float | None:
    """The injected stage's nominal time per step in the toy model (None: unknown)."""
    if opts.model != TOY:
        return None
    attr = TOY_STAGES.get(opts.inject_stage)
    if attr is None:
        return None
    per_interval = float(getattr(opts, attr))
    return per_interval * (opts.microbatches if opts.inject_stage in PER_MICROBATCH else 1)


def inject_delay_ms(opts: DemoOptions) -> float:
    """Delay added to every interval of the injected stage."""
    if opts.inject_ms is not None:
        return opts.inject_ms
    if opts.model == TOY:
        attr = TOY_STAGES.get(opts.inject_stage)
        return float(getattr(opts, attr)) * opts.inject_slowdown if attr else 0.0
    return opts.forward_ms * opts.inject_slowdown


def inject_gap_ms(opts: DemoOptions) -> float:
    """The injected stage's extra time per step (the gap the detector sees against a peer)."""
    per_step = opts.microbatches if opts.inject_stage in PER_MICROBATCH else 1
    return inject_delay_ms(opts) * per_step


def injecting(opts: DemoOptions) -> bool:
    return opts.inject_rank is not None and (opts.inject_slowdown > 0 or bool(opts.inject_ms))


def describe_injection(opts: DemoOptions) -> str:
    """The injected slowdown in words ("none" when the run injects nothing)."""
    if not injecting(opts):
        return "none"
    size = f"+{opts.inject_ms:g} ms per interval" if opts.inject_ms is not None else f"+{opts.inject_slowdown:.0%}"
    until = f" until step {opts.inject_until}" if opts.inject_until else ""
    return (f"rank {opts.inject_rank} {opts.inject_stage} {size} ({opts.inject_kind}) from step "
            f"{opts.inject_from}{until}")


def straggler_overrides(ranks: int) -> dict[str, Any]:
    """The demo's only departure from the shipped straggler settings: with 2 ranks each one is compared with
    its single peer (``min_cohort_size`` 2 instead of 3)."""
    return {"min_cohort_size": 2} if ranks == 2 else {}


def detector_settings(ranks: int = 8) -> Config:
    """The straggler processor's settings in the collector the demo starts (defaults + overrides)."""
    from collector_processor.processor.straggler.config import Config

    return Config(**straggler_overrides(ranks))


def check_options(opts: DemoOptions, det: Config) -> None:
    """Raise OptionError for options the demo cannot run or cannot show. ``det`` holds the settings of the
    detector in the collector the demo starts (``detector_settings``)."""
    absolute_floor_ms, window_steps = det.absolute_floor_ms, det.window_steps
    persistence_windows = det.persistence_windows
    for name in ("ranks", "steps", "microbatches"):
        if getattr(opts, name) < 1:
            raise OptionError(f"--{name} must be >= 1")
    if opts.ranks < 2:
        raise OptionError("--ranks must be >= 2: a straggler is slow relative to its peers")
    if opts.model not in MODELS:
        raise OptionError(f"--model {opts.model!r} is not one of: {', '.join(MODELS)}")
    if opts.inject_kind not in ("host", "device"):
        raise OptionError(f"--inject-kind {opts.inject_kind!r} is not host or device")
    if opts.stall_timeout_s <= 0:
        raise OptionError("--stall-timeout must be > 0 seconds")
    # ranges first: a value out of range is a mistake, not a way to switch the injection off
    if not 0 <= opts.inject_slowdown <= 10:
        raise OptionError("--inject-slowdown is a fraction between 0 and 10 (0.10 = +10%)")
    if opts.inject_ms is not None and opts.inject_ms < 0:
        raise OptionError("--inject-ms must be >= 0")
    if not injecting(opts):
        return
    assert opts.inject_rank is not None
    if not 0 <= opts.inject_rank < opts.ranks:
        raise OptionError(f"--inject-rank {opts.inject_rank} is not below --ranks {opts.ranks}")
    if opts.inject_stage in NOT_JUDGED:
        raise OptionError(f"--inject-stage {opts.inject_stage} is never judged (a collective or the whole "
                          "step: the peers wait there for a straggler); slow a compute stage instead, "
                          "e.g. forward-compute")
    if opts.model == TOY and opts.inject_stage not in TOY_STAGES:
        raise OptionError(f"--inject-stage {opts.inject_stage!r} is not a judged timer of the toy model: "
                          f"{', '.join(TOY_STAGES)}")
    if opts.model == TOY and TOY_STAGES[opts.inject_stage] is None and opts.inject_ms is None:
        raise OptionError(f"--inject-stage {opts.inject_stage} has no nominal time to scale by "
                          "--inject-slowdown; give the delay with --inject-ms")
    if opts.inject_from < 0:
        raise OptionError("--inject-from must be >= 0")
    if opts.inject_from >= opts.steps:
        raise OptionError(f"--steps {opts.steps} ends before --inject-from {opts.inject_from}: "
                          "nothing would be slowed")
    # The detector convicts after `persistence_windows` slow windows, plus one for an onset inside a window.
    need = (persistence_windows + 1) * window_steps
    if opts.steps - opts.inject_from < need:
        raise OptionError(
            f"--steps {opts.steps} leaves {opts.steps - opts.inject_from} slowed steps after --inject-from "
            f"{opts.inject_from}; the detector needs at least {need} ({persistence_windows} slow windows of "
            f"{window_steps} steps to convict, and one partly slowed): use --steps {opts.inject_from + need} "
            "or more")
    if opts.inject_until is not None and opts.inject_until <= opts.inject_from:
        raise OptionError(f"--inject-until {opts.inject_until} must be after --inject-from {opts.inject_from}")
    # A measured gap scatters around the injected one: keep it clear of the floor, not just at it. Toy model
    # only: its stages are timed on the host alone, where the host floor applies and its margin was measured
    # (bench/results/demo-under-load.md). A megatron model's stages are judged on device time too, whose floor
    # (device_floor_ms, or the host floor under device_min_stage_ms) depends on stage times known only once it
    # runs; a gap under the floor that applies is named in the run's "not detected" reason.
    gap = inject_gap_ms(opts)
    if opts.endpoint is None and opts.model == TOY and gap < FLOOR_MARGIN * absolute_floor_ms:
        nominal = nominal_stage_ms(opts)
        what = (f"+{opts.inject_slowdown:.0%} of {opts.inject_stage} ({nominal:.0f} ms per step)"
                if opts.inject_ms is None and nominal else f"{opts.inject_stage} +{inject_delay_ms(opts):.2f} ms "
                "per interval")
        raise OptionError(
            f"{what} adds {gap:.1f} ms per step, too close to the detector's absolute floor of "
            f"{absolute_floor_ms:g} ms (a gap under it is reported as uncertain/below_absolute_floor, never as a "
            f"straggler; the demo asks for {FLOOR_MARGIN:g}x the floor): raise --inject-slowdown, --inject-ms or "
            "--microbatches")


def require_model_runtime(model: str) -> None:
    """Raise OptionError unless ``model`` can run here (megatron models: CUDA and megatron-core)."""
    if not model.startswith("megatron:"):
        return
    try:
        import torch
    except ImportError as exc:
        raise OptionError(f"--model {model} needs torch with CUDA: {exc}") from exc
    if not torch.cuda.is_available():
        raise OptionError(f"--model {model} runs a megatron-core GPT on CUDA, and this machine has no CUDA "
                          f"device (torch {torch.__version__}); use --model {TOY} here")
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise OptionError(f"--model {model} needs megatron-core (pip install 'otel-straggler[megatron]'): "
                          f"{exc}") from exc


@dataclass
class Detection:
    rank: int
    stage: str
    verdict: str
    deviation: float | None
    steps_to_detect: int | None
    attribution: str
    step: int | None
    injected: bool  # the injected rank and stage, convicted once its slowdown began (else a false alarm)
    recovered_step: int | None = None
    step_time_lost_ms: float | None = None
    gpu_seconds_per_hour: float | None = None
    host: str = ""
    gpu: str = ""
    reference_rank: int | None = None


@dataclass
class DemoResult:
    detected: list[Detection]
    false_alarms: int
    verdicts: int
    injected: dict
    report_html: str | None
    report_png: str | None
    evidence: str | None
    spans_seen: int
    elapsed_s: float
    ok: bool
    # Why the run failed, one line each (empty when ok): a rank that failed, the injected rank not
    # detected (with the detector's reason), a false alarm.
    problems: list[str] = field(default_factory=list)
    metrics: str | None = None  # the collector's /metrics, scraped at the end of the run
    stage_times: str | None = None  # CSV of every rank's stage times per step, as the collector saw them
    # stage times the trace tap did not keep (its cap reached): missing from stage_times and the report
    stage_points_dropped: int = 0

    def to_json(self) -> str:
        d = asdict(self)
        d["detected"] = [
            {k: v for k, v in asdict(x).items() if k in (
                "rank", "stage", "verdict", "deviation", "steps_to_detect", "attribution", "recovered_step",
                "step_time_lost_ms", "gpu_seconds_per_hour", "step", "injected")}
            for x in self.detected
        ]
        return json.dumps(d, sort_keys=True)

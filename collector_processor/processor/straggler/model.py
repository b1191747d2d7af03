"""Data passed between the straggler processor's parts: span -> sample -> window -> verdict.

``StageSample`` is what one stage span becomes after decoding (one rank, one stage, one step);
``StepSummary`` is what one ``rank-step`` span's step summary becomes (one rank, one step, every stage:
parallel lists, so a rank-step costs one object, not one per stage).
``Verdict`` is what the detector concludes about one rank and stage at a window's close; the
processor turns it into an OTel log record, a verdict span, Prometheus series and an evidence line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import otel_straggler_schema as s


def _reason(name: str) -> str:
    """A ``straggler.reason`` value, checked against the schema's list at import."""
    if name not in s.REASONS:
        raise ValueError(f"{name!r} is not in otel_straggler_schema.REASONS")
    return name


# ``Verdict.reason`` values (``schema.REASONS``), named after the rule that gives each (docs/detector.md)
SLOWER_THAN_REFERENCE = _reason("slower_than_reference")  # straggler: window_excess + persistence
PERSISTENT_EXCESS = _reason("persistent_excess")  # straggler: sequential_excess
WITHIN_TOLERANCE = _reason("within_tolerance")  # recovered: recovery
BELOW_ABSOLUTE_FLOOR = _reason("below_absolute_floor")  # uncertain: absolute_floor
WORKLOAD_INCOMPARABLE = _reason("workload_incomparable")  # uncertain: workload
COHORT_BELOW_MIN_SIZE = _reason("cohort_below_min_size")  # uncertain: min_cohort
MISSING_SAMPLES = _reason("missing_samples")  # uncertain: device_samples_missing
RECOVERY_EVIDENCE_INSUFFICIENT = _reason("recovery_evidence_insufficient")  # uncertain: hold
NON_FINITE_SAMPLE = _reason("non_finite_sample")  # uncertain: non_finite
PAIR_AMBIGUOUS = _reason("pair_ambiguous")  # uncertain: pair
COLLECTIVE_WAIT = _reason("collective_wait")  # uncertain: collective_wait
NODE_SLOW = _reason("node_slow")  # straggler: node (node.py)
HOST_CONTENTION = _reason("host_contention")  # uncertain: host_contention
GROUP_SLOW = _reason("group_slow")  # straggler: culprit (culprit.py), no member of the group named
INTERMITTENT_EXCESS = _reason("intermittent_excess")  # straggler: intermittent_excess (intermittent.py)
COLLECTIVE_SLOW = _reason("collective_slow")  # uncertain: collective signal (collective_signal.py), never a page


@dataclass(slots=True)
class StageSample:
    job: str
    cohort: str
    rank: int
    host: str
    gpu: str
    world_size: int
    stage: str  # Megatron timer name (or "rank-step" for the per-rank step span)
    group: str  # stage group from otel_straggler_schema.STAGE_GROUPS
    step: int | None  # dl.iteration; None -> wall-clock windows
    device_ms: float | None  # None when the span carried no device time
    host_ms: float | None
    count: int  # intervals aggregated into the span
    tokens: int | None  # workload, None when not published
    start_unix_ns: int
    end_unix_ns: int
    trace_id: bytes  # 16 bytes
    span_id: bytes  # 8 bytes
    dp_size: int = 0  # dl.data_parallel.size: the ranks the cohort should have (0 = not published)
    collective: bool = False  # straggler.stage.collective: the stage contains a wait in a collective
    dp_rank: int = -1  # dl.data_parallel.rank: the rank's DP replica (-1 = not published)


@dataclass(slots=True)
class StepSummary:
    job: str
    cohort: str
    rank: int
    host: str
    gpu: str
    world_size: int
    dp_size: int
    step: int
    tokens: int | None
    start_unix_ns: int
    end_unix_ns: int
    trace_id: bytes
    span_id: bytes  # the rank-step span's id: deterministic per (job, step, rank), the dedup key
    stages: list[str]  # the rank-step itself first (host time of the whole step), then one per timer
    groups: list[str]
    device_ms: list[float | None]  # None: not measured or not finite
    host_ms: list[float | None]  # None: not finite (an entry with neither is present but unusable)
    counts: list[int]
    collective: Sequence[str] = ()  # straggler.summary.collective: timers whose interval holds a collective wait
    dp_rank: int = -1  # dl.data_parallel.rank: the rank's DP replica (-1 = not published)
    gpu_hints: dict[str, object] | None = None  # the rank-step's NVML sample (straggler.gpu.*; hints.py)

    def samples(self) -> list[StageSample]:
        """One StageSample per entry (the stage-span path's form), e.g. for tests and tools."""
        return [StageSample(self.job, self.cohort, self.rank, self.host, self.gpu, self.world_size, stage,
                            self.groups[i], self.step, self.device_ms[i], self.host_ms[i], self.counts[i],
                            self.tokens, self.start_unix_ns, self.end_unix_ns, self.trace_id,
                            self.span_id + stage.encode(), self.dp_size, stage in self.collective, self.dp_rank)
                for i, stage in enumerate(self.stages)]


@dataclass(slots=True)
class Verdict:
    job: str
    cohort: str
    rank: int
    host: str
    gpu: str
    stage: str
    group: str
    verdict: str  # schema.VERDICTS
    reason: str  # schema.REASONS
    deviation: float | None  # (value - reference) / reference
    value_ms: float | None
    reference_rank: int | None
    reference_ms: float | None
    measurement: str  # schema.MEASUREMENT_DEVICE / MEASUREMENT_HOST_ONLY
    window_start: int  # first step of the window (or wall-clock window index)
    window_end: int  # last step, inclusive
    step: int | None  # the step at which the verdict fired (window_end for step windows)
    attribution: str  # schema.ATTRIBUTIONS
    step_time_lost_ms: float  # excess time per step on the critical path
    gpu_seconds_per_hour: float  # step_time_lost * waiting ranks * steps per hour
    cohort_size: int  # effective comparable ranks (including this one)
    collective_evidence: str  # e.g. "waits_least:grad-sync" or ""
    trace_id: bytes  # trace of the step where the verdict fired (16 bytes, may be empty)
    emitted_unix_ns: int = 0
    # the step (and its trace) where the rank-stage's alert was first convicted: this verdict's own step for a
    # new straggler verdict or one without an alert; the alert's for a refresh, a hold or its recovery
    first_step: int | None = None
    first_trace_id: bytes = b""
    window_gpu_seconds: float = 0.0  # GPU-seconds the waiting ranks lost over this verdict's window
    node: str = ""  # the host of the node verdict covering this verdict (node.py); "" when none
    node_ranks: tuple[int, ...] = ()  # a node verdict: the host's ranks convicted together
    node_gpus: tuple[str, ...] = ()  # a node verdict: their GPUs
    mp_group: str = ""  # culprit.py: the model-parallel group of a culprit, group or victim verdict ("dp3.pp0")
    group_ranks: tuple[int, ...] = ()  # a group verdict: the group's ranks slow together, none named
    victims: tuple[int, ...] = ()  # a culprit's verdict: the ranks of its group waiting for it
    victim_of: str = ""  # a victim's verdict: "rank:<culprit>" or "group:<name>"
    derived: bool = False  # made by culprit.py (a group verdict), not by a rank's judgement
    hint: str = ""  # a straggler verdict: its GPU's NVML sample against its peers' (hints.py); "" when none
    # an intermittent_excess alert's verdicts: the median steps between its episodes (None: not intermittent) and
    # the episodes in its lookback (intermittent.py); the cost per step is step_time_lost_ms
    period_steps: float | None = None
    episodes: int = 0
    # a collective signal's events (collective_signal.py): the ring it was seen in ("" for every other verdict) and
    # the member whose links the evidence names (None: nobody named)
    ring: str = ""
    link_rank: int | None = None

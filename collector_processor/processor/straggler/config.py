"""Configuration of the straggler processor: every rule's knob, with its default and the reason for it.

``docs/detector.md`` explains each rule; the defaults here are the ones it documents.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

import otel_straggler_schema as s
from collector_processor.processor.straggler.decode import COLLECTOR_SERVICE_NAME
from otel_straggler_schema.stages import MP_WAIT_TIMERS

# Time bounds: finite and at most 1e9 s (about 31 years, "never"): nanosecond arithmetic on them stays in 64 bits
_NEVER = 1e9


class MetricsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = True
    # Cap on label sets across the processor's gauges; beyond it series are not created (counted).
    max_series: int = Field(default=10_000, ge=1)
    # A series not updated for this long (and not holding an active alert) is removed at the next snapshot.
    series_ttl_s: float = Field(default=900.0, gt=0, le=_NEVER)


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # --- windows ------------------------------------------------------------------------------------
    # Steps per step-aligned window (window index = step // window_steps). 5 steps: a median over 5
    # samples absorbs one heavy-tail spike, and 2 windows of persistence fire inside the 15-step bound
    # wherever the onset falls in its window (bench/results/detection.md).
    window_steps: int = Field(default=5, ge=1, le=1_000_000)
    # Device timing may be sampled (every Nth step): a rank's device statistic is the median of its latest
    # window_steps device samples, drawn from this window and at most this many windows back. With every
    # step measured that is exactly the window's samples.
    device_history_windows: int = Field(default=4, ge=0)
    # Wall-clock window length for spans without dl.iteration, anchored at the cohort's first observation.
    wall_window_s: float = Field(default=10.0, gt=0, le=_NEVER)
    # A window closes a grace period after the first sample of a later window arrived, even if a rank is
    # late. The grace adapts to the arrival lag measured in the cohort: 1.5 x the largest lag (how long after
    # a later window opened a window's samples still arrived, over its latest 64 closed windows and late
    # samples), at least grace_s and at most grace_max_s. Ranks exporting with the OTel SDK's 5 s schedule
    # delay deliver a step up to ~5 s after another rank's batch opened later windows, whatever the step time;
    # 30 s: rank_timeout_s, after which a silent rank holds no window anyway. grace_max_s <= grace_s: fixed.
    grace_s: float = Field(default=5.0, ge=0, le=_NEVER)
    grace_max_s: float = Field(default=30.0, ge=0, le=_NEVER)
    # A rank not heard from for this long no longer holds windows open (it may have died or been rescheduled).
    rank_timeout_s: float = Field(default=30.0, gt=0, le=_NEVER)
    # A window that accepted no sample for window_idle_s, or opened window_max_age_s ago, is closed (judged) at
    # the next tick, whatever its cohort's progress: the last window of a job that stopped, or one that a
    # client keeps re-sending a step of, never completes. 60 s: twice the report interval rank_timeout_s
    # assumes (a window of a running job takes a sample at least once per step); 600 s: 5 steps of 2 minutes.
    window_idle_s: float = Field(default=60.0, gt=0, le=_NEVER)
    window_max_age_s: float = Field(default=600.0, gt=0, le=_NEVER)

    # --- comparison ---------------------------------------------------------------------------------
    reference: Literal["fastest", "median"] = "fastest"
    # With reference=fastest: the peer at this low quantile of the comparable peers (index
    # floor(q * (peers - 1))). Up to 10 peers that is the fastest itself; in a cohort of hundreds the single
    # fastest is an extreme value of the noise and would convict healthy ranks, the 10th percentile does not.
    fastest_quantile: float = Field(default=0.1, ge=0, lt=1)
    # Relative deviation (value - reference) / reference beyond which a window counts as slow. 4 %, below
    # the +5 % a straggler must be found at: a threshold equal to the fault size finds it only in about
    # half of the windows (docs/detection-defaults.md).
    tolerance: float = Field(default=0.04, gt=0)
    # Noise-aware tolerance: per stage and window the tolerance rises to noise_z standard errors of a rank's
    # window median, from the step-to-step noise measured within the cohort's ranks (robust: spikes and a
    # slow rank do not move it). 8: device timing with <= ~0.9 % per-step noise keeps the 4 % tolerance; a
    # noisier cohort is judged on what its noise supports instead of producing false alarms, and its small
    # slowdowns are found by sequential_excess (lower values: docs/detection-defaults.md). 0 disables.
    noise_z: float = Field(default=8.0, ge=0)
    # Absolute gap (value - reference) under which a slow-looking window is uncertain, never slow: the floor
    # of every HOST comparison and of device comparisons of small stages. Host intervals of sub-ms to few-ms
    # stages jitter by 10x (launch/scheduling); 5 ms keeps that from ever reading as a straggler.
    absolute_floor_ms: float = Field(default=5.0, ge=0)
    # Device (CUDA event) time of a stage that is not launch-bound is precise: for a device comparison whose
    # reference is at least device_min_stage_ms the floor is device_floor_ms instead, so +5 % on a 20 ms
    # stage (1 ms) is judged on the relative tolerance. Below device_min_stage_ms a device interval is about
    # as long as its launches and inherits host jitter (stream bubbles), so the host floor applies.
    # See docs/detection-defaults.md for the measurements behind both.
    device_floor_ms: float = Field(default=0.5, ge=0)
    device_min_stage_ms: float = Field(default=10.0, ge=0)
    # First windows of every rank excluded from judging and from references (lazy CUDA-event warmup skew).
    warmup_windows: int = Field(default=2, ge=0)
    # Consecutive window indices beyond tolerance before a straggler verdict.
    persistence_windows: int = Field(default=2, ge=1)
    # sequential_excess (sequential.py): per rank and stage, the per-step device excess over the
    # comparable peers' per-step median, in units of the cohort's measured per-step spread, summed over every
    # lookback of more than a window's steps that ends now. sequential_threshold: the standardised sum
    # (sum / sqrt(n), a one-sided z-score) that convicts; sequential_margin: the least median excess over the
    # lookback that is a straggler; sequential_window_z: the least standardised sum of the lookback's steps in
    # this window and in the previous one, each (two consecutive windows of evidence); sequential_rest_z: the
    # least standardised sum of the lookback without its strongest run of window_steps steps (one window, or
    # a burst as long, does not convict on its own); sequential_step_cap: the most one step adds (a spike is
    # one step's evidence); sequential_history_steps: the longest lookback; sequential_sigma_windows: windows
    # whose spreads are averaged; sequential_sigma_floor: the least spread assumed. Measured in
    # docs/detection-defaults.md.
    sequential: bool = True
    sequential_threshold: float = Field(default=5.5, gt=0)
    sequential_margin: float = Field(default=0.025, gt=0)
    sequential_window_z: float = Field(default=2.0, gt=0)
    sequential_rest_z: float = Field(default=3.0, gt=0)
    sequential_step_cap: float = Field(default=3.0, gt=0)
    sequential_history_steps: int = Field(default=20, ge=2)
    sequential_sigma_windows: int = Field(default=16, ge=1)
    sequential_sigma_floor: float = Field(default=0.002, gt=0)
    # intermittent_excess (intermittent.py): a rank whose steps are far above its peers' median of the same step
    # (a spike: intermittent_spike_z of the cohort's per-step sigmas, and at least tolerance) in episodes that
    # recur, costing the job per step at least what the smallest steady straggler does (sequential_margin of the
    # peers' median, and the device floor), over the last intermittent_history_steps steps and recently. A single
    # spike or burst costs nothing; intermittent_min_episodes episodes are needed, so a period-P spike is found
    # min_episodes - 1 periods after its first, for periods up to history / (min_episodes - 1) steps.
    intermittent: bool = True
    intermittent_history_steps: int = Field(default=100, ge=2, le=10_000)
    intermittent_min_episodes: int = Field(default=4, ge=3)
    intermittent_spike_z: float = Field(default=6.0, gt=0)
    # collective signal (collective_signal.py): per cohort and collective stage (collective groups and
    # mp_wait_stages), the per-step minimum over the ranks (the collective's own time: the last to arrive waits for
    # nobody) against the median of the cohort's latest collective_baseline_windows windows not lost; beyond
    # collective_tolerance of it (and its noise and floor) for persistence_windows windows: an uncertain/
    # collective_slow event (never a page) and otel_straggler_collective_lost_seconds.
    collective_signal: bool = True
    collective_tolerance: float = Field(default=0.1, gt=0)
    collective_baseline_windows: int = Field(default=12, ge=3, le=1000)
    # Effective comparable ranks (the rank itself plus usable comparable peers) required to judge.
    min_cohort_size: int = Field(default=3, ge=2)
    # pair (pair.py): a cohort of exactly 2 ranks (DP = 2) whose ranks differ beyond tolerance names the slower
    # one only on evidence from outside the window's comparison: its own level rose against its baseline while
    # its pair's did not (change_point), or every rank of the job's other cohorts sits at its pair's level at the
    # same steps (other_roles); else uncertain/pair_ambiguous. pair_history_windows: windows at par kept as each
    # rank's baseline; pair_min_history: windows at par needed before a change point can name a rank.
    pair: bool = True
    pair_history_windows: int = Field(default=6, ge=1)
    pair_min_history: int = Field(default=2, ge=1)
    # collective_wait (collective.py): a rank slower than its reference in one stage is not convicted when the
    # reference is slower than the rank in another judged stage of the same window by at least this fraction of
    # the gap (beyond that stage's tolerance and floor) and, in a cohort of 3 or more, the rank is at par with as
    # many peers as are below it: its excess is the wait, inside a collective, for the reference's own excess
    # (DDP's backward holds the gradient all-reduce). uncertain/collective_wait names the reference.
    collective_wait: bool = True
    collective_wait_fraction: float = Field(default=0.5, gt=0, le=1)
    # mp_wait: stages whose time is an all-reduce over the model-parallel group (Megatron's optimizer found-inf,
    # grad-norm and zero-count all-reduces). A rank slow there waits for another member of its group:
    # uncertain/collective_wait, never a straggler, a node's or a group's evidence; so is an enclosing timer
    # ("optimizer") whose excess those stages explain by collective_wait_fraction. The waits are evidence that
    # the rank is not its group's culprit (culprit.py). Empty: off.
    mp_wait_stages: list[str] = Field(default_factory=lambda: list(MP_WAIT_TIMERS))
    # host_contention: a window that would convict a rank on host time (host_stall, or no device samples) while
    # every comparable peer runs on the rank's own host is uncertain/host_contention (attributed
    # host_only_stall), never a page: the ranks share the machine's CPUs, and without a peer on another host a
    # rank's own stall cannot be told from the machine's contention (a DDP job on one loaded machine).
    host_contention: bool = True
    # Relative token difference beyond which two ranks do not do comparable work.
    workload_tolerance: float = Field(default=0.05, ge=0)
    # per_unit (per_unit.py): where the cohort's tokens per step spread beyond workload_tolerance (MoE routing,
    # packed sequences), each judged stage's time is fitted as a fixed cost plus a cost per token over the
    # window's samples and every sample brought to the cohort's median tokens before the rules compare ranks.
    per_unit: bool = True
    # node (node.py): when more than node_min_fraction of one host's ranks of a job (and at least
    # node_min_ranks) hold straggler alerts together, one node verdict names the host, its GPUs and ranks,
    # and the rank verdicts it covers carry straggler.node. node_max_hosts bounds the hosts tracked (LRU).
    node_verdicts: bool = True
    node_min_fraction: float = Field(default=0.5, ge=0, lt=1)
    node_min_ranks: int = Field(default=2, ge=2)
    node_max_hosts: int = Field(default=65_536, ge=1)
    # culprit (culprit.py): straggler verdicts of one DP replica's model-parallel ranks (TP/CP/EP peers, pipeline
    # stages) in the same stage together are one verdict: the culprit named by a stage it is slow in alone
    # (over the latest culprit_history_windows windows) with its victims listed, else one group verdict.
    # culprit_max_groups bounds the replicas tracked (LRU).
    culprit: bool = True
    culprit_history_windows: int = Field(default=4, ge=1, le=64)
    culprit_max_groups: int = Field(default=65_536, ge=1)
    # Stage groups judged; collective groups are evidence only (a straggler's peers wait there, so judging
    # them would accuse the healthy ranks), and the per-rank step span is synchronised by the collectives.
    judged_groups: list[str] = Field(
        default_factory=lambda: ["forward", "backward", "optimizer", "data", "other"]
    )
    # Groups where "device flat (or under its floor), host up" is itself a straggler (host_only_stall): a host
    # stall (CPU contention, a stalled launch, waiting for the data loader) delays the step whether or not it
    # starves the stream. Every judged group by default. The host comparison has its own noise-raised
    # tolerance and the host floor (absolute_floor_ms), and counts only the host excess the device excess does
    # not explain (attribution.py), so launch-time jitter and a blocked host tracking a slow GPU are not host
    # stalls (tests/collector/processor/test_straggler_launch_time.py).
    host_stall_groups: list[str] = Field(
        default_factory=lambda: ["forward", "backward", "optimizer", "data", "other"]
    )
    # Recovery (hysteresis): an alert ends after recovery_windows consecutive windows at par, each within
    # the recovery margin of the comparable peers' median and, with sequential evidence, a mean per-step excess
    # within half the sequential margin. The margin is recovery_margin (half the tolerance: well inside it) or,
    # where the measured noise is larger, two standard errors of a window median, at most the tolerance. One
    # window is not enough: a rank slowing steadily (a thermal ramp) has noisy windows near par while its
    # excess still rises (docs/detection-defaults.md).
    recovery_margin: float = Field(default=0.02, gt=0)
    recovery_windows: int = Field(default=2, ge=1)
    # An uncertain verdict is emitted on a change of reason, else at most once per this many windows per
    # rank and stage; the rest are counted (uncertain_suppressed).
    uncertain_every_windows: int = Field(default=20, ge=1)

    # --- bounds -------------------------------------------------------------------------------------
    max_cohorts: int = Field(default=256, ge=1)
    max_ranks_per_cohort: int = Field(default=4096, ge=1)
    max_stages: int = Field(default=64, ge=1)
    # Open windows per cohort (each holds every stage); beyond it the oldest is closed early (counted). What
    # an open window holds is bounded by its rank-steps (window_steps per rank); windows close by progress as
    # soon as every rank moved past them, so many are open only while ranks arrive far apart: with ~70 ms
    # steps (0.35 s windows) and the SDK's 5 s schedule delay, a rank's batch opens ~13 windows and its peers'
    # batches arrive up to 5 s (~14 windows) later. 64 covers that twice over.
    max_open_windows: int = Field(default=64, ge=1)
    # Step quarantine: a step sample whose window index is more than this many windows beyond its cohort's range
    # (the lower median of its ranks' latest windows) is rejected (spans_rejected_total{reason="quarantined"})
    # and never opens or closes a window, so one rank reporting a wrong step number, or a client writing
    # far-future steps into a job, cannot make the job's real samples late. 256 windows (1280 steps at 5 per
    # window): four times max_open_windows, far beyond how far apart the ranks of a running cohort can be.
    # 0 disables.
    step_quarantine_windows: int = Field(default=256, ge=0, le=2**40)
    # Stage-span ids remembered for replay detection (LRU). A step summary is deduplicated by its identity
    # instead: one per (rank, step) in a window.
    dedup_capacity: int = Field(default=262_144, ge=1)
    # Stage-span samples kept per (rank, step, stage) in a window (per (rank, stage) in a wall-clock window):
    # interval detail sends one per microbatch, so repeats are legitimate up to a bound; beyond it they are
    # rejected (over_cap). 256: a step of Megatron rarely runs more microbatches per rank and model chunk.
    max_samples_per_step: int = Field(default=256, ge=1)
    # Per (rank, stage) detector states kept (LRU, active alerts are kept first).
    max_states: int = Field(default=200_000, ge=1)

    # --- outputs ------------------------------------------------------------------------------------
    emit_verdict_spans: bool = True
    collector_service_name: str = COLLECTOR_SERVICE_NAME
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @field_validator("judged_groups", "host_stall_groups")
    @classmethod
    def _known_groups(cls, groups: list[str]) -> list[str]:
        unknown = [g for g in groups if g not in s.STAGE_GROUPS]
        if unknown:
            raise ValueError(f"unknown stage groups: {unknown}")
        return groups

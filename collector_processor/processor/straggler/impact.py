"""Impact of a straggler on the job: step time lost and GPU-seconds per hour.

Stage spans are per-step sums, so (value - reference) is the excess per step on that stage. In synchronous
data parallelism every other rank waits for it at the next collective, so
``gpu_seconds_per_hour = step_time_lost_s * (world_size - 1) * steps_per_hour``.
Steps per hour come from the cohort's median ``rank-step`` duration in the window, else from the window's
wall-clock span divided by its steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from collector_processor.processor.straggler.statistics import median


def step_period_ms(rank_step_ms: Sequence[float], wall_span_ns: int, steps: int) -> float | None:
    if rank_step_ms:
        p = median(rank_step_ms)
        if p > 0:
            return p
    if wall_span_ns > 0 and steps > 0:
        return wall_span_ns / 1e6 / steps
    return None


def impact(step_time_lost_ms: float, world_size: int, period_ms: float | None) -> float:
    """GPU-seconds per hour lost by the job's waiting ranks (0 when the period is unknown)."""
    if period_ms is None or period_ms <= 0 or step_time_lost_ms <= 0:
        return 0.0
    steps_per_hour = 3_600_000.0 / period_ms
    return step_time_lost_ms / 1000.0 * max(world_size - 1, 0) * steps_per_hour

"""Emitter counters: plain ints, each field written by exactly ONE thread (no lock needed).

Written by the TRAINING thread (start/stop path): ``dropped_ring_full``, ``barriers_skipped``,
``unbalanced``, ``faults_training`` (the fields of ``hot_path.HotCounters``: C fields where the C hot path runs),
``names_truncated`` (at a new timer's lookup).
Written by the READOUT thread: ``intervals``, ``degraded_counts`` (per reason code: the training thread only
writes the code into the ring's record, the readout thread counts it; ``degraded`` is the same by name),
``faults_readout``, ``readout_lag_ms``, ``quarantined``, ``quarantine_released``, ``sink_errors``, ``pool_high_water``
(sampled at the top of each drain, before the readout returns any event to the pool).
Written once at construction (before any thread starts): ``config_errors``.
``snapshot()`` may be called from any thread; an int read is atomic under the GIL, and a snapshot that
is one increment stale is fine for cumulative self-metrics. ``SNAPSHOT_KEYS`` are its keys, in order.
"""

from __future__ import annotations

from array import array
from typing import Final

import otel_straggler_schema as schema
from otel_straggler.hot_path import HotCounters

# The schema's degraded reasons by meaning (unpacked in schema order; a change there fails loudly here).
NO_CUDA, SAMPLED_OUT, POOL_EXHAUSTED, READOUT_TIMEOUT, CUDA_ERROR, UNBALANCED = schema.DEGRADED_REASONS

# A reason as the ring's records carry it: 0 none, else 1 + its index in the schema's tuple
REASONS: Final = (None, *schema.DEGRADED_REASONS)
CODE: Final = {r: i for i, r in enumerate(REASONS) if r is not None}
NO_CUDA_CODE, SAMPLED_OUT_CODE, POOL_EXHAUSTED_CODE, READOUT_TIMEOUT_CODE, CUDA_ERROR_CODE, UNBALANCED_CODE = (
    CODE[r] for r in schema.DEGRADED_REASONS)

# the keys the training thread writes (the rest: the readout thread, and ``faults_config_error`` at construction)
TRAINING_KEYS: Final = ("dropped_ring_full", "barriers_skipped", "unbalanced", "faults_training", "names_truncated")
SNAPSHOT_KEYS: Final = (
    "intervals",
    "dropped_ring_full",
    *(f"degraded_{r}" for r in schema.DEGRADED_REASONS),
    "barriers_skipped",
    "unbalanced",
    "faults",
    "faults_training",
    "faults_readout",
    "faults_config_error",
    "faults_sink",
    "pool_high_water",
    "readout_lag_ms",
    "quarantined",
    "quarantine_released",
    "names_truncated",
)


class EmitterCounters(HotCounters):
    __slots__ = (
        "config_errors",
        "degraded_counts",
        "faults_readout",
        "intervals",
        "names_truncated",
        "pool_high_water",
        "quarantine_released",
        "quarantined",
        "readout_lag_ms",
        "sink_errors",
    )

    def __init__(self, config_errors: int = 0) -> None:
        self.intervals = 0
        self.dropped_ring_full = 0
        # intervals without device time, by reason code (``REASONS``); index 0 is unused
        self.degraded_counts = array("q", bytes(8 * len(REASONS)))
        self.barriers_skipped = 0
        self.unbalanced = 0
        self.faults_training = 0
        self.faults_readout = 0
        self.config_errors = int(config_errors)
        self.pool_high_water = 0
        self.readout_lag_ms = 0
        self.quarantined = 0
        self.quarantine_released = 0
        self.sink_errors = 0
        self.names_truncated = 0  # timer names longer than the wire's bound (training thread, at lookup)

    @property
    def degraded(self) -> dict[str, int]:
        """Intervals without device time, by reason (a copy)."""
        counts = self.degraded_counts
        return {r: counts[i] for i, r in enumerate(REASONS) if r is not None}

    @property
    def faults(self) -> int:
        return self.faults_training + self.faults_readout + self.config_errors + self.sink_errors

    def snapshot(self) -> dict[str, int]:
        counts = self.degraded_counts
        values = (
            self.intervals,
            self.dropped_ring_full,
            *(counts[i] for i in range(1, len(REASONS))),
            self.barriers_skipped,
            self.unbalanced,
            self.faults,
            self.faults_training,
            self.faults_readout,
            self.config_errors,
            self.sink_errors,
            self.pool_high_water,
            self.readout_lag_ms,
            self.quarantined,
            self.quarantine_released,
            self.names_truncated,
        )
        return dict(zip(SNAPSHOT_KEYS, values, strict=True))

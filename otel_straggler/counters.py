"""Emitter counters: plain ints, each field written by exactly ONE thread (no lock needed).

Written by the TRAINING thread (start/stop path): ``dropped_ring_full``, ``barriers_skipped``,
``unbalanced``, ``faults_training``, ``names_truncated`` (at a new timer's lookup).
Written by the READOUT thread: ``intervals``, ``degraded`` (per reason; the training thread only
writes the reason into the ring slot, the readout thread counts it), ``faults_readout``,
``readout_lag_ms``, ``quarantined``, ``quarantine_released``, ``sink_errors``, ``pool_high_water``
(sampled at the top of each drain, before the readout returns any event to the pool).
Written once at construction (before any thread starts): ``config_errors``.
``snapshot()`` may be called from any thread; an int read is atomic under the GIL, and a snapshot that
is one increment stale is fine for cumulative self-metrics.
"""

from __future__ import annotations

import otel_straggler_schema as schema

# The schema's degraded reasons by meaning (unpacked in schema order; a change there fails loudly here).
NO_CUDA, SAMPLED_OUT, POOL_EXHAUSTED, READOUT_TIMEOUT, CUDA_ERROR, UNBALANCED = schema.DEGRADED_REASONS


class EmitterCounters:
    __slots__ = (
        "barriers_skipped",
        "config_errors",
        "degraded",
        "dropped_ring_full",
        "faults_readout",
        "faults_training",
        "intervals",
        "names_truncated",
        "pool_high_water",
        "quarantine_released",
        "quarantined",
        "readout_lag_ms",
        "sink_errors",
        "unbalanced",
    )

    def __init__(self, config_errors: int = 0) -> None:
        self.intervals = 0
        self.dropped_ring_full = 0
        self.degraded: dict[str, int] = dict.fromkeys(schema.DEGRADED_REASONS, 0)
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
    def faults(self) -> int:
        return self.faults_training + self.faults_readout + self.config_errors + self.sink_errors

    def snapshot(self) -> dict[str, int]:
        out = {
            "intervals": self.intervals,
            "dropped_ring_full": self.dropped_ring_full,
        }
        for reason, n in list(self.degraded.items()):
            out[f"degraded_{reason}"] = n
        out.update(
            barriers_skipped=self.barriers_skipped,
            unbalanced=self.unbalanced,
            faults=self.faults,
            faults_training=self.faults_training,
            faults_readout=self.faults_readout,
            faults_config_error=self.config_errors,
            faults_sink=self.sink_errors,
            pool_high_water=self.pool_high_water,
            readout_lag_ms=self.readout_lag_ms,
            quarantined=self.quarantined,
            quarantine_released=self.quarantine_released,
            names_truncated=self.names_truncated,
        )
        return out

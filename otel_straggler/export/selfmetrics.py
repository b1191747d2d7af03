"""Emitter self-metrics: OTel observable instruments over the latest cumulative counters.

Two sources are merged at each collection: the cumulative stats dict the training side publishes
(``intervals``, ``dropped_ring_full``, ``degraded_<reason>``, ``barriers_skipped``, ``faults``,
``pool_high_water``, ``readout_lag_ms``, ...) and the export side's own counters (``dropped_pipe_full``,
``dropped_queue_full``, ``dropped_export_failed``, ``dropped_shutdown``, ``dropped_late``, ``spans_exported``,
``steps_evicted``, ``sidecar_restarts``, ``faults_<where>``). Keys ``dropped_<reason>`` feed
``dropped{reason}``, ``degraded_<reason>`` feed ``degraded{reason}``, ``faults``/``faults_<where>`` feed
``faults{where}``.

Every counter, and every reason/where value of the schema (``SM_DROPPED_REASONS``, ``DEGRADED_REASONS``,
``SM_FAULT_WHERES``), is reported from the first collection, at 0 until it moves, so a ``rate()`` sees its
first event. Units are base units: counts ``1``, the readout lag in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

import otel_straggler_schema as schema

FAULTS_WHERE_ATTR = "where"

# Keys the training side may publish under names without the dropped_/degraded_ prefix.
_ALIASES = {
    "ring_full": "dropped_ring_full",
    "pipe_full": "dropped_pipe_full",
    "queue_full": "dropped_queue_full",
    "export_failed": "dropped_export_failed",
    "shutdown": "dropped_shutdown",
}


def normalize(stats: dict[str, int | float]) -> dict[str, int | float]:
    """Training-side stats in self-metric keys. ``faults`` is the total of the ``faults_<where>`` keys when
    those are present (then dropped, so ``faults{where}`` sums to the total); alone it becomes
    ``faults_training``. Keys without an instrument (``unbalanced`` calls, ``quarantined``) are kept but
    not exported: their effect shows as ``degraded{unbalanced}`` and ``faults{where}``."""
    out: dict[str, int | float] = {}
    for key, value in stats.items():
        out[_ALIASES.get(key, key)] = value
    total = out.pop("faults", None)
    if total is not None and not any(k.startswith("faults_") for k in out):
        out["faults_training"] = total
    return out


def _by_prefix(snapshot: dict[str, int | float], prefix: str, attr: str, known: tuple[str, ...]) -> list[Observation]:
    """One observation per ``known`` value (0 until counted) and per other value seen."""
    values = dict.fromkeys(known, 0)
    for key, value in snapshot.items():
        if key.startswith(prefix) and len(key) > len(prefix):
            values[key[len(prefix):]] = value
    return [Observation(int(v), {attr: k}) for k, v in values.items()]


class SelfMetrics:
    """Registers the instruments on ``meter``; ``snapshot`` returns the merged cumulative counters."""

    def __init__(self, meter: Meter, snapshot: Callable[[], dict[str, int | float]]) -> None:
        self._snapshot = snapshot

        def scalar(key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
            def cb(_: CallbackOptions) -> Iterable[Observation]:
                return [Observation(int(self._snapshot().get(key, 0)))]

            return cb

        def intervals(_: CallbackOptions) -> Iterable[Observation]:
            snap = self._snapshot()
            return [Observation(int(snap.get("intervals", snap.get("intervals_received", 0))))]

        def dropped(_: CallbackOptions) -> Iterable[Observation]:
            return _by_prefix(self._snapshot(), "dropped_", schema.SM_REASON_ATTR, schema.SM_DROPPED_REASONS)

        def degraded(_: CallbackOptions) -> Iterable[Observation]:
            return _by_prefix(self._snapshot(), "degraded_", schema.SM_REASON_ATTR, schema.DEGRADED_REASONS)

        def faults(_: CallbackOptions) -> Iterable[Observation]:
            return _by_prefix(self._snapshot(), "faults_", FAULTS_WHERE_ATTR, schema.SM_FAULT_WHERES)

        def readout_lag_s(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(float(self._snapshot().get("readout_lag_ms", 0)) / 1000.0)]

        count = schema.UNIT_COUNT
        meter.create_observable_counter(schema.SM_INTERVALS, [intervals], unit=count,
                                        description="Start/stop intervals completed")
        meter.create_observable_counter(schema.SM_SPANS_EXPORTED, [scalar("spans_exported")], unit=count,
                                        description="Spans handed to the OTLP exporter and exported")
        meter.create_observable_counter(schema.SM_DROPPED, [dropped], unit=count,
                                        description="Intervals or spans dropped, by reason")
        meter.create_observable_counter(schema.SM_DEGRADED, [degraded], unit=count,
                                        description="Intervals timed on the host only, by reason")
        meter.create_observable_counter(schema.SM_BARRIERS_SKIPPED, [scalar("barriers_skipped")], unit=count,
                                        description="barrier=True calls accepted and not executed")
        meter.create_observable_counter(schema.SM_FAULTS, [faults], unit=count,
                                        description="Exceptions caught inside the package, by where")
        meter.create_observable_counter(schema.SM_STEPS_EVICTED, [scalar("steps_evicted")], unit=count,
                                        description="Step aggregates closed early at the open-steps cap")
        meter.create_observable_counter(schema.SM_SIDECAR_RESTARTS, [scalar("sidecar_restarts")], unit=count,
                                        description="Export child process restarts")
        meter.create_observable_counter(schema.SM_NAMES_TRUNCATED, [scalar("names_truncated")], unit=count,
                                        description="Timer names cut to the wire's bound (with a hash suffix)")
        meter.create_observable_gauge(schema.SM_POOL_HIGH_WATER, [scalar("pool_high_water")], unit=count,
                                      description="Most CUDA events in flight at once")
        meter.create_observable_gauge(schema.SM_READOUT_LAG, [readout_lag_s], unit=schema.UNIT_SECONDS,
                                      description="Delay from stop to readout of the latest interval")
        meter.create_observable_gauge(schema.SM_ENDED, [scalar("ended")], unit=count,
                                      description="1 once the rank's export shut down (a normal end)")

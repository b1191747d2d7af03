"""Export side: completed intervals -> per-step aggregation -> OTel spans -> OTLP.

``create_sink(config, identity, counters)`` returns the ``IntervalSink`` the readout thread feeds:
``ProcessSink`` (default ``export_mode="process"``: an export child process does the OTel work),
``ThreadSink`` (``"thread"``: in-process, for CPU runs and tests) or ``NullSink`` (``"off"``, or
``OTEL_SDK_DISABLED=true``).
``config`` and ``identity`` are duck-typed (``config.detail``, ``config.export_mode``,
``config.step_close_s``, ``config.max_open_steps``, ``config.step_close_lag``, ``config.shutdown_timeout_s``,
``config.sidecar_max_restarts``; ``identity.resource_attributes()``, ``identity.rank``, ``identity.job_id``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from otel_straggler import schema
from otel_straggler.export.provider import Counters
from otel_straggler.interval import Interval, IntervalSink

EXPORT_PROCESS = "process"
EXPORT_THREAD = "thread"
EXPORT_OFF = "off"


class NullSink:
    """Export disabled: intervals are counted and discarded."""

    def __init__(self, counters: Counters | None = None) -> None:
        self.counters = counters if counters is not None else Counters()

    def submit(self, intervals: Sequence[Interval]) -> None:
        self.counters.add("intervals_discarded", len(intervals))

    def publish_stats(self, stats: dict[str, int]) -> None:
        return None

    def flush(self, timeout_s: float) -> bool:
        return True

    def shutdown(self, timeout_s: float) -> None:
        return None


def _resource_attributes(identity: Any) -> dict[str, Any]:
    fn = getattr(identity, "resource_attributes", None)
    attrs = fn() if callable(fn) else (fn or {})
    return dict(attrs)


def create_sink(config: Any, identity: Any, counters: Any = None) -> IntervalSink:
    """Build the sink named by ``config.export_mode``; tracked for fork inertness (``lifecycle``).

    ``counters`` may be an export-side ``Counters`` to share; anything else is ignored (the training
    side's counters reach the self-metrics through ``publish_stats``).
    """
    from otel_straggler import lifecycle

    mode = str(getattr(config, "export_mode", EXPORT_PROCESS) or EXPORT_PROCESS).lower()
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        mode = EXPORT_OFF
    own = counters if isinstance(counters, Counters) else Counters()
    detail = str(getattr(config, "detail", schema.DETAIL_STEP) or schema.DETAIL_STEP)
    attrs = _resource_attributes(identity)
    rank = int(getattr(identity, "rank", attrs.get(schema.RES_RANK, 0)) or 0)
    job_id = str(getattr(identity, "job_id", attrs.get(schema.RES_JOB_ID, "local")) or "local")
    common = {
        "rank": rank,
        "job_id": job_id,
        "detail": detail,
        "step_close_s": float(getattr(config, "step_close_s", 2.0)),
        "max_open_steps": int(getattr(config, "max_open_steps", 8)),
        "close_lag_steps": int(getattr(config, "step_close_lag", 0)),
        "counters": own,
    }
    sink: Any
    if mode == EXPORT_OFF:
        sink = NullSink(own)
    elif mode == EXPORT_THREAD:
        from otel_straggler.export.thread_sink import ThreadSink

        sink = ThreadSink(attrs, **common)
    else:
        from otel_straggler.export.process_sink import ProcessSink

        sink = ProcessSink(
            attrs,
            shutdown_timeout_s=float(getattr(config, "shutdown_timeout_s", 5.0)),
            max_restarts=int(getattr(config, "sidecar_max_restarts", 3)),
            nice=int(getattr(config, "export_nice", 10)),
            affinity=str(getattr(config, "export_affinity", "auto")),
            **common,
        )
    lifecycle.track_sink(sink)
    lifecycle.register_sink_fallback(sink, float(getattr(config, "shutdown_timeout_s", 5.0)))
    return sink


__all__ = ["EXPORT_OFF", "EXPORT_PROCESS", "EXPORT_THREAD", "Counters", "NullSink", "create_sink"]

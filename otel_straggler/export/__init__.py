"""Export side: completed intervals -> per-step aggregation -> OTel spans -> OTLP.

``create_sink(config, identity, counters)`` returns the ``IntervalSink`` the readout thread feeds:
``ProcessSink`` (default ``export_mode="process"``: an export child process does the OTel work),
``ThreadSink`` (``"thread"``: in-process, for CPU runs and tests) or ``NullSink`` (``"off"``, or
``OTEL_SDK_DISABLED=true``). Every setting comes from the one ``EmitterConfig``.
"""

from __future__ import annotations

from otel_straggler.config import EmitterConfig
from otel_straggler.counters import EmitterCounters
from otel_straggler.export.otel_env import OtelSettings
from otel_straggler.export.provider import Counters
from otel_straggler.identity import Identity
from otel_straggler.interval import IntervalSink, NullSink

EXPORT_PROCESS = "process"
EXPORT_THREAD = "thread"
EXPORT_OFF = "off"


def create_sink(config: EmitterConfig, identity: Identity, counters: EmitterCounters | None = None) -> IntervalSink:
    """Build the sink named by ``config.export_mode``; tracked for fork inertness (``lifecycle``).

    ``counters``: the training side's counters (they reach the self-metrics through ``publish_stats``); each
    invalid standard ``OTEL_*`` variable counts there as a config error (``otel_env``).
    """
    from otel_straggler import lifecycle

    otel = OtelSettings.from_env()  # the standard OTEL_* settings: validated here, once, and counted
    if counters is not None:
        counters.config_errors += len(otel.errors)  # before the readout thread exists: no race
    mode = EXPORT_OFF if otel.sdk_disabled else config.export_mode
    attrs = dict(identity.resource_attributes())
    sink: IntervalSink
    if mode == EXPORT_OFF:
        sink = NullSink()
    elif mode == EXPORT_THREAD:
        from otel_straggler.export.thread_sink import ThreadSink

        sink = ThreadSink(attrs, rank=identity.rank, job_id=identity.job_id, config=config, otel=otel,
                          counters=Counters())
    else:
        from otel_straggler.export.process_sink import ProcessSink

        sink = ProcessSink(attrs, rank=identity.rank, job_id=identity.job_id, config=config, otel=otel,
                           counters=Counters())
    lifecycle.track_sink(sink)
    lifecycle.register_sink_fallback(sink, config.shutdown_timeout_s)
    return sink


__all__ = ["EXPORT_OFF", "EXPORT_PROCESS", "EXPORT_THREAD", "Counters", "NullSink", "create_sink"]

"""otel-straggler: find the slow rank in Megatron training jobs through OpenTelemetry.

Training side: ``Timers`` (drop-in for ``megatron.core.timers.Timers``), ``install_megatron`` and, for
other loops, ``configure`` + ``stage`` + ``step``. Off unless enabled (``OTEL_STRAGGLER_ENABLED``).
"""

from otel_straggler.config import EmitterConfig
from otel_straggler.install import configure, get_timers, install_megatron, shutdown, stage, step
from otel_straggler.interval import Interval, IntervalSink
from otel_straggler.timers import Timers

__all__ = [
    "EmitterConfig",
    "Interval",
    "IntervalSink",
    "Timers",
    "configure",
    "get_timers",
    "install_megatron",
    "shutdown",
    "stage",
    "step",
]

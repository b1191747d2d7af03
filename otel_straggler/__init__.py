"""otel-straggler: find the slow rank in Megatron training jobs through OpenTelemetry.

Training side: ``Timers`` (drop-in for ``megatron.core.timers.Timers``), ``install_megatron`` and, for
other loops, ``configure`` + ``stage`` + ``step``. Off unless enabled (``OTEL_STRAGGLER_ENABLED``).

Importing the package loads nothing else: the names below load on first use. The contract the collector shares
is the package ``otel_straggler_schema`` (``otel_straggler.schema`` re-exports it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from otel_straggler.version import __version__

if TYPE_CHECKING:
    from otel_straggler.config import EmitterConfig
    from otel_straggler.install import configure, get_timers, install_megatron, shutdown, stage, step
    from otel_straggler.interval import Interval, IntervalSink
    from otel_straggler.timers import Timers

_EXPORTS = {
    "EmitterConfig": "otel_straggler.config",
    "Interval": "otel_straggler.interval",
    "IntervalSink": "otel_straggler.interval",
    "Timers": "otel_straggler.timers",
    "configure": "otel_straggler.install",
    "get_timers": "otel_straggler.install",
    "install_megatron": "otel_straggler.install",
    "shutdown": "otel_straggler.install",
    "stage": "otel_straggler.install",
    "step": "otel_straggler.install",
}

__all__ = [
    "EmitterConfig",
    "Interval",
    "IntervalSink",
    "Timers",
    "__version__",
    "configure",
    "get_timers",
    "install_megatron",
    "shutdown",
    "stage",
    "step",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'otel_straggler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

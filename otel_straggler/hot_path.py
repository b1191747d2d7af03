"""Which implementation runs the training thread's hot path, the C extension or the Python code, and its types.

``_hotpath.c`` (the module ``otel_straggler._hotpath``) and ``_hotpath_py.py`` implement ``Timer.start``/``stop``
and the state they touch, type for type with the same names, fields and logic: ``HotCounters``, ``EventTable``,
``Ring``, ``SharedEvent``, ``StepState``, ``TimerCore``, ``TimersCore``. This module exports the chosen one's, and
the rest of the package imports them from here; the C module's readout calls (``event_elapsed``, ``event_query``,
``elapsed_batch``, ``pack_records``: the readout's drain of the records into the wire's) are None on the Python path.
Both write the same bytes. The C one uses CPython's public C API only. Between a step's kernel launches a
start+stop's code and data are cold, and the C path touches far fewer cache lines than the Python one
(``bench/results/cpu-native-floor.md``, ``bench/results/gpu-h200.md``).

The choice is made once, when the timers are first imported, by ``OTEL_STRAGGLER_HOT_PATH``, and logged once at
INFO (``otel-straggler --version`` says it too):

* ``auto`` (default): the C extension when the installed wheel carries it (the manylinux wheels, an editable
  install, or ``OTEL_STRAGGLER_BUILD_NATIVE=1`` at build time: ``setup.py``), else the Python code;
* ``native``: the C extension; when it cannot be loaded the Python code runs and a warning says why (fail open);
* ``python``: the Python code.

``NAME`` says which runs (``native`` or ``python``), ``REASON`` why the Python code runs when it does, ``core`` is the
C module when it runs (else None).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from types import ModuleType
from typing import Any

import otel_straggler_schema as schema
from otel_straggler import _hotpath_py
from otel_straggler.version import __version__

_log = logging.getLogger(__name__)

ENV = "OTEL_STRAGGLER_HOT_PATH"
CHOICES = ("auto", "native", "python")


def _built() -> bool:
    """Whether there is a C module to import (an import of a missing submodule during the package's own import
    would say "circular import")."""
    try:
        return importlib.util.find_spec("otel_straggler._hotpath") is not None
    except (ImportError, ValueError):  # a module without a spec in sys.modules: the import below says what it is
        return True


def _set_reasons(impl: ModuleType) -> None:
    """The reasons by the codes the records carry (counters.REASONS: 1 + the schema's index)."""
    reasons = (None, *schema.DEGRADED_REASONS)
    impl.set_reasons(reasons, *(reasons.index(r) for r in ("sampled_out", "cuda_error", "pool_exhausted")))


def _load() -> tuple[ModuleType | None, str | None]:
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        _log.warning("otel-straggler: %s=%r is not one of %s; using auto", ENV, choice, ", ".join(CHOICES))
        choice = "auto"
    if choice == "python":
        return None, f"{ENV}=python"
    level = logging.WARNING if choice == "native" else logging.DEBUG
    if not _built():
        _log.log(level, "otel-straggler: the C hot path is not built (no otel_straggler/_hotpath module: a pure "
                 "Python install; the manylinux wheels carry it, or install with OTEL_STRAGGLER_BUILD_NATIVE=1); "
                 "using the Python one")
        return None, "not built"
    try:
        from otel_straggler import _hotpath

        _set_reasons(_hotpath)
    except ImportError as exc:
        _log.log(level, "otel-straggler: the C hot path could not be imported (%s); using the Python one", exc)
        return None, "not built"
    except Exception as exc:  # a module that fails to load or to set up (one built from other sources)
        _log.warning("otel-straggler: the C hot path failed to load (%s: %s); using the Python one",
                     type(exc).__name__, exc)
        return None, f"failed to load: {type(exc).__name__}"
    return _hotpath, None


_set_reasons(_hotpath_py)
core, REASON = _load()
NAME = "native" if core is not None else "python"
_impl: Any = core if core is not None else _hotpath_py

HotCounters: Any = _impl.HotCounters
EventTable: Any = _impl.EventTable
Ring: Any = _impl.Ring
SharedEvent: Any = _impl.SharedEvent
StepState: Any = _impl.StepState
TimerCore: Any = _impl.TimerCore
TimersCore: Any = _impl.TimersCore
NO_REUSE: int = _impl.NO_REUSE
event_elapsed: Any = _impl.event_elapsed
event_query: Any = _impl.event_query
elapsed_batch: Any = _impl.elapsed_batch
pack_records: Any = _impl.pack_records
# the wire record's size and the frame header ``pack_records`` writes (records.py checks them)
RECORD_SIZE: int | None = getattr(core, "RECORD_SIZE", None)
RECORD_HEADER: int | None = getattr(core, "RECORD_HEADER", None)


def describe() -> str:
    """``native (C extension)`` or ``python (<why>)``: what runs the hot path in this process."""
    return "native (C extension)" if core is not None else f"python ({REASON})"


_log.info("otel-straggler %s: hot path %s", __version__, describe())

"""Zero-code Megatron: an OpenTelemetry instrumentor that puts the straggler timers where Megatron builds its own.

Registered under the ``opentelemetry_instrumentor`` entry point (``otel_straggler``), so::

    OTEL_STRAGGLER_ENABLED=1 opentelemetry-instrument python pretrain_gpt.py ...

times every stage of a Megatron-LM run without a code change. Or in code::

    from otel_straggler.instrumentation import MegatronInstrumentor
    MegatronInstrumentor().instrument()        # before Megatron builds its timers
    ...
    MegatronInstrumentor().uninstrument()      # Megatron's own Timers again

What it patches, when (and as soon as) each module is imported:

* ``megatron.core.timers.Timers`` and ``megatron.core.Timers``: constructing Megatron's ``Timers(log_level,
  log_option)`` returns the straggler ``Timers`` (``install_megatron``: the process-wide default too, so
  ``otel_straggler.stage``/``step`` reach it);
* ``megatron.training.global_vars`` (Megatron-LM): its ``Timers`` name, which ``_set_timers`` calls to build the
  global timers that ``get_timers()`` returns and the training loop assigns to ``config.timers``; timers it built
  before the instrumentor ran are swapped in place (same ``timing_log_level`` and ``timing_log_option``).

Disabled (``OTEL_STRAGGLER_ENABLED`` unset or false, or ``instrument(enabled=False)``): nothing is patched.
``uninstrument`` restores the names, puts Megatron's own ``Timers`` (built alongside) back as the global timers, and
shuts the straggler ones down; a config that still holds them keeps a working, exporting-nothing group.
Every step fails open: a patch that cannot be applied is logged and training runs with Megatron's timers.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable, Collection
from typing import Any, ClassVar

import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from otel_straggler.version import __version__

_log = logging.getLogger(__name__)

CORE_MODULE = "megatron.core"
TIMERS_MODULE = "megatron.core.timers"
GLOBAL_VARS_MODULE = "megatron.training.global_vars"
_PATCHED_FLAG = "_otel_straggler_original"


def _enabled(explicit: bool | None) -> bool:
    from otel_straggler.config import EmitterConfig

    try:
        return EmitterConfig.from_env(enabled=explicit).enabled
    except Exception as exc:  # a configuration fault of ours: fail open
        _log.warning("otel-straggler: cannot read the configuration (%s); not instrumenting", exc)
        return False


class MegatronInstrumentor(BaseInstrumentor):  # type: ignore[misc]
    """``instrument(enabled=None, **options)``: ``options`` go to ``otel_straggler.install_megatron`` (e.g.
    ``sink=``); ``enabled`` overrides ``OTEL_STRAGGLER_ENABLED``."""

    _lock = threading.Lock()
    _active = False
    _hooks_registered = False
    _options: ClassVar[dict[str, Any]] = {}  # replaced, never mutated
    # straggler Timers -> the Megatron Timers built alongside it (restored by uninstrument)
    _twins: ClassVar[weakref.WeakKeyDictionary[Any, Any]] = weakref.WeakKeyDictionary()

    def instrumentation_dependencies(self) -> Collection[str]:
        # Megatron-LM usually runs from a source checkout, without package metadata to check against: the
        # patches are applied when (if) Megatron's modules are imported, and never otherwise.
        return ()

    def _instrument(self, **kwargs: Any) -> None:
        enabled = kwargs.pop("enabled", None)
        kwargs.pop("tracer_provider", None)  # the straggler spans have their own provider (export side)
        if not _enabled(enabled):
            _log.debug("otel-straggler: not enabled (OTEL_STRAGGLER_ENABLED); Megatron is left as it is")
            return
        cls = type(self)
        with cls._lock:
            cls._options = dict(kwargs)
            cls._active = True
            first = not cls._hooks_registered
            cls._hooks_registered = True
        for name, hook in _HOOKS:
            module = sys.modules.get(name)
            if first:  # runs the hook at once when the module is already imported, else right after its import
                wrapt.register_post_import_hook(hook, name)
            elif module is not None:  # instrumented again: the hooks stay registered (wrapt cannot remove them)
                hook(module)
        _log.info("otel-straggler %s: Megatron's Timers will be the straggler timers", __version__)

    def _uninstrument(self, **kwargs: Any) -> None:
        cls = type(self)
        with cls._lock:
            cls._active = False
        for name in (CORE_MODULE, TIMERS_MODULE, GLOBAL_VARS_MODULE):
            module = sys.modules.get(name)
            if module is not None:
                _unpatch_name(module, "Timers")
        gv = sys.modules.get(GLOBAL_VARS_MODULE)
        if gv is not None:
            current = getattr(gv, "_GLOBAL_TIMERS", None)
            twin = cls._twins.get(current) if current is not None else None
            if twin is not None:
                gv._GLOBAL_TIMERS = twin
        from otel_straggler import install

        for ours in list(cls._twins.keys()):
            if install.get_timers() is ours:
                install.shutdown()
            else:
                ours.shutdown()
        cls._twins.clear()


def _active() -> bool:
    return MegatronInstrumentor._active


def _build(original: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Megatron's Timers and, when enabled, the straggler Timers with the same log level and option (returned
    instead); Megatron's alone when anything fails."""
    theirs = original(*args, **kwargs)
    if not _active():
        return theirs
    return _replace(theirs)


def _replace(theirs: Any) -> Any:
    from otel_straggler.install import install_megatron

    try:
        ours = install_megatron(set_global=False, log_level=theirs._log_level, log_option=theirs._log_option,
                                **MegatronInstrumentor._options)
    except Exception as exc:  # install_megatron does not raise; an odd Megatron Timers might
        _log.warning("otel-straggler: cannot build the timers (%s); Megatron's own are used", exc)
        return theirs
    if ours is None:
        return theirs
    MegatronInstrumentor._twins[ours] = theirs
    return ours


_PATCHED: dict[type, type] = {}  # Megatron's Timers -> its patched subclass (one per class: every name gets the same)


def _patched_class(original: type) -> type:
    """A subclass of Megatron's ``Timers`` (``isinstance`` and ``issubclass`` checks against the name keep working)
    whose construction returns the straggler Timers."""
    if original in _PATCHED:
        return _PATCHED[original]

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        return _build(original, args, kwargs)

    patched = type(original.__name__, (original,), {
        "__new__": __new__,
        "__doc__": original.__doc__,
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        _PATCHED_FLAG: original,
    })
    _PATCHED[original] = patched
    return patched


def _patch_name(module: Any, name: str, original: type | None = None) -> None:
    current = getattr(module, name, None)
    if current is None or _PATCHED_FLAG in vars(current):
        return
    try:
        setattr(module, name, _patched_class(original or current))
    except Exception as exc:
        _log.warning("otel-straggler: cannot patch %s.%s (%s)", module.__name__, name, exc)


def _unpatch_name(module: Any, name: str) -> None:
    current = getattr(module, name, None)
    original = vars(current).get(_PATCHED_FLAG) if isinstance(current, type) else None
    if original is not None:
        setattr(module, name, original)


def _guarded(fn: Callable[[Any], None]) -> Callable[[Any], None]:
    def hook(module: Any) -> None:
        if not _active():
            return
        try:
            fn(module)
        except Exception as exc:  # never break the program's import of Megatron
            _log.warning("otel-straggler: instrumenting %s failed (%s: %s)", module.__name__, type(exc).__name__, exc)

    return hook


@_guarded
def _on_timers(module: Any) -> None:
    _patch_name(module, "Timers")


@_guarded
def _on_core(module: Any) -> None:
    _patch_name(module, "Timers")


@_guarded
def _on_global_vars(module: Any) -> None:
    _patch_name(module, "Timers")
    current = getattr(module, "_GLOBAL_TIMERS", None)
    if current is not None and current not in MegatronInstrumentor._twins and hasattr(current, "_log_option"):
        module._GLOBAL_TIMERS = _replace(current)  # built before the instrumentor ran


_HOOKS = ((CORE_MODULE, _on_core), (TIMERS_MODULE, _on_timers), (GLOBAL_VARS_MODULE, _on_global_vars))

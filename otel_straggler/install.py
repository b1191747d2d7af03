"""Wiring: ``install_megatron`` for Megatron, ``configure``/``stage``/``step`` for any training loop.

Nothing here touches signals or atexit directly: when ``install_megatron``/``configure`` created the
export sink themselves, they hand the Timers to ``lifecycle.register`` (``Timers.shutdown(timeout)`` at the
real exit: atexit, or a SIGTERM under its default action; a SIGTERM the program handles itself only
flushes; idempotent and bounded); pass ``register_lifecycle=False`` to skip.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from otel_straggler.config import EmitterConfig
from otel_straggler.counters import EmitterCounters
from otel_straggler.event_pool import create_pool
from otel_straggler.identity import DIMS, Identity, resolve_identity
from otel_straggler.inject import injector_from_env
from otel_straggler.interval import IntervalSink, NullSink
from otel_straggler.timers import Timers

_log = logging.getLogger(__name__)
_lock = threading.Lock()  # guards _DEFAULT assignment only (never taken on the hot path)
_DEFAULT: list[Timers | None] = [None]

F = TypeVar("F", bound=Callable[..., Any])

_EXTRA_KEYS = (
    "log_level",
    "log_option",
    "sink",
    "event_factory",
    "identity",
    "env",
    "start_readout",
    "register_lifecycle",
)
_IDENTITY_KEYS = (
    "rank",
    "local_rank",
    "world_size",
    "model_chunk",
    *(f"{d}_{k}" for d in DIMS for k in ("rank", "size")),
)


def _export_sink(config: EmitterConfig, identity: Identity, counters: EmitterCounters) -> IntervalSink:
    try:
        from otel_straggler.export import create_sink  # provided by the export side
    except Exception as exc:
        _log.warning("otel-straggler: export side unavailable (%s); intervals are dropped", type(exc).__name__)
        counters.sink_errors += 1
        return NullSink()
    try:
        return create_sink(config, identity, counters)
    except Exception as exc:
        _log.warning("otel-straggler: export sink failed to start (%s); intervals are dropped", type(exc).__name__)
        counters.sink_errors += 1
        return NullSink()


def build_timers(enabled: bool | None = None, **opts: Any) -> Timers | None:
    """One fully wired Timers (pool warmed, readout started, export sink), or None when disabled.
    Never raises: whatever fails while wiring (it should not) is logged and leaves training untimed."""
    try:
        return _build_timers(enabled, opts)
    except Exception as exc:
        _log.warning("otel-straggler: setup failed (%s: %s); training continues without it",
                     type(exc).__name__, exc)
        return None


def _build_timers(enabled: bool | None, opts: dict[str, Any]) -> Timers | None:
    extras = {k: opts.pop(k) for k in list(opts) if k in _EXTRA_KEYS}
    id_args = {k: opts.pop(k) for k in list(opts) if k in _IDENTITY_KEYS}
    env = extras.get("env")
    config = EmitterConfig.from_env(env, enabled=enabled, **opts)
    if not config.enabled:
        return None
    pool = create_pool(config.pool_size, extras.get("event_factory"), config.record_api)
    identity = extras.get("identity") or resolve_identity(
        env=env, cuda=pool.cuda, job_id=config.job_id or None, topology_epoch=config.topology_epoch, **id_args
    )
    injector, inject_error = injector_from_env(identity.rank, env)
    if injector is not None:
        injector.calibrate(pool.cuda)
    counters = EmitterCounters(len(config.config_errors) + int(inject_error))
    own_sink = extras.get("sink") is None
    sink: IntervalSink = extras.get("sink") or _export_sink(config, identity, counters)
    timers = Timers(
        extras.get("log_level", 2),
        extras.get("log_option", "minmax"),
        config=config,
        pool=pool,
        counters=counters,
        sink=sink,
        injector=injector,
        identity=identity,
        start_readout=extras.get("start_readout", True),
    )
    if own_sink and extras.get("register_lifecycle", True):
        _register_lifecycle(timers, config.shutdown_timeout_s)
    return timers


def _register_lifecycle(timers: Timers, timeout_s: float) -> None:
    """Bounded shutdown at exit/SIGTERM is the export side's ``lifecycle`` (guarded: optional)."""
    try:
        from otel_straggler import lifecycle

        lifecycle.register(timers, timeout_s)
    except Exception:
        timers.counters.sink_errors += 1


def install_megatron(
    model_config: Any = None,
    optimizer_config: Any = None,
    *,
    set_global: bool = True,
    enabled: bool | None = None,
    **opts: Any,
) -> Timers | None:
    """Install the timers into Megatron: ``model_config.timers``, ``optimizer_config.timers`` and
    (``set_global``) ``megatron.training.global_vars._GLOBAL_TIMERS`` when the program imported it.
    Disabled (argument, else ``OTEL_STRAGGLER_ENABLED``): returns None and touches nothing.

    Assign the model config AFTER the model is built (attention/MoE deep-copy their config while being
    built; the timers survive a deepcopy as the same object anyway). ``log_level`` defaults to 2 so the
    per-microbatch stages are timed; ``log_option`` to ``minmax``.
    """
    timers = build_timers(enabled=enabled, **opts)
    if timers is None:
        return None
    for cfg in (model_config, optimizer_config):
        if cfg is not None:
            try:
                cfg.timers = timers
            except Exception:  # a frozen or odd config: leave it, count it
                timers.counters.faults_training += 1
    if set_global:
        gv = sys.modules.get("megatron.training.global_vars")  # imported by a Megatron-LM program; never here
        if gv is not None:
            try:
                gv._GLOBAL_TIMERS = timers
            except Exception:
                timers.counters.faults_training += 1
    with _lock:
        _DEFAULT[0] = timers
    return timers


def configure(enabled: bool | None = None, **opts: Any) -> Timers | None:
    """Create the process-wide default Timers for ``stage``/``step`` (same options as install_megatron).
    Replaces (and shuts down) a previous default. Returns None when disabled."""
    timers = build_timers(enabled=enabled, **opts)
    with _lock:
        old, _DEFAULT[0] = _DEFAULT[0], timers
    if old is not None and old is not timers:
        old.shutdown(1.0)
    return timers


def get_timers() -> Timers | None:
    return _DEFAULT[0]


def shutdown(timeout_s: float | None = None) -> None:
    """Shut the default Timers down (idempotent, bounded)."""
    with _lock:
        timers, _DEFAULT[0] = _DEFAULT[0], None
    if timers is not None:
        timers.shutdown(timeout_s)


def step(n: int, tokens: int | None = None, sequences: int | None = None, microbatches: int | None = None) -> None:
    """Publish the current step (and workload) on the default Timers; no-op when not configured."""
    timers = _DEFAULT[0]
    if timers is not None:
        timers.set_step(n, tokens, sequences, microbatches)


class stage:  # used like a function: ``with stage("forward-compute"):`` / ``@stage("x")``
    """Time a block or a function as one interval of timer ``name`` on the default Timers.

    ``collective=True`` marks the timer as holding a wait in a collective (e.g. ``loss.backward()`` under
    PyTorch DDP, whose gradient all-reduce waits for the slowest rank): its spans carry
    ``straggler.stage.collective``, and the collector uses the stage as evidence of who waited least instead of
    judging it (a waiter's stage is long because another rank is slow). The mark stays on the timer name.
    """

    __slots__ = ("_timer", "collective", "level", "name")

    def __init__(self, name: str, level: int | None = None, *, collective: bool = False) -> None:
        self.name = name
        self.level = level
        self.collective = collective
        self._timer: Any = None

    def __enter__(self) -> stage:
        timers = _DEFAULT[0]
        if timers is not None:
            try:
                self._timer = timers(self.name, self.level)
            except Exception:  # AssertionError (Megatron level checks) or any internal fault: fail open
                self._timer = None
                timers.counters.faults_training += 1
            if self._timer is not None:
                if self.collective and not getattr(self._timer, "collective", True):
                    self._timer.collective = True  # a Timer (the shared DummyTimer has no such attribute)
                self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        t, self._timer = self._timer, None
        if t is not None:
            t.stop()

    def __call__(self, fn: F) -> F:
        name, level, collective = self.name, self.level, self.collective

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with stage(name, level, collective=collective):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

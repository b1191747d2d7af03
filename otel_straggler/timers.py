"""Drop-in replacement for ``megatron.core.timers.Timers`` (megatron-core 0.12-0.16) that never syncs.

Same call shapes and level filtering as Megatron: ``timers(name, log_level=None)`` returns a timer with
``start/stop/elapsed/active_time/reset/set_elapsed``; ``log``/``write``/``get_all_timers_string`` print
Megatron's text format. Differences, all deliberate:

* No ``torch.cuda.synchronize`` and no collective anywhere: ``barrier=True`` is accepted, never
  executed, and counted (``barriers_skipped``). ``elapsed()``/``log()``/``write()`` report THIS rank's
  HOST time (``time.perf_counter_ns``). On CUDA that is host launch time, not GPU time (Megatron's sync
  made them equal); the GPU stream time is measured with CUDA events and reaches the export side through
  the readout thread. ``log`` prints this rank's value in every field (min = max = this rank).
* Start on a started timer / stop on a stopped timer raise Megatron's ``AssertionError`` ("timer has already
  been started", "timer is not started"), before anything changes, and are counted (``unbalanced``); unlike a
  Python ``assert`` they raise under ``python -O`` too.
* Configuration errors in ``timers(name, log_level)`` (a level above 2 for a new name, a different level
  for an existing name) raise the same ``AssertionError`` as Megatron, at lookup: the program is equally
  (in)correct with either timers object, and the error shows at the first call, not mid-run silently.
  ``DummyTimer.elapsed/active_time`` raise like Megatron's too.
* Every other ``Exception`` inside start/stop is caught and counted (``faults``); training never sees it. A
  ``KeyboardInterrupt`` or ``SystemExit`` (a signal handler that raised inside the call) is the program's: it
  propagates, the interrupted start or stop did not happen, and the pool events it held go back through the readout.
* Names and levels are Megatron's: any hashable name (the wire and the spans carry its ``str``, bounded to
  ``interval.MAX_NAME_BYTES``: a longer one is truncated with a hash suffix and counted, ``names_truncated``), any
  number as level (the wire's one-byte level is clamped).
* ``copy.deepcopy(timers)`` returns the same object (Megatron deep-copies configs that carry it);
  ``pickle`` gives an inert copy (host-only, no pool, no thread, no sink) that still works.

Hot path (start/stop on the training thread): one ``perf_counter_ns()`` (two at a device-sampled start that
records); on device-sampled steps, for one repeat of each timer per step (``device_repeats``: the middle one of
its previous step's; every repeat with ``all``), a pre-created event from the pool recorded on the current stream
(``pool.record``: the driver's ``cuEventRecord`` on the raw handles where available, ``event_pool.py``), or the
previous boundary's event when this one follows it closely (``SharedEvent``); at stop one 64-byte ring record
written (step, repeat index and workload bound here, at completion; ``ring.py``). No lock, no I/O, no logging, no
sync. The lookup ``timers(name, log_level)``, which Megatron makes before every start and stop, is the other half:
``TimersCore`` finds an existing timer, anything else goes to ``Timers._get``. ``TimerCore`` and ``TimersCore``
(``hot_path.py``: ``_hotpath.c`` or ``_hotpath_py.py``) hold the start, the stop and that lookup.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Iterable
from types import MethodType
from typing import Any

from otel_straggler.config import DEFAULTS, EmitterConfig
from otel_straggler.counters import EmitterCounters
from otel_straggler.event_pool import EventPool, HostOnlyPool
from otel_straggler.hot_path import Ring, SharedEvent, TimerCore, TimersCore
from otel_straggler.interval import IntervalSink, bound_name, wire_level
from otel_straggler.ring import NO_EVENT, register
from otel_straggler.stages import stage_group
from otel_straggler.step_context import StepContext

_log = logging.getLogger("otel_straggler.timers")
# Timers.log's text goes where megatron-core's Timers.log puts it: INFO on this logger, so the logging set up for
# Megatron (its --logging-level, a handler on "megatron") shows both the same way
_megatron_log = logging.getLogger("megatron.core.timers")
_clock = time.perf_counter_ns  # read by the C start/stop when replaced (tests); the Python one's: _hotpath_py._clock

MAX_LOG_LEVEL = 2
MAX_TIMER_NAMES = 1024


class DummyTimer:
    """Shared no-op timer for names above the configured log level (Megatron's DummyTimer)."""

    __slots__ = ("name",)

    def __init__(self) -> None:
        self.name = "dummy timer"

    def start(self, barrier: bool = False) -> None:
        return

    def stop(self, barrier: bool = False) -> None:
        return

    def reset(self) -> None:
        return

    def set_elapsed(self, value: float) -> None:
        return

    def set_barrier_group(self, barrier_group: Any) -> None:
        return

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        raise Exception(
            "dummy timer should not be used to calculate elapsed time, check if timer's log_level <= self._log_level."
        )

    def active_time(self) -> float:
        raise Exception(
            "active timer should not be used to calculate elapsed time, check if timer's log_level <= self._log_level."
        )

    def __deepcopy__(self, memo: dict) -> DummyTimer:
        return self


class Timer(TimerCore):
    """One named timer. State is per timer, so nesting and per-microbatch repeats just work."""

    __slots__ = ()

    def __init__(
        self,
        name: Any,
        level: Any,
        *,
        ring: Ring,
        ctx: StepContext,
        pool: EventPool | HostOnlyPool,
        counters: EmitterCounters,
        share: SharedEvent,
        inject: Any = None,
        is_step: bool = False,
        sample_repeats: bool = False,
        label: str | None = None,
    ) -> None:
        self.name = name  # Megatron's: any hashable, whole
        self._level = level  # Megatron's: any number (``timers(name, 1.5)``), whole; the wire clamps it
        # what the wire and the spans call it: its str, bounded (records.py ``bound_name``)
        self.label = label if label is not None else bound_name(name)[0]
        self._group = stage_group(self.label)
        self._started = False
        self._t0 = 0
        self._elapsed_ns = 0
        self._elapsed_base = 0.0
        self._active_ns = 0
        self._sev = NO_EVENT
        self._reason = 0
        self._rep_step = -1
        self._rep = -1
        # the repeat of a step that gets device time (device_repeats middle; -1: every repeat): the middle one of the
        # timer's starts in the last device-sampled step it started in, set at its first start of each such step (0
        # until one was seen). Counted at start, by the step current at the start: an interval that straddles a
        # step change (started before set_step, stopped after) is bound to its stop's step, the pick to its start's
        self._pick = 0 if sample_repeats else -1
        self._sstep = -1  # the step of those starts
        self._starts = 0  # device-sampled starts in it
        self._ring = ring
        # the timer's id in the ring's table, which the records carry: what the wire calls it
        self._id = register(ring, self.label, wire_level(level), self._group, False)
        self._ctx = ctx
        self._tab = pool.table
        self._free = pool.free
        self._orphans = pool.orphans
        self._record = pool.record
        # the C hot path calls cuEventRecord itself where the pool records through the driver (event_pool.py)
        self._cu_record = int(getattr(pool.record, "cu_event_record", 0) or 0)
        # the C hot path reads CLOCK_MONOTONIC (perf_counter_ns) unless the module's clock was replaced (tests)
        self._clock = None if _clock is time.perf_counter_ns else _clock
        self._share = share
        self._c = counters
        self._inject = inject
        self._is_step = is_step

    # ---- Megatron Timer API (not per-microbatch) --------------------------------------------------
    def reset(self) -> None:
        """Megatron: zero the elapsed time (not the active time) and forget a running start."""
        try:
            sev = self._sev
            if sev != NO_EVENT:  # recorded: the readout thread frees it once complete (``SharedEvent.release``,
                tb = self._tab  # inline: no call before the state is whole, for a signal handler's exception)
                tb.refs[sev] -= 1
                tb.tainted[sev] = 1
                self._sev = NO_EVENT
                sh = self._share
                if tb.refs[sev] <= 0 and sev != sh.ev:
                    tb.tag[sev] = sh.ring.head
                    self._orphans.append(sev)
            self._active_ns += self._elapsed_ns  # active time survives reset (Megatron)
            self._elapsed_ns = 0
            self._elapsed_base = 0.0
            self._started = False
        except Exception:
            self._c.faults_training += 1

    def set_elapsed(self, value: float) -> None:
        self._active_ns += self._elapsed_ns
        self._elapsed_base = float(value)
        self._elapsed_ns = 0

    def set_barrier_group(self, barrier_group: Any) -> None:
        return  # barriers are never executed, so the group is never used

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Host seconds accumulated; a running timer is stopped and restarted (Megatron semantics)."""
        started = self._started
        if started:
            self.stop(barrier=barrier)
        value = self._elapsed_base + self._elapsed_ns / 1e9
        if reset:
            self.reset()
        if started:
            is_step = self._is_step
            self._is_step = False  # a restart inside elapsed() is not a new step
            if self._sstep == self._ctx.step and self._starts > 0:
                self._starts -= 1  # nor a new repeat: its second half is measured iff its first was
            try:
                self.start(barrier=barrier)
            finally:
                self._is_step = is_step
        return value

    def active_time(self) -> float:
        """Host seconds the timer was active, cumulative across resets (Megatron semantics)."""
        return (self._active_ns + self._elapsed_ns) / 1e9

    @property
    def level(self) -> int:
        return self._level

    @property
    def group(self) -> str:
        return self._group

    @property
    def collective(self) -> bool:
        """The interval holds a wait in a collective (``stage(..., collective=True)``): the wire's flag, kept in the
        ring's table of timers."""
        table = self._ring.timers
        return self._id < len(table) and table[self._id][3]

    @collective.setter
    def collective(self, value: bool) -> None:
        table = self._ring.timers
        if self._id < len(table):
            label, level, group, _ = table[self._id]
            table[self._id] = (label, level, group, bool(value))  # one store: the readout reads either tuple

    def __deepcopy__(self, memo: dict) -> Timer:
        return self

    def __copy__(self) -> Timer:
        return self

    def __reduce__(self) -> tuple:
        return (_inert_timer, (self.name, self._level))


def _call(self: Timers, name: str, log_level: int | None = None) -> Timer | DummyTimer:
    """``timers(name, log_level=None)``: the timer ``name`` (Megatron's ``Timers.__call__``)."""
    return self(name, log_level)


class _TimersType(type):
    """The type of ``Timers``: ``Timers.__call__`` read from the class is ``_call``, with Megatron's signature, for
    ``inspect.signature``, ``mock.create_autospec`` and wrappers. The call itself stays ``TimersCore``'s (the C
    type's slot: a ``__call__`` defined on the class would replace it with a Python dispatch, and on Python 3.12+
    lose its vectorcall)."""

    def __getattribute__(cls, name: str) -> Any:
        if name == "__call__":
            return _call
        return type.__getattribute__(cls, name)


class _CallSignature:
    """``__signature__`` read from a ``Timers`` object: its call's, ``(name, log_level=None)`` (Python 3.13's
    ``inspect`` looks ``__call__`` up statically, past ``_TimersType``); None read from the class, whose own signature
    ``inspect`` then derives as usual."""

    def __get__(self, obj: object, cls: type | None = None) -> inspect.Signature | None:
        if obj is None:
            return None
        params = list(inspect.signature(_call).parameters.values())[1:]
        return inspect.signature(_call).replace(parameters=params)


class Timers(TimersCore, metaclass=_TimersType):
    """Group of timers, Megatron's ``Timers(log_level, log_option)`` plus keyword-only wiring.

    Built bare (``Timers(2, "minmax")``) it is a host-only timer group with nothing attached: intervals
    are counted as dropped, ``log``/``elapsed`` work. ``install_megatron``/``configure`` build it with a
    pool, a ring and a readout thread feeding a sink.
    """

    __slots__ = (
        "__dict__",
        "__weakref__",
        "_dummy_timer",
        "_log_level",
        "_log_levels",
        "_log_option",
        "_max_log_level",
        "_rank",
        "_sample_repeats",
        "_step_timer",
        "_world_size",
        "config",
        "counters",
        "ctx",
        "identity",
        "injector",
        "names_dropped",
        "pool",
        "readout",
        "ring",
        "share",
        "sink",
        "wall_anchor",
    )

    __signature__ = _CallSignature()

    def __init__(
        self,
        log_level: int,
        log_option: str,
        *,
        config: EmitterConfig | None = None,
        pool: EventPool | HostOnlyPool | None = None,
        counters: EmitterCounters | None = None,
        sink: IntervalSink | None = None,
        injector: Any = None,
        identity: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        start_readout: bool = False,
    ) -> None:
        allowed = {"max", "minmax", "all"}
        assert log_option in allowed, f"input log option {log_option} is invalid. It must be one of {allowed}"
        self._log_level = log_level
        self._log_option = log_option
        # ``timers.__call__`` read from the object: Megatron's signature too (``_TimersType`` says why); the call
        # itself never reads it
        self.__dict__["__call__"] = MethodType(_call, self)
        self._timers: dict[str, Timer] = {}
        self._log_levels: dict[str, int] = {}
        self._dummy_timer = DummyTimer()
        self._max_log_level = MAX_LOG_LEVEL
        self.config = config
        cfg = config if config is not None else DEFAULTS
        self.identity = identity
        self._rank = int(rank if rank is not None else getattr(identity, "rank", 0))
        self._world_size = int(world_size if world_size is not None else getattr(identity, "world_size", 1))
        self.counters = (
            counters if counters is not None else EmitterCounters(len(cfg.config_errors))
        )
        self.pool = pool if pool is not None else HostOnlyPool()
        self.sink = sink
        self.injector = injector
        self._step_timer = cfg.step_timer
        # a device-sampled step times one repeat (microbatch) of each timer on the device (config.py)
        self._sample_repeats = cfg.device_repeats == "middle"
        # with no sink nothing consumes the ring: a 0-record ring counts every interval as dropped
        self.ring = Ring(cfg.ring_size) if sink is not None else Ring(0)
        self.share = SharedEvent(gap_us=cfg.share_gap_us, stream_of=getattr(self.pool, "stream", None),
                                 table=self.pool.table, ring=self.ring)
        self.ctx = StepContext(device_every=cfg.device_every, cuda=self.pool.cuda,
                               budget=cfg.device_budget,
                               max_every=cfg.device_every_max,
                               record_cost_s=getattr(self.pool, "record_cost_s", 10e-6),
                               intervals=self._interval_count,
                               records=self._record_count)
        self.names_dropped = 0
        # Wall clock derived from the monotonic clock: one anchor pair, no second clock read per call.
        self.wall_anchor = (time.time_ns(), _clock())
        self.readout: Any = None
        if sink is not None:
            from otel_straggler.readout import Readout

            self.readout = Readout(
                self.ring,
                self.pool,
                self.counters,
                sink,
                interval_ms=cfg.readout_interval_ms,
                timeout_s=cfg.readout_timeout_s,
                wall_anchor=self.wall_anchor,
            )
            if start_readout:
                self.readout.start()

    def _record_count(self) -> int:
        """Events recorded so far (read once per step change for adaptive sampling)."""
        return self.share.records

    def _interval_count(self) -> int:
        """Intervals written so far (the ring's head; read once per step change for adaptive sampling)."""
        return self.ring.head

    # ---- Megatron API ---------------------------------------------------------------------------
    def _get(self, name: Any, log_level: Any = None) -> Timer | DummyTimer:
        """``timers(name, log_level)``: Megatron's lookup (``TimersCore`` answers an existing timer first)."""
        t = self._timers.get(name)
        if t is not None:
            if log_level is not None:
                assert log_level == t._level, (
                    f"input log level {log_level} does not match already existing log level {t._level} for {name} timer"
                )
            return t
        if log_level is None:
            log_level = self._max_log_level
        assert log_level <= self._max_log_level, (
            f"log level {log_level} is larger than max supported log level {self._max_log_level}"
        )
        if log_level > self._log_level:
            return self._dummy_timer
        if len(self._timers) >= MAX_TIMER_NAMES:
            self.names_dropped += 1
            return self._dummy_timer
        label, truncated = bound_name(name)
        if truncated:
            self.counters.names_truncated += 1
        inj = self.injector if (self.injector is not None and self.injector.stage == name) else None
        timer = Timer(
            name,
            log_level,
            label=label,
            ring=self.ring,
            ctx=self.ctx,
            pool=self.pool,
            counters=self.counters,
            share=self.share,
            inject=inj,
            is_step=(name == self._step_timer),
            sample_repeats=self._sample_repeats,
        )
        self._timers[name] = timer
        self._log_levels[name] = log_level
        return timer

    def _this_rank_times(self, names: Iterable[str], reset: bool, barrier: bool, normalizer: float) -> dict:
        if barrier:
            self.counters.barriers_skipped += 1
        out: dict[str, float] = {}
        for name in names:
            t = self._timers.get(name)
            if t is None:
                continue
            v = t.elapsed(reset=reset)
            if v > 0.0:  # Megatron filters timers with no timing
                out[name] = v / normalizer
        return out

    # Megatron's private helpers, same signatures, this rank only (no gather, no sync).
    def _get_elapsed_time_all_ranks(self, names: list[str], reset: bool, barrier: bool) -> Any:
        """A [world_size, len(names)] CPU tensor with only this rank's row filled (no all-gather)."""
        if len(names) == 0:
            return None
        import torch

        if barrier:
            self.counters.barriers_skipped += 1
        out = torch.zeros((self._world_size, len(names)), dtype=torch.float)
        for i, name in enumerate(names):
            t = self._timers.get(name)
            if t is not None:
                out[self._rank, i] = t.elapsed(reset=reset)
        return out

    def _get_global_min_max_time(self, names: Iterable[str], reset: bool, barrier: bool, normalizer: float) -> dict:
        return {n: (v, v) for n, v in self._this_rank_times(names, reset, barrier, normalizer).items()}

    def _get_global_min_max_time_string(
        self, names: Iterable[str], reset: bool, barrier: bool, normalizer: float, max_only: bool
    ) -> str | None:
        name_to_min_max_time = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if not name_to_min_max_time:
            return None
        out = "max time across ranks (ms):" if max_only else "(min, max) time across ranks (ms):"
        for name, (lo, hi) in name_to_min_max_time.items():
            label = (str(name) + " ").ljust(48, ".")
            if max_only:
                out += f"\n    {label}: {hi:.2f}"
            else:
                out += f"\n    {label}: ({lo:.2f}, {hi:.2f})"
        return out

    def _get_all_ranks_time_string(
        self, names: Iterable[str], reset: bool, barrier: bool, normalizer: float
    ) -> str | None:
        times = self._this_rank_times(names, reset, barrier, normalizer)
        if not times:
            return None
        out = "times across ranks (ms):"
        for name, v in times.items():
            out += f"\n  {name!s}:"
            out += f"\n     rank {self._rank:2d}: {v:.2f}"
        return out

    def get_all_timers_string(
        self,
        names: list[str] | None = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> str | None:
        """Megatron's text, with this rank's host value in every field; no collective, no sync."""
        if names is None:
            names = list(self._timers.keys())
        assert normalizer > 0.0
        if self._log_option in ("max", "minmax"):
            return self._get_global_min_max_time_string(
                names, reset, barrier, normalizer / 1000.0, self._log_option == "max"
            )
        if self._log_option == "all":
            return self._get_all_ranks_time_string(names, reset, barrier, normalizer / 1000.0)
        raise Exception(f"unknown timing log option {self._log_option}")

    def log(
        self,
        names: list[str],
        rank: int | None = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Log this rank's timers as megatron-core does: on the last rank by default, at INFO on the
        ``megatron.core.timers`` logger."""
        output = self.get_all_timers_string(names, normalizer, reset, barrier)
        if rank is None:
            rank = self._world_size - 1
        if rank == self._rank and output is not None:
            _megatron_log.info(output)

    def write(
        self,
        names: list[str],
        writer: Any,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Write ``<name>-time`` scalars (this rank's host seconds / normalizer) like Megatron."""
        assert normalizer > 0.0
        times = self._this_rank_times(names, reset, barrier, normalizer)
        if writer is None:
            return
        for name, v in times.items():
            if hasattr(writer, "add_scalar"):
                writer.add_scalar(name + "-time", v, iteration)
            elif hasattr(writer, "log"):
                writer.log({name + "-time": v}, iteration)

    # ---- step context ----------------------------------------------------------------------------
    def set_step(
        self,
        step: int,
        tokens: int | None = None,
        sequences: int | None = None,
        microbatches: int | None = None,
    ) -> None:
        """Training thread: publish the step (and workload) that following stops bind to."""
        try:
            self.ctx.set_step(step, tokens, sequences, microbatches)
        except Exception:
            self.counters.faults_training += 1

    # ---- lifecycle ---------------------------------------------------------------------------------
    def flush(self, timeout_s: float = 5.0) -> bool:
        """Drain the ring to the sink, then flush the sink; bounded by timeout_s. Not for the hot path."""
        if self.readout is None:
            return True
        deadline = time.monotonic() + max(0.0, timeout_s)
        ok = self.readout.flush(timeout_s)
        sink = self.sink
        if sink is not None:
            try:
                ok = bool(sink.flush(max(0.0, deadline - time.monotonic()))) and ok
            except Exception:
                self.counters.sink_errors += 1
                ok = False
        return ok

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop the readout (draining what it can), flush and shut the sink; bounded and idempotent."""
        if timeout_s is None:
            timeout_s = (self.config if self.config is not None else DEFAULTS).shutdown_timeout_s
        deadline = time.monotonic() + max(0.0, timeout_s)
        readout = self.readout
        if readout is not None:
            try:
                self.share.retire()  # the latest event goes back with the rest
                readout.stop(max(0.0, timeout_s * 0.6))
            except Exception:
                self.counters.faults_readout += 1
        sink = self.sink
        self.sink = None
        if sink is not None and readout is not None:
            try:
                sink.publish_stats(self.counters.snapshot())
            except Exception:
                self.counters.sink_errors += 1
            try:
                sink.flush(max(0.0, deadline - time.monotonic()))
            except Exception:
                self.counters.sink_errors += 1
            try:
                sink.shutdown(max(0.0, deadline - time.monotonic()))
            except Exception:
                self.counters.sink_errors += 1

    # ---- copy / pickle ----------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict) -> Timers:
        return self

    def __copy__(self) -> Timers:
        return self

    def __reduce__(self) -> tuple:
        return (
            _inert_timers,
            (self._log_level, self._log_option, dict(self._log_levels), self._rank, self._world_size),
        )


def _inert_timers(log_level: int, log_option: str, levels: dict, rank: int = 0, world_size: int = 1) -> Timers:
    t = Timers(log_level, log_option, rank=rank, world_size=world_size)
    for name, level in levels.items():
        t(name, level)
    return t


_INERT: list[Timers] = []


def _inert_timer(name: str, level: int) -> Timer:
    if not _INERT:
        _INERT.append(Timers(MAX_LOG_LEVEL, "minmax"))
    owner = _INERT[0]
    return Timer(name, level, ring=owner.ring, ctx=owner.ctx, pool=owner.pool, counters=owner.counters,
                 share=owner.share)

"""Emitter configuration: keyword arguments over ``OTEL_STRAGGLER_*`` environment variables.

Never raises into training: a bad value (unparsable, or outside its bounds: every size knob has an upper
bound, ``MAX_*`` below) is warned about once (``logging``), replaced by the default and recorded in
``EmitterConfig.config_errors`` (the counters count each as a ``config_error`` fault).

The settings, their defaults, bounds and meanings: ``docs/configuration.md`` (generated from ``EmitterConfig``,
``_PARSERS`` and ``HELP`` below by ``scripts/gen_docs.py``).

Every module takes its defaults from ``DEFAULTS`` (``EmitterConfig()``), the one place they are written.

``device_every`` defaults to ``auto``: a CUDA event record costs a few microseconds warm through the driver
(several times that through torch's ``Event.record``), and several times its warm cost between the launches of
a launch-bound step, where a device-sampled step pays a measurable share of the step; on a step of a second
events cost next to nothing (``bench/results/gpu-h200.md`` sections 2 and 3). Auto sampling picks the smallest N
(1..``device_every_max``) whose cost stays within ``device_budget``: a prior of 5x the records' micro-cost
until the measured difference between device-sampled and host-only step periods resolves the budget
(``step_context.py``): N = 3-4 launch-bound, N = 1 for long steps. The other steps are timed on the host
(``sampled_out``). A fixed N >= 1 disables the adaptation.
``device_repeats`` defaults to ``middle``: a timer that runs once per microbatch (``forward-compute``,
``backward-compute``, ``batch-generator``, the P2P timers) records events on a device-sampled step for one of its
repeats only, the middle one by its previous step's count (away from the first microbatch's parameter gather and
the last one's gradient reduction), and times the others on the host (``sampled_out``). The stage's device time of
the step is that repeat's x the step's repeats (``straggler.duration.device_repeats`` on the stage span says how
many were measured; ``docs/schema.md``). Every rank of a cohort times the same repeat of a step, so the collector
compares like with like, and the records per step no longer grow with the microbatches: device time on every
step of a pipeline schedule with 32 microbatches costs what one microbatch's does. Repeats are counted by the
step current at their start; an ``elapsed()`` read of a running timer continues its repeat. A step that runs fewer
repeats than the previous step's middle index (the first after a change of microbatches) has none measured for
that timer. ``all`` times every repeat.
The readout thread wakes every 500 ms: each wake takes the GIL from the training thread and hands it back, and
on a launch-bound step those hand-offs, not the drain's work, are most of what the readout costs, so fewer wakes
cost less (``bench/results/gpu-h200.md`` section 3; ``bench/results/cpu-gil-handoff.md``).
500 ms keeps the collector's allowances (``export/batch_delay.py``): the delivery spread between ranks, a readout
period plus the batch delay (at least 200 ms), stays inside ``max_open_windows`` x ``window_steps`` steps down to
~18 ms steps with 8 open windows (inside half of them from 35 ms; the default 64 hold it down to ~2 ms). The pool
holds what a period leaves in flight with device time on every step: 26 intervals per 20 ms step for 500 ms and the
step still running are ~1,400 events, a third of the 4096 (fewer events: ``pool_exhausted``, host-only and
counted). The export child runs at ``export_nice`` (+10) so it yields to training processes on shared cores.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import otel_straggler_schema as schema
from otel_straggler.event_pool import RECORD_APIS

_log = logging.getLogger(__name__)
_warned: set[str] = set()
_informed: set[str] = set()

ENV_PREFIX = "OTEL_STRAGGLER_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError("not a boolean (1/0, true/false, yes/no, on/off)")


_parse_bool.allowed = "1/0, true/false, yes/no, on/off"  # type: ignore[attr-defined]


def _int_in(lo: int, hi: int) -> Callable[[Any], int]:
    """An integer in [lo, hi]: every size knob is bounded, so no value can exhaust memory at install."""

    def parse(v: Any) -> int:
        if isinstance(v, bool):
            raise ValueError("bool is not an int")
        if isinstance(v, float) and not v.is_integer():
            raise ValueError("not an integer")
        try:
            x = int(v)
        except ValueError:
            raise ValueError("not an integer") from None  # int()'s own message quotes the value
        if not lo <= x <= hi:
            raise ValueError(f"must be in [{lo}, {hi}]")
        return x

    parse.allowed = f"integer {lo} to {hi}"  # type: ignore[attr-defined]
    return parse


def _float_in(hi: float, allow_zero: bool = False) -> Callable[[Any], float]:
    """A finite number in (0, hi] (``allow_zero``: [0, hi])."""

    def parse(v: Any) -> float:
        if isinstance(v, bool):
            raise ValueError("bool is not a number")
        try:
            x = float(v)
        except ValueError:
            raise ValueError("not a number") from None
        if not (0.0 <= x if allow_zero else 0.0 < x) or not x <= hi:  # also refuses nan and inf
            raise ValueError(f"must be in {'[' if allow_zero else '('}0, {hi}]")
        return x

    parse.allowed = f"{'0' if allow_zero else '> 0'} to {hi:g}"  # type: ignore[attr-defined]
    return parse


def _choice(*allowed: str) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        s = str(v).strip().lower()
        if s not in allowed:
            raise ValueError(f"must be one of {allowed}")
        return s

    parse.allowed = ", ".join(allowed)  # type: ignore[attr-defined]
    return parse


def _device_every(v: Any) -> int:
    """``auto`` (or 0) adapts N to the step time; otherwise a fixed N >= 1."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return 0
    return _int_in(0, MAX_DEVICE_EVERY)(v)


_device_every.allowed = "auto (0) or 1 to 1000"  # type: ignore[attr-defined]


def _text(v: Any) -> str:
    return str(v).strip()


_text.allowed = "text"  # type: ignore[attr-defined]


def _nonempty(v: Any) -> str:
    s = str(v).strip()
    if not s:
        raise ValueError("must not be empty")
    return s


_nonempty.allowed = "non-empty text"  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class EmitterConfig:
    enabled: bool = False
    job_id: str = ""
    detail: str = schema.DETAIL_STEP
    device_every: int = 0  # 0 = auto
    device_budget: float = 0.0025
    device_every_max: int = 4
    # middle: on a device-sampled step each timer's middle repeat (microbatch) of its previous step's count is timed
    # on the device and its other repeats on the host (``sampled_out``); the stage's device time is that repeat's
    # x the step's repeats (module docstring); all: every repeat records its events
    device_repeats: str = "middle"
    pool_size: int = 4096  # events in flight over a readout period (module docstring)
    # auto: the CUDA driver's cuEventRecord on raw handles when it passes the install check (a fraction of
    # torch's Event.record cost on the training thread), else torch's; torch: always torch's
    record_api: str = "auto"
    # a start (or an outer stop) less than this after the previous boundary's record on the same stream reuses its
    # event instead of recording one (shared_event.py); 0: every boundary records its own
    share_gap_us: float = 50.0
    ring_size: int = 8192
    # 500 ms: every wake of the readout thread takes the GIL from a launch-bound training thread and hands it
    # back; fewer, larger drains cost it less (bench/results/gpu-h200.md section 3,
    # bench/results/cpu-gil-handoff.md), within the collector's allowances (module docstring)
    readout_interval_ms: float = 500.0
    readout_timeout_s: float = 30.0
    export_mode: str = "process"
    # the export child lowers its own CPU priority so that, on a node whose cores it shares, it yields to
    # the training processes (measured on the H200 VM: contention from it showed up in launch-bound steps)
    export_nice: int = 10
    # auto: the export child runs on the allowed CPUs other than the training thread's core (and its SMT
    # siblings) at the child's start; all: wherever the scheduler puts it
    export_affinity: str = "auto"
    topology_epoch: int = 0
    step_timer: str = "forward-backward"
    shutdown_timeout_s: float = 5.0
    # export side (the export child, or the in-process sink): per-step aggregation and the child's restarts
    step_close_s: float = 2.0
    step_close_lag: int = 0
    max_open_steps: int = 8
    max_timers_per_step: int = 512
    sidecar_max_restarts: int = 3
    sidecar_restart_backoff_s: float = 0.5
    # export side: sample the rank's GPU through NVML every this many seconds on a thread of its own and attach
    # the latest sample to the rank-step (nvml.py); 0: off, nothing imported, no thread
    nvml_interval_s: float = 0.0
    config_errors: tuple[str, ...] = field(default=())  # names of the settings that fell back to default

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> EmitterConfig:
        """Keyword overrides win over the environment; unknown keywords are config errors too."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        errors: list[str] = []
        known = {f.name for f in fields(cls) if f.name != "config_errors"}
        for key in overrides:
            if key not in known:
                errors.append(key)
                warn_once(key, f"otel-straggler: unknown setting {key!r} ignored")
        for name, parser in _PARSERS.items():
            default = _DEFAULTS[name]
            raw: Any
            if name in overrides and overrides[name] is not None:
                raw, source = overrides[name], name
            else:
                source = ENV_PREFIX + name.upper()
                raw = env.get(source)
                if raw is None:
                    values[name] = default
                    continue
            try:
                values[name] = parser(raw)
            except (ValueError, TypeError, OverflowError) as exc:
                # named by where it came from, never quoting the value (it may be a secret put in the wrong place)
                errors.append(name)
                warn_once(name, f"otel-straggler: bad value for {source} ({exc}); using default {default!r}")
                values[name] = default
        return cls(**values, config_errors=tuple(errors))

    def as_dict(self) -> dict[str, Any]:
        """The settings (not ``config_errors``) as plain values, e.g. for the export child's header."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "config_errors"}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> EmitterConfig:
        """Inverse of ``as_dict``, validated like keyword arguments (the environment is not read)."""
        return cls.from_env({}, **dict(values))


def info_once(key: str, msg: str) -> None:
    """Log ``msg`` at INFO the first time ``key`` is seen in this process."""
    if key not in _informed:
        _informed.add(key)
        _log.info(msg)


def warn_once(key: str, msg: str) -> None:
    """Log ``msg`` as a warning the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        _log.warning(msg)


# Upper bounds of the numeric settings (a value beyond is a bad value: warned, default, counted).
MAX_DEVICE_EVERY = 1000  # also in _device_every.allowed
MAX_POOL_SIZE = 65536  # CUDA events
MAX_RING_SIZE = 1 << 20  # records (preallocated, 64 bytes each)
MAX_OPEN_STEPS = 1024
MAX_TIMERS_PER_STEP = 4096
MAX_STEP_CLOSE_LAG = 64
MAX_RESTARTS = 100

_PARSERS: dict[str, Callable[[Any], Any]] = {
    "enabled": _parse_bool,
    "job_id": _text,
    "detail": _choice(schema.DETAIL_STEP, schema.DETAIL_INTERVAL),
    "device_every": _device_every,
    "device_budget": _float_in(1.0),
    "device_every_max": _int_in(1, MAX_DEVICE_EVERY),
    "device_repeats": _choice("middle", "all"),
    "pool_size": _int_in(2, MAX_POOL_SIZE),
    "record_api": _choice(*RECORD_APIS),
    "share_gap_us": _float_in(10_000.0, allow_zero=True),
    "ring_size": _int_in(2, MAX_RING_SIZE),
    "readout_interval_ms": _float_in(60_000.0),
    "readout_timeout_s": _float_in(86_400.0),
    "export_mode": _choice("process", "thread", "off"),
    "export_nice": _int_in(0, 19),
    "export_affinity": _choice("auto", "all"),
    "topology_epoch": _int_in(0, 2**31 - 1),
    "step_timer": _nonempty,
    "shutdown_timeout_s": _float_in(600.0),
    "step_close_s": _float_in(3600.0),
    "step_close_lag": _int_in(0, MAX_STEP_CLOSE_LAG),
    "max_open_steps": _int_in(1, MAX_OPEN_STEPS),
    "max_timers_per_step": _int_in(1, MAX_TIMERS_PER_STEP),
    "sidecar_max_restarts": _int_in(0, MAX_RESTARTS),
    "sidecar_restart_backoff_s": _float_in(600.0),
    "nvml_interval_s": _float_in(3600.0, allow_zero=True),
}
# One line per setting: what it does (docs/configuration.md's table is generated from this, the defaults and
# the parsers' bounds; tests/test_generated_docs.py fails when the docs differ).
HELP: dict[str, str] = {
    "enabled": "master switch: nothing changes unless set",
    "job_id": "job id, the input of the trace ids; empty: derived (Job and run ids, below)",
    "detail": "`step`: one span per timer per step (microbatch repeats summed); `interval`: one per start/stop",
    "device_every": "CUDA events on every N-th step, host timing on the others; `auto` (0) picks N from the step "
                    "time within `device_budget`",
    "device_budget": "`auto`: event-record cost allowed, as a fraction of the step time",
    "device_every_max": "`auto`: largest N (every 5-step window keeps a device sample)",
    "device_repeats": "which repeats (microbatches) of a timer record CUDA events on a device-sampled step: "
                      "`middle` one, `all` every one (Device repeats, below)",
    "pool_size": "pre-created, pre-warmed CUDA events (two per interval awaiting readout)",
    "record_api": "`auto`/`driver`: the driver's `cuEventRecord` when it passes a check at install (`driver` "
                  "warns when not), else torch's `Event.record`; `torch`: always torch's",
    "share_gap_us": "a start this many microseconds or less after the previous boundary's record on the same "
                    "stream reuses its event (Shared events, below); 0: every boundary records its own",
    "ring_size": "interval ring records (64 bytes each), rounded up to a power of two (full: dropped, counted)",
    "readout_interval_ms": "readout thread period: each wake takes the GIL from the training thread once",
    "readout_timeout_s": "an unfinished end event older than this: host-only (`readout_timeout`)",
    "export_mode": "`process` (spans built in a child process), `thread` (in-process), `off`",
    "export_nice": "niceness the export child adds to itself, so it yields to training on shared cores",
    "export_affinity": "`auto`: the export child runs on the allowed CPUs other than the training thread's core; "
                       "`all`: anywhere",
    "topology_epoch": "bump on re-shard: ranks of different epochs are never compared",
    "step_timer": "timer whose start advances the automatic step",
    "shutdown_timeout_s": "bound on flush at exit / SIGTERM",
    "step_close_s": "export side: an open step closes after this long without new intervals",
    "step_close_lag": "export side: older steps kept open behind the newest (reorder window)",
    "max_open_steps": "export side: step aggregates held; beyond, the oldest closes early (`steps_evicted`)",
    "max_timers_per_step": "export side: timers per step; beyond, dropped (`dropped{reason=overflow}`)",
    "sidecar_max_restarts": "restarts of a dead export child, then it is given up (`sidecar_restarts`)",
    "sidecar_restart_backoff_s": "first restart delay of the export child (doubles each time)",
    "nvml_interval_s": "export side: NVML cause hints (SM clock, throttle reasons, temperature, power, PCIe/NVLink "
                       "errors) sampled every N s and attached to the rank-step (the `nvml` extra); 0: off, nothing "
                       "imported, no thread",
}
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(EmitterConfig) if f.name in _PARSERS}
DEFAULTS = EmitterConfig()  # the one source of every default

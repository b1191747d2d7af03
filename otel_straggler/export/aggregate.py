"""Per-step aggregation of one rank's intervals into span records (no OpenTelemetry here).

Detail ``step``: the intervals of one timer in one step become ONE stage span (host ms summed,
``straggler.count`` = repeats). Device ms: the sum over the repeats that have it, scaled to all repeats when the
others were only sampled out (``device_repeats`` ``middle``, config.py: one repeat per step measured;
``straggler.duration.device_repeats`` = how many were); none when a repeat lacks it for any other reason (its
reason is the stage's) or no repeat has it. Detail ``interval``:
one stage span per interval, emitted at once. In both, each step yields a ``rank-step`` span (earliest
start .. latest stop of the step) carrying the step summary (every timer's per-step aggregate as parallel
arrays: what the collector reads), and the first rank of each block of ``STEP_TRACE_RANKS`` ranks also yields the
``train-step`` root of its block's step trace.

A step closes when an interval of a later step arrives (steps advance monotonically per rank; an
optional ``step_close_lag`` reorder window keeps that many older steps open), after
``step_close_s`` without new intervals, or on ``close_all`` (flush/shutdown). At most ``max_open_steps``
step aggregates and ``max_timers_per_step`` timers per step are held; beyond, the oldest step is closed
early (counted ``steps_evicted``) and surplus timers are dropped (counted ``dropped_overflow``). An
interval of an already closed step is dropped and counted (``dropped_late``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_straggler import schema
from otel_straggler.config import DEFAULTS, EmitterConfig
from otel_straggler.counters import CUDA_ERROR, SAMPLED_OUT
from otel_straggler.interval import Interval

KIND_JOB_STEP = 0
KIND_RANK_STEP = 1
KIND_STAGE = 2


@dataclass(slots=True)
class SpanRecord:
    """One span to build: ids of the step spans are fixed, stage spans get a random id."""

    kind: int
    name: str
    step: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


@dataclass(slots=True)
class _TimerAgg:
    name: str
    level: int
    group: str
    count: int
    start_ns: int
    end_ns: int
    host_ms: float
    device_ms: float  # sum over repeats that had device time
    device_n: int  # repeats that had device time
    degraded: str | None  # first degraded reason other than sampled_out (that one: sampled)
    sampled: bool  # a repeat was sampled out
    injected: bool
    collective: bool = False  # the timer holds a wait in a collective


@dataclass(slots=True)
class _StepAgg:
    step: int
    start_ns: int
    end_ns: int
    last: Interval  # latest interval (workload is bound at stop time)
    timers: dict[str, _TimerAgg] = field(default_factory=dict)


def _workload(attrs: dict[str, Any], iv: Interval) -> None:
    if iv.tokens is not None:
        attrs[schema.ATTR_WORKLOAD_TOKENS] = int(iv.tokens)
    if iv.sequences is not None:
        attrs[schema.ATTR_WORKLOAD_SEQUENCES] = int(iv.sequences)
    if iv.microbatches is not None:
        attrs[schema.ATTR_WORKLOAD_MICROBATCHES] = int(iv.microbatches)


def _stage_device(t: _TimerAgg) -> tuple[float | None, str | None]:
    """(device ms of the step's repeats, None when not measured; the degraded reason when not measured)."""
    if t.degraded is not None or t.device_n == 0:
        return None, t.degraded or (SAMPLED_OUT if t.sampled else None)
    if t.device_n == t.count:
        return t.device_ms, None
    return t.device_ms * t.count / t.device_n, None


def _measurement(
    attrs: dict[str, Any],
    device_ms: float | None,
    degraded: str | None,
    injected: bool,
    workload: Interval,
    collective: bool = False,
) -> None:
    """The stage span's measurement (device ms, else host-only with its reason), workload, injection and
    collective marking."""
    if device_ms is not None:
        attrs[schema.ATTR_DEVICE_MS] = device_ms
        attrs[schema.ATTR_MEASUREMENT] = schema.MEASUREMENT_DEVICE
    else:
        attrs[schema.ATTR_MEASUREMENT] = schema.MEASUREMENT_HOST_ONLY
        if degraded:
            attrs[schema.ATTR_DEGRADED_REASON] = degraded
    _workload(attrs, workload)
    if injected:
        attrs[schema.ATTR_INJECTED] = True
    if collective:
        attrs[schema.ATTR_STAGE_COLLECTIVE] = True


class StepAggregator:
    """Aggregates one rank's intervals; ``counters`` is a plain dict of cumulative counts it adds to.
    ``config``: ``detail``, ``step_close_s``, ``step_close_lag``, ``max_open_steps``, ``max_timers_per_step``."""

    def __init__(self, *, rank: int, config: EmitterConfig = DEFAULTS, counters: dict[str, int] | None = None,
                 hints: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.rank = int(rank)
        self.hints = hints  # the latest cause hints (nvml.py) for every rank-step; None: none
        self.detail = schema.DETAIL_INTERVAL if config.detail == schema.DETAIL_INTERVAL else schema.DETAIL_STEP
        self.step_close_ns = int(max(0.0, config.step_close_s) * 1e9)
        self.max_open_steps = max(1, int(config.max_open_steps))
        self.max_timers_per_step = max(1, int(config.max_timers_per_step))
        self.close_lag_steps = max(0, int(config.step_close_lag))
        self.counters = counters if counters is not None else {}
        self._open: OrderedDict[int, _StepAgg] = OrderedDict()
        self._last_closed = -(2**62)
        self._last_arrival_ns = 0

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    @property
    def open_steps(self) -> int:
        return len(self._open)

    def add(self, intervals: Iterable[Interval], now_ns: int, out: list[SpanRecord]) -> None:
        for iv in intervals:
            self._add_one(iv, out)
        self._last_arrival_ns = now_ns

    def _add_one(self, iv: Interval, out: list[SpanRecord]) -> None:
        step = int(iv.step)
        if step <= self._last_closed:
            self._count("dropped_late")
            return
        # Steps advance monotonically: an interval of step S closes every open step before S
        # (before S - close_lag_steps when a reorder window is configured).
        while self._open:
            first = next(iter(self._open))
            if first >= step - self.close_lag_steps:
                break
            self._close(first, out)
        agg = self._open.get(step)
        if agg is None:
            while len(self._open) >= self.max_open_steps:
                self._count("steps_evicted")
                self._close(next(iter(self._open)), out)
            agg = _StepAgg(step=step, start_ns=iv.host_start_ns, end_ns=iv.host_end_ns, last=iv)
            self._open[step] = agg
            if len(self._open) > 1 and step < next(reversed(self._open)):
                self._open = OrderedDict(sorted(self._open.items()))
        else:
            agg.start_ns = min(agg.start_ns, iv.host_start_ns)
            agg.end_ns = max(agg.end_ns, iv.host_end_ns)
            if iv.host_end_ns >= agg.last.host_end_ns:
                agg.last = iv
        if self.detail == schema.DETAIL_INTERVAL:
            out.append(self._interval_record(iv))
        t = agg.timers.get(iv.name)
        if t is None:
            if len(agg.timers) >= self.max_timers_per_step:
                self._count("dropped_overflow")
                return
            t = agg.timers[iv.name] = _TimerAgg(
                name=iv.name,
                level=int(iv.level),
                group=iv.group,
                count=0,
                start_ns=iv.host_start_ns,
                end_ns=iv.host_end_ns,
                host_ms=0.0,
                device_ms=0.0,
                device_n=0,
                degraded=None,
                sampled=False,
                injected=False,
            )
        t.count += 1
        t.start_ns = min(t.start_ns, iv.host_start_ns)
        t.end_ns = max(t.end_ns, iv.host_end_ns)
        t.host_ms += (iv.host_end_ns - iv.host_start_ns) / 1e6
        if iv.device_ms is not None:
            t.device_ms += iv.device_ms
            t.device_n += 1
        elif iv.degraded == SAMPLED_OUT:
            t.sampled = True
        elif t.degraded is None:
            t.degraded = iv.degraded or CUDA_ERROR
        t.injected = t.injected or bool(iv.injected)
        t.collective = t.collective or iv.collective

    def tick(self, now_ns: int, out: list[SpanRecord]) -> None:
        """Close every open step when no interval arrived for ``step_close_s``."""
        if self._open and now_ns - self._last_arrival_ns >= self.step_close_ns:
            self.close_all(out)

    def close_all(self, out: list[SpanRecord]) -> None:
        while self._open:
            self._close(next(iter(self._open)), out)

    # --- records ------------------------------------------------------------------------------
    def _close(self, step: int, out: list[SpanRecord]) -> None:
        agg = self._open.pop(step)
        self._last_closed = max(self._last_closed, step)
        if self.rank % schema.STEP_TRACE_RANKS == 0:  # the first rank of its block roots the block's step trace
            out.append(
                SpanRecord(
                    KIND_JOB_STEP,
                    schema.SPAN_JOB_STEP,
                    step,
                    agg.start_ns,
                    agg.end_ns,
                    {schema.ATTR_ITERATION: step, schema.ATTR_STAGE_GROUP: "step",
                     schema.ATTR_TRACE_BLOCK: schema.trace_block(self.rank)},
                )
            )
        rs_attrs: dict[str, Any] = {
            schema.ATTR_ITERATION: step,
            schema.ATTR_STAGE: schema.SPAN_RANK_STEP,
            schema.ATTR_STAGE_GROUP: "step",
            schema.ATTR_HOST_MS: (agg.end_ns - agg.start_ns) / 1e6,
        }
        _workload(rs_attrs, agg.last)
        timers = agg.timers.values()
        rs_attrs[schema.ATTR_SUMMARY_STAGES] = [t.name for t in timers]
        rs_attrs[schema.ATTR_SUMMARY_GROUPS] = [t.group for t in timers]
        measured = [_stage_device(t) for t in timers]
        rs_attrs[schema.ATTR_SUMMARY_DEVICE_MS] = [schema.SUMMARY_NOT_MEASURED if d is None else d
                                                   for d, _ in measured]
        rs_attrs[schema.ATTR_SUMMARY_HOST_MS] = [t.host_ms for t in timers]
        rs_attrs[schema.ATTR_SUMMARY_COUNTS] = [t.count for t in timers]
        collective = [t.name for t in timers if t.collective]
        if collective:
            rs_attrs[schema.ATTR_SUMMARY_COLLECTIVE] = collective
        if self.hints is not None:
            rs_attrs.update(self.hints())
        out.append(SpanRecord(KIND_RANK_STEP, schema.SPAN_RANK_STEP, step, agg.start_ns, agg.end_ns, rs_attrs))
        if self.detail == schema.DETAIL_INTERVAL:
            return  # the stage spans went out per interval
        for t, (device_ms, degraded) in zip(timers, measured, strict=True):
            attrs: dict[str, Any] = {
                schema.ATTR_STAGE: t.name,
                schema.ATTR_STAGE_GROUP: t.group,
                schema.ATTR_STAGE_LEVEL: t.level,
                schema.ATTR_ITERATION: step,
                schema.ATTR_HOST_MS: t.host_ms,
                schema.ATTR_COUNT: t.count,
                schema.ATTR_DETAIL: schema.DETAIL_STEP,
            }
            _measurement(attrs, device_ms, degraded, t.injected, agg.last, t.collective)
            if device_ms is not None and t.device_n != t.count:
                attrs[schema.ATTR_DEVICE_REPEATS] = t.device_n
            out.append(SpanRecord(KIND_STAGE, t.name, step, t.start_ns, t.end_ns, attrs))

    @staticmethod
    def _interval_record(iv: Interval) -> SpanRecord:
        attrs: dict[str, Any] = {
            schema.ATTR_STAGE: iv.name,
            schema.ATTR_STAGE_GROUP: iv.group,
            schema.ATTR_STAGE_LEVEL: int(iv.level),
            schema.ATTR_ITERATION: int(iv.step),
            schema.ATTR_MICROBATCH_ID: int(iv.repeat),
            schema.ATTR_HOST_MS: (iv.host_end_ns - iv.host_start_ns) / 1e6,
            schema.ATTR_COUNT: 1,
            schema.ATTR_DETAIL: schema.DETAIL_INTERVAL,
        }
        device_ms = float(iv.device_ms) if iv.device_ms is not None else None
        _measurement(attrs, device_ms, iv.degraded, iv.injected, iv, iv.collective)
        return SpanRecord(KIND_STAGE, iv.name, int(iv.step), iv.host_start_ns, iv.host_end_ns, attrs)

"""When the collector receives what a simulated job sends: each rank's spans batched as the OTel SDK's
``BatchSpanProcessor`` batches them, and delivered in arrival order.

Per rank, a step's spans are queued when the step ends (``step_s`` apart). The rank exports when its queue
reaches ``max_batch`` spans (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``, 512) or ``schedule_delay_s`` after its last
export (``OTEL_BSP_SCHEDULE_DELAY``, 5 s by default), everything queued then, in requests of at most
``max_batch`` spans; its timer starts at a random phase, as processes start at different times. A request
arrives ``latency_s`` later. With the SDK's defaults and ~70 ms steps a rank's data reaches the collector
up to ~5 s after the step, and ranks are seconds apart from one another: what the collector's window
closing must absorb (``docs/detector.md``, Windows).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

import otel_straggler_schema as s


@dataclass(frozen=True)
class Batching:
    step_s: float = 0.07  # time per training step
    schedule_delay_s: float = 5.0  # OTEL_BSP_SCHEDULE_DELAY (the SDK's default: 5000 ms)
    max_batch: int = 512  # OTEL_BSP_MAX_EXPORT_BATCH_SIZE (the SDK's default)
    latency_s: tuple[float, float] = (0.005, 0.05)  # uniform, per request: network and receiver


@dataclass
class _Rank:
    resource: Resource
    next_timer_s: float
    queue: list[tuple[str, Span]] = field(default_factory=list)  # (scope name, span)
    busy_until_s: float = 0.0  # when its last request arrived (requests of one rank arrive in order)


def batched(stream: Iterable[tuple[int, ExportTraceServiceRequest]], b: Batching, seed: int = 0
            ) -> Iterator[tuple[float, ExportTraceServiceRequest]]:
    """(arrival time in seconds from the job's start, request) in arrival order, for a stream of one request
    per step (``JobStream``): each rank's ``ResourceSpans`` of the step are that rank's spans."""
    rng = random.Random(seed)
    ranks: dict[int, _Rank] = {}
    out: list[tuple[float, int, ExportTraceServiceRequest]] = []

    def export(st: _Rank, at_s: float) -> None:
        sent = max(at_s, st.busy_until_s)
        while st.queue:  # one request after another (the exporter waits for each answer)
            chunk, st.queue = st.queue[:b.max_batch], st.queue[b.max_batch:]
            sent += rng.uniform(*b.latency_s)
            out.append((sent, len(out), _request(st.resource, chunk)))
        st.busy_until_s = sent
        st.next_timer_s = at_s + b.schedule_delay_s

    def timers_until(t: float) -> None:
        for st in ranks.values():
            while st.next_timer_s <= t:
                export(st, st.next_timer_s)

    end_s = 0.0
    for step, req in stream:
        end_s = step * b.step_s
        timers_until(end_s)
        for rs in req.resource_spans:
            rank = next(a.value.int_value for a in rs.resource.attributes if a.key == s.RES_RANK)
            st = ranks.get(rank)
            if st is None:
                st = ranks[rank] = _Rank(rs.resource, end_s + rng.uniform(0.0, b.schedule_delay_s))
            for ss in rs.scope_spans:
                st.queue.extend((ss.scope.name, sp) for sp in ss.spans)
            if len(st.queue) >= b.max_batch:
                export(st, end_s)
    for st in ranks.values():  # shutdown: the SDK flushes what is queued
        if st.queue:
            export(st, end_s)
    out.sort(key=lambda x: (x[0], x[1]))
    for at_s, _, req in out:
        yield at_s, req


def _request(resource: Resource, spans: list[tuple[str, Span]]) -> ExportTraceServiceRequest:
    """One rank's export: its resource, one ``ScopeSpans`` per scope present, as the SDK's encoder groups them."""
    by_scope: dict[str, list[Span]] = {}
    for scope, sp in spans:
        by_scope.setdefault(scope, []).append(sp)
    rs = ResourceSpans(resource=resource)
    for scope, sps in by_scope.items():
        ss = ScopeSpans(spans=sps)
        ss.scope.name = scope
        rs.scope_spans.append(ss)
    return ExportTraceServiceRequest(resource_spans=[rs])


class SimClock:
    """A settable clock for a processor driven by ``drive`` (``StragglerProcessor(clock=...)``)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def drive(arrivals: Iterable[tuple[float, ExportTraceServiceRequest]], process: Callable[[ExportTraceServiceRequest],
          object], tick: Callable[[float], None], clock: SimClock, tick_s: float = 0.25) -> None:
    """Deliver ``batched`` requests at their arrival times on ``clock`` (started at the job's start), calling
    ``tick`` every ``tick_s`` of simulated time in between, as the collector's pipeline does."""
    start = next_tick = clock.t
    for at_s, req in arrivals:
        while next_tick + tick_s <= start + at_s:
            next_tick += tick_s
            clock.t = next_tick
            tick(next_tick)
        clock.t = max(clock.t, start + at_s)
        process(req)

"""The CUDA event of the latest interval boundary, reused by the boundaries that follow it closely.

Megatron's timers meet back to back: ``forward-compute`` stops and ``backward-compute`` starts a few
microseconds later, the next microbatch's ``forward-compute`` starts right after ``backward-compute`` stops, an
outer timer starts just before its first inner one and stops just after its last. Two events recorded at such
adjacent boundaries mark the same point of the stream, and each record costs the training thread several
microseconds on a launch-bound step (``bench/results/gpu-h200.md`` section 3). So a boundary reuses the event
recorded at the previous one when, by the host clock, it comes less than ``share_gap_us`` after that record on
the same stream:

* a start reuses it whatever recorded it (the previous timer's stop, or an outer timer's start);
* a stop reuses it only when a stop recorded it (an inner timer's stop, just before an outer one's) and it is
  not the stopping timer's own start event: an interval's own work is always between two distinct records, so
  a stage launched in microseconds (one all-reduce, one fused optimizer kernel) keeps its device time.

A start that records nothing on a device-sampled step (a repeat sampled out, ``device_repeats``; an event the
pool could not give or the driver could not record), and a stop whose record failed, end the adjacency: the
interval's GPU work may be launched in microseconds (one CUDA graph, one big kernel), and a later boundary that
reused the event recorded before it would take that work into its own interval. They set ``ns`` to ``NO_REUSE``,
so the next boundary records. (A stop that records nothing because its interval was sampled out leaves it: the
work launched between the last record and that stop is glue, which moves as below.)

GPU work launched inside such a gap (glue code between two timers) moves: after a reused start it counts to
the interval that starts; before a reused stop it is left out of the outer interval that stops (which ends
where its inner one did), and is in no interval unless a later start reuses that event too.

Ownership (which ring record returns an event to the pool): each pool event has ``refs``, the references to
it not yet published in the ring (training thread only). A record owns an event when publishing it leaves no
reference behind and the event can no longer be reused (it is not the latest boundary's). The latest event
with no reference left when a new record replaces it is released with ``tag`` = the ring's head: the readout
returns it to the pool once every record before that head was read (``readout.py``). Ring order is publication
order, so an event is never returned while a record that reads it is unread; and since those records read it
complete, it needs no query of its own unless one of them could not (``tainted``).

Events are ids into the pool's ``event_pool.EventTable``: ``refs``, ``tag`` and ``tainted`` are its arrays, and
``ev`` is an id (``NO_EVENT``: none).

``SharedEvent`` is the C extension's type of that name when it runs the hot path (``hot_path.py``), else
``PySharedEvent`` below; both keep the same fields and do the same.
"""

from __future__ import annotations

from typing import Any, Final

from otel_straggler import hot_path
from otel_straggler.ring import NO_EVENT

# ``SharedEvent.ns`` after a boundary that recorded nothing: no reuse before a record (the C module's, where it runs)
NO_REUSE: Final = getattr(hot_path.core, "NO_REUSE", -(1 << 62))


class PySharedEvent:
    """Training-thread state of one timer group: the latest recorded event, when and on which stream."""

    __slots__ = ("at_stop", "ev", "gap_ns", "ns", "records", "ring", "stream", "stream_of", "table")

    def __init__(self, *, gap_us: float, stream_of: Any, table: Any, ring: Any) -> None:
        # no stream function (torch's own record API, no CUDA): nothing says two records share a stream, so no
        # event is ever kept for reuse (``ev`` stays NO_EVENT and ``stream_of`` is never called)
        self.gap_ns = int(gap_us * 1000) if stream_of is not None else 0
        self.stream_of = stream_of
        self.table = table
        self.ring = ring
        self.ev = NO_EVENT  # the latest boundary's event while it may still be reused (gap_ns > 0)
        self.ns = 0  # host clock of its record
        self.stream: Any = None  # the stream it was recorded on (what the pool's record returned)
        self.at_stop = False  # recorded by a stop
        self.records = 0  # events recorded (adaptive sampling prices a device-sampled step with it)

    def recorded(self, ev: int, ns: int, stream: Any, at_stop: bool) -> None:
        """A boundary recorded ``ev`` at host time ``ns`` on ``stream``: later boundaries may reuse it, and the
        event it replaces goes back through the readout once nothing refers to it."""
        self.records += 1
        if self.gap_ns:
            old = self.ev
            # every field first, the call last: an exception a signal handler raises when the call returns finds
            # this state whole
            self.ev = ev
            self.ns = ns
            self.stream = stream
            self.at_stop = at_stop
            tb = self.table
            if old != NO_EVENT and tb.refs[old] <= 0:
                tb.tag[old] = self.ring.head
                tb.orphans.append(old)

    def release(self, ev: int) -> None:
        """A reference that will not be published (a reset): the event goes back through the readout once nothing
        else refers to it, and only once it completed (``tainted``: no record read it)."""
        tb = self.table
        tb.refs[ev] -= 1
        tb.tainted[ev] = 1
        if tb.refs[ev] <= 0 and ev != self.ev:
            tb.tag[ev] = self.ring.head
            tb.orphans.append(ev)

    def retire(self) -> None:
        """Stop reusing the latest event (shutdown): released like a replaced one."""
        ev = self.ev
        self.ev = NO_EVENT
        tb = self.table
        if ev != NO_EVENT and tb.refs[ev] <= 0:
            tb.tag[ev] = self.ring.head
            tb.orphans.append(ev)


SharedEvent: Any = hot_path.core.SharedEvent if hot_path.core is not None else PySharedEvent

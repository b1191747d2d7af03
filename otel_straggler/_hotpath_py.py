"""The training thread's hot path in Python: the twin of ``_hotpath.c``, type for type in the C file's order.

``hot_path.py`` picks this module or the C one and exports the chosen types; the rest of the package imports them
from there. Each type has the C type's name, fields and logic (``HotCounters``: the training thread's counters,
``EventTable``: the pool's events by id, ``Ring``: the ring of 64-byte records, ``SharedEvent``: the latest
boundary's event, ``StepState``: the step fields a stop reads, ``TimerCore``: a timer's start/stop, ``TimersCore``:
``timers(name, log_level)``), and both write the same bytes (``tests/emitter/test_hot_path_parity.py``). The C
module's readout calls (``event_elapsed``, ``event_query``, ``elapsed_batch``, ``pack_records``) have no twin here:
on this path the pool calls the driver through ctypes (``event_pool.py``) and the readout reads and packs each record
itself (``readout.py``), as both paths do for what the C calls leave.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Final

from otel_straggler.ring import F_INJECTED, NO_EVENT, RECORD, _pow2, _storage

# ``SharedEvent.ns`` after a boundary that recorded nothing: no reuse before a record
NO_REUSE: Final = -(1 << 62)
# the degraded reasons' codes the records carry (``counters.REASONS``), set by ``set_reasons``
SAMPLED_OUT_CODE, CUDA_ERROR_CODE, POOL_EXHAUSTED_CODE = 2, 5, 3
_clock = time.perf_counter_ns  # the host clock (tests replace it here and as ``timers._clock``, which C reads)
_pack = RECORD.pack_into  # the stop's one write: its record into the ring's bytes
RING_RECORD_SIZE = RECORD.size


class HotCounters:
    """The training thread's counters (``counters.EmitterCounters`` derives from it)."""

    __slots__ = ("barriers_skipped", "dropped_ring_full", "faults_training", "unbalanced")


class EventTable:
    """The pool's events by id and the state the hot path keeps of each, in arrays indexed by id: ``refs`` (int32:
    references not yet published in the ring, training thread; shared_event.py), ``tag`` (int64: the ring head at
    its release), ``tainted`` (a byte: released with its state unknown, the readout queries it before reuse),
    ``handle`` (uint64: the raw ``CUevent`` for the driver's calls, 0 without them). ``free`` (ids the training
    thread takes, ``popleft``; the readout returns them, ``append``) and ``orphans`` (ids the training thread let go
    of; the readout quarantines them) are deques: each operation is atomic under the GIL, so no lock is shared with
    the training thread."""

    __slots__ = ("events", "free", "handle", "orphans", "refs", "tag", "tainted")

    def __init__(self, events: list[Any], refs: Any, tag: Any, tainted: Any, handle: Any, free: deque[int],
                 orphans: deque[int]) -> None:
        self.events = events
        self.refs = refs
        self.tag = tag
        self.tainted = tainted
        self.handle = handle
        self.free = free
        self.orphans = orphans


class Ring:
    """The single-producer single-consumer ring of ``ring.RECORD`` records (``ring.py``)."""

    __slots__ = ("buf", "cap", "head", "mask", "pre", "tail", "timers")

    def __init__(self, capacity: int) -> None:
        cap = _pow2(max(1, int(capacity))) if capacity > 0 else 0
        self.cap = cap
        self.mask = cap - 1 if cap else 0
        self.buf, self.pre, self.timers = _storage(max(cap, 1))
        self.head = 0  # written by the training thread only
        self.tail = 0  # written by the readout thread only

    def __len__(self) -> int:
        return self.head - self.tail


class SharedEvent:
    """Training-thread state of one timer group: the CUDA event of the latest interval boundary (when and on which
    stream it was recorded), reused by the boundaries that follow it closely.

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

    Events are ids into the pool's ``EventTable``: ``refs``, ``tag`` and ``tainted`` are its arrays, and
    ``ev`` is an id (``NO_EVENT``: none).
    """

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


class StepState:
    """The fields the timers' hot path reads (``step``, ``wire``, ``device_on``, ``host_code``) and ``binding``
    (``step_context.StepContext`` derives from it)."""

    __slots__ = ("binding", "device_on", "host_code", "step", "wire")


def _same_stream(sh: SharedEvent) -> bool:
    """Whether the current stream is the one ``sh.ev`` was recorded on; False when that cannot be told (the
    lookup raised): the boundary then records its own event, and no reference is left half taken."""
    try:
        return sh.stream_of() == sh.stream
    except Exception:
        return False


class TimerCore:
    """A timer's state and its start/stop (``timers.Timer`` derives from it). Events are ids into the pool's table
    (``_tab``: ``EventTable``), reasons are codes (``counters.REASONS``)."""

    __slots__ = (
        "_active_ns",
        "_c",
        "_clock",
        "_ctx",
        "_cu_record",
        "_elapsed_base",
        "_elapsed_ns",
        "_free",
        "_group",
        "_id",
        "_inject",
        "_is_step",
        "_level",
        "_orphans",
        "_pick",
        "_reason",
        "_record",
        "_rep",
        "_rep_step",
        "_ring",
        "_sev",
        "_share",
        "_sstep",
        "_started",
        "_starts",
        "_t0",
        "_tab",
        "label",
        "name",
    )

    # ---- hot path -------------------------------------------------------------------------------
    def start(self, barrier: bool = False) -> None:
        if self._started:
            self._c.unbalanced += 1
            raise AssertionError("timer has already been started")  # Megatron's assert, before anything
        try:
            if barrier:
                self._c.barriers_skipped += 1
            ctx = self._ctx
            if self._is_step:
                ctx.step_timer_started()
            if ctx.device_on:
                pick = self._pick
                if pick >= 0:
                    nxt = self._starts
                    if self._sstep != ctx.step:  # its first start in this step: the middle of its previous count
                        self._pick = pick = nxt >> 1
                        self._sstep = ctx.step
                        nxt = 0
                    self._starts = nxt + 1
                    if nxt != pick:
                        self._reason = SAMPLED_OUT_CODE  # another repeat (microbatch) of this step has its device time
                        self._share.ns = NO_REUSE  # its GPU work is in no later boundary's reused event
                        self._started = True
                        self._t0 = _clock()
                        return
                sh = self._share
                t = _clock()
                ev = sh.ev
                if ev != NO_EVENT and t - sh.ns < sh.gap_ns and _same_stream(sh):
                    self._tab.refs[ev] += 1  # the previous boundary's event marks this point of the stream too
                    self._sev = ev
                    self._reason = 0
                    self._started = True
                    self._t0 = t
                    return
                free = self._free
                if free:
                    ev = free[0]  # held before it leaves the pool: see _abandon
                    self._tab.refs[ev] = 1
                    self._sev = ev
                    free.popleft()
                    self._reason = 0
                    try:
                        stream = self._record(ev)
                    except Exception:
                        self._reason = CUDA_ERROR_CODE
                        sh.ns = NO_REUSE
                    else:
                        sh.recorded(ev, t, stream, False)
                else:
                    self._reason = POOL_EXHAUSTED_CODE
                    sh.ns = NO_REUSE
            else:
                self._reason = ctx.host_code
            self._started = True
            self._t0 = _clock()
        except Exception:
            self._c.faults_training += 1
        except BaseException:  # KeyboardInterrupt, SystemExit: the caller's; the start did not happen
            self._started = False
            sev = self._sev
            self._sev = NO_EVENT
            _abandon(self, sev, NO_EVENT)
            raise

    # One function, as _hotpath.c's stop is (line for line): a call per split costs on every stop (cpu-hot-path-ab.md)
    def stop(self, barrier: bool = False) -> None:  # noqa: C901
        if not self._started:
            self._c.unbalanced += 1
            raise AssertionError("timer is not started")
        sev = eev = NO_EVENT
        published = False  # this call's event references were handed to the ring (or to the orphans)
        try:
            if barrier:
                self._c.barriers_skipped += 1
            injected = 0
            if self._inject is not None and self._inject.apply(self._ctx.step):
                injected = F_INJECTED
            now = _clock()
            self._started = False
            self._elapsed_ns += now - self._t0
            w = self._ctx.wire
            if w[0] == self._rep_step:
                rep = self._rep + 1
            else:
                rep = 0
                self._rep_step = w[0]
            self._rep = rep
            sev = self._sev
            reason = self._reason
            own = srefs = erefs = 0
            if sev != NO_EVENT:
                self._sev = NO_EVENT
                sh = self._share
                refs = self._tab.refs
                if reason == 0:
                    ev = sh.ev
                    if (ev != NO_EVENT and sh.at_stop and ev != sev and now - sh.ns < sh.gap_ns
                            and _same_stream(sh)):
                        refs[ev] += 1  # an inner timer's stop just before this one's
                        eev = ev
                    else:
                        free = self._free
                        if free:
                            eev = free[0]  # held before it leaves the pool: see _abandon
                            refs[eev] = 1
                            free.popleft()
                            try:
                                stream = self._record(eev)
                            except Exception:
                                reason = CUDA_ERROR_CODE
                                sh.ns = NO_REUSE
                            else:
                                sh.recorded(eev, now, stream, True)
                        else:
                            reason = POOL_EXHAUSTED_CODE
                            sh.ns = NO_REUSE
                # the references once published: the record owns (returns to the pool) what nothing else refers to
                last = sh.ev
                srefs = refs[sev] - 1
                if eev != NO_EVENT:
                    erefs = refs[eev] - 1
                    if erefs <= 0 and eev != last:
                        own = 2
                if sev != eev and srefs <= 0 and sev != last:
                    own |= 1
            r = self._ring
            h = r.head
            if h - r.tail >= r.cap:
                published = True
                self._c.dropped_ring_full += 1
                if sev != NO_EVENT:  # no record reads them: whoever returns them waits for them to complete
                    tb = self._tab
                    tb.refs[sev] = srefs
                    tb.tainted[sev] = 1
                    lost: tuple = ()
                    if own & 1:
                        tb.tag[sev] = h
                        lost = (sev,)
                    if eev != NO_EVENT:
                        tb.refs[eev] = erefs
                        tb.tainted[eev] = 1
                        if own & 2:
                            tb.tag[eev] = h
                            lost += (eev,)
                    self._orphans.extend(lost)
                return
            _pack(r.buf, (h & r.mask) * RING_RECORD_SIZE, self._t0, now, w[0], w[1], w[2], w[3], rep, self._id, sev,
                  eev, w[4] | injected, own, reason)
            # no call from here to the head's store: an exception a signal handler raises (it runs where a call
            # returns) finds this interval published or its events still held
            published = True
            if sev != NO_EVENT:
                refs[sev] = srefs
                if eev != NO_EVENT:
                    refs[eev] = erefs
            r.head = h + 1
        except Exception:
            self._c.faults_training += 1
        except BaseException:  # KeyboardInterrupt, SystemExit: the caller's; the interval is not published
            if not published:
                if sev == NO_EVENT:  # raised before the stop took the start's event: it is still the timer's
                    sev = self._sev
                self._sev = NO_EVENT
                self._started = False
                _abandon(self, sev, eev)
            raise


def _abandon(t: Any, sev: int, eev: int) -> None:
    """The events a start or stop that raised (a signal handler's KeyboardInterrupt, SystemExit) holds go back as a
    reset lets go of a running start's: each reference released, the event tainted, and once nothing refers to it,
    through the readout. An event taken but not yet popped (``free[0]``) is simply left in the pool."""
    free = t._free
    sh = t._share
    tb = t._tab
    for ev in (sev, eev) if eev != sev else (sev,):
        if ev == NO_EVENT:
            continue
        if free and free[0] == ev:
            tb.refs[ev] = 0
            continue
        tb.refs[ev] -= 1
        tb.tainted[ev] = 1
        if tb.refs[ev] <= 0 and ev != sh.ev:
            tb.tag[ev] = sh.ring.head
            t._orphans.append(ev)


class TimersCore:
    """``timers(name, log_level)``: an existing timer found here, anything else through ``self._get``
    (``timers.Timers``)."""

    __slots__ = ("_timers",)

    def __call__(self, name: Any, log_level: Any = None) -> Any:
        t = self._timers.get(name)
        if t is not None and (log_level is None or log_level == t._level):
            return t
        return self._get(name, log_level)  # type: ignore[attr-defined]


# the C module's readout calls: none here (see the module's docstring)
event_elapsed = event_query = elapsed_batch = pack_records = None


def set_reasons(names: tuple[str | None, ...], sampled_out: int, cuda_error: int, pool_exhausted: int) -> None:
    """The degraded reasons by code (``counters.REASONS``): the codes the start/stop writes."""
    global SAMPLED_OUT_CODE, CUDA_ERROR_CODE, POOL_EXHAUSTED_CODE
    if not all(0 < c < len(names) for c in (sampled_out, cuda_error, pool_exhausted)):
        raise ValueError("set_reasons(names, sampled_out, cuda_error, pool_exhausted): codes index names")
    SAMPLED_OUT_CODE, CUDA_ERROR_CODE, POOL_EXHAUSTED_CODE = sampled_out, cuda_error, pool_exhausted

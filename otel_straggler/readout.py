"""Readout thread: turns the ring's records into the wire's and hands them to the sink in batches.

The only consumer of the ring (see ``ring.py``). Every ``readout_interval_ms`` (pure polling: the
training thread never signals it, since setting a ``threading.Event`` takes a lock) it wakes once and drains
the ring in order:

* a record with CUDA events waits for its last event: ``pool.elapsed(start, end)`` (one driver call, or torch's
  ``query()`` then ``elapsed_time()``) is None, or for a lone event ``pool.query(event)`` False, while it is
  unfinished; the drain then STOPS
  at that record (head-of-line: completion order is preserved, nothing blocks on an unfinished event)
  unless the record is older than ``readout_timeout_s``: then the interval goes out host-only
  (``readout_timeout``) and its events move to a bounded quarantine; they return to the pool only once
  ``pool.query`` is True (or at shutdown), so a recorded-but-unfinished event is never re-recorded;
* device time is that elapsed time; any CUDA exception makes the interval host-only (``cuda_error``) and
  quarantines its events;
* the batch goes to the sink by one route (``interval.IntervalSink``): each record becomes a wire record in the
  sink's frame (``sink.new_batch``, a ``records.RecordBatch``), most of them packed by the C drain
  (``_hotpath.pack_records``: every read device-timed record and host-only record without events whose strings
  have an id; it stops at any other record, which the loop below reads and ``RecordBatch.put`` packs), and the
  frame goes to ``sink.submit_batch``. About once a second ``sink.publish_stats(counters.snapshot())``.
  Sink exceptions are caught and counted.

A wake holds the GIL except around one batch of driver calls: the pool's per-record driver calls keep it, and the
process sink writes the pipe without releasing it. The hand-offs of the GIL, not the work, were most of what the
readout cost a launch-bound step when each driver call released it (``bench/results/gpu-h200.md`` section 3,
``bench/results/cpu-gil-handoff.md``), so the period is long (``readout_interval_ms``, config.py) and the pool
and ring are sized for what a period holds. The batch: with the C module and the driver's API, the pool's
``elapsed_many`` reads the device times of all pending records first, releasing the GIL around its driver calls
once per 256 records (a wake of the default period reads about that many on a launch-bound step), so the training
thread launches through them: one more hand-off of the GIL instead of the calls' time under it (a call between
launches: ``bench/results/gpu-h200/driver_calls-9.log``). What is left under the GIL is the drain, 64 bytes in and
68 out per interval, in C where it runs (``bench/readout_cost.py``, ``bench/results/cpu-emitter.md``).

``flush`` asks the thread to drain now (bounded); ``stop`` flushes, stops the thread and, once it has
exited, drains the rest in the caller (unfinished events then count as ``readout_timeout``).
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Any

from otel_straggler.config import DEFAULTS
from otel_straggler.counters import CUDA_ERROR_CODE, READOUT_TIMEOUT_CODE, REASONS, EmitterCounters
from otel_straggler.hot_path import Ring
from otel_straggler.interval import IntervalSink
from otel_straggler.records import F_COLLECTIVE, F_DEVICE, RecordBatch, WireEncoder
from otel_straggler.ring import NAN, NO_EVENT, RECORD

_clock = time.perf_counter_ns

STATS_PERIOD_NS = 1_000_000_000
MAX_BATCH = 4096
END_NS = struct.Struct("<q")
END_NS_AT = 8  # a record's end_ns (ring.RECORD)


class Readout:
    def __init__(
        self,
        ring: Ring,
        pool: Any,
        counters: EmitterCounters,
        sink: IntervalSink,
        *,
        interval_ms: float = DEFAULTS.readout_interval_ms,
        timeout_s: float = DEFAULTS.readout_timeout_s,
        wall_anchor: tuple[int, int] | None = None,
    ) -> None:
        self.ring = ring
        self.pool = pool
        self.counters = counters
        self.sink = sink
        self.interval_s = max(0.001, float(interval_ms) / 1000.0)
        self.timeout_ns = int(float(timeout_s) * 1e9)
        wall0, mono0 = wall_anchor if wall_anchor is not None else (time.time_ns(), _clock())
        self._wall_offset = wall0 - mono0
        self.quarantine: list[tuple[int, ...]] = []  # (event id, ...) groups waiting for pool.query True
        self.quarantine_cap = max(16, 2 * int(getattr(pool, "capacity", 0)))
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._stop_req = False
        self._flush_req = 0
        self._flush_done = 0
        self._flush_deadline = 0.0
        self._flush_result = True
        self._last_pub = _clock()
        self._lag_max_ns = 0
        self._spare = WireEncoder()  # frames for the records of a wake whose sink raised in new_batch

    # ---- thread --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="otel-straggler-readout", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop_req:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self.wake()

    def wake(self) -> None:
        """One wake's work (the readout thread's, or a benchmark's stand-in for it): a flush request, else one
        drain; then the stats when due."""
        try:
            with self._cond:
                req, deadline = self._flush_req, self._flush_deadline
            if req != self._flush_done:
                ok = self._drain_until(deadline)
                with self._cond:
                    self._flush_result = ok
                    self._flush_done = req
                    self._cond.notify_all()
            else:
                self.drain()
            self._maybe_publish()
        except Exception:
            self.counters.faults_readout += 1

    def flush(self, timeout_s: float) -> bool:
        """Drain everything now (bounded). True when the ring was emptied."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not self.alive:
            return self._drain_until(deadline)
        with self._cond:
            self._flush_req += 1
            req = self._flush_req
            self._flush_deadline = deadline
        self._wake.set()
        with self._cond:
            self._cond.wait_for(lambda: self._flush_done >= req, timeout=max(0.0, deadline - time.monotonic()) + 0.05)
            return self._flush_done >= req and self._flush_result

    def stop(self, timeout_s: float) -> None:
        """Flush, stop the thread, drain the rest (unfinished -> readout_timeout), release quarantine."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self.alive:
            self.flush(max(0.0, timeout_s * 0.7))
        self._stop_req = True
        self._wake.set()
        t = self._thread
        if t is not None and t.is_alive():
            t.join(max(0.0, deadline - time.monotonic()))
        if t is None or not t.is_alive():
            try:
                self.drain(force=True)
                self._release_quarantine(force=True)
                self._publish()
            except Exception:
                self.counters.faults_readout += 1

    def _drain_until(self, deadline: float) -> bool:
        while True:
            self.drain()
            if self.ring.head == self.ring.tail:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    # ---- draining ------------------------------------------------------------------------------
    def drain(self, force: bool = False) -> int:
        """Read completed records in order; returns how many intervals went to the sink."""
        # Only this thread returns events to ``pool.free``, so since the last drain it has only shrunk: the most
        # events in flight since then is what is out of it now, before anything below returns one.
        pool = self.pool
        n = pool.capacity - len(pool.free)
        if n > self.counters.pool_high_water:
            self.counters.pool_high_water = n
        self._release_quarantine(force=False)
        total = 0
        while True:
            n, more = self._drain_batch(force)
            total += n
            if not more:
                break
        self._collect_orphans()  # after the records: those published before an orphan's release are read now
        return total

    def _open_batch(self, capacity: int) -> tuple[RecordBatch, bool]:
        """The sink's frame for ``capacity`` records (``IntervalSink.new_batch``), and whether it is the sink's;
        when the sink raised (counted), a spare frame: the records are read and freed all the same, and it is not
        submitted."""
        try:
            return self.sink.new_batch(capacity), True
        except Exception:
            self.counters.sink_errors += 1
            return self._spare.batch(capacity), False

    # One function: its locals are hoisted for the per-record loop; a call per split costs on every record
    # (bench/results/cpu-emitter.md, drain us / interval)
    def _drain_batch(self, force: bool) -> tuple[int, bool]:  # noqa: C901
        r = self.ring
        c = self.counters
        tail = r.tail
        rh = r.head  # read once: the training thread moves it on meanwhile
        head = min(rh, tail + MAX_BATCH)
        more = head < rh
        if tail >= head:
            return 0, more
        mask = r.mask
        now = _clock()
        timeout_ns = self.timeout_ns
        pool = self.pool
        table = pool.table
        free = table.free
        tainted = table.tainted
        elapsed = pool.elapsed
        query = pool.query
        off = self._wall_offset
        buf = r.buf
        pre = r.pre
        timers = r.timers
        degraded = c.degraded_counts
        # each record goes straight into the sink's frame: most of them packed by the C drain
        # (``RecordBatch.pack_records``: a read device-timed or host-only record), the rest by ``put`` below
        out, deliver = self._open_batch(head - tail)
        put = out.put
        pack = out.pack_records if out.packs else None
        first = tail
        many = pool.elapsed_many
        if many is not None:
            try:
                many(r, table, tail, head)  # device times into the ring's ``pre``, the GIL released around the driver
            except Exception:
                c.faults_readout += 1  # the records are read one by one below
        first_end_ns = END_NS.unpack_from(buf, (tail & mask) * RECORD.size + END_NS_AT)[0]  # before it is freed
        while tail < head:
            if pack is not None:
                try:
                    lost = pack(r, table, head, degraded, off)
                    if lost:
                        c.faults_readout += lost
                except Exception:
                    c.faults_readout += 1
                    pack = None  # the rest of this batch record by record, below
                tail = r.tail
                if tail >= head:
                    break
            i = tail & mask
            try:
                (start_ns, end_ns, step, tokens, sequences, microbatches, repeat, tid, sev, eev, flags, own,
                 code) = RECORD.unpack_from(buf, i * RECORD.size)
                device_ms = None
                if sev != NO_EVENT:
                    try:
                        if code == 0 and eev != NO_EVENT:
                            device_ms = pre[i]  # read ahead by elapsed_many; NaN: not read
                            if device_ms != device_ms:
                                device_ms = elapsed(sev, eev)  # None while unfinished
                            done: bool | None = device_ms is not None
                        else:  # host-only with events: both must have completed before either is reused
                            done = bool(query(sev)) and (eev == NO_EVENT or bool(query(eev)))
                    except Exception:
                        device_ms = None
                        done = None
                    if done is None:
                        code = CUDA_ERROR_CODE
                        self._quarantine_record(sev, eev, own)
                    elif not done:
                        if force or now - end_ns > timeout_ns:
                            code = READOUT_TIMEOUT_CODE
                            self._quarantine_record(sev, eev, own)
                        else:
                            more = False
                            break  # head-of-line: later records wait for this one
                    else:  # read complete: whatever tainted them in this life is over
                        if own & 1:
                            tainted[sev] = 0
                            free.append(sev)
                        if own & 2:
                            tainted[eev] = 0
                            free.append(eev)
                if device_ms is None and code == 0:
                    code = CUDA_ERROR_CODE
                label, level, group, collective = timers[tid]
                if device_ms is None:
                    flags &= ~F_DEVICE
                    degraded[code] += 1
                    put(label, group, REASONS[code], level, flags | (F_COLLECTIVE if collective else 0), step,
                        repeat, start_ns + off, end_ns + off, 0.0, tokens, sequences, microbatches)
                else:
                    put(label, group, None, level, flags | F_DEVICE | (F_COLLECTIVE if collective else 0), step,
                        repeat, start_ns + off, end_ns + off, device_ms, tokens, sequences, microbatches)
            except Exception:
                c.faults_readout += 1
            pre[i] = NAN
            tail += 1
            r.tail = tail
        n = out.count + out.dropped
        if tail > first:
            c.intervals += n
            lag = now - first_end_ns  # the oldest record of the batch (records are in completion order)
            if lag > self._lag_max_ns:
                self._lag_max_ns = lag
        if deliver:
            try:
                self.sink.submit_batch(out)
            except Exception:
                c.sink_errors += 1
        else:
            self._spare.rollback()
        return n, more

    # ---- quarantine ----------------------------------------------------------------------------
    def _quarantine_record(self, sev: int, eev: int, own: int) -> None:
        """A record whose events' state is unknown (an error, a timeout): quarantine those it owns, taint the others
        (their owner, a later record or an orphan, then waits for them to complete)."""
        self._quarantine(sev if own & 1 else NO_EVENT, eev if own & 2 else NO_EVENT)
        tainted = self.pool.table.tainted
        if sev != NO_EVENT and not own & 1:
            tainted[sev] = 1
        if eev != NO_EVENT and not own & 2:
            tainted[eev] = 1

    def _collect_orphans(self) -> None:
        """Events the training thread let go of without a record that returns them (``SharedEvent``), each once
        every record published before it (its ``tag``) was read. Every record that referred to it read it complete,
        so it goes straight back to the pool, unless it is ``tainted`` (a reference was dropped, reset, timed out
        or failed: its state is unknown): then it is quarantined until ``pool.query`` says it completed."""
        table = self.pool.table
        orphans = table.orphans
        tag = table.tag
        tainted = table.tainted
        tail = self.ring.tail
        free = table.free
        while orphans and tag[orphans[0]] <= tail:
            ev = orphans.popleft()
            if tainted[ev]:
                tainted[ev] = 0
                self._quarantine(ev, NO_EVENT)
            else:
                free.append(ev)

    def _quarantine(self, sev: int, eev: int) -> None:
        group = tuple(e for e in (sev, eev) if e != NO_EVENT)
        if not group:
            return
        if len(self.quarantine) >= self.quarantine_cap:
            return  # cannot happen with pool events only; the events are simply not reused
        self.quarantine.append(group)
        self.counters.quarantined += 1

    def _release_quarantine(self, force: bool) -> None:
        if not self.quarantine:
            return
        keep: list[tuple[int, ...]] = []
        table = self.pool.table
        free = table.free
        tainted = table.tainted
        query = self.pool.query
        for group in self.quarantine:
            done = force
            if not done:
                try:
                    done = all(bool(query(e)) for e in group)
                except Exception:
                    done = False
            if done:
                for ev in group:
                    tainted[ev] = 0
                free.extend(group)
                self.counters.quarantine_released += 1
            else:
                keep.append(group)
        self.quarantine = keep

    # ---- stats ---------------------------------------------------------------------------------
    def _maybe_publish(self) -> None:
        if _clock() - self._last_pub >= STATS_PERIOD_NS:
            self._publish()

    def _publish(self) -> None:
        self._last_pub = _clock()
        self.counters.readout_lag_ms = int(self._lag_max_ns // 1_000_000)
        self._lag_max_ns = 0
        self._spare = WireEncoder()  # frames for the records of a wake whose sink raised in new_batch
        try:
            self.sink.publish_stats(self.counters.snapshot())
        except Exception:
            self.counters.sink_errors += 1

"""Properties of the hot path's event ownership, over programs that hypothesis draws and shrinks.

A program is what a training script can do to the timers between two readout wakes: starts and stops of random
timers (nested or not, some unbalanced), host gaps around the reuse gap, device work, resets, step changes, drains
with the device partly or wholly caught up, on a small pool and ring (exhaustion and ring-full drops on the way).
Whatever the program, on whichever hot path runs (``scripts/test`` runs this file on the C path and the Python
path):

* no event is in the free list twice, and none while an unread record, a running timer or the latest boundary
  still refers to it;
* once the device has caught up, the timers still running were reset and the emitter shut down, every event is
  back in the pool with no reference left, and nothing was counted as a fault;
* every interval shipped has device time or a schema reason, and every stop that was not a misuse reaches the
  sink or the ring-full count.

A counterexample is shrunk to a shortest program. A deliberate mistake in the readout's ownership rules (an event
returned to the pool before the records published ahead of its release are read) must be found.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_shared_event import GAP_US, NAMES, HostClock, check_free, play

import otel_straggler._hotpath_py as hot_path_py
import otel_straggler.readout as readout_mod
import otel_straggler.timers as timers_mod
from otel_straggler.counters import REASONS

FEW = ("forward-backward", "forward-compute", "x-a")  # few names: a stop or reset often meets a running timer
OPS = st.one_of(
    st.tuples(st.just("gap"), st.sampled_from((1, 5, 30, 49, 51, 200, 2000))),
    st.tuples(st.just("start"), st.sampled_from(FEW)),
    st.tuples(st.just("stop"), st.sampled_from(FEW)),
    st.tuples(st.just("work"), st.sampled_from((0.0, 0.1, 1.0))),
    st.tuples(st.just("drain"), st.booleans()),
    st.tuples(st.just("reset"), st.sampled_from(NAMES)),
    st.tuples(st.just("step"), st.integers(min_value=0, max_value=50)),
)
PROGRAMS = st.lists(OPS, min_size=30, max_size=200)  # long enough to reach nested reuse and stalls
CONFIGS = st.fixed_dictionaries({
    "pool_size": st.sampled_from((2, 3, 6, 64)),
    "ring_size": st.sampled_from((1, 4, 64)),
    "device_every": st.sampled_from((1, 2)),
    "device_repeats": st.sampled_from(("all", "middle")),
    "gap_us": st.sampled_from((0.0, GAP_US)),
})
SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _run(ops: list[tuple[str, Any]], cfg: dict[str, Any]) -> None:
    clock = HostClock()
    saved = timers_mod._clock, hot_path_py._clock, readout_mod._clock
    timers_mod._clock = hot_path_py._clock = readout_mod._clock = clock
    try:
        stops = sum(1 for op, _ in ops if op == "stop")
        t, sink = play(ops, clock, check=check_free, **cfg)
        check_free(t)
        c = t.counters
        misuses = c.unbalanced
        for timer in t._timers.values():  # a timer still running holds its start event: let go of it
            if timer._started:
                timer.reset()
        t.shutdown(1.0)
        pool = t.pool
        assert sorted(pool.free) == list(range(pool.capacity)), "an event never came back to the pool"
        assert all(pool.table.refs[i] == 0 for i in range(pool.capacity))
        assert c.faults_training == 0 and c.faults_readout == 0
        for iv in sink.intervals:
            assert (iv.device_ms is None) == (iv.degraded is not None)
            assert iv.degraded is None or iv.degraded in REASONS
        # every stop of a running timer is shipped or counted as dropped; each misuse is one stop or start refused
        shipped = len(sink.intervals) + c.dropped_ring_full
        assert shipped <= stops and stops - shipped <= misuses
    finally:
        timers_mod._clock, hot_path_py._clock, readout_mod._clock = saved


@SETTINGS
@given(ops=PROGRAMS, cfg=CONFIGS)
def test_no_event_is_freed_while_in_use_and_every_event_comes_back(ops: list[tuple[str, Any]],
                                                                   cfg: dict[str, Any]) -> None:
    _run(ops, cfg)


def _early_orphans(self: readout_mod.Readout) -> None:
    """The mutant: orphans go back to the pool at once, not once the records published before them were read."""
    table = self.pool.table
    while table.orphans:
        ev = table.orphans.popleft()
        table.tainted[ev] = 0
        table.free.append(ev)


def test_the_properties_find_an_event_returned_too_early(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readout_mod.Readout, "_collect_orphans", _early_orphans)
    found: list[BaseException] = []

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate], suppress_health_check=[HealthCheck.too_slow])  # found is enough: no shrinking
    @given(ops=PROGRAMS, cfg=CONFIGS)
    def prop(ops: list[tuple[str, Any]], cfg: dict[str, Any]) -> None:
        _run(ops, cfg)

    with pytest.raises(AssertionError) as err:
        prop()
    found.append(err.value)
    assert "still referred to" in str(found[0]) or "twice in the free list" in str(found[0])

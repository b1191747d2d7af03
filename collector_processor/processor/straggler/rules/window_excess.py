"""``window_excess`` and ``persistence``: a slow window adds to the streak (counted in samples: the first slow
window counts ``window_steps``, each following one its fresh samples, so pooled sparse device samples shared by
consecutive windows are not counted twice); ``straggler/slower_than_reference`` fires at ``persistence_windows`` x
``window_steps``, or when ``sequential_excess`` fires in this window. An active alert is refreshed."""

from __future__ import annotations

import otel_straggler_schema as s
from collector_processor.processor.straggler import sequential
from collector_processor.processor.straggler.evidence import DEVICE
from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import SLOWER_THAN_REFERENCE

name = "window_excess"


def judge(j: Judgement) -> bool:
    cmp = j.cmp
    if not cmp.slow:
        return False
    cfg = j.cfg
    st = j.st
    mine = j.mine
    assert mine is not None
    k = cfg.window_steps
    idx = j.ev.window.index
    # a window missing one device sample (auto sampling's host-only probe step) still counts as full
    fresh = mine.fresh if (mine.fresh and cmp.measurement == DEVICE and mine.fresh < k - 1) else k
    st.streak = st.streak + fresh if st.last_slow_index == idx - 1 else k
    st.last_slow_index = idx
    st.held_reported = False
    st.par_windows = 0
    if st.alert is not None:
        j.alert(j.emit(s.VERDICT_STRAGGLER, SLOWER_THAN_REFERENCE, st.alert.attribution, cmp))
        return True
    need = cfg.persistence_windows * k
    if st.streak < need and cmp.measurement == DEVICE and not cmp.host_stall and j.sequential_fires():
        st.streak = need
    if st.streak >= need:
        attribution = j.attribution(cmp)
        sequential.reset(st)
        j.alert(j.emit(s.VERDICT_STRAGGLER, SLOWER_THAN_REFERENCE, attribution, cmp), new=True)
    return True

"""``sequential_excess`` (``sequential.py``): a window not slow on its own convicts when the per-step excess over
the peers' per-step medians, accumulated over this and the previous window, fires: ``straggler/persistent_excess``,
reporting the lookback's value at its median excess against the peers' mean per-step median."""

from __future__ import annotations

import otel_straggler_schema as s
from collector_processor.processor.straggler import sequential
from collector_processor.processor.straggler.evidence import DEVICE
from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import PERSISTENT_EXCESS
from collector_processor.processor.straggler.statistics import relative_deviation
from collector_processor.processor.straggler.window_evidence import Comparison

name = "sequential_excess"


def judge(j: Judgement) -> bool:
    st = j.st
    cmp = j.cmp
    if st.alert is not None or cmp.measurement != DEVICE or cmp.host_stall or not j.sequential_fires():
        return False
    seq = j.seq
    assert seq is not None and seq.value_ms is not None and seq.reference_ms is not None
    value, ref = seq.value_ms, seq.reference_ms
    dev = relative_deviation(value, ref)
    found = Comparison(DEVICE, value, None, ref, dev, cmp.size, value - ref, j.cfg.sequential_margin, peers=cmp.peers)
    v = j.emit(s.VERDICT_STRAGGLER, PERSISTENT_EXCESS, j.attribution(found), found)
    j.clear_streak()
    sequential.reset(st)
    j.alert(v, new=True)
    return True

"""``hysteresis``: an active alert holds (refreshed, no verdict) until ``recovery_windows`` consecutive windows are at
par (``Judgement.at_par``): within ``recovery_margin`` of the comparable peers' median (two standard errors of a
window median where the measured noise is larger, at most the base ``tolerance``, never the noise-raised one)
and, with sequential evidence, a mean per-step excess within half the sequential margin. A rank just above the
margin, or one whose excess is still rising, does not recover on one noisy window and get convicted again."""

from __future__ import annotations

import otel_straggler_schema as s
from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import SLOWER_THAN_REFERENCE

name = "hysteresis"


def judge(j: Judgement) -> bool:
    st = j.st
    if st.alert is None:
        return False
    cmp = j.cmp
    if j.at_par(cmp):
        if j.count_par() >= j.cfg.recovery_windows:
            return False
    else:
        st.par_windows = 0
    j.clear_streak()
    j.alert(j.emit(s.VERDICT_STRAGGLER, SLOWER_THAN_REFERENCE, st.alert.attribution, cmp))
    return True

"""``missing_rank``: the rank sent no sample of this stage in a window its cohort filled (it has state for the
stage). Its streak and sequential history restart; an active alert holds (``hold``). Judges the ranks absent from
a stage, not the rules' chain."""

from __future__ import annotations

from collector_processor.processor.straggler import sequential
from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.window_evidence import Comparison

name = "missing_rank"


def judge(j: Judgement) -> bool:
    st = j.st
    j.c["missing_windows"] += 1
    j.clear_streak()
    st.par_windows = 0
    sequential.reset(st)
    if st.alert is not None:
        j.hold(Comparison())
    return True

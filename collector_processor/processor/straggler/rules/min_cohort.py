"""``min_cohort``: fewer than ``min_cohort_size`` comparable ranks with a statistic of the rank's kind (and no
``pair`` comparison): ``uncertain/cohort_below_min_size``."""

from __future__ import annotations

from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import COHORT_BELOW_MIN_SIZE
from collector_processor.processor.straggler.window_evidence import Comparison

name = "min_cohort"


def judge(j: Judgement) -> bool:
    if j.cmp.ref_ms is not None:
        return False
    j.c["below_min_cohort_windows"] += 1
    j.unusable(COHORT_BELOW_MIN_SIZE, Comparison(j.kind, j.value, size=j.cmp.size))
    return True

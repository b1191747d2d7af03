"""``record``: the window is usable evidence: the rank's deviation (``WindowOutcome.rank_deviation``) and its
excess over its comparable peers' median (``WindowOutcome.stage_excess``, for ``culprit.py``) are recorded before
the rules that convict or recover. Never decides."""

from __future__ import annotations

from collector_processor.processor.straggler.judgement import Judgement

name = "record"


def judge(j: Judgement) -> bool:
    j.record_deviation(j.cmp)
    j.record_excess(j.cmp)
    return False

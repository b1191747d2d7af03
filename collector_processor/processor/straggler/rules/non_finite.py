"""``non_finite``: a rank whose every sample of the stage was non-finite: ``uncertain/non_finite_sample``, never a
reference."""

from __future__ import annotations

from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import NON_FINITE_SAMPLE
from collector_processor.processor.straggler.window_evidence import Comparison

name = "non_finite"


def judge(j: Judgement) -> bool:
    mine = j.mine
    assert mine is not None
    if mine.dev is not None or mine.host is not None:
        return False
    j.c["non_finite_windows"] += 1
    j.unusable(NON_FINITE_SAMPLE, Comparison())
    return True

"""``absolute_floor``: a window that looks slow but whose gap is under the floor of its kind
(``WindowEvidence.floor``): ``uncertain/below_absolute_floor`` (no evidence either way: a 1 ms stage 50 % slower
costs 0.5 ms, and host jitter alone gives such ratios)."""

from __future__ import annotations

from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import BELOW_ABSOLUTE_FLOOR

name = "absolute_floor"


def judge(j: Judgement) -> bool:
    cmp = j.cmp
    assert cmp.ref_ms is not None and cmp.measurement is not None
    if not (cmp.slow and cmp.gap < j.ev.floor(cmp.measurement, cmp.ref_ms)):
        return False
    j.c["below_floor_windows"] += 1
    j.unusable(BELOW_ABSOLUTE_FLOOR, cmp)
    return True

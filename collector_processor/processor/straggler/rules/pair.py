"""``pair``: in a 2-rank cohort (``pair.py`` of the package) the rank against the other one, with the deviation and
tolerance that module measures (the gap at that deviation); the slower rank that no evidence names is
``uncertain/pair_ambiguous``."""

from __future__ import annotations

from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import PAIR_AMBIGUOUS
from collector_processor.processor.straggler.window_evidence import Comparison

name = "pair"


def judge(j: Judgement) -> bool:
    cmp = j.cmp
    pw = j.se.pair
    if cmp.ref_ms is not None or pw is None:
        return False
    assert cmp.value is not None
    if pw.kind != cmp.measurement or j.rank not in pw.values:
        return False
    peer = pw.other(j.rank)
    ref = pw.values[peer]
    dev = pw.deviation[j.rank]  # per step where both were timed on the same steps (pair.py)
    cmp = j.cmp = Comparison(cmp.measurement, cmp.value, peer, ref, dev, 2, ref * dev, pw.tolerance, own=True)
    if pw.slow != j.rank or pw.named:
        return False
    j.c["pair_ambiguous_windows"] += 1
    j.record_deviation(cmp)
    j.unusable(PAIR_AMBIGUOUS, cmp)
    return True

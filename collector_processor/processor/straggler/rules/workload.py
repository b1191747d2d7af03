"""``workload``: the rank's tokens per step beyond ``workload_tolerance`` of the cohort's median:
``uncertain/workload_incomparable`` (ranks without tokens are comparable; in a stage judged per unit,
``per_unit.py``, every rank is)."""

from __future__ import annotations

from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import WORKLOAD_INCOMPARABLE
from collector_processor.processor.straggler.statistics import within_relative
from collector_processor.processor.straggler.window_evidence import Comparison

name = "workload"


def judge(j: Judgement) -> bool:
    if j.se.uniform:  # per unit, or every warm rank's tokens within the tolerance of each other's, so of
        return False  # their median too: |a - b| / max(a, b) <= (hi - lo) / hi for a, b in [lo, hi]
    ev = j.ev
    tok = ev.rank_tokens.get(j.rank)
    if tok is None or ev.tok_median is None or len(ev.rank_tokens) <= 1 \
            or within_relative(tok, ev.tok_median, j.cfg.workload_tolerance):
        return False
    j.c["workload_incomparable_windows"] += 1
    j.unusable(WORKLOAD_INCOMPARABLE, Comparison(j.kind, j.value))
    return True

"""``mp_wait``: a window that would count against the rank in a stage whose time is an all-reduce over its
model-parallel group (``mp_wait_stages``), or in a timer enclosing them whose excess their excess explains (by
``collective_wait_fraction``): the rank waits there for a member of its group, ``uncertain/collective_wait``. It is
never the rank's conviction (nor its node's, nor a group's); ``culprit.py`` reads it
(``WindowOutcome.mp_waits``) as the rank's evidence of being a victim."""

from __future__ import annotations

from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import COLLECTIVE_WAIT
from collector_processor.processor.straggler.statistics import median
from collector_processor.processor.straggler.window_evidence import Comparison
from otel_straggler_schema.stages import MP_WAIT_ENCLOSING

name = "mp_wait"


def _waits(j: Judgement, cmp: Comparison) -> bool:
    waits = j.cfg.mp_wait_stages
    if not waits or not j.counts_against(cmp):
        return False
    stage_name = j.se.name
    if stage_name in waits:
        return True
    inner = MP_WAIT_ENCLOSING.get(stage_name)
    if inner is None or cmp.measurement is None or cmp.gap <= 0.0:
        return False
    explained = 0.0
    for stage in inner:
        if stage not in waits:
            continue
        per = j.ev.stats.get(stage)
        mine = per.get(j.rank) if per else None
        v = mine.value(cmp.measurement) if mine is not None else None
        if v is None or per is None:
            continue
        peers = [x for p, st in per.items() if p != j.rank and (x := st.value(cmp.measurement)) is not None]
        if peers:
            explained += v - median(peers)
    return explained >= j.cfg.collective_wait_fraction * cmp.gap


def judge(j: Judgement) -> bool:
    cmp = j.cmp
    if not _waits(j, cmp):
        return False
    j.c["mp_wait_windows"] += 1
    j.ev.out.mp_waits.add((j.rank, j.se.name))
    j.unusable(COLLECTIVE_WAIT, cmp)
    return True

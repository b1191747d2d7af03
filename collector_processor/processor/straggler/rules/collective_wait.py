"""``collective_wait`` (``collective.py``): a window that would count against the rank (slow, or
``sequential_excess`` firing) whose excess is the wait for its reference's excess in another stage:
``uncertain/collective_wait``."""

from __future__ import annotations

from collector_processor.processor.straggler import collective
from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import COLLECTIVE_WAIT

name = "collective_wait"


def judge(j: Judgement) -> bool:
    cmp = j.cmp
    if not j.counts_against(cmp) or not j.cfg.collective_wait or not collective.waits(j.ev, j.se, j.rank, cmp):
        return False
    j.c["collective_wait_windows"] += 1
    j.unusable(COLLECTIVE_WAIT, cmp)
    return True

"""``recovery``: what no rule before decided is par evidence (the floor never blocks it): the streak restarts and
an active alert ends with ``recovered/within_tolerance`` (``Judgement.recover``). Always decides: the last rule."""

from __future__ import annotations

from collector_processor.processor.straggler.judgement import Judgement

name = "recovery"


def judge(j: Judgement) -> bool:
    j.recover(j.cmp)
    return True

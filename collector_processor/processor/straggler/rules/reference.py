"""``reference``: the rank's statistic against its reference among the comparable peers with a statistic of the
same kind (``Judgement.compare``): the comparison the later rules decide on. Never decides."""

from __future__ import annotations

from collector_processor.processor.straggler.judgement import Judgement

name = "reference"


def judge(j: Judgement) -> bool:
    value = j.value
    assert value is not None
    j.cmp = j.compare(j.kind, value)
    return False

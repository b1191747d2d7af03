"""``device_samples_missing``: the rank, without a device sample of the stage in this window, sent some in the last
``device_history_windows`` windows: it times the stage on the device, and its host time is launch time, never
compared as if it were the stage's duration (``uncertain/missing_samples``). A rank that stopped timing it on the
device longer ago is judged on host time against its peers' host times (its device history is dropped)."""

from __future__ import annotations

from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import MISSING_SAMPLES
from collector_processor.processor.straggler.window_evidence import Comparison

name = "device_samples_missing"


def judge(j: Judgement) -> bool:
    mine = j.mine
    assert mine is not None
    if mine.dev is not None:
        return False
    recent = j.st.dev_recent
    if not recent:
        return False
    if recent[-1][0] < j.ev.window.index - j.cfg.device_history_windows:
        j.st.dev_recent = None
        return False
    j.c["device_samples_missing_windows"] += 1
    j.unusable(MISSING_SAMPLES, Comparison())
    return True

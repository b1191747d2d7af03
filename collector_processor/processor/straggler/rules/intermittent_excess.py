"""``intermittent_excess`` (``intermittent.py``): without an alert, the rank's recurring spikes over its peers'
per-step median cost the job per step at least what the smallest steady straggler does, over the lookback and
recently: ``straggler/intermittent_excess``, reporting the cost per step against the peers' mean per-step median,
the period and the episodes; where the machine's other ranks spike too, ``uncertain/host_contention``. An alert it
convicted holds (refreshed with the cost) while the recent cost stays at half the threshold or more;
``recovery_windows`` consecutive windows below that end it."""

from __future__ import annotations

import otel_straggler_schema as s
from collector_processor.processor.straggler import sequential
from collector_processor.processor.straggler.evidence import DEVICE
from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import HOST_CONTENTION, INTERMITTENT_EXCESS

name = "intermittent_excess"


def _hold(j: Judgement) -> None:
    alert = j.st.alert
    assert alert is not None
    cmp = j.cmp
    im = j.intm
    if im is not None and im.holds:
        j.st.par_windows = 0
        j.alert(j.emit(s.VERDICT_STRAGGLER, INTERMITTENT_EXCESS, alert.attribution, j.intermittent_comparison(im, cmp)))
        return
    if j.count_par() >= j.cfg.recovery_windows:
        j.recover(cmp)
        return
    j.alert(alert)


def judge(j: Judgement) -> bool:
    st = j.st
    alert = st.alert
    if alert is not None:
        if alert.reason != INTERMITTENT_EXCESS:
            return False
        _hold(j)
        return True
    im = j.intm
    cmp = j.cmp
    if im is None or not im.fires or cmp.measurement != DEVICE or cmp.host_stall:
        return False
    found = j.intermittent_comparison(im, cmp)
    if j.cfg.host_contention and j.shared_host_spikes(found, episodes=True):
        j.c["host_contention_windows"] += 1  # the machine's other ranks spike on the host too
        j.unusable(HOST_CONTENTION, cmp, s.ATTRIBUTION_HOST)
        return True
    attribution = j.attribution(found)
    j.clear_streak()
    st.par_windows = 0
    sequential.reset(st)
    j.c["intermittent_verdicts"] += 1
    j.alert(j.emit(s.VERDICT_STRAGGLER, INTERMITTENT_EXCESS, attribution, found), new=True)
    return True

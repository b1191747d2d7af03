"""``host_contention``: a slow window on host time, or on device time the host starved (attributed
``host_only_stall``), whose comparable peers all run on the rank's host while at least a quarter of them (and 2)
spike on the host in the window too (``Judgement.shared_host_spikes``): the ranks share the machine's starved
CPUs, so the excess is ``uncertain/host_contention``, attributed to the host, and pages nobody. One rank slow on a
machine whose other ranks run steadily is still judged."""

from __future__ import annotations

import otel_straggler_schema as s
from collector_processor.processor.straggler.evidence import HOST
from collector_processor.processor.straggler.judgement import Judgement
from collector_processor.processor.straggler.model import HOST_CONTENTION

name = "host_contention"


def judge(j: Judgement) -> bool:
    cmp = j.cmp
    if not j.cfg.host_contention or not cmp.slow:
        return False
    if cmp.measurement != HOST and j.attribution(cmp) != s.ATTRIBUTION_HOST:
        return False  # a GPU slow on its own (the device excess explains the host's)
    if not j.shared_host_spikes(cmp):
        return False
    j.c["host_contention_windows"] += 1
    j.unusable(HOST_CONTENTION, cmp, s.ATTRIBUTION_HOST)
    return True

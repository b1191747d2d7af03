"""``host_stall``: in a ``host_stall_groups`` stage whose device comparison does not fire (flat or sub-floor), the
rank's host time beyond tolerance and the host floor against the peers' host times, and not explained by its device
excess (``attribution.py``), is the comparison instead: a host stall (CPU contention, a stalled launch, waiting for
data) with the GPU flat. While an alert convicted on host time is active, the host comparison stays the evidence
(it holds or recovers on host time). Never decides."""

from __future__ import annotations

from collector_processor.processor.straggler.evidence import DEVICE, HOST
from collector_processor.processor.straggler.judgement import Judgement

name = "host_stall"


def judge(j: Judgement) -> bool:
    mine = j.mine
    cmp = j.cmp
    assert mine is not None
    if cmp.measurement != DEVICE or j.se.group not in j.cfg.host_stall_groups or mine.host is None:
        return False
    assert cmp.ref_ms is not None
    if cmp.slow and cmp.gap >= j.ev.floor(DEVICE, cmp.ref_ms):
        return False
    alert = j.st.alert
    on_host = alert is not None and alert.measurement == HOST
    if not on_host:
        # no peer's host time is far enough below the rank's to clear the floor: nothing to compare (the
        # common case, decided without the host tolerance)
        lowest = j.se.views.host.lowest(j.rank)
        if lowest is None or mine.host - lowest < j.cfg.absolute_floor_ms:
            return False
    host = j.compare(HOST, mine.host)
    if host.ref_ms is None or host.ref_ms <= 0:
        return False
    if not on_host and not (host.slow and host.gap >= j.cfg.absolute_floor_ms and j.host_unexplained(cmp.peers)):
        return False
    host.host_stall = True
    host.peers = cmp.peers
    j.cmp = host
    return False

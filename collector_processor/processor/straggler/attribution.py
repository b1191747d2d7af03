"""Attribution of a confirmed slowdown to the GPU stream or the host, and collective corroboration.

What CUDA events can show: a device interval is the stream time between the start and stop events. A slow
GPU (clocks, thermals, a bad link) stretches it while the host interval, made of asynchronous launches,
stays flat (the emitter never synchronises and Megatron's compute stages do not block on the GPU). A
stalled host stretches the host interval AND, when the stream starves between the two events, the device
interval by about as much. Hence, with ``share = host excess / device excess`` (excess = gap to the
reference, host against peers' host times, device against peers' device times):

* the device comparison fires (deviation > tolerance, gap >= floor):
  - host within tolerance, or ``share < host_ambiguous_fraction`` [0.25]: ``gpu_stream_stall``;
  - ``share >= host_explains_fraction`` [0.8]: the host stall accounts for the device stretch:
    ``host_only_stall``;
  - in between: ``attribution_unknown`` (both grew, neither explains the other);
* only the host comparison fires (device flat, or no device sample): ``host_only_stall``;
* anything else: ``attribution_unknown``.

Limit: a GPU slowdown inside an interval that also contains a host-blocking call (``.item()``, a
synchronising copy) stretches both intervals equally and is reported as ``host_only_stall``.
"""

from __future__ import annotations

from collector_processor.processor.straggler.statistics import median
from otel_straggler import schema as s


def attribute(
    *,
    measurement: str,
    device_deviation: float | None,
    device_gap_ms: float | None,
    host_deviation: float | None,
    host_gap_ms: float | None,
    tolerance: float,
    floor_ms: float,
    host_explains_fraction: float,
    host_ambiguous_fraction: float = 0.25,
    host_floor_ms: float | None = None,
    host_tolerance: float | None = None,
) -> str:
    """``floor_ms`` and ``tolerance`` gate the device comparison, ``host_floor_ms`` and ``host_tolerance``
    (default: the same) the host one: host excess within the host's own noise explains nothing."""
    hfloor = floor_ms if host_floor_ms is None else host_floor_ms
    htol = tolerance if host_tolerance is None else host_tolerance
    if measurement == s.MEASUREMENT_HOST_ONLY or device_deviation is None or device_gap_ms is None \
            or device_deviation <= tolerance or device_gap_ms < floor_ms:
        # only the host comparison can fire
        host_fires = host_deviation is not None and host_gap_ms is not None and host_deviation > htol \
            and host_gap_ms >= hfloor
        return s.ATTRIBUTION_HOST if host_fires else s.ATTRIBUTION_UNKNOWN
    if host_deviation is None or host_gap_ms is None or host_deviation <= htol:
        return s.ATTRIBUTION_GPU
    share = host_gap_ms / device_gap_ms
    if share >= host_explains_fraction:
        return s.ATTRIBUTION_HOST
    if share < host_ambiguous_fraction:
        return s.ATTRIBUTION_GPU
    return s.ATTRIBUTION_UNKNOWN


def collective_evidence(rank: int, per_group: dict[str, dict[int, float]], tolerance: float) -> str:
    """``waits_least:<group>`` for each collective group where ``rank`` spent the least time in the cohort
    while its peers waited more (their median beyond ``tolerance`` above it). Evidence only."""
    found: list[str] = []
    for group in s.COLLECTIVE_GROUPS:
        values = per_group.get(group)
        if not values or rank not in values or len(values) < 2:
            continue
        mine = values[rank]
        peers = [v for r, v in values.items() if r != rank]
        if mine > min(peers):
            continue
        if median(peers) > mine * (1.0 + tolerance):
            found.append(f"waits_least:{group}")
    return ",".join(found)

"""Attribution of a confirmed slowdown to the GPU stream or the host, and collective corroboration.

What CUDA events and host clocks show, by regime:

* the host is not blocked by the GPU (launches run ahead of the stream): a slow GPU stretches the device
  interval, the host interval (its launches) stays flat; a host stall (CPU contention, a stalled launch)
  stretches the host interval, and the device interval only by what exceeds the work already queued (the
  stream starves);
* the launch queue is full (GPU-bound): the host blocks on it, so its interval tracks the device's: a slow
  GPU stretches both by about the same time; a host stall shorter than the queued work is absorbed.

So the device excess explains as much host excess as itself, whatever the regime, and one rule serves both
(``attribute``), for every rule that convicts (``window_excess``, ``sequential_excess``, ``host_stall``).
Excess is the rank's window statistic minus the comparable peers' median of the same kind (host against
host, device against device): the same robust reference for both kinds, so neither share is inflated by a
noisier kind's extreme peer.

* convicted on host time (``host_stall``: device flat or under its floor; or a rank without device samples):
  ``host_only_stall``;
* convicted on device time in a stage whose work is the host's (``HOST_WORK_GROUPS``: the data loader), where
  the GPU runs nothing of its own and its interval is the stream waiting for the host: ``host_only_stall``;
* convicted on device time: the host excess the device excess does not explain, ``host - max(device, 0)``,
  beyond the host's noise-raised tolerance of the host reference and the host floor: ``host_only_stall`` (the
  host stalled and starved the stream); otherwise ``gpu_stream_stall`` (the device excess explains the host's,
  e.g. a blocked host tracking a slow GPU).

Limit: a host stall in a GPU-bound stage long enough to drain the queue, or a host stall in a stage whose
launches pace the stream, stretches both intervals by the same time, exactly as a slow GPU with a blocked
host does; interval times cannot tell them apart, and both read ``gpu_stream_stall``.
"""

from __future__ import annotations

import otel_straggler_schema as s
from collector_processor.processor.straggler.statistics import median

# stage groups whose work is done on the host (the data loader): the GPU has nothing of its own to run there,
# so their device interval only tracks the host's and any excess in it is the host's
HOST_WORK_GROUPS = frozenset({"data"})


def unexplained_host_excess(*, device_excess_ms: float | None, host_excess_ms: float | None,
                            host_reference_ms: float | None, host_tolerance: float, host_floor_ms: float) -> bool:
    """True when the host excess that the device excess does not explain is evidence of its own: beyond
    ``host_tolerance`` of the host reference and at least ``host_floor_ms``."""
    if host_excess_ms is None or host_reference_ms is None or host_reference_ms <= 0:
        return False
    rest = host_excess_ms - max(device_excess_ms or 0.0, 0.0)
    return rest >= host_floor_ms and rest > host_tolerance * host_reference_ms


def attribute(*, convicted_on: str, group: str, device_excess_ms: float | None, host_excess_ms: float | None,
              host_reference_ms: float | None, host_tolerance: float, host_floor_ms: float) -> str:
    """``gpu_stream_stall`` or ``host_only_stall`` of a straggler of a ``group`` stage convicted on
    ``convicted_on`` time (``schema.MEASUREMENT_DEVICE`` or ``MEASUREMENT_HOST_ONLY``); see the module
    docstring."""
    if convicted_on != s.MEASUREMENT_DEVICE or group in HOST_WORK_GROUPS:
        return s.ATTRIBUTION_HOST
    if unexplained_host_excess(device_excess_ms=device_excess_ms, host_excess_ms=host_excess_ms,
                               host_reference_ms=host_reference_ms, host_tolerance=host_tolerance,
                               host_floor_ms=host_floor_ms):
        return s.ATTRIBUTION_HOST
    return s.ATTRIBUTION_GPU


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

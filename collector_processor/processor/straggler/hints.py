"""``hints``: a verdict's cause hint from the NVML samples its rank and its peers attach to their rank-steps
(``otel_straggler/nvml.py``; only where the emitter samples NVML).

The convicted rank's latest sample against its comparable peers' median: an SM clock at least
``CLOCK_DROP`` below the peers' ("SM clock 1,410 MHz vs peers 1,980 (thermal slowdown)", with the clocks event
reasons the GPU gives that its peers do not), PCIe replays or NVLink errors beyond the peers' most, a temperature
``HOT_C`` above their median. Nothing when no sample says anything: the hint is evidence for the operator,
never a rule's input.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import otel_straggler_schema as s

CLOCK_DROP = 0.03  # an SM clock this far below the peers' median is named
HOT_C = 10  # a GPU this many degrees above the peers' median is named
_WORDS = {
    "sw_thermal_slowdown": "thermal slowdown",
    "hw_thermal_slowdown": "thermal slowdown",
    "sw_power_cap": "power cap",
    "hw_power_brake_slowdown": "power brake",
    "hw_slowdown": "hardware slowdown",
    "sync_boost": "sync boost",
    "applications_clocks_setting": "application clocks",
}
# decoded from a rank-step: attribute -> kind
KEYS = {
    s.ATTR_GPU_SM_CLOCK_MHZ: "int", s.ATTR_GPU_SM_CLOCK_MAX_MHZ: "int", s.ATTR_GPU_CLOCK_REASONS: "strings",
    s.ATTR_GPU_TEMPERATURE_C: "int", s.ATTR_GPU_POWER_W: "double", s.ATTR_GPU_PCIE_REPLAYS: "int",
    s.ATTR_GPU_NVLINK_ERRORS: "int",
}


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def describe(mine: Mapping[str, Any] | None, peers: Iterable[Mapping[str, Any] | None]) -> str:
    """The hint of a rank whose latest sample is ``mine`` among its ``peers``' latest ('' when none)."""
    if not mine:
        return ""
    others = [p for p in peers if p]
    if not others:
        return ""
    parts: list[str] = []
    clock = mine.get(s.ATTR_GPU_SM_CLOCK_MHZ)
    peer_clocks = [float(p[s.ATTR_GPU_SM_CLOCK_MHZ]) for p in others if p.get(s.ATTR_GPU_SM_CLOCK_MHZ)]
    if clock and peer_clocks:
        ref = _median(peer_clocks)
        if clock < (1.0 - CLOCK_DROP) * ref:
            theirs = {r for p in others for r in p.get(s.ATTR_GPU_CLOCK_REASONS, ())}
            words = sorted({_WORDS[r] for r in mine.get(s.ATTR_GPU_CLOCK_REASONS, ()) if r in _WORDS
                            and r not in theirs})
            why = f" ({', '.join(words)})" if words else ""
            parts.append(f"SM clock {int(clock):,} MHz vs peers {round(ref):,}{why}")
    temp = mine.get(s.ATTR_GPU_TEMPERATURE_C)
    peer_temps = [float(p[s.ATTR_GPU_TEMPERATURE_C]) for p in others if p.get(s.ATTR_GPU_TEMPERATURE_C) is not None]
    if temp is not None and peer_temps and temp >= _median(peer_temps) + HOT_C:
        parts.append(f"{int(temp)} C vs peers {round(_median(peer_temps))} C")
    for key, label in ((s.ATTR_GPU_PCIE_REPLAYS, "PCIe replays"), (s.ATTR_GPU_NVLINK_ERRORS, "NVLink errors")):
        n = mine.get(key)
        most = max((int(p[key]) for p in others if p.get(key) is not None), default=None)
        if n is not None and most is not None and int(n) > most:
            parts.append(f"{label} {int(n):,} vs peers' most {most:,}")
    return "; ".join(parts)

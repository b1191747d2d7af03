"""``evidence``: one warm rank's statistic of one stage in a window, and the stage's tolerances and sorted values,
each of two kinds: ``DEVICE`` (device time) and ``HOST`` (host time). Device and host are never mixed: two ranks
are compared on device time when both have it, else on host time when both have it (``values_of_kind``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import otel_straggler_schema as s
from collector_processor.processor.straggler.statistics import SortedPeers, median

DEVICE = s.MEASUREMENT_DEVICE
HOST = s.MEASUREMENT_HOST_ONLY


@dataclass(slots=True)
class RankStat:
    """One warm rank's samples of one stage in the window and its statistic."""

    dev: float | None  # median of the device samples (pooled over recent windows when sparse)
    dev_samples: list[float]
    host_samples: list[float]
    fresh: int = 0  # samples of this window behind the device statistic (0: all of them)
    dev_used: list[float] | None = None  # the samples behind the device statistic when pooled
    dev_steps: list[int] | None = None  # the step of each device sample (step windows)
    tokens: list[int] | None = None  # the rank's tokens per sample (straggler.workload.tokens), as published
    _host: float | None = None

    @property
    def host(self) -> float | None:
        """Median of the host samples (None without any), computed on first read: a rank with device times
        is judged on those, its host statistic is read only for a host-stall group or an attribution."""
        if self._host is None and self.host_samples:
            self._host = median(self.host_samples)
        return self._host

    def value(self, kind: str) -> float | None:
        """The statistic of ``kind`` (``DEVICE`` or ``HOST``)."""
        return self.dev if kind == DEVICE else self.host


def values_of_kind(a: RankStat, b: RankStat) -> tuple[str, float, float] | None:
    """Both ranks' statistic of one kind: device when both have it, else host when both have it."""
    if a.dev is not None and b.dev is not None:
        return DEVICE, a.dev, b.dev
    if a.dev is None and b.dev is None:
        ha, hb = a.host, b.host
        if ha is not None and hb is not None:
            return HOST, ha, hb
    return None


class Tolerances:
    """Device and host tolerance of one stage in one window (``noise_tolerance``). The host one is computed on
    first use: a stage whose ranks all have device times needs it only for a host-stall group or a slow
    rank's attribution, and its robust sigma costs as much as the device one."""

    __slots__ = ("_host", "_host_of", "device")

    def __init__(self, device: float, host_of: Callable[[], float]) -> None:
        self.device = device
        self._host: float | None = None
        self._host_of = host_of

    @property
    def host(self) -> float:
        if self._host is None:
            self._host = self._host_of()
        return self._host

    def of(self, kind: str) -> float:
        """The tolerance of ``kind`` (``DEVICE`` or ``HOST``)."""
        return self.device if kind == DEVICE else self.host


class Views:
    """One stage's device values and host values (a rank without device samples is compared host-vs-host),
    each sorted once for every rank's reference; the host side on first use (see ``Tolerances``)."""

    __slots__ = ("_host", "_per", "device")

    def __init__(self, per: dict[int, RankStat]) -> None:
        self._per = per
        self.device = SortedPeers({r: st.dev for r, st in per.items() if st.dev is not None})
        self._host: SortedPeers | None = None

    @property
    def host(self) -> SortedPeers:
        if self._host is None:
            self._host = SortedPeers({r: st.host for r, st in self._per.items() if st.host is not None})
        return self._host

    def of(self, kind: str) -> SortedPeers:
        """The sorted values of ``kind`` (``DEVICE`` or ``HOST``)."""
        return self.device if kind == DEVICE else self.host

"""Cohort and rank registry: ranks are compared only within (job, cohort key). Every map is capped."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from collector_processor.processor.straggler.collective_ring import Rings
from collector_processor.processor.straggler.pair import PairTrack
from collector_processor.processor.straggler.window import KIND_STEP, KIND_WALL, WindowSet

NO_INDEX = -(2**62)  # no window index seen yet
NO_CEILING = 2**62  # a cohort without a step range yet: no sample is quarantined


@dataclass(slots=True)
class RankInfo:
    host: str
    gpu: str
    world_size: int
    last_seen_s: float
    max_step_index: int = NO_INDEX
    max_wall_index: int = NO_INDEX
    windows_seen: int = 0  # windows in which the rank had samples (warmup counts these)
    claim_index: int = NO_INDEX  # step window index of the rank's latest sample, accepted or quarantined
    in_range: bool = False  # some step sample of the rank was not quarantined (it counts in the cohort's range)
    dp_rank: int = -1  # dl.data_parallel.rank (-1: not published): its model-parallel group (culprit.py)
    gpu_hints: dict[str, object] | None = None  # its latest NVML sample (hints.py)


@dataclass(slots=True)
class Cohort:
    job: str
    key: str
    last_seen_s: float
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    expected_ranks: int = 0  # largest dl.data_parallel.size published by its ranks (0: unknown)
    stages: dict[str, str] = field(default_factory=dict)  # stage -> group
    steps: WindowSet = field(default_factory=lambda: WindowSet(KIND_STEP))
    wall: WindowSet = field(default_factory=lambda: WindowSet(KIND_WALL))
    # stage -> latest per-window spreads of the per-step excess (sequential evidence; bounded by max_stages)
    seq_sigma: dict[str, deque[float]] = field(default_factory=dict)
    # stages whose intervals hold a wait in a collective (straggler.stage.collective; bounded by max_stages)
    collective: set[str] = field(default_factory=set)
    # stage -> the 2-rank cohort's levels (pair.py; bounded by max_stages)
    pairs: dict[str, PairTrack] = field(default_factory=dict)
    # collective stage -> its ring's baseline and signal (collective_signal.py; bounded by max_stages)
    rings: Rings = field(default_factory=Rings)
    # highest step window index a sample may open (step quarantine; processor._refresh_range): NO_CEILING until
    # the cohort has a range
    step_ceiling: int = NO_CEILING
    range_at: float = float("-inf")  # when the range was last computed


class CohortRegistry:
    """(job, cohort key) -> Cohort, least recently seen evicted beyond ``max_cohorts``."""

    def __init__(self, max_cohorts: int) -> None:
        self.max_cohorts = max_cohorts
        self._cohorts: OrderedDict[tuple[str, str], Cohort] = OrderedDict()

    def get(self, job: str, key: str, now_s: float) -> tuple[Cohort, Cohort | None]:
        """The cohort (created if new) and the cohort evicted to make room, if any."""
        k = (job, key)
        c = self._cohorts.get(k)
        if c is not None:
            if c.last_seen_s != now_s:
                c.last_seen_s = now_s
                self._cohorts.move_to_end(k)
            return c, None
        evicted = None
        if len(self._cohorts) >= self.max_cohorts:
            _, evicted = self._cohorts.popitem(last=False)
        c = self._cohorts[k] = Cohort(job, key, now_s)
        return c, evicted

    def find(self, job: str, key: str) -> Cohort | None:
        """The cohort if held (its recency unchanged)."""
        return self._cohorts.get((job, key))

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._cohorts.values()))

    def __len__(self) -> int:
        return len(self._cohorts)

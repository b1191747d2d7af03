"""Cohort and rank registry: ranks are compared only within (job, cohort key). Every map is capped."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

from collector_processor.processor.straggler.collective_ring import Rings
from collector_processor.processor.straggler.pair import PairTrack
from collector_processor.processor.straggler.window import KIND_STEP, KIND_WALL, WindowSet
from collector_processor.tenancy import label_of

NO_INDEX = -(2**62)  # no window index seen yet
NO_CEILING = 2**62  # a cohort without a step range yet: no sample is quarantined




def _no_tenant(_job: str) -> str:
    return ""


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
    tenant: str = ""  # whose job it is (CohortRegistry's budget)


class CohortRegistry:
    """(job, cohort key) -> Cohort, at most ``max_cohorts``, budgeted per tenant (``tenant_of(job)``): to make room
    for a new cohort, a tenant at or over its share (``max_cohorts`` over the tenants holding cohorts) evicts its
    own least recently seen cohort, any other the busiest tenant's. So a tenant under its share loses no cohort to
    another's load. Evictions are counted per tenant in ``evictions`` (labels tenant, structure)."""

    def __init__(self, max_cohorts: int, tenant_of: Callable[[str], str] | None = None,
                 evictions: Counter | None = None) -> None:
        self.max_cohorts = max_cohorts
        self._tenant_of = tenant_of or _no_tenant
        self._evictions = evictions
        self._cohorts: dict[tuple[str, str], Cohort] = {}
        # tenant -> its cohorts, least recently seen first
        self._by_tenant: dict[str, OrderedDict[tuple[str, str], None]] = {}

    def get(self, job: str, key: str, now_s: float) -> tuple[Cohort, Cohort | None]:
        """The cohort (created if new) and the cohort evicted to make room, if any."""
        k = (job, key)
        c = self._cohorts.get(k)
        if c is not None:
            if c.last_seen_s != now_s:
                c.last_seen_s = now_s
                self._by_tenant[c.tenant].move_to_end(k)
            return c, None
        tenant = self._tenant_of(job)
        own = self._by_tenant.get(tenant)
        evicted = None
        if len(self._cohorts) >= self.max_cohorts:
            share = self.max_cohorts // (len(self._by_tenant) + (own is None))
            victim = own if own is not None and len(own) >= share else max(self._by_tenant.values(), key=len)
            evicted = self._cohorts.pop(victim.popitem(last=False)[0])
            if not victim:
                del self._by_tenant[evicted.tenant]
                if victim is own:
                    own = None
            self._count(evicted)
        if own is None:
            own = self._by_tenant[tenant] = OrderedDict()
        own[k] = None
        c = self._cohorts[k] = Cohort(job, key, now_s, tenant=tenant)
        return c, evicted

    def _count(self, evicted: Cohort) -> None:
        if self._evictions is not None:
            tenant = label_of(evicted.tenant)
            self._evictions.labels(tenant=tenant, structure="cohorts").inc()
            windows = len(evicted.steps.open) + len(evicted.wall.open)
            if windows:
                self._evictions.labels(tenant=tenant, structure="windows").inc(windows)

    def find(self, job: str, key: str) -> Cohort | None:
        """The cohort if held (its recency unchanged)."""
        return self._cohorts.get((job, key))

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._cohorts.values()))

    def held_by(self, tenant: str) -> int:
        """Cohorts of ``tenant``'s jobs held now."""
        return len(self._by_tenant.get(tenant, ()))

    def __len__(self) -> int:
        return len(self._cohorts)

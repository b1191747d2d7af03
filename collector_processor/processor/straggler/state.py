"""Per (job, cohort, rank, stage) detector state: onset streak over consecutive window indices, the active
alert, and the uncertain-verdict rate limit. Bounded LRU; an entry holding an active alert is evicted only
when no inactive entry is left (counted either way)."""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from collector_processor.processor.straggler.model import Verdict

StateKey = tuple[str, str, int, str]


@dataclass(slots=True)
class IntHistory:
    """One rank-stage's intermittent history (``intermittent.py``): observed steps and their peers' medians since
    it began (one episode's window at the latest), and the episodes ``[start step, last step, summed excess ms]``."""

    steps: array[int] = field(default_factory=lambda: array("q"))
    refs: array[float] = field(default_factory=lambda: array("d"))
    devs: array[float] = field(default_factory=lambda: array("d"))  # x / m - 1 of each step
    episodes: deque[list[float]] = field(default_factory=deque)


@dataclass(slots=True)
class RankStageState:
    streak: int = 0  # fresh samples of consecutive slow windows (a full window adds window_steps)
    last_slow_index: int | None = None
    alert: Verdict | None = None  # the straggler verdict while active, refreshed every slow window
    held_reported: bool = False  # recovery_evidence_insufficient already emitted for this hold
    par_windows: int = 0  # consecutive windows at par while an alert is active (hysteresis)
    last_par_index: int | None = None
    last_uncertain_reason: str = ""
    last_uncertain_index: int | None = None
    # (window index, per-step device ms) of the latest judged samples: pools sparse (sampled) device timing
    dev_recent: deque[tuple[int, float]] | None = None
    # sequential evidence (sequential.py): recent per-step records (flat doubles) and the window they reached
    seq_hist: array[float] | None = None
    seq_index: int = -1
    # intermittent evidence (intermittent.py): kept only while an episode is in the lookback
    intm: IntHistory | None = None

    @property
    def active(self) -> bool:
        return self.alert is not None


class StateStore:
    def __init__(self, max_states: int) -> None:
        self.max_states = max_states
        self._states: OrderedDict[StateKey, RankStageState] = OrderedDict()
        self._active: dict[StateKey, RankStageState] = {}
        self.evicted = 0

    def get(self, key: StateKey) -> RankStageState:
        st = self._states.get(key)
        if st is not None:
            self._states.move_to_end(key)
            return st
        if len(self._states) >= self.max_states:
            self._evict_one()
        st = self._states[key] = RankStageState()
        return st

    def peek(self, key: StateKey) -> RankStageState | None:
        return self._states.get(key)

    def _evict_one(self) -> None:
        for k, st in self._states.items():
            if not st.active:
                del self._states[k]
                self.evicted += 1
                return
        k, _ = self._states.popitem(last=False)
        self._active.pop(k, None)
        self.evicted += 1

    def set_active(self, key: StateKey, st: RankStageState, alert: Verdict | None) -> None:
        st.alert = alert
        if alert is None:
            self._active.pop(key, None)
        else:
            self._active[key] = st

    def active_alerts(self) -> list[Verdict]:
        return [st.alert for st in self._active.values() if st.alert is not None]

    def drop_cohort(self, job: str, cohort: str) -> int:
        keys = [k for k in self._states if k[0] == job and k[1] == cohort]
        for k in keys:
            del self._states[k]
            self._active.pop(k, None)
        return len(keys)

    def __len__(self) -> int:
        return len(self._states)

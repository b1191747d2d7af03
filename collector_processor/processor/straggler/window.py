"""Step-aligned windows (index = step // K) and wall-clock windows (integer ns from a per-cohort anchor).

A window holds, per stage and rank, the per-step samples of that rank. Windows close in index order; the
highest closed index is a fence: a sample for a window at or below it is ``late`` (counted, never re-judged).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KIND_STEP = "step"
KIND_WALL = "wall"


@dataclass(slots=True)
class RankCell:
    """One rank's samples of one stage in one window."""

    dev: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    # the step of each dev sample (step-aligned windows only): per-step comparison (sequential.py)
    dev_steps: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Window:
    kind: str
    index: int
    created_s: float
    start: int  # first step (or wall index)
    end: int  # last step, inclusive (or wall index)
    successor_s: float | None = None  # when the first sample of a later window arrived
    max_step: int | None = None
    start_ns: int = 0
    end_ns: int = 0
    cells: dict[str, dict[int, RankCell]] = field(default_factory=dict)

    def cell(self, stage: str, rank: int) -> RankCell:
        ranks = self.cells.get(stage)
        if ranks is None:
            ranks = self.cells[stage] = {}
        c = ranks.get(rank)
        if c is None:
            c = ranks[rank] = RankCell()
        return c

    def ranks(self) -> set[int]:
        out: set[int] = set()
        for ranks in self.cells.values():
            out.update(ranks)
        return out


@dataclass(slots=True)
class WindowSet:
    """Open windows of one cohort in one index space (step or wall clock)."""

    kind: str
    open: dict[int, Window] = field(default_factory=dict)
    closed_through: int | None = None  # fence: every index <= this is closed
    anchor_ns: int | None = None  # wall clock only: the cohort's first observation

    def is_closed(self, index: int) -> bool:
        return self.closed_through is not None and index <= self.closed_through

    def get_or_open(self, index: int, now_s: float, window_steps: int) -> tuple[Window, bool]:
        w = self.open.get(index)
        if w is not None:
            return w, False
        if self.kind == KIND_STEP:
            w = Window(self.kind, index, now_s, index * window_steps, index * window_steps + window_steps - 1)
        else:
            w = Window(self.kind, index, now_s, index, index)
        for other in self.open.values():
            if other.index < index and other.successor_s is None:
                other.successor_s = now_s
        self.open[index] = w
        return w, True

    def pop_through(self, index: int) -> list[Window]:
        """Remove and return every open window with index <= ``index`` (ascending) and move the fence."""
        out = sorted((w for i, w in self.open.items() if i <= index), key=lambda w: w.index)
        for w in out:
            del self.open[w.index]
        if self.closed_through is None or index > self.closed_through:
            self.closed_through = index
        return out

    def oldest(self) -> int | None:
        return min(self.open) if self.open else None


def step_index(step: int, window_steps: int) -> int:
    return step // window_steps


def wall_index(start_ns: int, anchor_ns: int, window_ns: int) -> int:
    """Integer arithmetic only: no float boundary can merge or split windows."""
    return (start_ns - anchor_ns) // window_ns


def due_by_progress(ws: WindowSet, rank_max_index: list[int]) -> int | None:
    """Highest open index every listed rank has moved beyond (None when none is)."""
    if not ws.open or not rank_max_index:
        return None
    floor = min(rank_max_index)
    due = [i for i in ws.open if i < floor]
    return max(due) if due else None


def due_by_time(ws: WindowSet, now_s: float, grace_s: float, wall_window_s: float) -> int | None:
    """Highest open index whose grace expired (a later window began grace_s ago), or, for wall-clock
    windows, whose own span plus grace has passed."""
    due: int | None = None
    for i, w in ws.open.items():
        expired = w.successor_s is not None and now_s - w.successor_s >= grace_s
        if not expired and ws.kind == KIND_WALL:
            expired = now_s - w.created_s >= wall_window_s + grace_s
        if expired and (due is None or i > due):
            due = i
    return due

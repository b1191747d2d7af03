"""Step-aligned windows (index = step // K) and wall-clock windows (integer ns from a per-cohort anchor).

A window holds, per stage and rank, the per-step samples of that rank. Windows close in index order; the
highest closed index is a fence: a sample for a window at or below it is ``late`` (counted, never re-judged).

The grace a window waits for a silent rank after a later window opened adapts to the arrival lag measured
in its window set (``WindowSet.grace``): ranks that export in batches (the OTel SDK's schedule delay) deliver
a step seconds after another rank's batch opened later windows, whatever the step time.

What a window holds is bounded by the data's identity, not by who sends it: one step summary per (rank,
step) (``Window.first_summary``), at most ``max_samples_per_step`` stage-span samples per (rank, step, stage)
(``RankCell.admit``), and a window lives at most ``window_max_age_s``, or ``window_idle_s`` past its last
accepted sample (``due_by_age``), however much repeated data keeps arriving for it.

Step summaries (one row per rank-step: every timer of the step) are queued per rank as they come and spread
into the cells when the window closes (``Window.settle``), column by column: a window's rows of one rank
have the same timers, so each cell gets its values in one ``extend`` instead of an append per rank-step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

KIND_STEP = "step"
KIND_WALL = "wall"
LAG_WINDOWS = 64  # closed windows (and late samples) whose arrival lag sets a window set's grace
GRACE_LAG_FACTOR = 1.5  # the grace covers the largest of those lags this many times over


@dataclass(slots=True)
class RankCell:
    """One rank's samples of one stage in one window."""

    dev: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    # the step of each dev sample (step-aligned windows only): per-step comparison (sequential.py)
    dev_steps: list[int] = field(default_factory=list)
    # stage-span samples admitted per step (None: wall-clock window); stays None on the summary path
    counts: dict[int | None, int] | None = None

    def admit(self, step: int | None, cap: int) -> bool:
        """One more stage-span sample of ``step``, unless the cell holds ``cap`` of that step already."""
        counts = self.counts
        if counts is None:
            counts = self.counts = {}
        n = counts.get(step, 0)
        if n >= cap:
            return False
        counts[step] = n + 1
        return True


@dataclass(slots=True)
class SummaryRows:
    """One rank's step summaries in one window, not yet in the cells. Every row has the entries ``stages``
    (all admitted to the cohort), so the rows are columns once transposed."""

    stages: Sequence[str]
    steps: list[int] = field(default_factory=list)
    tokens: list[int | None] = field(default_factory=list)
    dev: list[Sequence[float | None]] = field(default_factory=list)
    host: list[Sequence[float | None]] = field(default_factory=list)


@dataclass(slots=True)
class Window:
    kind: str
    index: int
    created_s: float
    start: int  # first step (or wall index)
    end: int  # last step, inclusive (or wall index)
    successor_s: float | None = None  # when the first sample of a later window arrived
    last_s: float = 0.0  # when the latest sample was accepted (0: none yet)
    lag_s: float = 0.0  # the latest acceptance after successor_s: how much grace this window needed
    max_step: int | None = None
    start_ns: int = 0
    end_ns: int = 0
    cells: dict[str, dict[int, RankCell]] = field(default_factory=dict)
    rows: dict[int, SummaryRows] = field(default_factory=dict)  # queued step summaries per rank
    summarized: dict[int, int] = field(default_factory=dict)  # rank -> bit (step - start) per summary taken

    def first_summary(self, rank: int, step: int) -> bool:
        """Take the rank's summary of ``step`` (a step of this window); False when one was taken already."""
        bit = 1 << (step - self.start)
        taken = self.summarized.get(rank, 0)
        if taken & bit:
            return False
        self.summarized[rank] = taken | bit
        return True

    def held(self) -> int:
        """Values held: the cells' device and host samples and the queued summaries' values."""
        n = sum(len(c.dev) + len(c.host) for ranks in self.cells.values() for c in ranks.values())
        for rows in self.rows.values():
            n += sum(len(v) - v.count(None) for v in (*rows.dev, *rows.host))
        return n

    def cell(self, stage: str, rank: int) -> RankCell:
        """The rank's cell of ``stage`` (created: the rank is present in the window even without a value)."""
        if self.rows:  # queued summaries arrived first: theirs go in first
            self.settle()
        return self._cell(stage, rank)

    def took(self, step: int | None, start_unix_ns: int, end_unix_ns: int, now_s: float) -> None:
        """A sample of ``step`` spanning ``start_unix_ns``-``end_unix_ns`` was accepted at ``now_s``: the window's
        last step, time span, idle clock and arrival lag (what the grace must cover: ``WindowSet.grace``)."""
        self.last_s = now_s
        if self.successor_s is not None and now_s - self.successor_s > self.lag_s:
            self.lag_s = now_s - self.successor_s
        if step is not None and (self.max_step is None or step > self.max_step):
            self.max_step = step
        if self.start_ns == 0 or start_unix_ns < self.start_ns:
            self.start_ns = start_unix_ns
        if end_unix_ns > self.end_ns:
            self.end_ns = end_unix_ns

    def add_sample(self, stage: str, rank: int, step: int | None, dev: float | None, host: float | None,
                   tokens: int | None, cap: int) -> bool:
        """One stage-span sample into its cell; False when the cell holds ``cap`` samples of ``step`` already
        (``RankCell.admit``: the rank is present all the same)."""
        cell = self.cell(stage, rank)
        if not cell.admit(step, cap):
            return False
        if dev is not None:
            cell.dev.append(dev)
            if step is not None:
                cell.dev_steps.append(step)
        if host is not None:
            cell.host.append(host)
        if tokens is not None:
            cell.tokens.append(tokens)
        return True

    def add_entries(self, rank: int, step: int, tokens: int | None, stages: Sequence[str],
                    dev: Sequence[float | None], host: Sequence[float | None], admitted: Sequence[bool]) -> int:
        """The ``admitted`` entries of one rank-step summary straight into their cells (a cohort at its stage cap:
        the summary cannot be queued whole); the entries with a value, which are the ones accepted."""
        accepted = 0
        for i, stage in enumerate(stages):
            if not admitted[i]:
                continue
            cell = self.cell(stage, rank)
            d = dev[i]
            h = host[i]
            if d is None and h is None:
                continue  # non-finite: present, no value (already counted by the decoder)
            if d is not None:
                cell.dev.append(d)
                cell.dev_steps.append(step)
            if h is not None:
                cell.host.append(h)
            if tokens is not None:
                cell.tokens.append(tokens)
            accepted += 1
        return accepted

    def _cell(self, stage: str, rank: int) -> RankCell:
        ranks = self.cells.get(stage)
        if ranks is None:
            ranks = self.cells[stage] = {}
        c = ranks.get(rank)
        if c is None:
            c = ranks[rank] = RankCell()
        return c

    def queued(self, rank: int) -> Sequence[str] | None:
        """The entries of the rank's queued summaries (None: none queued)."""
        rows = self.rows.get(rank)
        return rows.stages if rows is not None else None

    def queue_summary(self, rank: int, stages: Sequence[str], step: int, tokens: int | None,
                      dev: Sequence[float | None], host: Sequence[float | None]) -> None:
        """Queue one rank-step summary whose entries (``stages``, parallel to ``dev`` and ``host``) are all
        admitted. A rank's summary with other entries than its queued ones first settles the queue."""
        rows = self.rows.get(rank)
        if rows is None or rows.stages != stages:
            if rows is not None:
                self.settle()
            rows = self.rows[rank] = SummaryRows(stages)
        rows.steps.append(step)
        rows.tokens.append(tokens)
        rows.dev.append(dev)
        rows.host.append(host)

    def settle(self) -> None:
        """Spread the queued summaries into the cells, as adding them entry by entry in arrival order would
        (cells created, and values appended, in the same order): rank by rank in the order ranks first
        queued, which is the arrival order of first appearances because each rank's rows share one list of
        entries. Per entry: a device time with its step, a host time, and the rank-step's tokens when the
        entry had a value at all (an entry with neither still makes the rank present)."""
        pending, self.rows = self.rows, {}
        for rank, rows in pending.items():
            steps = rows.steps
            all_tokens = [t for t in rows.tokens if t is not None]
            for stage, dev, host in zip(rows.stages, zip(*rows.dev), zip(*rows.host), strict=True):
                ranks = self.cells.get(stage)
                if ranks is None:
                    ranks = self.cells[stage] = {}
                c = ranks.get(rank)
                if c is None and None not in dev and None not in host:  # the common case: a new, full cell
                    ranks[rank] = RankCell(list(dev), list(host), all_tokens.copy(), steps.copy())
                    continue
                if c is None:
                    c = ranks[rank] = RankCell()
                if None not in dev:
                    c.dev.extend(dev)
                    c.dev_steps.extend(steps)
                else:
                    for d, t in zip(dev, steps, strict=True):
                        if d is not None:
                            c.dev.append(d)
                            c.dev_steps.append(t)
                if None not in host:  # every entry has a value: each adds its tokens
                    c.host.extend(host)
                    c.tokens.extend(all_tokens)
                    continue
                for d, h, tok in zip(dev, host, rows.tokens, strict=True):
                    if h is not None:
                        c.host.append(h)
                    if tok is not None and (d is not None or h is not None):
                        c.tokens.append(tok)

    def ranks(self) -> set[int]:
        if self.rows:
            self.settle()
        out: set[int] = set()
        for ranks in self.cells.values():
            out.update(ranks)
        return out


@dataclass(slots=True)
class WindowSet:
    """Open windows of one cohort in one index space (step or wall clock), and the arrival lag measured in it:
    how long after a later window opened the samples of a window still arrived (``lags``: one value per closed
    window and per late sample, the latest ``LAG_WINDOWS``)."""

    kind: str
    open: dict[int, Window] = field(default_factory=dict)
    closed_through: int | None = None  # fence: every index <= this is closed
    anchor_ns: int | None = None  # wall clock only: the cohort's first observation
    lags: deque[float] = field(default_factory=lambda: deque(maxlen=LAG_WINDOWS))
    # index -> when its successor opened (or it closed), for the latest closed windows: a late sample's lag
    closed_at: OrderedDict[int, float] = field(default_factory=OrderedDict)

    def get_or_open(self, index: int, now_s: float, window_steps: int) -> Window:
        w = self.open.get(index)
        if w is not None:
            return w
        if self.kind == KIND_STEP:
            w = Window(self.kind, index, now_s, index * window_steps, index * window_steps + window_steps - 1)
        else:
            w = Window(self.kind, index, now_s, index, index)
        for other in self.open.values():
            if other.index < index and other.successor_s is None:
                other.successor_s = now_s
        self.open[index] = w
        return w

    def fenced(self, index: int, now_s: float) -> bool:
        """``index`` is closed (at or below the fence): a sample of it is late, and its lag joins ``lags`` when the
        window is recent (``late``)."""
        if self.closed_through is None or index > self.closed_through:
            return False
        self.late(index, now_s)
        return True

    def full(self, max_open: int) -> int | None:
        """The oldest open index when ``max_open`` windows are open (a new one needs it closed first), else None."""
        return min(self.open) if len(self.open) >= max_open else None

    def drop_beyond(self, ceiling: int) -> int:
        """Drop, unjudged, the open windows beyond ``ceiling`` (step quarantine); how many."""
        far = [i for i in self.open if i > ceiling]
        for i in far:
            del self.open[i]
        return len(far)

    def fence_back(self, ceiling: int) -> bool:
        """A fence beyond ``ceiling`` (moved by windows beyond the range) back to the latest window closed within
        it; True when it moved."""
        if self.closed_through is None or self.closed_through <= ceiling:
            return False
        self.closed_through = max((i for i in self.closed_at if i <= ceiling), default=None)
        return True

    def pop_through(self, index: int, now_s: float | None = None) -> list[Window]:
        """Remove and return every open window with index <= ``index`` (ascending) and move the fence; each
        closed window's arrival lag joins ``lags``."""
        out = sorted((w for i, w in self.open.items() if i <= index), key=lambda w: w.index)
        for w in out:
            del self.open[w.index]
            w.settle()
            self.lags.append(w.lag_s)
            since = w.successor_s if w.successor_s is not None else now_s
            if since is not None:
                self.closed_at[w.index] = since
                if len(self.closed_at) > LAG_WINDOWS:
                    self.closed_at.popitem(last=False)
        if self.closed_through is None or index > self.closed_through:
            self.closed_through = index
        return out

    def late(self, index: int, now_s: float) -> None:
        """A sample of the closed window ``index`` arrived: its lag joins ``lags`` when the window is recent."""
        since = self.closed_at.get(index)
        if since is not None:
            self.lags.append(now_s - since)

    @property
    def lag_max(self) -> float:
        """The largest recent arrival lag (0 before any)."""
        return max(self.lags, default=0.0)

    def grace(self, least_s: float, most_s: float) -> float:
        """Grace of this window set: ``GRACE_LAG_FACTOR`` x the largest recent arrival lag, at most ``most_s``
        (``grace_max_s``) and at least ``least_s`` (``grace_s``, which wins when larger)."""
        return max(least_s, min(most_s, GRACE_LAG_FACTOR * self.lag_max))


def due_by_progress(ws: WindowSet, rank_max_index: list[int]) -> int | None:
    """Highest open index every listed rank has moved beyond (None when none is)."""
    if not ws.open or not rank_max_index:
        return None
    floor = min(rank_max_index)
    due = [i for i in ws.open if i < floor]
    return max(due) if due else None


def due_by_age(ws: WindowSet, now_s: float, idle_s: float, max_age_s: float) -> int | None:
    """Highest open index whose window took no sample for ``idle_s`` or opened ``max_age_s`` ago: what
    nothing else closes (a job that stopped, a window that never completes while data keeps coming)."""
    due: int | None = None
    for i, w in ws.open.items():
        if (now_s - (w.last_s or w.created_s) >= idle_s or now_s - w.created_s >= max_age_s) \
                and (due is None or i > due):
            due = i
    return due


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

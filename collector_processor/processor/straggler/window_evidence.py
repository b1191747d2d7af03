"""What the rules judge one closed window of one cohort on, and what the judgement gives back.

``WindowEvidence``: what every judgement of the window shares (``Detector.judge`` builds it), with the stage
tolerances (``noise_tolerance``) and the gap floors (``floor``) of the window. ``StageEvidence``: one judged stage.
``Comparison``: one rank's value against its reference, as the rules decide on it and a verdict reports it.
``WindowOutcome``: the verdicts and the evidence the window leaves for the metrics and ``culprit.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import otel_straggler_schema as s
from collector_processor.processor.straggler.cohort import Cohort
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.evidence import DEVICE, RankStat, Tolerances, Views
from collector_processor.processor.straggler.intermittent import IntResult
from collector_processor.processor.straggler.model import Verdict
from collector_processor.processor.straggler.pair import PairWindow
from collector_processor.processor.straggler.sequential import SeqResult
from collector_processor.processor.straggler.statistics import noise_raised_tolerance, pooled_relative_sigma
from collector_processor.processor.straggler.window import Window


@dataclass(slots=True)
class WindowOutcome:
    verdicts: list[Verdict] = field(default_factory=list)
    # (rank, stage_group, measurement) -> seconds (sum of the group's stage statistics)
    rank_group_seconds: dict[tuple[int, str, str], float] = field(default_factory=dict)
    # rank -> worst deviation over judged stages
    rank_deviation: dict[int, float] = field(default_factory=dict)
    # alerts refreshed or cleared in this window: (rank, stage) -> alert or None
    alerts: dict[tuple[int, str], Verdict | None] = field(default_factory=dict)
    # (rank, stage) -> the rank's excess over its comparable peers' median, relative, and whether it is beyond
    # the stage's tolerance and floor (evidence for culprit.py: who is slow in a stage alone)
    stage_excess: dict[tuple[int, str], tuple[float, bool]] = field(default_factory=dict)
    # (rank, stage) where the rank waited in a model-parallel collective (mp_wait): evidence for culprit.py
    # that the rank waits for a member of its group, so it is not the group's culprit
    mp_waits: set[tuple[int, str]] = field(default_factory=set)
    # (collective stage, ring) -> (ms lost per step beyond the cohort's baseline, 0 within it; the rank the
    # evidence names or None): the collective signal (collective_signal.py)
    collective_lost: dict[tuple[str, str], tuple[float, int | None]] = field(default_factory=dict)


def noise_tolerance(cfg: Config, per: dict[int, RankStat], need: int | None = None) -> Tolerances:
    """Device and host tolerance of one stage in one window: ``tolerance``, raised to ``noise_z`` standard errors
    of a rank's window median when the cohort's step-to-step noise is larger. The per-step sigma is estimated
    robustly within each rank (``pooled_relative_sigma``: spikes and a slow rank do not move it); the standard
    error of a median of k samples is 1.2533 sigma / sqrt(k). A +5 % fault is found wherever the measured noise
    allows it; a noisier timing never convicts on noise (docs/detection-defaults.md). ``need``: the ranks the
    sigma is measured on (``min_cohort_size``)."""
    if cfg.noise_z <= 0:
        return Tolerances(cfg.tolerance, lambda: cfg.tolerance)
    need = cfg.min_cohort_size if need is None else need

    def raised(sigma: float | None) -> float:
        return noise_raised_tolerance(cfg.tolerance, cfg.noise_z, sigma, cfg.window_steps)

    return Tolerances(raised(pooled_relative_sigma((st.dev_used or st.dev_samples for st in per.values()), need)),
                      lambda: raised(pooled_relative_sigma((st.host_samples for st in per.values()), need)))


@dataclass(slots=True)
class WindowEvidence:
    """What every judgement of one closed window shares."""

    cfg: Config
    cohort: Cohort
    window: Window
    out: WindowOutcome
    step: int | None  # the window's last observed step (None: wall-clock window)
    period_ms: float | None
    world_size: int
    collectives: dict[str, dict[int, float]]  # collective group -> rank -> ms
    rank_tokens: dict[int, float]  # warm rank -> median tokens per step
    tok_median: float | None  # the cohort's median of rank_tokens
    uniform: bool  # every warm rank's work comparable with every other's
    now_ns: int
    stats: dict[str, dict[int, RankStat]] = field(default_factory=dict)  # every stage's warm ranks
    tolerances: dict[str, Tolerances] = field(default_factory=dict)  # stage -> its tolerances, once computed
    tokens_vary: bool = False  # some warm ranks' tokens differ or vary beyond workload_tolerance (per_unit)
    traces: dict[int, bytes] = field(default_factory=dict)  # trace block -> trace id of ``step``, once computed

    def trace_of(self, rank: int) -> bytes:
        """The trace of the window's last step that holds ``rank``'s spans (its block's: ``s.trace_block``); b""
        for a wall-clock window."""
        if self.step is None:
            return b""
        block = s.trace_block(rank)
        tid = self.traces.get(block)
        if tid is None:
            tid = s.trace_id_for_step(self.cohort.job, self.step, s.cohort_run(self.cohort.key), block).to_bytes(
                16, "big")
            self.traces[block] = tid
        return tid

    def tolerance(self, stage: str, kind: str) -> float:
        """The noise tolerance of any stage of the window, of ``kind`` (computed once)."""
        tols = self.tolerances.get(stage)
        if tols is None:
            tols = self.tolerances[stage] = noise_tolerance(self.cfg, self.stats.get(stage, {}))
        return tols.of(kind)

    def floor(self, kind: str, ref_ms: float) -> float:
        """Absolute gap floor of one comparison: the host floor, or for a device comparison of a stage of
        at least ``device_min_stage_ms`` (not launch-bound, precise) the device floor."""
        cfg = self.cfg
        if kind == DEVICE and ref_ms >= cfg.device_min_stage_ms:
            return cfg.device_floor_ms
        return cfg.absolute_floor_ms


class StageEvidence:
    """One judged stage in the window: every warm rank's statistic, the stage's tolerances, each rank's
    sequential evidence, and the values sorted for references (built once, on first use)."""

    __slots__ = ("_views", "group", "intm", "name", "pair", "per", "per_unit", "seq", "tols", "uniform")

    def __init__(self, name: str, group: str, per: dict[int, RankStat], uniform: bool, tols: Tolerances,
                 per_unit: bool = False) -> None:
        self.name = name
        self.per_unit = per_unit  # the samples are brought to the cohort's median tokens (per_unit.py)
        self.group = group
        self.per = per
        self.uniform = uniform  # every rank's work comparable with every other's
        self.tols = tols
        self.seq: dict[int, SeqResult] = {}
        self.intm: dict[int, IntResult] = {}  # each rank's intermittent evidence (intermittent.py)
        self.pair: PairWindow | None = None  # a 2-rank cohort's comparison (pair.py)
        self._views: Views | None = None

    @property
    def views(self) -> Views:
        if self._views is None:
            self._views = Views(self.per)
        return self._views

    def others(self, rank: int) -> list[int]:
        return [p for p in self.per if p != rank]


@dataclass(slots=True)
class Comparison:
    """The rank's value against its reference, as a verdict reports it; the fields after ``size`` are what
    the rules decide on. A comparison that could not be made leaves the reference (or everything) None."""

    measurement: str | None = None  # DEVICE or HOST; None: nothing usable was compared
    value: float | None = None
    ref_rank: int | None = None
    ref_ms: float | None = None
    deviation: float | None = None  # (value - reference) / reference; inf against a zero reference
    size: int = 0  # effective cohort: the rank and its comparable peers with a sample of this kind
    gap: float = 0.0  # value - reference, ms
    tolerance: float = 0.0  # the deviation beyond which the window is slow
    host_stall: bool = False  # the host comparison replaced the device one (host_stall)
    peers: list[int] | None = None  # the comparable peers (None: every other rank)
    own: bool = False  # deviation, gap and tolerance are this comparison's own (pair), not the window medians'

    @property
    def slow(self) -> bool:
        return self.deviation is not None and self.deviation > self.tolerance

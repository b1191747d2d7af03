"""A cohort's rings of the collective signal (``collective_signal.py``): per collective stage its baseline and its
signal's state, kept on the cohort (``Cohort.rings``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from collector_processor.processor.straggler.evidence import DEVICE
from collector_processor.processor.straggler.model import Verdict


@dataclass(slots=True)
class Ring:
    """One cohort's ring of one collective stage."""

    baseline: deque[float]
    kind: str = DEVICE
    streak: int = 0  # consecutive lost windows
    par: int = 0  # consecutive windows not lost while the signal is open
    last_index: int | None = None
    open: Verdict | None = None  # the signal's latest event while it is open
    said_index: int = 0  # window of the latest event


@dataclass(slots=True)
class Rings:
    """A cohort's rings, one per collective stage (bounded by ``max_stages``)."""

    by_stage: dict[str, Ring] = field(default_factory=dict)

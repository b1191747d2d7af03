"""The rules of one rank's judgement of one stage, one module each behind one interface (``judgement.Rule``: a
``name`` and ``judge``), run in the order of ``RULES``: the first that decides ends the judgement. A new rule is a
module here, its line in ``RULES``, and its knobs in ``config.py`` and ``docs/detector.md`` (the same name).
``ABSENT`` judges a rank with state for a stage it sent nothing of."""

from __future__ import annotations

from collector_processor.processor.straggler.judgement import Rule
from collector_processor.processor.straggler.rules import (
    absolute_floor,
    collective_wait,
    device_samples_missing,
    host_contention,
    host_stall,
    hysteresis,
    intermittent_excess,
    min_cohort,
    missing_rank,
    mp_wait,
    non_finite,
    pair,
    record,
    recovery,
    reference,
    sequential_excess,
    window_excess,
    workload,
)

RULES: tuple[Rule, ...] = (
    non_finite,  # uncertain/non_finite_sample
    device_samples_missing,  # uncertain/missing_samples
    workload,  # uncertain/workload_incomparable
    reference,  # the comparison (never decides)
    pair,  # uncertain/pair_ambiguous
    min_cohort,  # uncertain/cohort_below_min_size
    host_stall,  # the host comparison instead (never decides)
    absolute_floor,  # uncertain/below_absolute_floor
    collective_wait,  # uncertain/collective_wait
    mp_wait,  # uncertain/collective_wait
    host_contention,  # uncertain/host_contention
    record,  # evidence for the metrics and culprit.py (never decides)
    intermittent_excess,  # straggler/intermittent_excess, its hold and recovery
    window_excess,  # straggler/slower_than_reference (persistence)
    sequential_excess,  # straggler/persistent_excess
    hysteresis,  # an alert holds
    recovery,  # recovered/within_tolerance
)
ABSENT: Rule = missing_rank

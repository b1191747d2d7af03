"""Rejections said once: a rank's duplicate rank-steps (one line per job and rank at most every
``DUPLICATE_LOG_EVERY_S``), and a high share of late samples (one warning naming the cause and the fix at most every
``LATE_LOG_EVERY_S``: ranks delivering too far apart, or a re-run under the same job and run id). Every rejection is
counted in ``spans_rejected_total`` whatever is said."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

import otel_straggler_schema as s
from collector_processor.processor.straggler.cohort import Cohort
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.model import StepSummary

DUPLICATE_LOG_EVERY_S = 600.0  # one line per (job, rank) at most this often about its duplicate rank-steps
DUPLICATE_LOG_KEYS = 1024  # (job, rank) pairs remembered for that (least recently logged forgotten first)
# Late rejections are rated per period; past the rate (and the count) a warning names the fix, at most once
# per LATE_LOG_EVERY_S. A few late samples are normal (a rank restarting, a retried request).
LATE_PERIOD_S = 60.0
LATE_WARN_RATE = 0.01
LATE_WARN_MIN = 20
LATE_LOG_EVERY_S = 600.0
# A late step this many windows behind what its own rank already sent did not lag: the rank's steps started again
# (a re-run or a restart from a checkpoint under the same job and run id). A retried request is 1-2 windows back.
RERUN_BEHIND_WINDOWS = 2


class RejectionLog:
    def __init__(self, config: Config, counters: dict[str, int], log: logging.Logger) -> None:
        self.cfg = config
        self.c = counters
        self._log = log
        # (job, rank) -> [when its last duplicate line was logged, duplicates since]
        self._duplicates: OrderedDict[tuple[str, int], list[float]] = OrderedDict()
        # late rejections in the current period: [period start, samples and summaries offered, late, late ones
        # of steps far behind their own rank's (its steps started again: a re-run, RERUN_BEHIND_WINDOWS)]
        self._period: list[float] = [0.0, 0.0, 0.0, 0.0]
        self._far_late = 0  # such samples in the request being processed (added to the period by rate_late)
        self._rerun_job = ""  # the job of the latest such sample
        self._late_logged_s: float | None = None

    def far_late(self, job: str) -> None:
        """A late sample of a step more than ``RERUN_BEHIND_WINDOWS`` windows behind its own rank's latest."""
        self._far_late += 1
        self._rerun_job = job

    def duplicate(self, summ: StepSummary, now: float) -> None:
        """Say that a rank's rank-step was dropped as a duplicate: at most once per (job, rank) and
        ``DUPLICATE_LOG_EVERY_S``, with the count since its last line (every one is counted in
        ``spans_rejected_total{reason="duplicate"}``)."""
        key = (summ.job, summ.rank)
        seen = self._duplicates.get(key)
        if seen is not None:
            seen[1] += 1
            if now - seen[0] < DUPLICATE_LOG_EVERY_S:
                return
            self._duplicates.move_to_end(key)
        else:
            seen = self._duplicates[key] = [now, 1]
            if len(self._duplicates) > DUPLICATE_LOG_KEYS:
                self._duplicates.popitem(last=False)
        self._log.warning("job %s rank %d: %d duplicate rank-step(s) dropped since the last such line, the latest "
                          "of step %d (the same rank and step sent again, whatever its span id); counted in "
                          "%s{reason=\"duplicate\"}", summ.job, summ.rank, int(seen[1]), summ.step,
                          s.M_SPANS_REJECTED)
        seen[0], seen[1] = now, 0

    def rate_late(self, now: float, offered: int, late: int, cohorts: Iterable[Cohort]) -> None:
        """Count this request's offered samples and late rejections in the current period; when the period's
        late share is high, say so and how to fix it (``LATE_*``)."""
        period = self._period
        if now - period[0] >= LATE_PERIOD_S:
            period[0], period[1], period[2], period[3] = now, 0.0, 0.0, 0.0
        period[1] += offered
        period[2] += late
        period[3] += self._far_late
        self._far_late = 0
        if not late or period[2] < LATE_WARN_MIN or period[2] < LATE_WARN_RATE * period[1]:
            return
        if self._late_logged_s is not None and now - self._late_logged_s < LATE_LOG_EVERY_S:
            return
        self._late_logged_s = now
        cfg = self.cfg
        if period[3] >= period[2] / 2:
            self._log.warning(
                "%d of %d step samples (%.1f %%) since %.0f s ago were rejected as late (%s{reason=\"late\"}), %d "
                "of them from steps more than %d windows behind what their own rank had already sent, latest of "
                "job %r: its steps started again from a lower number, so this is a re-run (or a restart "
                "from a checkpoint) under the same job id and run id as the run already judged, not a slow "
                "delivery. Each launch needs a run of its own: the emitter derives %s from the launch, except "
                "across hosts with a fixed --master-port; set OTEL_STRAGGLER_RUN_ID (or a new "
                "OTEL_STRAGGLER_JOB_ID) per launch.",
                int(period[2]), int(period[1]), 100.0 * period[2] / max(period[1], 1.0), now - period[0],
                s.M_SPANS_REJECTED, int(period[3]), RERUN_BEHIND_WINDOWS, self._rerun_job, s.RES_RUN_ID)
            return
        held = list(cohorts)
        lag = max((ch.steps.lag_max for ch in held), default=0.0)
        grace = max((ch.steps.grace(cfg.grace_s, cfg.grace_max_s) for ch in held), default=cfg.grace_s)
        self._log.warning(
            "%d of %d step samples (%.1f %%) since %.0f s ago arrived after their window had closed and were "
            "rejected as late (%s{reason=\"late\"}): ranks deliver their steps too far apart. Arrival lag "
            "measured: %.1f s, grace now %.1f s (grace_s %.1f s, at most grace_max_s %.1f s); windows closed "
            "early at max_open_windows (%d): %d. Fix: export more often than that lag: on the ranks leave "
            "OTEL_BSP_SCHEDULE_DELAY unset (the emitter fits it to the step time) or set it well below %.0f ms; "
            "or raise processors.straggler grace_max_s and max_open_windows (docs/detector.md, Windows).",
            int(period[2]), int(period[1]), 100.0 * period[2] / max(period[1], 1.0), now - period[0],
            s.M_SPANS_REJECTED, lag, grace, cfg.grace_s, cfg.grace_max_s, cfg.max_open_windows,
            self.c["windows_closed_early"], 1000.0 * cfg.grace_max_s / 2)

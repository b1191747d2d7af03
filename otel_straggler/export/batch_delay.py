"""The batch span processor's schedule delay, fitted to the measured step time (unless ``OTEL_BSP_SCHEDULE_DELAY``
is set: then that, always).

Why: spans wait in the batch queue up to the schedule delay (the SDK's default is 5 s), so two ranks deliver
the same step up to one delay (plus a readout period) apart. The straggler collector closes a window ``grace_s``
after the first sample of a later window arrived, and holds at most ``max_open_windows`` windows of
``window_steps`` steps; a rank whose summaries arrive later than either allows is rejected as ``late``. The rule
takes the collector's ``grace_s`` (5 s) and ``window_steps`` (5) defaults and assumes only 8 open windows (its
default holds 64), so it also fits a collector configured down to 8: with ~70 ms steps 8 open windows span
2.8 s, less than the SDK's 5 s delay.

Rule: with ``s`` the median step period of the rank (last ``REFIT_STEPS`` closed steps) and ``r`` the readout
period, the delivery spread between ranks (at most delay + ``r``) may use half of each allowance:

* grace: rank B's last step of a window is late when it arrives more than ``grace_s`` + ``s`` after rank A's
  first step of the next window (A's step ended one period later), so delay + r <= ``grace_s`` / 2 + s;
* open windows: delay + r <= (``max_open_windows`` / 2) x ``window_steps`` x s (20 steps);

    delay = clamp(min(2.5 seconds + s, 20 x s) - r, 200 ms, 5000 ms)

With the default 500 ms readout period: 70 ms steps 0.9 s; 125 ms: 2.0 s; 1 s: 3.0 s; 3 s and longer: the SDK's
5 s. Below 35 ms steps the delay is at its 200 ms minimum and the spread (0.7 s) takes more than half of the
open windows, all of them below ~18 ms steps (``readout_interval_ms`` lower then). Until a step
period is measured (the first ``FIRST_FIT_STEPS`` steps) the delay is the minimum; it is fitted then, and
again every ``REFIT_STEPS`` closed steps when the fit moved by more than ``HYSTERESIS`` either way.
"""

from __future__ import annotations

import statistics
from collections import deque

# The straggler collector's defaults (collector_processor/processor/straggler/config.py; a test checks them).
# The open-window count is a lower bound on the collector's default, not the default itself.
COLLECTOR_GRACE_S = 5.0
COLLECTOR_WINDOW_STEPS = 5
COLLECTOR_MAX_OPEN_WINDOWS = 8  # assumed: the collector's default holds more (64), so the rule also fits one set to 8
SHARE = 0.5  # of the grace and of the open windows the delivery spread may take

MIN_DELAY_MS = 200
MAX_DELAY_MS = 5000  # the SDK's default: never longer
FIRST_FIT_STEPS = 4
REFIT_STEPS = 16
HYSTERESIS = 1.25


def fitted_delay_ms(step_s: float | None, readout_s: float) -> int:
    """The schedule delay for a step period ``step_s`` (None: not measured yet: the minimum)."""
    if step_s is None or step_s <= 0.0:
        return MIN_DELAY_MS
    grace_bound = COLLECTOR_GRACE_S * SHARE + step_s
    window_bound = COLLECTOR_MAX_OPEN_WINDOWS * SHARE * COLLECTOR_WINDOW_STEPS * step_s
    ms = (min(grace_bound, window_bound) - readout_s) * 1000.0
    return int(min(MAX_DELAY_MS, max(MIN_DELAY_MS, ms)))


class DelayFit:
    """Fed every closed step (step number, end time); says when the delay should change."""

    def __init__(self, readout_s: float) -> None:
        self.readout_s = float(readout_s)
        self.delay_ms = fitted_delay_ms(None, self.readout_s)
        self._periods: deque[float] = deque(maxlen=REFIT_STEPS)
        self._last: tuple[int, int] | None = None
        self._since_fit = 0
        self._fitted = False

    def observe(self, step: int, end_ns: int) -> int | None:
        """A new delay in ms when it should change now, else None. The caller reports a change it made
        with ``applied`` (one it could not make now is proposed again at the next fit)."""
        last, self._last = self._last, (step, end_ns)
        if last is None or step <= last[0] or end_ns <= last[1]:
            return None
        self._periods.append((end_ns - last[1]) / 1e9 / (step - last[0]))
        self._since_fit += 1
        if self._since_fit < (REFIT_STEPS if self._fitted else FIRST_FIT_STEPS):
            return None
        self._fitted, self._since_fit = True, 0
        new = fitted_delay_ms(statistics.median(self._periods), self.readout_s)
        if self.delay_ms / HYSTERESIS <= new <= self.delay_ms * HYSTERESIS:
            return None
        return new

    def applied(self, delay_ms: int) -> None:
        self.delay_ms = delay_ms

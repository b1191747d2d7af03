"""Step and workload the training thread publishes; bound to an interval at its stop.

``binding`` is one immutable tuple ``(step, tokens, sequences, microbatches)`` replaced (never mutated)
by ``set_step``; ``wire`` is the same as the ring's record carries it, ``(step, tokens, sequences, microbatches,
flags)`` with 0 for a value not published and the wire's ``F_TOKENS``/``F_SEQUENCES``/``F_MICROBATCHES`` bits for
those that are, so a stop copies five integers into its record and a later ``set_step`` cannot change what an
already-stopped interval belongs to. Written and read on the training thread only.

Auto step: until ``set_step`` is called once, every start of the step timer (``forward-backward`` by
default) advances the step by one (the first step is 1; intervals before it belong to step 0), so a
pure drop-in of the timers still gets steps.

Device sampling: ``device_on`` is decided when the step changes (every ``device_every``-th step), not
per call. Without CUDA it is always False and ``host_reason`` is ``no_cuda`` (``host_code``: its code, which the hot
path writes into the record).

``device_every=0`` (auto, the default): at each step change the context reads the monotonic clock once and
the ring's interval count, keeps moving averages of the step period and of intervals per step, and picks
the smallest N in ``[1, max_every]`` whose event cost stays within ``budget`` (a fraction of the step time)
when paid every N-th step. The cost of a device-sampled step is estimated two ways:

* a prior: the records of a device-sampled step (a moving average of what the timers recorded on such steps;
  2 per interval until one was seen: adjacent boundaries share events, ``SharedEvent``) x the record cost
  measured when the pool was warmed x ``PRIOR_FACTOR``.
  A record between kernel launches costs several times its warm micro-cost on a launch-bound step's
  sampled steps (``bench/results/gpu-h200.md`` section 3, whichever record API);
* the measurement: what a device-sampled step takes longer than a host-only one, from per-kind running means
  of the step period over the last ~``MEASURE_STEPS`` steps of each kind (steps over ``OUTLIER`` x the
  average period and the time from install to the first step are left out; with N = 1 every
  ``PROBE_EVERY``-th step is host-only so that there is one to compare with).

Once the measurement resolves the budget (its 2-standard-error half-width is at most half of what the
budget allows per step) it is the cost: on steady, long (GPU-bound) steps the records' CPU time hides behind
device work and N drops to 1. Until then the cost is the larger of the prior and the
measurement's lower 2-standard-error bound: step jitter on a launch-bound step is far larger than the
budget (``bench/results/gpu-h200.md`` section 3), so an unproven difference must not lower N, and a proven
one raises it. The launch-bound model of that section gets N = 3-4; steps of a few hundred ms or more get
N = 1, so the detector sees device time on every step where it is cheap.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from otel_straggler.counters import NO_CUDA_CODE, REASONS, SAMPLED_OUT_CODE
from otel_straggler.hot_path import StepState
from otel_straggler.records import F_MICROBATCHES, F_SEQUENCES, F_TOKENS

MIN_MEASURED = 4  # steps of each kind (device-sampled, host-only) before their period difference is used
MEASURE_STEPS = 100  # the per-kind running mean weighs about the last 100 steps of its kind
# in-context cost of a record on a launch-bound step / its warm micro-cost (bench/results/gpu-h200.md section 3)
PRIOR_FACTOR = 5.0
RESOLVED = 0.5  # the measurement decides alone once 2 standard errors <= this fraction of the budget
PROBE_EVERY = 16  # auto with N = 1: every 16th step is host-only, so the price of sampling stays measured
OUTLIER = 3.0  # a step longer than 3x the average period is not booked to either kind's period
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # a step and a workload value fit the record's 64 bits


class StepContext(StepState):
    __slots__ = ("_adaptive", "_budget", "_clock", "_cuda", "_every", "_intervals", "_last_count", "_last_records",
                 "_last_t", "_max_every", "_measured", "_n_avg", "_period_avg", "_periods", "_r_avg", "_record_cost_s",
                 "_records", "auto")

    def __init__(self, *, device_every: int = 4, cuda: bool = False, budget: float = 0.0025, max_every: int = 4,
                 record_cost_s: float = 10e-6, intervals: Callable[[], int] | None = None,
                 records: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._adaptive = int(device_every) <= 0
        self._max_every = max(1, int(max_every))
        self._every = self._max_every if self._adaptive else max(1, int(device_every))
        self._budget = float(budget)
        self._record_cost_s = float(record_cost_s)
        self._intervals = intervals
        self._records = records  # events recorded so far (the timers' count)
        self._last_records = 0
        self._r_avg = -1.0  # records per device-sampled step (moving average; < 0: none seen yet)
        self._clock = clock  # seconds, monotonic (tests pass a fake)
        self._last_t: float | None = None
        self._last_count = 0
        self._period_avg = 0.0
        self._n_avg = 0.0
        # step period of device-sampled and of host-only steps (moving averages) and how many of each
        # per kind of step (host-only, device-sampled): [steps seen, moving mean period, moving variance]
        self._periods = ([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
        self.device_on = False  # until the first step: also what _adapt reads as "the step that just ended"
        self._measured = False  # the first period (from install to the first step) includes setup: not a step
        self._cuda = bool(cuda)
        self.auto = True
        self.step = -1  # replaced by step 0 just below
        self._apply(0, None, None, None)

    @property
    def device_every(self) -> int:
        return self._every

    @property
    def host_reason(self) -> str | None:
        """Why a start now times host-only (``host_code``'s reason), None on a device-sampled step."""
        return REASONS[self.host_code]

    def _adapt(self) -> None:
        """Once per step change: moving averages of step period and intervals per step -> N."""
        now = self._clock()
        count = self._intervals() if self._intervals is not None else 0
        records = self._records() if self._records is not None else 0
        if self.device_on and self._records is not None and self._last_t is not None:
            r = records - self._last_records
            self._r_avg = float(r) if self._r_avg < 0 else self._r_avg + 0.2 * (r - self._r_avg)
        self._last_records = records
        if self._last_t is not None and self._measured:
            period = now - self._last_t
            n = count - self._last_count
            if period > 0.0 and n >= 0:
                avg = self._period_avg
                outlier = avg > 0.0 and period > OUTLIER * avg  # a checkpoint, an evaluation, a stall
                a = 0.2 if avg else 1.0
                # the step period follows a real change within a few steps, but one outlier moves it <= 3x
                self._period_avg += a * ((min(period, OUTLIER * avg) if avg else period) - avg)
                self._n_avg += a * (n - self._n_avg)
                if not outlier:  # an outlier is never booked to either kind: it is not the price of sampling
                    k = self._periods[1 if self.device_on else 0]  # the kind of the step that just ended
                    k[0] += 1.0
                    w = 1.0 / k[0] if k[0] < MEASURE_STEPS else 1.0 / MEASURE_STEPS
                    dev = period - k[1]
                    k[1] += w * dev
                    k[2] += w * (dev * dev * (1.0 - w) - k[2])
                per_step = self._r_avg if self._r_avg >= 0 else 2.0 * self._n_avg
                micro = per_step * self._record_cost_s
                cost = PRIOR_FACTOR * micro
                allowed = self._budget * self._period_avg
                off, on = self._periods
                if on[0] >= MIN_MEASURED and off[0] >= MIN_MEASURED:
                    # standard error of the difference of the two running means (2 / w - 1: the effective
                    # sample count of a moving average of weight w)
                    cap = 2.0 * MEASURE_STEPS - 1.0
                    se = math.sqrt(on[2] / min(on[0], cap) + off[2] / min(off[0], cap))
                    diff = on[1] - off[1]
                    if 2.0 * se <= RESOLVED * allowed:
                        cost = max(0.0, diff)
                    else:
                        cost = max(cost, diff - 2.0 * se)
                every = math.ceil(cost / allowed) if self._budget > 0 else self._max_every
                self._every = min(self._max_every, max(1, every))
        elif self._last_t is not None:
            self._measured = True
        self._last_t = now
        self._last_count = count

    def _apply(self, step: int, tokens: int | None, sequences: int | None, microbatches: int | None) -> None:
        for v in (step, tokens, sequences, microbatches):
            if v is not None and not INT64_MIN <= v <= INT64_MAX:
                raise OverflowError(f"{v} does not fit the record's 64 bits")
        if self._adaptive and self._cuda and step != self.step:
            self._adapt()
        self.step = step
        self.binding = (step, tokens, sequences, microbatches)
        self.wire = (step, tokens or 0, sequences or 0, microbatches or 0,
                     (0 if tokens is None else F_TOKENS) | (0 if sequences is None else F_SEQUENCES)
                     | (0 if microbatches is None else F_MICROBATCHES))
        on = self._cuda and step % self._every == 0
        if on and self._adaptive and self._every == 1 and step % PROBE_EVERY == PROBE_EVERY - 1:
            on = False  # probe: a host-only step to compare with
        self.device_on = on
        self.host_code = 0 if on else (SAMPLED_OUT_CODE if self._cuda else NO_CUDA_CODE)

    def set_step(
        self,
        step: int,
        tokens: int | None = None,
        sequences: int | None = None,
        microbatches: int | None = None,
    ) -> None:
        """Publish the current step (and optional workload); turns the auto step off."""
        self.auto = False
        self._apply(int(step), _opt_int(tokens), _opt_int(sequences), _opt_int(microbatches))

    def step_timer_started(self) -> None:
        if self.auto:
            self._apply(self.step + 1, None, None, None)


def _opt_int(v: int | None) -> int | None:
    return None if v is None else int(v)

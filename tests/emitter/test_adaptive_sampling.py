"""Adaptive device sampling (``device_every=auto``): N follows step time and intervals per step.

The clock is the real monotonic clock with the steps paced by sleeps, except where a test needs exact step
periods (then a fake clock). CUDA is faked by ``cuda=True`` on the step context (the decision logic needs
no device). Record micro-costs of 2 us are the driver's record on the H200 (1.6 us)."""

from __future__ import annotations

import random
import time

from otel_straggler.config import EmitterConfig
from otel_straggler.step_context import StepContext


class _Count:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        return self.n


def _run(step_s: float, intervals_per_step: int, record_cost_s: float, steps: int = 8) -> tuple[int, list[bool]]:
    count = _Count()
    ctx = StepContext(device_every=0, cuda=True, budget=0.0025, max_every=4, record_cost_s=record_cost_s,
                      intervals=count)
    on = []
    for step in range(1, steps + 1):
        ctx.set_step(step)
        on.append(ctx.device_on)
        count.n += intervals_per_step
        time.sleep(step_s)
    return ctx.device_every, on


def test_launch_bound_steps_sample_the_device_every_few_steps() -> None:
    # 26 intervals of 2 us records on a 30 ms step: by the prior (5x the micro-cost between launches) events
    # on every step would be ~1.7 % of the step
    every, on = _run(0.030, 26, 2e-6)
    assert every == 4
    assert on[-4:].count(True) == 1


def test_long_steps_time_every_step_on_the_device() -> None:
    # the same intervals on a 0.3 s step cost ~0.17 %: within budget on every step
    every, on = _run(0.300, 26, 2e-6, steps=5)
    assert every == 1
    assert all(on[1:])


def test_a_fixed_n_is_not_adapted_and_cpu_never_samples() -> None:
    count = _Count()
    ctx = StepContext(device_every=3, cuda=True, record_cost_s=1.0, intervals=count)
    for step in range(1, 7):
        ctx.set_step(step)
        count.n += 1000
    assert ctx.device_every == 3
    cpu = StepContext(device_every=0, cuda=False, intervals=count)
    cpu.set_step(4)
    assert not cpu.device_on and cpu.host_reason == "no_cuda"


def test_auto_is_the_default_and_parses() -> None:
    assert EmitterConfig.from_env({}).device_every == 0
    assert EmitterConfig.from_env({"OTEL_STRAGGLER_DEVICE_EVERY": "auto"}).device_every == 0
    bad = EmitterConfig.from_env({"OTEL_STRAGGLER_DEVICE_EVERY": "sometimes"})
    assert bad.device_every == 0 and "device_every" in bad.config_errors


def test_the_measured_price_of_a_sampled_step_raises_n() -> None:
    """Records look cheap (0.05 us x 26 per 10 ms step: N = 1 by the prior), but device-sampled steps
    take 2 ms longer than host-only ones (every 16th step is a host-only probe while N = 1): once both
    kinds have been seen, N follows the measured price (2 ms every N-th step within 0.25 % of 10 ms needs
    N >= 80: the cap, 4). Equally long steps leave N at 1: the difference is taken at its lower
    2-standard-error bound, so step jitter does not move it. A fake clock paces the steps (10 ms, 0.3 ms
    jitter): a loaded machine's sleeps would make the test's outcome depend on its load."""
    def run(extra_s: float) -> tuple[list[int], list[bool]]:
        count = _Count()
        clock, rng = _Clock(), random.Random(7)
        ctx = StepContext(device_every=0, cuda=True, budget=0.0025, max_every=4, record_cost_s=5e-8,
                          intervals=count, clock=clock)
        seen, on = [], []
        for step in range(1, 90):
            ctx.set_step(step)
            seen.append(ctx.device_every)
            on.append(ctx.device_on)
            count.n += 26
            clock.t += 0.010 + rng.gauss(0.0, 0.0003) + (extra_s if ctx.device_on else 0.0)
        return seen, on

    seen, on = run(0.002)
    assert seen[3] == 1 and not on[14] and on[13]  # micro-cost: every step, step 15 a host-only probe
    assert seen[-1] == 4
    seen, on = run(0.0)
    assert seen[-1] == 1 and on.count(False) <= 6


def test_setup_time_and_a_stall_are_not_the_price_of_sampling() -> None:
    """The period from install to the first step (model setup) is not a step, and a step 30x the average
    (a checkpoint) on a device-sampled step is not booked to either kind: N stays 1 (before, either kept
    N = 4 for hundreds of steps)."""
    count = _Count()
    ctx = StepContext(device_every=0, cuda=True, budget=0.0025, max_every=4, record_cost_s=5e-8, intervals=count)
    time.sleep(0.3)  # setup between install and the first step
    seen = []
    for step in range(1, 60):
        ctx.set_step(step)
        seen.append(ctx.device_every)
        count.n += 26
        time.sleep(0.3 if step == 30 else 0.010)  # step 30 is device-sampled (N = 1) and stalls
    assert seen[0] == 4 and max(seen[2:]) == 1  # N starts at the cap until a step has been measured


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _paced(record_cost_s: float, period_s, steps: int) -> list[int]:
    """N after each of ``steps`` steps whose period ``period_s(step, device_on)`` gives, on a fake clock."""
    clock, count = _Clock(), _Count()
    ctx = StepContext(device_every=0, cuda=True, budget=0.0025, max_every=4, record_cost_s=record_cost_s,
                      intervals=count, clock=clock)
    seen = []
    for step in range(1, steps + 1):
        ctx.set_step(step)
        seen.append(ctx.device_every)
        count.n += 26
        clock.t += period_s(step, ctx.device_on)
    return seen


def test_a_resolved_measurement_overrides_the_prior() -> None:
    """10 us records x 26 on a 100 ms step: the prior (5x) says 2.6 ms per sampled step, N = 4. Steady steps
    that measurably cost nothing more when sampled bring N to 1 (the records hide behind device work); the
    same mean periods with +-10 % jitter never resolve the 0.25 % budget, so the prior holds."""
    steady = _paced(10e-6, lambda step, on: 0.100 + 1e-5 * (step % 3), 120)
    assert steady[2] == 4 and steady[-1] == 1
    noisy = _paced(10e-6, lambda step, on: 0.100 * (1.1 if step % 2 else 0.9), 120)
    assert noisy[-1] == 4
    # a resolved, real price is kept: sampled steps 0.4 ms longer need N = 2 (0.4 ms / 0.25 ms per step)
    priced = _paced(10e-6, lambda step, on: 0.100 + (0.0004 if on else 0.0) + 1e-5 * (step % 3), 200)
    assert priced[-1] == 2

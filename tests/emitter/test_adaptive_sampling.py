"""Adaptive device sampling (``device_every=auto``): N follows step time and intervals per step.

The clock is the real monotonic clock; the steps are paced with sleeps. CUDA is faked by
``cuda=True`` on the step context (the decision logic needs no device)."""

from __future__ import annotations

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
    # 26 intervals of ~10 us records on a 30 ms step: events on every step would be ~1.7 % of the step
    every, on = _run(0.030, 26, 10e-6)
    assert every == 4
    assert on[-4:].count(True) == 1


def test_long_steps_time_every_step_on_the_device() -> None:
    # the same intervals on a 0.3 s step cost ~0.17 %: within budget on every step
    every, on = _run(0.300, 26, 10e-6, steps=5)
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

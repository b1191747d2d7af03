"""Test-only slowdown inside one stage on one rank (inert unless configured).

| env | meaning |
|---|---|
| OTEL_STRAGGLER_INJECT_RANK | global rank to slow down (required to activate) |
| OTEL_STRAGGLER_INJECT_STAGE | Megatron timer name to slow down (required) |
| OTEL_STRAGGLER_INJECT_HOST_MS | host sleep inside the interval, ms |
| OTEL_STRAGGLER_INJECT_DEVICE_MS | extra GPU work on the current stream, ~ms (matmul loop calibrated once at install) |
| OTEL_STRAGGLER_INJECT_FROM_STEP | first step (inclusive, default 0) |
| OTEL_STRAGGLER_INJECT_UNTIL_STEP | last step (inclusive, default: no end) |

The delay runs inside the interval, right before stop's clock read, so the measured host (and device)
time includes it; the interval is marked ``injected=True``. Without CUDA a ``_DEVICE_MS`` request is
applied as a host sleep of the same length (there is no stream to load). Bad values disable injection
(counted as a config error by the caller), never raise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

PREFIX = "OTEL_STRAGGLER_INJECT_"


class Injector:
    __slots__ = ("_gpu_fn", "_host_s", "_iters", "device_ms", "from_step", "host_ms", "stage", "until_step")

    def __init__(
        self,
        stage: str,
        *,
        host_ms: float = 0.0,
        device_ms: float = 0.0,
        from_step: int = 0,
        until_step: int | None = None,
    ) -> None:
        self.stage = stage
        self.host_ms = max(0.0, float(host_ms))
        self.device_ms = max(0.0, float(device_ms))
        self.from_step = int(from_step)
        self.until_step = None if until_step is None else int(until_step)
        self._host_s = self.host_ms / 1000.0
        self._gpu_fn: Any = None
        self._iters = 0

    def calibrate(self, cuda: bool) -> None:
        """Once at install: size the GPU work (a matmul loop) to ~device_ms; host sleep without CUDA."""
        if self.device_ms <= 0.0:
            return
        if not cuda:
            self._host_s += self.device_ms / 1000.0
            return
        try:
            import torch

            a = torch.randn(1024, 1024, device="cuda")
            b = torch.randn(1024, 1024, device="cuda")

            def work(n: int) -> None:
                for _ in range(n):
                    torch.mm(a, b)

            work(3)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work(50)
            end.record()
            end.synchronize()
            per_iter = max(start.elapsed_time(end) / 50.0, 1e-4)
            self._iters = max(1, round(self.device_ms / per_iter))
            self._gpu_fn = work
        except Exception:  # fall back to host time
            self._host_s += self.device_ms / 1000.0

    def apply(self, step: int) -> bool:
        """Training thread, inside the interval. True when the slowdown ran."""
        if step < self.from_step or (self.until_step is not None and step > self.until_step):
            return False
        if self._gpu_fn is not None:
            self._gpu_fn(self._iters)
        if self._host_s > 0.0:
            time.sleep(self._host_s)
        return True


def injector_from_env(rank: int, env: Mapping[str, str] | None = None) -> tuple[Injector | None, bool]:
    """(injector for this rank or None, config_error)."""
    env = os.environ if env is None else env
    target = env.get(PREFIX + "RANK")
    stage = env.get(PREFIX + "STAGE")
    if target is None and stage is None:
        return None, False
    try:
        if target is None or not stage:
            raise ValueError("RANK and STAGE are both required")
        if int(target) != int(rank):
            return None, False
        until = env.get(PREFIX + "UNTIL_STEP")
        inj = Injector(
            stage,
            host_ms=float(env.get(PREFIX + "HOST_MS", "0") or 0),
            device_ms=float(env.get(PREFIX + "DEVICE_MS", "0") or 0),
            from_step=int(env.get(PREFIX + "FROM_STEP", "0") or 0),
            until_step=int(until) if until not in (None, "") else None,
        )
        if inj.host_ms <= 0.0 and inj.device_ms <= 0.0:
            return None, False
        return inj, False
    except (ValueError, TypeError):
        return None, True

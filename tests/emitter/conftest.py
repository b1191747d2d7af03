"""Shared fixtures for the emitter tests.

CUDA cannot run on the CI machines, so device timing is driven through ``FakeDevice``/``FakeEvent``
(``fake_cuda.py``): a fake stream clock whose events complete when the test says so.
Everything else is real (threads, ring, readout, Megatron's own Timers for parity).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fake_cuda import FakeDevice
from recording_sink import RecordingSink

from otel_straggler.config import EmitterConfig
from otel_straggler.event_pool import EventPool
from otel_straggler.timers import Timers


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def device() -> FakeDevice:
    return FakeDevice(auto_complete=True)


MakeTimers = Callable[..., Timers]


@pytest.fixture
def make_timers(sink: RecordingSink, device: FakeDevice) -> MakeTimers:
    """Timers on the fake device; readout thread NOT started (tests drain deterministically)."""
    made: list[Timers] = []

    def make(
        *,
        device_every: int = 1,
        pool_size: int = 32,
        ring_size: int = 64,
        readout_timeout_s: float = 30.0,
        log_level: int = 2,
        start_readout: bool = False,
        fake: FakeDevice | None = None,
        sink_: Any = None,
        share_gap_us: float = 0.0,
        device_repeats: str = "all",
        **kw: Any,
    ) -> Timers:
        dev = fake or device
        cfg = EmitterConfig(
            enabled=True,
            share_gap_us=share_gap_us,  # 0: every boundary records its own event (test_shared_event.py: reuse)
            device_repeats=device_repeats,  # all: every repeat on device (test_repeat_sampling.py: middle)
            device_every=device_every,
            pool_size=pool_size,
            ring_size=ring_size,
            readout_timeout_s=readout_timeout_s,
            readout_interval_ms=5,
        )
        pool = EventPool(pool_size, dev.factory, synchronize=None)
        t = Timers(log_level, "minmax", config=cfg, pool=pool, sink=sink_ or sink, start_readout=start_readout, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.shutdown(1.0)

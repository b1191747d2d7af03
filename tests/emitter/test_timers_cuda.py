"""Real CUDA events through the whole emitter path (runs only where CUDA is available: the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from otel_straggler.config import EmitterConfig
from otel_straggler.event_pool import EventPool, create_pool
from otel_straggler.inject import Injector
from otel_straggler.timers import Timers

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _work(a: torch.Tensor, n: int) -> None:
    for _ in range(n):
        torch.mm(a, a)


def test_device_time_matches_direct_event_measurement(sink) -> None:
    pool = create_pool(64)
    assert isinstance(pool, EventPool) and pool.cuda
    assert all(pool.events[i].query() for i in pool.free)  # warmed: recorded once at install, complete
    cfg = EmitterConfig(enabled=True, device_every=2, pool_size=64, readout_interval_ms=5)
    t = Timers(2, "minmax", config=cfg, pool=pool, sink=sink, start_readout=True)
    a = torch.randn(2048, 2048, device="cuda")
    _work(a, 5)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    _work(a, 20)
    e.record()
    e.synchronize()
    direct = s.elapsed_time(e)
    for step in range(8):
        t.set_step(step, tokens=1024)
        t("forward-compute").start()
        _work(a, 20)
        t("forward-compute").stop()
    assert t.flush(10.0)
    ivs = sink.intervals
    assert [iv.step for iv in ivs] == list(range(8))
    sampled = [iv for iv in ivs if iv.step % 2 == 0]
    assert all(iv.device_ms is not None and iv.degraded is None for iv in sampled)
    assert all(iv.degraded == "sampled_out" for iv in ivs if iv.step % 2 == 1)
    for iv in sampled:
        assert 0.5 * direct < iv.device_ms < 2.0 * direct, (iv.device_ms, direct)
        # host time is launch time: without a sync it can be far below device time
        assert (iv.host_end_ns - iv.host_start_ns) / 1e6 < iv.device_ms * 2 + 50
    assert t.counters.faults == 0
    t.shutdown(5.0)
    assert len(pool.free) == pool.capacity


def test_device_injection_adds_gpu_time(sink) -> None:
    inj = Injector("forward-compute", device_ms=5.0)
    inj.calibrate(cuda=True)
    cfg = EmitterConfig(enabled=True, device_every=1, pool_size=16, readout_interval_ms=5)
    t = Timers(2, "minmax", config=cfg, pool=create_pool(16), sink=sink, injector=inj, start_readout=True)
    t.set_step(0)
    t("forward-compute").start()
    t("forward-compute").stop()
    t("backward-compute").start()
    t("backward-compute").stop()
    assert t.flush(10.0)
    fc, bc = sink.intervals
    assert fc.injected and not bc.injected
    assert 3.0 < fc.device_ms < 10.0, fc.device_ms
    assert bc.device_ms < 1.0
    t.shutdown(5.0)


def test_gpu_identity_from_device_properties() -> None:
    from otel_straggler.identity import resolve_identity

    ident = resolve_identity(env={}, cuda=True, use_parallel_state=False)
    assert ident.gpu_uuid.startswith("GPU-") and len(ident.gpu_uuid) > 10
    assert ident.gpu_index == torch.cuda.current_device()
    assert ident.gpu_pci_bus_id not in ("", "unknown") and ident.gpu_pci_bus_id.count(":") == 2

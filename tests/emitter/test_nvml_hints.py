"""NVML cause hints (``otel_straggler/nvml.py``): a low-rate sampler on its own thread in the process that builds the
step summaries, its latest sample attached to every rank-step; nothing imported and no thread when off.

There is no GPU here: the tests inject a fake NVML module at the import boundary (``sys.modules["pynvml"]``, the
one name the sampler imports), which answers like ``nvidia-ml-py`` does: values, ``NVMLError_NotSupported`` for a
counter the GPU lacks, and an error for a broken read. The real binding's path is the same calls.
"""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from otel_straggler import schema
from otel_straggler.config import EmitterConfig
from otel_straggler.export.aggregate import KIND_RANK_STEP, StepAggregator
from otel_straggler.interval import Interval


class NVMLError_NotSupported(Exception):
    pass


def fake_nvml(sm_mhz: int = 1410, reasons: int = 0x20 | 0x1, broken_power: bool = False) -> types.ModuleType:
    """A module answering the calls the sampler makes, for one GPU (index 0, UUID GPU-fake-0) with 2 NVLinks."""
    m = types.ModuleType("pynvml")
    m.NVML_CLOCK_SM = 1
    m.NVML_TEMPERATURE_GPU = 0
    m.calls = {"init": 0, "shutdown": 0, "clock": 0}
    handle = object()

    def init() -> None:
        m.calls["init"] += 1

    def clock(h: object, kind: int) -> int:
        assert h is handle and kind == m.NVML_CLOCK_SM
        m.calls["clock"] += 1
        return sm_mhz

    def power(h: object) -> int:
        if broken_power:
            raise RuntimeError("GPU is lost")
        return 612_500  # mW

    def pcie(h: object) -> int:
        raise NVMLError_NotSupported("Not Supported")

    def link_state(h: object, link: int) -> int:
        if link >= 2:
            raise NVMLError_NotSupported("Not Supported")
        return 1

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.__setitem__("shutdown", m.calls["shutdown"] + 1)
    m.nvmlDeviceGetHandleByIndex = lambda i: handle if i == 0 else (_ for _ in ()).throw(ValueError(i))
    m.nvmlDeviceGetHandleByUUID = lambda u: handle if u == "GPU-fake-0" else (_ for _ in ()).throw(ValueError(u))
    m.nvmlDeviceGetClockInfo = clock
    m.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980
    m.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: reasons
    m.nvmlDeviceGetTemperature = lambda h, kind: 87
    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetPcieReplayCounter = pcie
    m.nvmlDeviceGetNvLinkState = link_state
    m.nvmlDeviceGetNvLinkErrorCounter = lambda h, link, counter: 3 if counter == 0 else 0
    return m


def test_a_sample_reads_every_counter_and_leaves_out_what_the_gpu_lacks() -> None:
    from otel_straggler.nvml import NvmlSampler

    s = NvmlSampler(10.0, "GPU-fake-0", module=fake_nvml())
    sample = s.sample() if s.start() else {}
    s.stop()
    assert sample == {
        schema.ATTR_GPU_SM_CLOCK_MHZ: 1410, schema.ATTR_GPU_SM_CLOCK_MAX_MHZ: 1980,
        schema.ATTR_GPU_CLOCK_REASONS: ["gpu_idle", "sw_thermal_slowdown"], schema.ATTR_GPU_TEMPERATURE_C: 87,
        schema.ATTR_GPU_POWER_W: 612.5, schema.ATTR_GPU_NVLINK_ERRORS: 6,  # 2 links x 3 replays
    }  # no PCIe replay counter: not supported, left out and not an error
    assert s.errors == 0


def test_a_broken_read_is_counted_and_the_others_still_sampled() -> None:
    from otel_straggler.nvml import NvmlSampler

    s = NvmlSampler(10.0, 0, module=fake_nvml(broken_power=True))
    assert s.start()
    s.stop()
    assert schema.ATTR_GPU_POWER_W not in s.latest() and s.latest()[schema.ATTR_GPU_SM_CLOCK_MHZ] == 1410
    assert s.errors == 1


def test_without_the_binding_or_the_gpu_hints_stay_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from otel_straggler.nvml import NvmlSampler

    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    assert not NvmlSampler(1.0, 0).start()
    assert not NvmlSampler(1.0, 5, module=fake_nvml()).start()  # no such GPU


def test_the_thread_samples_at_its_interval_and_stops() -> None:
    from otel_straggler.nvml import NvmlSampler

    nvml = fake_nvml()
    s = NvmlSampler(0.05, 0, module=nvml)
    assert s.start()
    deadline = time.monotonic() + 30.0
    while s.samples < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    s.stop()
    assert s.samples >= 3 and nvml.calls["shutdown"] == 1
    assert not [t for t in threading.enumerate() if t.name == "otel-straggler-nvml"]


def test_the_latest_sample_rides_on_every_rank_step() -> None:
    from otel_straggler.nvml import NvmlSampler

    s = NvmlSampler(10.0, 0, module=fake_nvml())
    assert s.start()
    agg = StepAggregator(rank=1, hints=s.latest)
    out: list = []
    agg.add([Interval("forward-compute", 1, "forward", 4, 0, 0, 5_000_000, 5.0, None, None, None, None, False)],
            0, out)
    agg.close_all(out)
    s.stop()
    (rs,) = [r for r in out if r.kind == KIND_RANK_STEP]
    assert rs.attributes[schema.ATTR_GPU_SM_CLOCK_MHZ] == 1410
    assert rs.attributes[schema.ATTR_GPU_CLOCK_REASONS] == ["gpu_idle", "sw_thermal_slowdown"]


def _pipeline(config: EmitterConfig):  # type: ignore[no-untyped-def]
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_straggler.export.pipeline import ExportPipeline

    return ExportPipeline({schema.RES_RANK: 0, schema.RES_GPU_UUID: "GPU-fake-0"}, rank=0, job_id="j",
                          config=config, span_exporter=InMemorySpanExporter(), metrics=False)


def test_off_by_default_nothing_is_imported_and_no_thread_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "otel_straggler.nvml", raising=False)
    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    p = _pipeline(EmitterConfig())
    try:
        assert p.nvml is None and p.aggregator.hints is None
        assert "otel_straggler.nvml" not in sys.modules and nvml.calls["init"] == 0
        assert not [t for t in threading.enumerate() if t.name == "otel-straggler-nvml"]
    finally:
        p.shutdown(1.0)


def test_on_the_pipeline_samples_the_ranks_gpu_and_stops_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("OTEL_STRAGGLER_NVML_INTERVAL_S", "0.5")
    config = EmitterConfig.from_env()
    assert config.nvml_interval_s == 0.5
    p = _pipeline(config)
    try:
        assert p.nvml is not None and p.aggregator.hints is not None
        assert p.aggregator.hints()[schema.ATTR_GPU_SM_CLOCK_MHZ] == 1410  # sampled at start, the GPU by UUID
    finally:
        p.shutdown(1.0)
    assert nvml.calls["shutdown"] == 1
    assert not [t for t in threading.enumerate() if t.name == "otel-straggler-nvml"]

"""Cause hints (``hints.py``): a straggler verdict says what its GPU's NVML sample shows against its peers'
(the emitter attaches the sample to each rank-step where it samples NVML; the simulator's ``nvml`` does the
same: a rank under a device fault reports its SM clock divided by the slowdown, hot, with a thermal reason)."""

from __future__ import annotations

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory, hints
from collector_processor.processor.straggler.events import event_attributes, summary
from collector_processor.processor.straggler.model import Verdict
from collector_processor.telemetry import Telemetry
from jobsim.faults import COMPUTE_STAGES, Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, SimConfig


def _run(fault: Fault, nvml: bool = True) -> list[Verdict]:
    verdicts: list[Verdict] = []
    proc = factory.create_processor(factory.create_default_config(), Telemetry(), verdicts.extend)
    proc.start()
    for _step, req in JobStream(SimConfig(layout=Layout(tp=1, dp=8), steps=90, seed=2, nvml=nvml), [fault]):
        proc.process_traces(req)
        proc.tick(0.0)
    proc.shutdown(5.0)
    return [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER]


def test_a_throttled_gpu_is_named_in_its_verdict() -> None:
    slow = _run(Fault("device", 3, COMPUTE_STAGES, 0.40, 45))
    assert slow and {v.rank for v in slow} == {3}
    for v in slow:
        assert v.hint == "SM clock 1,414 MHz vs peers 1,980 (thermal slowdown); 85 C vs peers 60 C"
        assert dict(event_attributes(v))[s.EV_HINT] == v.hint and v.hint in summary(v)


def test_no_sample_no_hint_and_a_host_stall_has_none() -> None:
    assert all(not v.hint and s.EV_HINT not in dict(event_attributes(v))
               for v in _run(Fault("device", 3, COMPUTE_STAGES, 0.40, 45), nvml=False))
    host = _run(Fault("host", 3, ("forward-compute",), 0.0, 45, stall_ms=30.0))
    assert host and all(v.hint == "" for v in host)  # its GPU reads like its peers'


def test_link_errors_beyond_every_peer_are_named_and_a_common_reason_is_not() -> None:
    peer = {s.ATTR_GPU_SM_CLOCK_MHZ: 1980, s.ATTR_GPU_PCIE_REPLAYS: 2, s.ATTR_GPU_NVLINK_ERRORS: 0,
            s.ATTR_GPU_CLOCK_REASONS: ["sw_power_cap"]}
    mine = {s.ATTR_GPU_SM_CLOCK_MHZ: 1700, s.ATTR_GPU_PCIE_REPLAYS: 2, s.ATTR_GPU_NVLINK_ERRORS: 1200,
            s.ATTR_GPU_CLOCK_REASONS: ["sw_power_cap"]}
    assert hints.describe(mine, [peer, peer, None]) == \
        "SM clock 1,700 MHz vs peers 1,980; NVLink errors 1,200 vs peers' most 0"
    assert hints.describe({s.ATTR_GPU_SM_CLOCK_MHZ: 1960}, [peer]) == ""  # within 3 %
    assert hints.describe(None, [peer]) == "" and hints.describe(mine, []) == ""

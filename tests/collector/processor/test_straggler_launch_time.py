"""On a CUDA rank a compute stage's host time is launch time: its jitter is no straggler, a host stall is.

Found on an H200 (bench/results/gpu-h200.md): four megatron-core replicas sharing one GPU had launch
times jittering by 10-30 % while device times stayed level. Host comparisons therefore carry their own
noise-raised tolerance and the host floor: launch-time jitter convicts nobody. A sustained host stall with
the GPU flat (CPU contention, a stalled launch) is a straggler in any judged stage (``host_stall``,
``host_only_stall``), and a rank whose device samples stopped for good is judged on host time again.
"""

from __future__ import annotations

import random

from straggler_sim import Sim, make_processor, run

import otel_straggler_schema as s
from collector_processor.processor.straggler.config import Config
from jobsim.arrival import SimClock


def _factor(rank: int, stage: str, start: int, factor: float):  # type: ignore[no-untyped-def]
    return lambda r, n, st: factor if (r == rank and n == stage and st >= start) else 1.0


def _stragglers(emitted):  # type: ignore[no-untyped-def]
    return [(v.rank, v.stage) for v in emitted if v.verdict == s.VERDICT_STRAGGLER]


def test_launch_time_jitter_on_a_compute_stage_is_not_a_straggler() -> None:
    """Every rank's compute launch times jitter by 10-30 % (replicas sharing a GPU), device times level."""
    rng = random.Random(7)
    clock = SimClock()
    proc, emitted, _ = make_processor(clock=clock)
    sim = Sim(host_factor=lambda r, n, st: (1.0 + abs(rng.gauss(0.0, 0.2))) if n in ("forward-compute",
                                                                                   "backward-compute") else 1.0)
    run(proc, sim, range(0, 150), clock=clock)
    assert _stragglers(emitted) == []


def test_host_stall_in_a_compute_stage_with_the_gpu_flat_is_a_host_only_stall() -> None:
    """Rank 2's forward-compute host time +30 ms (18 -> 48 ms), device flat: a straggler, host_only_stall,
    compared host against host; never silent. With the stage's group left out of host_stall_groups it is not
    judged on host time (what the default used to be)."""
    def host(r, n, st):  # type: ignore[no-untyped-def]
        return 48.0 / 18.0 if (r == 2 and n == "forward-compute" and st >= 30) else 1.0

    clock = SimClock()
    proc, emitted, _ = make_processor(clock=clock)
    run(proc, Sim(host_factor=host), range(0, 100), clock=clock)
    got = [v for v in emitted if v.verdict == s.VERDICT_STRAGGLER]
    assert [(v.rank, v.stage, v.measurement, v.attribution) for v in got] == [
        (2, "forward-compute", s.MEASUREMENT_HOST_ONLY, s.ATTRIBUTION_HOST)]
    assert got[0].step is not None and got[0].step - 30 <= 15

    clock = SimClock()
    proc, emitted, _ = make_processor(Config(host_stall_groups=["data"]), clock=clock)
    run(proc, Sim(host_factor=host), range(0, 100), clock=clock)
    assert _stragglers(emitted) == []


def test_host_stall_that_starves_the_stream_is_found_and_attributed_to_the_host() -> None:
    """Host +30 ms on an 18 ms launch, device +15 ms (the stream starved for part of it): the host excess the
    device excess does not explain is the host's own: host_only_stall, judged on device time."""
    clock = SimClock()
    proc, emitted, _ = make_processor(clock=clock)
    sim = Sim(host_factor=_factor(2, "forward-compute", 30, 48.0 / 18.0),
              device_factor=_factor(2, "forward-compute", 30, 1.25))
    run(proc, sim, range(0, 100), clock=clock)
    got = [v for v in emitted if v.verdict == s.VERDICT_STRAGGLER]
    assert [(v.rank, v.stage) for v in got] == [(2, "forward-compute")]
    assert got[0].measurement == s.MEASUREMENT_DEVICE
    assert got[0].attribution == s.ATTRIBUTION_HOST


def _drop_device_after(sim: Sim, rank: int, step0: int) -> None:
    """Rank ``rank`` sends no device time after ``step0`` (e.g. its event pool ran dry): host spans only."""
    orig = sim.step_spans

    def step_spans(step, ranks=None):  # type: ignore[no-untyped-def]
        spans = orig(step, ranks)
        if step > step0 and rank in spans:
            for sp in spans[rank]:
                keep = [a for a in sp.attributes if a.key != s.ATTR_DEVICE_MS]
                del sp.attributes[:]
                sp.attributes.extend(keep)
        return spans

    sim.step_spans = step_spans  # type: ignore[method-assign]


def test_a_cuda_rank_window_without_device_samples_is_not_judged_on_launch_time() -> None:
    """Device timing every 4th step, a 5-step window: while a rank's device samples are missing, for up to
    device_history_windows windows, its host (launch) times are not compared: uncertain/missing_samples."""
    clock = SimClock()
    proc, emitted, _ = make_processor(clock=clock)
    sim = Sim(device_every=4, host_factor=_factor(1, "forward-compute", 45, 1.5))
    _drop_device_after(sim, 1, 44)
    run(proc, sim, range(0, 66), clock=clock)  # windows 9-12 (steps 45-64) without device samples, judged
    assert _stragglers(emitted) == []
    assert any(v.rank == 1 and v.reason == "missing_samples" for v in emitted)


def test_a_rank_that_stops_timing_on_the_device_is_judged_on_host_time_again() -> None:
    """A rank whose device samples stopped for good is judged host against host once device_history_windows
    windows passed without any: rank 1's host +50 % (+9 ms) is then a host_only_stall; it is never left
    uncertain forever."""
    clock = SimClock()
    proc, emitted, _ = make_processor(clock=clock)
    sim = Sim(device_every=4, host_factor=_factor(1, "forward-compute", 45, 1.5))
    _drop_device_after(sim, 1, 44)
    run(proc, sim, range(0, 120), clock=clock)
    got = [v for v in emitted if v.verdict == s.VERDICT_STRAGGLER]
    assert [(v.rank, v.stage, v.measurement, v.attribution) for v in got] == [
        (1, "forward-compute", s.MEASUREMENT_HOST_ONLY, s.ATTRIBUTION_HOST)]
    assert got[0].step is not None and got[0].step >= 45 + 5 * Config().device_history_windows

"""On a CUDA rank a compute stage's host time is launch time, not the stage's duration.

Found on an H200 (bench/results/gpu-h200.md): four megatron-core replicas sharing one GPU had launch
times jittering by 10-30 % while device times stayed level, and comparing those launch times raised
straggler verdicts on healthy ranks. A compute stage is judged on device time only; a host stall there
counts when it starves the stream (the device interval stretches); host-side stages (the data loader)
are still judged on host time when their device time is flat.
"""

from __future__ import annotations

from straggler_sim import Clock, Sim, make_processor, run

from otel_straggler import schema as s


def _factor(rank: int, stage: str, start: int, factor: float):  # type: ignore[no-untyped-def]
    return lambda r, n, st: factor if (r == rank and n == stage and st >= start) else 1.0


def _stragglers(emitted):  # type: ignore[no-untyped-def]
    return [(v.rank, v.stage) for v in emitted if v.verdict == s.VERDICT_STRAGGLER]


def test_launch_time_jitter_on_a_compute_stage_is_not_a_straggler() -> None:
    clock = Clock()
    proc, emitted, _ = make_processor(clock=clock)
    sim = Sim(host_factor=_factor(2, "forward-compute", 30, 1.4))  # device flat, host (launch) up 40 %
    run(proc, sim, range(0, 100), clock=clock)
    assert _stragglers(emitted) == []


def test_host_stall_that_starves_the_stream_is_found_and_attributed_to_the_host() -> None:
    clock = Clock()
    proc, emitted, _ = make_processor(clock=clock)
    sim = Sim(host_factor=_factor(2, "forward-compute", 30, 1.3), device_factor=_factor(2, "forward-compute", 30, 1.25))
    run(proc, sim, range(0, 100), clock=clock)
    got = [v for v in emitted if v.verdict == s.VERDICT_STRAGGLER]
    assert [(v.rank, v.stage) for v in got] == [(2, "forward-compute")]
    assert got[0].measurement == s.MEASUREMENT_DEVICE


def test_a_cuda_rank_window_without_device_samples_is_not_judged_on_launch_time() -> None:
    """Device timing every 4th step, a 5-step window: if a rank's device samples go missing, its
    host (launch) times are never compared; the window is uncertain/missing_samples."""
    clock = Clock()
    proc, emitted, _ = make_processor(clock=clock)
    sim = Sim(device_every=4, host_factor=_factor(1, "forward-compute", 20, 1.5))
    # rank 1 stops sending device time after step 40 (e.g. its event pool ran dry): only host spans remain
    orig = sim.step_spans

    def step_spans(step, ranks=None):  # type: ignore[no-untyped-def]
        spans = orig(step, ranks)
        if step > 40 and 1 in spans:
            for sp in spans[1]:
                keep = [a for a in sp.attributes if a.key != s.ATTR_DEVICE_MS]
                del sp.attributes[:]
                sp.attributes.extend(keep)
        return spans

    sim.step_spans = step_spans  # type: ignore[method-assign]
    run(proc, sim, range(0, 100), clock=clock)
    assert _stragglers(emitted) == []
    assert any(v.rank == 1 and v.reason == "missing_samples" for v in emitted)

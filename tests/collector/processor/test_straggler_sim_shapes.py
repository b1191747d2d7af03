"""The simulator's shapes (``collector_processor/simulate/``): what the regimes and faults do to the host and
device intervals, and when batched spans arrive. The detector's benchmarks stand on these."""

from __future__ import annotations

from collector_processor.simulate.arrival import Batching, batched
from collector_processor.simulate.faults import Fault
from collector_processor.simulate.job import Layout, StepModel
from collector_processor.simulate.stream import JobStream, Noise, SimConfig
from otel_straggler import schema as s

_QUIET = Noise(jitter=0.0, host_jitter=0.0, spike_prob=0.0, warmup_steps=0, late_ranks=0, missing_prob=0.0)
FWD = 48.0  # forward-compute device ms; launches take 35 % of it (16.8 ms)


def _forward(regime: str, fault: Fault | None, step: int = 30) -> dict[int, tuple[float, float]]:
    """rank -> (device ms, host ms) of forward-compute at ``step``, from the step summaries."""
    cfg = SimConfig(layout=Layout(tp=1, dp=4), steps=step, step_model=StepModel.with_forward_ms(FWD),
                    noise=_QUIET, regime=regime)
    out: dict[int, tuple[float, float]] = {}
    for st, req in JobStream(cfg, [fault] if fault else []):
        if st != step:
            continue
        for rs in req.resource_spans:
            rank = next(a.value.int_value for a in rs.resource.attributes if a.key == s.RES_RANK)
            span = rs.scope_spans[1].spans[0]
            attrs = {a.key: a.value for a in span.attributes}
            names = [v.string_value for v in attrs[s.ATTR_SUMMARY_STAGES].array_value.values]
            i = names.index("forward-compute")
            out[rank] = (attrs[s.ATTR_SUMMARY_DEVICE_MS].array_value.values[i].double_value,
                         attrs[s.ATTR_SUMMARY_HOST_MS].array_value.values[i].double_value)
    return out


def test_a_slow_gpu_leaves_a_launching_host_flat_and_stretches_a_blocked_one() -> None:
    slow = Fault("device", 2, ("forward-compute",), 0.10, 10)
    launch, blocked = _forward("launch", slow), _forward("gpu_bound", slow)
    assert launch[2][0] == FWD * 1.1 and launch[2][1] == launch[0][1] == FWD * 0.35
    assert blocked[2][0] == blocked[2][1] == FWD * 1.1 and blocked[0][1] == FWD  # host tracks device


def test_a_host_stall_starves_the_stream_only_beyond_the_queued_work() -> None:
    short = _forward("launch", Fault("host", 2, ("forward-compute",), 0.0, 10, stall_ms=30.0))
    assert short[2] == (FWD, FWD * 0.35 + 30.0)  # 46.8 ms of launches: the GPU still had work
    long = _forward("launch", Fault("host", 2, ("forward-compute",), 0.0, 10, stall_ms=60.0))
    assert long[2][1] == FWD * 0.35 + 60.0 and long[2][0] == long[2][1]  # the stream waited for the launches
    absorbed = _forward("gpu_bound", Fault("host", 2, ("forward-compute",), 0.0, 10, stall_ms=30.0))
    assert absorbed[2] == absorbed[0] == (FWD, FWD)  # a full queue absorbs it


def test_a_ramp_rises_to_its_size_and_is_due_at_5_percent() -> None:
    ramp = Fault("ramp", 0, ("forward-compute",), 0.06, 50, ramp_steps=120)
    assert ramp.slowdown(49) == 0.0 and ramp.slowdown(169) == 0.06 and ramp.slowdown(300) == 0.06
    assert ramp.due == 150 and abs(ramp.slowdown(ramp.due) - 0.05) < 0.001


def test_sdk_batches_arrive_in_order_per_rank_within_the_schedule_delay() -> None:
    cfg = SimConfig(layout=Layout(tp=1, dp=4), steps=200, step_model=StepModel.with_forward_ms(12.0), seed=2)
    b = Batching()
    last: dict[int, int] = {}
    lag = 0.0
    n = 0
    for at_s, req in batched(JobStream(cfg, []), b, seed=2):
        n += 1
        (rs,) = req.resource_spans
        assert sum(len(ss.spans) for ss in rs.scope_spans) <= b.max_batch
        rank = next(a.value.int_value for a in rs.resource.attributes if a.key == s.RES_RANK)
        steps = [next(a.value.int_value for a in sp.attributes if a.key == s.ATTR_ITERATION)
                 for ss in rs.scope_spans if ss.scope.name == s.SCOPE_STEP_NAME for sp in ss.spans]
        assert steps == sorted(steps) and steps[0] > last.get(rank, 0)
        last[rank] = steps[-1]
        lag = max(lag, at_s - steps[0] * b.step_s)
    assert n < 4 * 200 / 20  # batches of many steps, not a request per step
    assert 3.0 < lag < b.schedule_delay_s + 0.2

"""The simulator's shapes (``jobsim/``): what the regimes and faults do to the host and
device intervals, and when batched spans arrive. The detector's benchmarks stand on these."""

from __future__ import annotations

import otel_straggler_schema as s
from jobsim.arrival import Batching, batched
from jobsim.faults import Fault
from jobsim.job import Layout, StepModel
from jobsim.stream import JobStream, Noise, SimConfig

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


def _tokens_and_forward(cfg: SimConfig, step: int) -> dict[int, tuple[int, float, float]]:
    """rank -> (tokens, forward device ms, optimizer device ms) at ``step``, from the step summaries."""
    out: dict[int, tuple[int, float, float]] = {}
    for st, req in JobStream(cfg, []):
        if st != step:
            continue
        for rs in req.resource_spans:
            rank = next(a.value.int_value for a in rs.resource.attributes if a.key == s.RES_RANK)
            attrs = {a.key: a.value for a in rs.scope_spans[1].spans[0].attributes}
            names = [v.string_value for v in attrs[s.ATTR_SUMMARY_STAGES].array_value.values]
            dev = attrs[s.ATTR_SUMMARY_DEVICE_MS].array_value.values
            out[rank] = (attrs[s.ATTR_WORKLOAD_TOKENS].int_value, dev[names.index("forward-compute")].double_value,
                         dev[names.index("optimizer-inner-step")].double_value)
    return out


def test_token_spread_scales_forward_and_backward_with_each_rank_steps_tokens() -> None:
    base = SimConfig(layout=Layout(tp=1, dp=8), steps=30, step_model=StepModel.with_forward_ms(FWD), noise=_QUIET)
    flat = _tokens_and_forward(base, 30)
    spread = _tokens_and_forward(SimConfig(layout=base.layout, steps=30, step_model=base.step_model, noise=_QUIET,
                                           token_spread=0.3), 30)
    assert {v[0] for v in flat.values()} == {base.tokens_per_step}
    toks = [v[0] for v in spread.values()]
    assert min(toks) >= 0.7 * base.tokens_per_step and max(toks) <= 1.3 * base.tokens_per_step
    assert max(toks) / min(toks) > 1.1
    for tok, fwd, opt in spread.values():
        assert abs(fwd / FWD - tok / base.tokens_per_step) < 1e-3  # forward time follows the tokens
        assert opt == flat[0][2]  # the optimizer does not


def test_a_node_fault_slows_every_rank_of_its_host() -> None:
    cfg = SimConfig(layout=Layout(tp=1, dp=16), steps=30, step_model=StepModel.with_forward_ms(FWD), noise=_QUIET)
    got = _tokens_and_forward(cfg, 30)
    slowed = _tokens_and_forward_with(cfg, Fault("node", 10, ("forward-compute",), 0.10, 5))
    assert {r for r in slowed if slowed[r][1] > got[r][1]} == set(range(8, 16))  # node0001: ranks 8-15
    assert all(abs(slowed[r][1] - FWD * 1.1) < 1e-6 for r in range(8, 16))


def _tokens_and_forward_with(cfg: SimConfig, fault: Fault) -> dict[int, tuple[int, float, float]]:
    out: dict[int, tuple[int, float, float]] = {}
    for st, req in JobStream(cfg, [fault]):
        if st != cfg.steps:
            continue
        for rs in req.resource_spans:
            rank = next(a.value.int_value for a in rs.resource.attributes if a.key == s.RES_RANK)
            attrs = {a.key: a.value for a in rs.scope_spans[1].spans[0].attributes}
            names = [v.string_value for v in attrs[s.ATTR_SUMMARY_STAGES].array_value.values]
            dev = attrs[s.ATTR_SUMMARY_DEVICE_MS].array_value.values
            out[rank] = (0, dev[names.index("forward-compute")].double_value, 0.0)
    return out

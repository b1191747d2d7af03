"""Intermittent stragglers (``rules/intermittent_excess.py``, ``intermittent.py``): a rank much slower on
one step in every few (a periodic background job) costs the job per step what a steady straggler does, while its
window medians stay at par and no single step is evidence enough. It is convicted within a bounded number of
periods, with the period and the cost in the evidence; a single spike or one burst pages nobody.

The jobs are simulated Megatron span streams (``jobsim``: DP 8 x TP 2, 1 % device jitter,
heavy-tail spikes on random ranks) fed to the processor as OTLP requests; CUDA cannot run here, so device times
are the simulator's numbers in the attributes the emitter would set."""

from __future__ import annotations

from collections import deque

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory, intermittent
from collector_processor.processor.straggler.events import event_attributes, verdict_to_dict
from collector_processor.processor.straggler.intermittent import IntParams
from collector_processor.processor.straggler.model import Verdict
from collector_processor.processor.straggler.state import RankStageState
from collector_processor.telemetry import Telemetry
from jobsim.faults import COMPUTE_STAGES, Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, SimConfig

FWD = ("forward-compute",)  # 48 ms


def _run(fault: Fault | None, seed: int = 3, steps: int = 200, **overrides: object
         ) -> tuple[list[Verdict], dict[str, int]]:
    verdicts: list[Verdict] = []
    cfg = factory.create_default_config().model_copy(update=overrides)
    proc = factory.create_processor(cfg, Telemetry(), verdicts.extend)
    proc.start()
    sim = SimConfig(layout=Layout(tp=2, dp=8), steps=steps, seed=seed)
    for _step, req in JobStream(sim, [fault] if fault else []):
        proc.process_traces(req)
        proc.tick(0.0)
    proc.shutdown(5.0)
    return verdicts, proc.stats()


def _slow(verdicts: list[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER]


def test_a_periodic_spike_costing_a_steady_stragglers_share_is_convicted_with_period_and_cost() -> None:
    """Rank 5's forward-compute +30 % on one step in 8 from step 50 to 140: 14.4 ms every 8 steps, 1.8 ms per step
    (3.75 % of the stage, above the 2.5 % a steady straggler is convicted at). Convicted once, by
    ``intermittent_excess``, within 4 periods of the first spike, on that rank and stage only, with the period (8
    steps), the episodes and the cost per step in the verdict and its event; recovered after the job stops."""
    fault = Fault("periodic", 5, FWD, 0.30, 50, 140, period=8)
    for seed in (3, 4):
        verdicts, stats = _run(fault, seed=seed)
        slow = _slow(verdicts)
        assert [(v.rank, v.stage, v.reason) for v in slow] == [(5, "forward-compute", "intermittent_excess")], seed
        v = slow[0]
        assert v.step is not None and fault.onset <= v.step <= fault.onset + 4 * fault.period
        assert v.period_steps == 8.0 and v.episodes >= 4
        assert 1.2 <= v.step_time_lost_ms <= 2.0  # 14.4 ms / 8
        assert v.deviation is not None and 0.025 <= v.deviation <= 0.045
        assert v.attribution == s.ATTRIBUTION_GPU and v.gpu_seconds_per_hour > 0
        attrs = dict(event_attributes(v))
        assert attrs[s.EV_REASON] == "intermittent_excess" and attrs[s.EV_PERIOD_STEPS] == 8.0
        assert attrs[s.EV_EPISODES] == v.episodes and attrs[s.EV_STEP_TIME_LOST_MS] == v.step_time_lost_ms
        assert verdict_to_dict(v)["period_steps"] == 8.0
        assert "every 8 steps" in str(verdict_to_dict(v)["summary"])
        rec = [r for r in verdicts if r.verdict == s.VERDICT_RECOVERED and r.rank == 5]
        assert len(rec) == 1 and rec[0].step is not None and rec[0].step >= fault.end - fault.period  # type: ignore[operator]
        assert stats["intermittent_verdicts"] == 1


def test_a_long_period_is_found_within_its_bound() -> None:
    """+100 % on one step in 16 (3 ms per step): found within ``intermittent_min_episodes`` periods."""
    fault = Fault("periodic", 11, FWD, 1.0, 45, 170, period=16)
    slow = _slow(_run(fault)[0])
    assert [(v.rank, v.reason, v.period_steps) for v in slow] == [(11, "intermittent_excess", 16.0)]
    assert slow[0].step is not None and slow[0].step <= fault.onset + 4 * fault.period


def test_single_spikes_and_one_burst_page_nobody() -> None:
    """One step +200 % (a GC pause), one 5-step burst +100 % on every compute stage (a checkpoint on one rank), and
    spikes that recur but cost less than the smallest steady straggler (+10 % every 10 steps: 1 %) convict
    nobody."""
    for fault in (Fault("burst", 2, FWD, 2.0, 60, period=1), Fault("burst", 9, COMPUTE_STAGES, 1.0, 60, period=5),
                  Fault("periodic", 6, FWD, 0.10, 50, 190, period=10)):
        verdicts, stats = _run(fault)
        assert _slow(verdicts) == [], fault.label()
        assert stats["intermittent_verdicts"] == 0


def test_the_rule_switched_off_gives_no_verdict() -> None:
    """``intermittent: false``: the periodic rank goes unseen, as every steady rule leaves it."""
    verdicts, _ = _run(Fault("periodic", 5, FWD, 0.30, 50, 140, period=8), intermittent=False)
    assert _slow(verdicts) == []


def _params(**kw: float) -> IntParams:
    base = {"history": 100, "min_episodes": 4, "spike_z": 6.0, "min_spike": 0.04, "margin": 0.025, "floor_ms": 0.5,
            "recent_steps": 10}
    base.update(kw)
    return IntParams(**base)  # type: ignore[arg-type]


def _feed(spikes: dict[int, float], steps: int, base: float = 50.0) -> list[intermittent.IntResult | None]:
    st = RankStageState()
    out: list[intermittent.IntResult | None] = []
    for w in range(steps // 5):
        items = [(t, base * (1.0 + spikes.get(t, 0.0)), base) for t in range(5 * w, 5 * w + 5)]
        out.append(intermittent.update(st, items, 0.01, _params()))
    return out


def test_cost_is_episode_rate_times_the_median_episode() -> None:
    """Every 5th step +40 % of 50 ms: 20 ms per episode, one in 5 steps, 4 ms per step; a burst of consecutive
    spike steps is one episode, so one long pause never fires; nothing is kept while no episode is in the
    lookback."""
    res = _feed({t: 0.4 for t in range(3, 200, 5)}, 200)
    last = res[-1]
    assert last is not None and last.fires and last.period_steps == 5.0
    assert abs(last.recent_cost_ms - 4.0) < 1e-9 and 3.5 <= last.cost_ms <= 4.0
    burst = _feed({t: 3.0 for t in range(20, 40)}, 150)
    assert all(r is None or (not r.fires and r.cost_ms == 0.0) for r in burst)
    assert burst[-1] is None  # the burst left the lookback: the history is dropped
    assert _feed({}, 50) == [None] * 10


def test_history_is_bounded_by_the_lookback() -> None:
    st = RankStageState()
    for w in range(400):
        items = [(t, 80.0 if t % 2 == 0 else 50.0, 50.0) for t in range(5 * w, 5 * w + 5)]
        intermittent.update(st, items, 0.01, _params())
    assert st.intm is not None
    assert len(st.intm.steps) == len(st.intm.refs) <= 100 and len(st.intm.episodes) <= 100
    assert isinstance(st.intm.episodes, deque)


def test_on_one_machine_a_periodic_gpu_is_convicted_and_contention_is_not() -> None:
    """DP 8 on one host: a periodic GPU fault on rank 4 is convicted (its peers do not spike), while a machine whose
    CPUs deschedule every rank in turn (``contention``) starves the streams of all its ranks: their episodes are
    shared, ``uncertain/host_contention``, and nobody is paged."""
    verdicts: list[Verdict] = []
    for fault in (Fault("periodic", 4, FWD, 0.30, 50, 170, period=6),
                  Fault("contention", 3, ("batch-generator", *COMPUTE_STAGES, "optimizer-inner-step"), 1.0, 1)):
        verdicts = []
        proc = factory.create_processor(factory.create_default_config(), Telemetry(), verdicts.extend)
        proc.start()
        for _step, req in JobStream(SimConfig(layout=Layout(tp=1, dp=8), steps=200, seed=2, ddp=True), [fault]):
            proc.process_traces(req)
            proc.tick(0.0)
        proc.shutdown(5.0)
        slow = _slow(verdicts)
        if fault.kind == "periodic":
            assert [(v.rank, v.reason) for v in slow] == [(4, "intermittent_excess")]
        else:
            assert slow == [] and any(v.reason == "host_contention" for v in verdicts)


def test_a_steady_straggler_is_called_steady() -> None:
    """+7 % on every step of forward-compute: many of its noisy steps clear the spike threshold, but its typical
    step is slow, so the steady rules convict it, never ``intermittent_excess``."""
    for seed in (3, 9):
        slow = _slow(_run(Fault("device", 9, FWD, 0.07, 45, 105), seed=seed, steps=150)[0])
        assert slow and {(v.rank, v.stage) for v in slow} == {(9, "forward-compute")}
        assert all(v.reason in ("slower_than_reference", "persistent_excess") for v in slow)


def test_tp_peers_waiting_for_a_periodic_gpu_are_victims_not_pages() -> None:
    """TP 4 x DP 8 whose TP peers end each compute stage together (``mp_sync``): rank 5's GPU spikes on one step in
    6, and its TP peers (ranks 4, 6, 7) spike with it inside their compute timers. Each is convicted
    intermittently there, but as one group (``group_slow`` naming dp1, its members ``victim_of`` it): no member
    of the group pages on its own in a compute stage."""
    verdicts: list[Verdict] = []
    proc = factory.create_processor(factory.create_default_config(), Telemetry(), verdicts.extend)
    proc.start()
    fault = Fault("periodic", 5, COMPUTE_STAGES, 0.5, 45, 170, period=6)
    for _step, req in JobStream(SimConfig(layout=Layout(tp=4, dp=8), steps=200, seed=1, mp_sync=True), [fault]):
        proc.process_traces(req)
        proc.tick(0.0)
    proc.shutdown(5.0)
    slow = _slow(verdicts)
    groups = [v for v in slow if v.group_ranks]
    assert groups and all(v.group_ranks == (4, 5, 6, 7) and v.reason == "group_slow" for v in groups)
    members = [v for v in slow if not v.group_ranks]
    assert members and {v.rank for v in members} <= {4, 5, 6, 7}
    assert all(v.victim_of == "group:dp1.pp0" and v.step_time_lost_ms == 0.0 for v in members)


def test_episodes_count_only_when_the_peers_spike_far_less_often() -> None:
    """``against_peers``: 5 episodes in 100 steps are the rank's own among quiet peers, not among peers spiking at
    about the same rate (heavy-tail noise on every rank)."""
    def res(episodes: int) -> intermittent.IntResult:
        return intermittent.IntResult(True, True, 2.0, 2.0, 50.0, 8.0, episodes, 100)

    quiet = {1: res(5)}
    intermittent.against_peers(quiet, list(range(8)))
    assert quiet[1].fires
    noisy = {r: res(5 if r == 1 else 2) for r in range(8)}
    intermittent.against_peers(noisy, list(range(8)))
    assert not noisy[1].fires
    assert intermittent.poisson_tail(4, 0.0) == 0.0 and abs(intermittent.poisson_tail(1, 1.0) - 0.6321) < 1e-4

"""Waits in the model-parallel group's collectives (``rules/mp_wait.py``, ``culprit.py``): a rank slow
in the optimizer's found-inf / grad-norm / zero-count all-reduces waits for a member of its group. It is never
convicted there, its host is not a bad node for it, no group verdict is made of it, and a rank that waits is
never its group's culprit.

The simulated jobs run ``mp_optimizer_sync`` (every rank of a DP replica waits in ``optimizer-clip-main-grad``
for the replica's slowest compute) and ``mp_sync`` (TP peers end each compute stage together)."""

from __future__ import annotations

from dataclasses import replace

from test_straggler_culprit import _Cohort, _Registry, _verdict

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory
from collector_processor.processor.straggler.culprit import Correlator
from collector_processor.processor.straggler.model import Verdict
from collector_processor.telemetry import Telemetry
from jobsim.faults import COMPUTE_STAGES, Fault
from jobsim.job import Layout
from jobsim.stream import MP_OPT_WAIT_STAGE, JobStream, SimConfig

GPU_WIDE = (*COMPUTE_STAGES, "optimizer-inner-step")
TP4PP2 = Layout(tp=4, pp=2, dp=4)  # ranks 0-15 pipeline stage 0, 16-31 stage 1; 8 GPUs per host


def _run(layout: Layout, fault: Fault, seed: int = 1, **overrides: object) -> tuple[list[Verdict], dict[str, int]]:
    verdicts: list[Verdict] = []
    cfg = factory.create_default_config().model_copy(update=overrides)
    proc = factory.create_processor(cfg, Telemetry(), verdicts.extend)
    proc.start()
    sim = SimConfig(layout=layout, steps=120, seed=seed, mp_sync=True, mp_optimizer_sync=True)
    for _step, req in JobStream(sim, [fault]):
        proc.process_traces(req)
        proc.tick(0.0)
    proc.shutdown(5.0)
    return verdicts, proc.stats()


def _slow(verdicts: list[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER]


def test_the_other_pipeline_stage_waiting_in_the_optimizer_pages_no_healthy_host() -> None:
    """TP 4 x PP 2 x DP 4, host node0000 (pipeline stage 0 of replicas 0 and 1) slowed on every GPU. Stage 1
    of those replicas (host node0002, healthy) waits in the grad-norm all-reduce: those ranks are
    ``uncertain/collective_wait`` there, no straggler verdict is on any host but node0000, the only node
    verdict names node0000, and no group verdict names a group of stage 1 (which has no slow member)."""
    for seed in (1, 2):
        verdicts, stats = _run(TP4PP2, Fault("node", 0, GPU_WIDE, 0.10, 45, 100), seed=seed)
        slow = _slow(verdicts)
        assert slow and {v.host for v in slow} == {"node0000"}, seed
        nodes = [v for v in slow if v.stage == s.NODE_STAGE]
        assert [v.node for v in nodes] == ["node0000"]
        groups = [v for v in slow if v.group_ranks]
        assert all(max(v.group_ranks) < 16 and not v.mp_group.endswith("pp1") for v in groups)
        waits = [v for v in verdicts if v.stage == MP_OPT_WAIT_STAGE and v.reason == "collective_wait"]
        assert {v.rank for v in waits} == set(range(16, 24))  # replicas 0 and 1 of stage 1
        assert all(v.verdict == s.VERDICT_UNCERTAIN for v in waits)
        assert stats["mp_wait_windows"] > 0


def test_mp_wait_off_convicts_the_waiters_again() -> None:
    """``mp_wait_stages: []``: the waits are judged as the rank's own time (what the rule prevents)."""
    verdicts, stats = _run(TP4PP2, Fault("node", 0, GPU_WIDE, 0.10, 45, 100), mp_wait_stages=[])
    assert "node0002" in {v.host for v in _slow(verdicts)} and stats["mp_wait_windows"] == 0


def test_a_culprit_gpu_is_named_across_tp_and_pp() -> None:
    """TP 2 x PP 2 x DP 8, rank 5 (TP 1, replica 2, stage 0) slow on its GPU: its TP peer is its victim, the
    other pipeline stage of its replica waits in the optimizer and is convicted of nothing."""
    verdicts, _ = _run(Layout(tp=2, pp=2, dp=8), Fault("device", 5, GPU_WIDE, 0.15, 45, 100))
    slow = _slow(verdicts)
    assert {v.rank for v in slow} <= {4, 5}
    assert all(v.victim_of == "rank:5" for v in slow if v.rank == 4)
    assert [v for v in slow if v.rank == 5 and v.victims == (4,)]
    assert not [v for v in slow if v.group_ranks]


def _pair() -> tuple[Correlator, _Cohort, _Cohort]:
    c0 = _Cohort("e0/s/tp0.pp0.vpp0.cp0.ep0.etp0.c0", {0: 0})
    c1 = _Cohort("e0/s/tp1.pp0.vpp0.cp0.ep0.etp0.c0", {1: 0})
    return Correlator(factory.create_default_config(), {}, _Registry([c0, c1])), c0, c1  # type: ignore[arg-type]


def test_a_member_that_waits_is_never_the_culprit() -> None:
    """Rank 1 reads slow alone in two windows, but it waited in its group's all-reduce in them: it is a
    victim, not the culprit; with nobody else standing out the group is said."""
    corr, c0, c1 = _pair()
    for idx in (7, 8):
        corr.window(c0, idx, {(0, "forward-compute"): (0.1, True), (0, "optimizer-inner-step"): (0.0, False)},
                    [])  # type: ignore[arg-type]
        corr.window(c1, idx, {(1, "forward-compute"): (0.1, True), (1, "optimizer-inner-step"): (0.1, True)},
                    [(1, "optimizer-clip-main-grad")])  # type: ignore[arg-type]
    out = corr.observe([_verdict(0, c0.key), _verdict(1, c1.key)])
    assert not [v for v in out if v.victims]
    assert [v.reason for v in out if v.derived] == ["group_slow"]


def test_a_named_culprit_outrun_by_its_victim_is_the_group() -> None:
    """The timers name rank 1 (slow alone twice), but rank 0, which would wait for it, is slower beyond the
    noise in the stage both are convicted in: the evidence conflicts, so the group, not a guess."""
    corr, c0, c1 = _pair()
    for idx in (7, 8):
        corr.window(c0, idx, {(0, "forward-compute"): (0.1, True), (0, "optimizer-inner-step"): (0.0, False)})  # type: ignore[arg-type]
        corr.window(c1, idx, {(1, "forward-compute"): (0.1, True), (1, "optimizer-inner-step"): (0.1, True)})  # type: ignore[arg-type]
    out = corr.observe([replace(_verdict(0, c0.key), deviation=0.30), replace(_verdict(1, c1.key), deviation=0.15)])
    assert [v.reason for v in out if v.derived] == ["group_slow"]
    assert {v.victim_of for v in out if not v.derived} == {"group:dp0.pp0"}
    corr, c0, c1 = _pair()
    for idx in (7, 8):
        corr.window(c0, idx, {(0, "forward-compute"): (0.1, True), (0, "optimizer-inner-step"): (0.0, False)})  # type: ignore[arg-type]
        corr.window(c1, idx, {(1, "forward-compute"): (0.1, True), (1, "optimizer-inner-step"): (0.1, True)})  # type: ignore[arg-type]
    out = corr.observe([replace(_verdict(0, c0.key), deviation=0.15), replace(_verdict(1, c1.key), deviation=0.16)])
    assert [v.victims for v in out if v.rank == 1] == [(0,)]  # at par within the noise: the culprit stands

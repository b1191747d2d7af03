"""Culprit versus victims (``culprit.py``): the ranks of one model-parallel group slow together are one verdict,
naming the culprit when a stage shows it slow alone, else the group; the victims reference it and page nothing.

The simulated jobs run with ``mp_sync`` (TP/CP peers of one DP replica end each compute stage together, as the
all-reduces inside Megatron's compute timers make them) and ``pp_sync`` (pipeline stages wait in ``p2p``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory
from collector_processor.processor.straggler.culprit import Correlator
from collector_processor.processor.straggler.events import event_attributes, summary
from collector_processor.processor.straggler.model import Verdict
from collector_processor.telemetry import Telemetry
from jobsim.faults import COMPUTE_STAGES, Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, SimConfig

GPU_WIDE = (*COMPUTE_STAGES, "optimizer-inner-step")  # a slow GPU: its collective-free optimizer step too


def _run(layout: Layout, fault: Fault, seed: int = 1, tel: Telemetry | None = None, pp_sync: bool = False,
         **overrides: object) -> list[Verdict]:
    verdicts: list[Verdict] = []
    cfg = factory.create_default_config().model_copy(update=overrides)
    proc = factory.create_processor(cfg, tel or Telemetry(), verdicts.extend)
    proc.start()
    for _step, req in JobStream(SimConfig(layout=layout, steps=120, seed=seed, mp_sync=True, pp_sync=pp_sync),
                                [fault]):
        proc.process_traces(req)
        proc.tick(0.0)
    proc.shutdown(5.0)
    return verdicts


def _slow(verdicts: list[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER]


def test_a_tp_culprit_is_named_once_and_its_peers_are_its_victims() -> None:
    """TP 4 x DP 8, rank 13 (TP 1 of replica 3) +15 % on its GPU: its 3 TP peers wait inside their compute
    timers and are each slow in their own cohort, but only rank 13 is slow in the optimizer's inner step. Its
    verdicts list the victims; theirs say ``victim_of = rank:13``, carry no cost, and page nothing (their alert
    series carry ``covered_by``)."""
    tel = Telemetry(CollectorRegistry())
    verdicts = _run(Layout(tp=4, dp=8), Fault("device", 13, GPU_WIDE, 0.15, 45, 100), tel=tel)
    slow = _slow(verdicts)
    assert {v.rank for v in slow} == {12, 13, 14, 15}  # the replica's TP group, no other rank
    culprit = [v for v in slow if v.rank == 13 and v.stage in COMPUTE_STAGES]
    assert {v.stage for v in culprit} == set(COMPUTE_STAGES)
    assert all(v.victims == (12, 14, 15) and v.mp_group == "dp3.pp0" and not v.victim_of and v.step_time_lost_ms > 0
               for v in culprit)
    victims = [v for v in slow if v.rank != 13]
    assert victims and all(v.victim_of == "rank:13" and v.step_time_lost_ms == 0.0 and v.gpu_seconds_per_hour == 0.0
                           for v in victims)
    assert not [v for v in slow if v.reason == "group_slow"]
    attrs = dict(event_attributes(culprit[0]))
    assert attrs[s.EV_VICTIMS] == [12, 14, 15] and attrs[s.EV_GROUP] == "dp3.pp0"
    assert dict(event_attributes(victims[0]))[s.EV_VICTIM_OF] == "rank:13"
    assert "culprit of group dp3.pp0" in summary(culprit[0]) and "waits for rank:13" in summary(victims[0])
    # what a StragglerDetected alert reads: the victims' series are covered, the culprit's page
    covered = {(smp.labels["rank"], smp.labels.get(s.L_COVERED_BY, "")) for fam in tel.registry.collect()
               if fam.name == s.M_STRAGGLER_ACTIVE for smp in fam.samples}
    assert {r for r, c in covered if not c} == {"13"}
    assert {r for r, c in covered if c} == {"12", "14", "15"} and {c for _, c in covered if c} == {"rank:13"}


def test_identical_excess_everywhere_is_said_as_the_group_not_four_culprits() -> None:
    """The same fault confined to the compute stages (which hold the TP all-reduces): every member's timers read
    the same, no stage shows one alone. One ``group_slow`` verdict per stage names the group and its ranks, with
    the cost once; every member is its victim (``victim_of = group:dp3.pp0``), none is called the culprit; the
    group verdict ends with ``recovered``."""
    tel = Telemetry(CollectorRegistry())
    verdicts = _run(Layout(tp=4, dp=8), Fault("device", 13, COMPUTE_STAGES, 0.15, 45, 100), tel=tel)
    groups = [v for v in verdicts if v.reason == "group_slow" or (v.group_ranks and v.verdict == s.VERDICT_RECOVERED)]
    opened = [v for v in groups if v.verdict == s.VERDICT_STRAGGLER]
    assert sorted(v.stage for v in opened) == sorted(COMPUTE_STAGES)
    assert all(v.group_ranks == (12, 13, 14, 15) and v.mp_group == "dp3.pp0" and v.step_time_lost_ms > 0
               for v in opened)
    assert sorted(v.stage for v in groups if v.verdict == s.VERDICT_RECOVERED) == sorted(COMPUTE_STAGES)
    members = [v for v in _slow(verdicts) if not v.group_ranks]
    assert {v.rank for v in members} == {12, 13, 14, 15}
    assert all(v.victim_of == "group:dp3.pp0" and not v.victims and v.step_time_lost_ms == 0.0 for v in members)
    assert dict(event_attributes(opened[0]))[s.EV_GROUP_RANKS] == [12, 13, 14, 15]
    paging = {(smp.labels["rank"], smp.labels["stage"]) for fam in tel.registry.collect()
              if fam.name == s.M_STRAGGLER_ACTIVE for smp in fam.samples
              if not smp.labels.get(s.L_COVERED_BY) and smp.value > 0}
    assert paging == set()  # recovered by the end
    ranks = {smp.labels["rank"] for fam in tel.registry.collect() if fam.name == s.M_STRAGGLER_ACTIVE
             for smp in fam.samples if not smp.labels.get(s.L_COVERED_BY)}
    assert ranks == {"12,13,14,15"}  # only the group's series ever paged


def test_a_cp_culprit_among_tp_and_cp_peers() -> None:
    """TP 2 x CP 2 x DP 6: the group of rank 9 is its replica's 4 TP and CP peers (ranks 8-11)."""
    verdicts = _run(Layout(tp=2, cp=2, dp=6), Fault("device", 9, GPU_WIDE, 0.15, 45, 100))
    slow = _slow(verdicts)
    assert {v.rank for v in slow} == {8, 9, 10, 11}
    assert all(v.victims == (8, 10, 11) for v in slow if v.rank == 9 and v.stage in COMPUTE_STAGES)
    assert all(v.victim_of == "rank:9" for v in slow if v.rank != 9)


def test_pipeline_waits_land_in_p2p_and_convict_no_other_stage() -> None:
    """PP 2 x DP 8: the slow stage's partner waits in ``forward-recv`` (p2p, never judged); only the culprit is
    convicted, and alone it needs no correlation."""
    verdicts = _run(Layout(pp=2, dp=8), Fault("device", 3, GPU_WIDE, 0.15, 45, 100), pp_sync=True)
    slow = _slow(verdicts)
    assert slow and {v.rank for v in slow} == {3}
    assert all(not v.victims and not v.victim_of for v in slow)


def test_without_the_rule_every_member_is_convicted_with_its_own_cost() -> None:
    verdicts = _run(Layout(tp=4, dp=8), Fault("device", 13, GPU_WIDE, 0.15, 45, 100), culprit=False)
    slow = [v for v in _slow(verdicts) if v.stage == "forward-compute"]
    assert {v.rank for v in slow} == {12, 13, 14, 15}
    assert all(v.step_time_lost_ms > 0 and not v.victim_of for v in slow)


class _Info:
    def __init__(self, dp: int) -> None:
        self.dp_rank = dp


class _Cohort:
    def __init__(self, key: str, ranks: dict[int, int]) -> None:
        self.job = "j"
        self.key = key
        self.ranks = {r: _Info(dp) for r, dp in ranks.items()}


class _Registry:
    def __init__(self, cohorts: list[_Cohort]) -> None:
        self.by = {(c.job, c.key): c for c in cohorts}

    def find(self, job: str, key: str) -> _Cohort | None:
        return self.by.get((job, key))


def _verdict(rank: int, cohort: str, stage: str = "forward-compute") -> Verdict:
    return Verdict(job="j", cohort=cohort, rank=rank, host="h", gpu=f"g{rank}", stage=stage, group="forward",
                   verdict=s.VERDICT_STRAGGLER, reason="slower_than_reference", deviation=0.1, value_ms=11.0,
                   reference_rank=None, reference_ms=10.0, measurement=s.MEASUREMENT_DEVICE, window_start=0,
                   window_end=4, step=4, attribution=s.ATTRIBUTION_GPU, step_time_lost_ms=1.0,
                   gpu_seconds_per_hour=1.0, cohort_size=8, collective_evidence="", trace_id=b"")


def _correlator(beyond: dict[int, list[tuple[int, str]]]) -> tuple[Correlator, list[Verdict]]:
    """Ranks 0 (cohort tp0) and 1 (tp1) of replica 0; ``beyond``: window index -> (rank, stage) beyond there;
    every rank judged in forward-compute and optimizer-inner-step in every window."""
    c0 = _Cohort("e0/s/tp0.pp0.vpp0.cp0.ep0.etp0.c0", {0: 0})
    c1 = _Cohort("e0/s/tp1.pp0.vpp0.cp0.ep0.etp0.c0", {1: 0})
    corr = Correlator(factory.create_default_config(), {}, _Registry([c0, c1]))  # type: ignore[arg-type]
    for idx, slow in sorted(beyond.items()):
        for cohort, rank in ((c0, 0), (c1, 1)):
            ex = {(rank, st): (0.1 if (rank, st) in slow else 0.0, (rank, st) in slow)
                  for st in ("forward-compute", "optimizer-inner-step")}
            corr.window(cohort, idx, ex)  # type: ignore[arg-type]
    return corr, [_verdict(0, c0.key), _verdict(1, c1.key)]


def test_one_noisy_window_alone_names_no_culprit() -> None:
    """Solo evidence must hold in two windows: one window where rank 1 alone read slow in the optimizer (noise)
    leaves the group undecided between its members: a group verdict."""
    both = [(0, "forward-compute"), (1, "forward-compute")]
    corr, verdicts = _correlator({7: [*both, (1, "optimizer-inner-step")], 8: both})
    out = corr.observe(verdicts)
    assert [v.reason for v in out if v.derived] == ["group_slow"]
    assert {v.victim_of for v in out if not v.derived} == {"group:dp0.pp0"}


def test_two_members_slow_alone_alike_is_the_group() -> None:
    """Both members slow alone somewhere in as many windows: the timers cannot tell, so the group."""
    both = [(0, "forward-compute"), (1, "forward-compute")]
    corr, verdicts = _correlator({7: [*both, (0, "optimizer-inner-step")], 8: [*both, (1, "optimizer-inner-step")],
                                  9: [*both, (0, "optimizer-inner-step")], 10: [*both, (1, "optimizer-inner-step")]})
    out = corr.observe(verdicts)
    assert [v.group_ranks for v in out if v.derived] == [(0, 1)]


def test_a_member_slow_alone_in_two_windows_is_the_culprit() -> None:
    both = [(0, "forward-compute"), (1, "forward-compute")]
    corr, verdicts = _correlator({7: [*both, (1, "optimizer-inner-step")], 8: [*both, (1, "optimizer-inner-step")]})
    out = corr.observe(verdicts)
    assert not [v for v in out if v.derived]
    by_rank = {v.rank: v for v in out}
    assert by_rank[1].victims == (0,) and by_rank[0].victim_of == "rank:1" and by_rank[0].step_time_lost_ms == 0.0


def test_groups_tracked_are_bounded_and_evictions_counted() -> None:
    counters: dict[str, int] = {}
    cfg = factory.create_default_config().model_copy(update={"culprit_max_groups": 2})
    cohort = _Cohort("e0/s/tp0.pp0.vpp0.cp0.ep0.etp0.c0", {r: r for r in range(5)})
    corr = Correlator(cfg, counters, _Registry([cohort]))  # type: ignore[arg-type]
    corr.window(cohort, 3, {(r, "forward-compute"): (0.0, False) for r in range(5)})  # type: ignore[arg-type]
    assert len(corr.groups) == 2 and counters["culprit_groups_evicted"] == 3


def test_the_bench_scores_culprit_victims_and_group() -> None:
    """``score_run`` with a group (``jobsim/score.py``): a victim without ``victim_of`` is a victim convicted,
    not a false alarm; with it, explained; a rank outside the replica is a false alarm; the culprit's verdict
    is the detection, or where the group is the answer the group verdict naming it."""
    from dataclasses import replace

    from jobsim.score import score_run

    fault = Fault("device", 13, GPU_WIDE, 0.15, 45, 100)
    culprit = replace(_verdict(13, "c"), step=54, window_end=54)
    waiting = replace(_verdict(12, "c"), step=54)
    assert score_run(fault, [culprit, waiting], 100, group={12, 13, 14, 15}).victims_convicted == 1
    res = score_run(fault, [replace(waiting, victim_of="rank:13"), culprit, replace(_verdict(3, "c"), step=60)],
                    100, group={12, 13, 14, 15})
    assert (res.detected, res.steps_to_detect, res.victims_convicted, res.false_alarms) == (True, 9, 0, 1)
    group = replace(culprit, rank=12, group_ranks=(12, 13, 14, 15), derived=True, reason="group_slow")
    res = score_run(fault, [group, replace(culprit, victim_of="group:dp3.pp0")], 100, group={12, 13, 14, 15},
                    expect_group=True)
    assert res.detected and res.victims_convicted == 0 and res.false_alarms == 0
    assert score_run(fault, [culprit], 100, group={12, 13, 14, 15}, expect_group=True).victims_convicted == 1


def test_a_cohort_closing_an_old_window_late_is_no_evidence_and_no_fault() -> None:
    """Cohorts close their windows apart (batched delivery): a window older than every one kept is left out."""
    cfg = factory.create_default_config().model_copy(update={"culprit_history_windows": 2})
    cohort = _Cohort("e0/s/tp0.pp0.vpp0.cp0.ep0.etp0.c0", {0: 0})
    corr = Correlator(cfg, {}, _Registry([cohort]))  # type: ignore[arg-type]
    for idx in (7, 8, 3):
        corr.window(cohort, idx, {(0, "forward-compute"): (0.1, True)})  # type: ignore[arg-type]
    (g,) = corr.groups.values()
    assert sorted(g.judged) == sorted(g.windows) == [7, 8]

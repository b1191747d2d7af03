"""Node verdicts (``node.py``): most ranks of one host slow together are said once, as one node verdict naming
the host, its GPUs and ranks; the rank verdicts it covers reference it."""

from __future__ import annotations

from dataclasses import replace

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory
from collector_processor.processor.straggler.events import event_attributes
from collector_processor.processor.straggler.model import Verdict
from collector_processor.processor.straggler.node import NodeVerdicts
from collector_processor.telemetry import Telemetry
from jobsim.faults import COMPUTE_STAGES, Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, SimConfig

NODE0 = "node0000"  # ranks 0-7 of DP 8 x TP 2 (8 GPUs per host): half of each cohort


def _run(faults: list[Fault], seed: int = 1, **overrides: object) -> list[Verdict]:
    verdicts: list[Verdict] = []
    cfg = factory.create_default_config().model_copy(update=overrides)
    proc = factory.create_processor(cfg, Telemetry(), verdicts.extend)
    proc.start()
    for _step, req in JobStream(SimConfig(layout=Layout(tp=2, dp=8), steps=130, seed=seed), faults):
        proc.process_traces(req)
        proc.tick(0.0)
    proc.shutdown(5.0)
    return verdicts


def _nodes(verdicts: list[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if v.stage == s.NODE_STAGE]


def test_a_bad_node_is_one_node_verdict_that_its_rank_verdicts_reference() -> None:
    for seed in (1, 2):
        verdicts = _run([Fault("node", 3, COMPUTE_STAGES, 0.10, 45, 100)], seed)
        nodes = _nodes(verdicts)
        assert [(v.verdict, v.reason) for v in nodes] == [(s.VERDICT_STRAGGLER, "node_slow"),
                                                          (s.VERDICT_RECOVERED, "within_tolerance")], seed
        node, ended = nodes
        assert node.host == node.node == NODE0 and node.node_ranks == tuple(range(8))
        assert node.node_gpus == tuple(f"GPU-sim-{r:05d}" for r in range(8))
        assert node.window_end - 45 <= 15 and ended.window_end >= 100
        assert 0 < node.step_time_lost_ms < 20.0  # the worst rank's excess, counted once
        ranks = [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER and v.stage != s.NODE_STAGE]
        assert {v.host for v in ranks} == {NODE0}  # no healthy host convicted
        during = [v for v in ranks if v.window_end >= node.window_end]
        assert during and all(v.node == NODE0 for v in during)
        attrs = dict(event_attributes(node))
        assert attrs[s.EV_NODE] == NODE0 and attrs[s.EV_NODE_RANKS] == list(range(8))
        assert dict(event_attributes(during[0]))[s.EV_NODE] == NODE0


def test_one_slow_rank_is_no_node_verdict() -> None:
    verdicts = _run([Fault("device", 5, COMPUTE_STAGES, 0.10, 45, 100)])
    assert not _nodes(verdicts)
    slow = [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER]
    assert slow and {v.rank for v in slow} == {5} and all(v.node == "" for v in slow)
    assert s.EV_NODE not in dict(event_attributes(slow[0]))


def test_node_verdicts_can_be_turned_off() -> None:
    verdicts = _run([Fault("node", 3, COMPUTE_STAGES, 0.10, 45, 100)], node_verdicts=False)
    assert not _nodes(verdicts) and all(v.node == "" for v in verdicts)


def _verdict(host: str, rank: int, verdict: str = s.VERDICT_STRAGGLER) -> Verdict:
    return Verdict(job="j", cohort="c", rank=rank, host=host, gpu=f"g{rank}", stage="forward-compute",
                   group="forward", verdict=verdict, reason="slower_than_reference", deviation=0.1, value_ms=11.0,
                   reference_rank=9, reference_ms=10.0, measurement=s.MEASUREMENT_DEVICE, window_start=0,
                   window_end=4, step=4, attribution=s.ATTRIBUTION_GPU, step_time_lost_ms=1.0,
                   gpu_seconds_per_hour=1.0, cohort_size=8, collective_evidence="", trace_id=b"")


class _Cohort:
    def __init__(self, hosts: dict[int, str]) -> None:
        self.job = "j"
        self.ranks = {r: type("Info", (), {"host": h})() for r, h in hosts.items()}


def test_hosts_tracked_are_bounded_and_evictions_counted() -> None:
    cfg = factory.create_default_config().model_copy(update={"node_max_hosts": 2})
    c: dict[str, int] = {}
    nodes = NodeVerdicts(cfg, c)
    cohorts = [_Cohort({r: f"h{r // 4}" for r in range(16)})]
    for h in range(4):  # one slow rank per host: no node verdict, each host tracked
        nodes.observe([_verdict(f"h{h}", 4 * h)], cohorts)  # type: ignore[list-item]
    assert len(nodes.hosts) == 2 and c["node_hosts_evicted"] == 2
    # three of h3's four ranks: a node verdict; a recovery back to two of four ends it (not more than half)
    out = nodes.observe([_verdict("h3", 13), _verdict("h3", 14)], cohorts)  # type: ignore[list-item]
    assert [v.reason for v in out if v.stage == s.NODE_STAGE] == ["node_slow"]
    assert all(v.node == "h3" for v in out)
    out = nodes.observe([replace(_verdict("h3", 14), verdict=s.VERDICT_RECOVERED)], cohorts)  # type: ignore[list-item]
    assert [v.verdict for v in out if v.stage == s.NODE_STAGE] == [s.VERDICT_RECOVERED]


def test_a_node_verdict_pages_once_and_its_rank_alerts_are_covered() -> None:
    """The metrics a Prometheus alert reads: while the node verdict holds, every rank alert series of its host
    carries ``covered_by="node:<host>"`` and no cost (StragglerDetected selects ``covered_by=""``), and the node
    verdict has one series of its own (stage ``node``, ``rank`` listing its ranks) with the job's cost once;
    after the node recovers its series reads 0."""
    from prometheus_client import CollectorRegistry

    tel = Telemetry(CollectorRegistry())
    verdicts: list[Verdict] = []
    proc = factory.create_processor(factory.create_default_config(), tel, verdicts.extend)
    proc.start()
    during: list[dict[str, tuple[str, float]]] = []
    for step, req in JobStream(SimConfig(layout=Layout(tp=2, dp=8), steps=130, seed=1),
                               [Fault("node", 3, COMPUTE_STAGES, 0.10, 45, 100)]):
        proc.process_traces(req)
        proc.tick(0.0)
        if step == 90:
            during.append(_active_series(tel))
    proc.shutdown(5.0)
    (now,) = during
    paging = {k: v for k, v in now.items() if v[0] == "" and v[1] > 0}
    covered = {k: v for k, v in now.items() if v[0] == f"node:{NODE0}"}
    assert list(paging) == [("node", ",".join(str(r) for r in range(8)), NODE0)], paging
    assert covered and all(k[2] == NODE0 and k[0] != "node" for k in covered)
    assert all(v[2] == 0.0 for v in covered.values()) and next(iter(paging.values()))[2] > 0  # cost once
    after = _active_series(tel)
    assert all(v[1] == 0.0 for k, v in after.items() if k[0] == "node")


def _active_series(tel: Telemetry) -> dict[tuple[str, str, str], tuple[str, float, float]]:
    """(stage, rank, host) -> (covered_by, otel_straggler_active, otel_straggler_step_time_lost_seconds)."""
    out: dict[tuple[str, str, str], tuple[str, float, float]] = {}
    lost: dict[tuple[str, ...], float] = {}
    fams = list(tel.registry.collect())
    for fam in fams:
        if fam.name == s.M_STEP_TIME_LOST:
            for smp in fam.samples:
                lost[tuple(sorted(smp.labels.items()))] = smp.value
    for fam in fams:
        if fam.name != s.M_STRAGGLER_ACTIVE:
            continue
        for smp in fam.samples:
            lb = smp.labels
            out[(lb["stage"], lb["rank"], lb.get("host", ""))] = (
                lb.get(s.L_COVERED_BY, ""), smp.value, lost[tuple(sorted(lb.items()))])
    return out

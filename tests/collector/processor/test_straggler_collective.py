"""Stages that hold a wait in a collective (plain PyTorch DDP: the gradient all-reduce inside ``loss.backward()``):
``collective_wait`` recognises the waiters, a stage marked collective is evidence only. Hand-built requests
with exact values, then the simulator's DDP job. Each test also shows the outcome without the rule."""

from __future__ import annotations

import time

from straggler_build import request, span
from straggler_sim import kv, make_processor

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory
from collector_processor.processor.straggler.config import Config
from collector_processor.telemetry import Telemetry
from jobsim.faults import Fault
from jobsim.job import Layout
from jobsim.score import score_run
from jobsim.stream import JobStream, SimConfig

FWD, BWD, OPT = 60.0, 120.0, 14.0


def ddp_step(st: int, ranks: int, fwd_of, bwd_of=lambda r, st: BWD, marked: bool = False,  # type: ignore[no-untyped-def]
             host: bool = False):
    """One DDP step: each rank's forward (``fwd_of``) and own backward (``bwd_of``); every rank's backward
    also holds the wait for the slowest arrival at the all-reduce (end of backward)."""
    arrive = {r: fwd_of(r, st) + bwd_of(r, st) for r in range(ranks)}
    last = max(arrive.values())
    per = {}
    for r in range(ranks):
        f = fwd_of(r, st)
        b = bwd_of(r, st) + (last - arrive[r])
        sp_b = span("backward-compute", st, None if host else b, b if host else 30.0, group="backward")
        if marked:
            sp_b.attributes.append(kv(s.ATTR_STAGE_COLLECTIVE, True))
        per[r] = [span("forward-compute", st, None if host else f, f if host else 20.0, group="forward"), sp_b,
                  span("optimizer", st, None if host else OPT, OPT if host else 5.0, group="optimizer")]
    return request(per, world=ranks)


def feed(proc, steps, ranks, fwd_of, **kw):  # type: ignore[no-untyped-def]
    for st in steps:
        proc.process_traces(ddp_step(st, ranks, fwd_of, **kw))


def stragglers(emitted):  # type: ignore[no-untyped-def]
    for v in emitted:
        assert v.verdict in s.VERDICTS and v.reason in s.REASONS
    return sorted({(v.rank, v.stage) for v in emitted if v.verdict == s.VERDICT_STRAGGLER})


def slow_forward(rank: int, factor: float, start: int = 20):  # type: ignore[no-untyped-def]
    return lambda r, st: FWD * factor if (r == rank and st >= start) else FWD


def test_waiters_in_a_stage_holding_the_all_reduce_are_not_convicted() -> None:
    """DP 4, rank 2's forward +50 % from step 20: the others wait 30 ms in their backward, where rank 2 is the
    fastest. Only rank 2 is convicted (in forward, waited least in backward); the waiters are
    uncertain/collective_wait naming rank 2. Without the rule the three waiters are convicted in backward."""
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 60), 4, slow_forward(2, 1.5))
    assert stragglers(emitted) == [(2, "forward-compute")]
    v = next(v for v in emitted if v.verdict == s.VERDICT_STRAGGLER)
    assert "waits_least:backward-compute" in v.collective_evidence.split(",")
    waits = [x for x in emitted if x.reason == "collective_wait"]
    assert {(x.rank, x.stage, x.reference_rank, x.verdict) for x in waits} == {
        (r, "backward-compute", 2, s.VERDICT_UNCERTAIN) for r in (0, 1, 3)}
    assert proc.stats()["collective_wait_windows"] >= 3 * 7
    proc0, emitted0, _ = make_processor(Config(collective_wait=False))
    feed(proc0, range(0, 60), 4, slow_forward(2, 1.5))
    assert stragglers(emitted0) == [(0, "backward-compute"), (1, "backward-compute"), (2, "forward-compute"),
                                    (3, "backward-compute")]


def test_the_slow_rank_is_never_taken_for_a_waiter() -> None:
    """Two real stragglers at once (rank 0's forward +30 %, rank 1's own backward +30 %; the job's collective
    sits outside these stages, so nobody waits in them): rank 1 is slower than rank 0 in backward while rank 0
    is slower in forward, the inverted split of a wait, but each is above all its other peers, so neither is a
    waiter. Both are convicted."""
    def fwd(r, st):  # type: ignore[no-untyped-def]
        return FWD * 1.3 if (r == 0 and st >= 20) else FWD

    def bwd(r, st):  # type: ignore[no-untyped-def]
        return BWD * 1.3 if (r == 1 and st >= 20) else BWD

    proc, emitted, _ = make_processor()
    for st in range(0, 60):
        per = {r: [span("forward-compute", st, fwd(r, st), 20.0, group="forward"),
                   span("backward-compute", st, bwd(r, st), 30.0, group="backward")] for r in range(6)}
        proc.process_traces(request(per, world=6))
    assert stragglers(emitted) == [(0, "forward-compute"), (1, "backward-compute")]
    assert proc.stats()["collective_wait_windows"] == 0


def test_a_stage_marked_collective_is_evidence_only() -> None:
    """The same DDP job with ``backward-compute`` marked collective: the stage is not judged at all (no
    verdict, no collective_wait), rank 2 is convicted in forward and waited least in the marked stage."""
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 60), 4, slow_forward(2, 1.5), marked=True)
    assert stragglers(emitted) == [(2, "forward-compute")]
    assert not [v for v in emitted if v.stage == "backward-compute"]
    assert proc.stats()["collective_wait_windows"] == 0
    v = next(v for v in emitted if v.verdict == s.VERDICT_STRAGGLER)
    assert "waits_least:backward-compute" in v.collective_evidence.split(",")


def test_dp2_ddp_needs_the_mark_to_name_the_rank() -> None:
    """DP 2 under DDP: rank 1's forward +50 % is matched by rank 0's wait in backward, and with two ranks the
    stage holding the all-reduce cannot be told from the one holding the slow rank's work: both excesses are
    uncertain/collective_wait, no verdict. Marked, rank 1 is named in forward (its own history rose)."""
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 60), 2, slow_forward(1, 1.5))
    assert stragglers(emitted) == []
    assert {(v.rank, v.stage) for v in emitted if v.reason == "collective_wait"} == {
        (1, "forward-compute"), (0, "backward-compute")}
    proc1, emitted1, _ = make_processor()
    feed(proc1, range(0, 60), 2, slow_forward(1, 1.5), marked=True)
    assert stragglers(emitted1) == [(1, "forward-compute")]
    # without the rule, the waiter is named in backward as well
    proc0, emitted0, _ = make_processor(Config(collective_wait=False))
    feed(proc0, range(0, 60), 2, slow_forward(1, 1.5))
    assert (0, "backward-compute") in stragglers(emitted0)


def test_host_only_ddp_the_demo_case() -> None:
    """No CUDA (gloo on CPU: host time is the work, and the waiters' backward holds the blocking all-reduce),
    DP 8, rank 3's forward doubled: only rank 3 is convicted; without the rule all seven waiters are too."""
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 60), 8, slow_forward(3, 2.0), host=True)
    assert stragglers(emitted) == [(3, "forward-compute")]
    proc0, emitted0, _ = make_processor(Config(collective_wait=False))
    feed(proc0, range(0, 60), 8, slow_forward(3, 2.0), host=True)
    assert len(stragglers(emitted0)) == 8


def _sim(layout: Layout, fault: Fault | None, *, marked: bool, summary: bool = True, seed: int = 3,
         **overrides: object) -> tuple:  # type: ignore[type-arg]
    verdicts: list = []
    cfg = factory.create_default_config().model_copy(update=overrides)
    proc = factory.create_processor(cfg, Telemetry(), verdicts.extend)
    proc.start()
    stream = JobStream(SimConfig(layout=layout, steps=120, seed=seed, ddp=True, collective_marked=marked,
                                 step_summary=summary), [fault] if fault else [])
    for _step, req in stream:
        proc.process_traces(req)
        proc.tick(time.time())
    proc.shutdown(5.0)
    return score_run(fault, verdicts, stream.healthy_rank_steps), verdicts, proc


def test_simulated_ddp_job_finds_the_slow_rank_without_false_alarms() -> None:
    """The simulator's DDP job (DP 8, the wait inside backward-compute), +30 % on rank 5's forward from step
    50, unmarked and marked, step summaries and stage spans: rank 5 found in forward, no false alarm; without
    collective_wait the unmarked job convicts the waiters."""
    fault = Fault("device", 5, ("forward-compute",), 0.30, 50, 100)
    for marked in (False, True):
        for summary in (True, False):
            score, verdicts, proc = _sim(Layout(tp=1, dp=8), fault, marked=marked, summary=summary)
            assert score.detected and score.stage_correct and score.false_alarms == 0, (marked, summary)
            assert ("backward-compute" in next(iter(proc.cohorts)).collective) == marked
            first = next(v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER)
            assert "waits_least:backward-compute" in first.collective_evidence
    score0, _, _ = _sim(Layout(tp=1, dp=8), fault, marked=False, collective_wait=False)
    assert score0.false_alarms >= 7


def test_simulated_ddp_wait_lands_in_backward() -> None:
    """The simulator's DDP pattern itself: the slow rank's backward is the cohort's shortest, the waiters'
    longer by about its excess; no grad-sync stage; the mark travels in the summary and on the stage span."""
    fault = Fault("device", 2, ("forward-compute",), 0.30, 1, None)
    stream = JobStream(SimConfig(layout=Layout(tp=1, dp=4), steps=30, seed=1, ddp=True, collective_marked=True),
                       [fault])
    *_, (_step, req) = iter(stream)
    bwd: dict[int, float] = {}
    fwd: dict[int, float] = {}
    for rs in req.resource_spans:
        rank = next(a.value.int_value for a in rs.resource.attributes if a.key == s.RES_RANK)
        for ss in rs.scope_spans:
            for sp in ss.spans:
                attrs = {a.key: a.value for a in sp.attributes}
                assert sp.name != "all-grads-sync"
                if sp.name == "backward-compute":
                    assert attrs[s.ATTR_STAGE_COLLECTIVE].bool_value
                    bwd[rank] = attrs[s.ATTR_DEVICE_MS].double_value
                elif sp.name == "forward-compute":
                    assert s.ATTR_STAGE_COLLECTIVE not in attrs
                    fwd[rank] = attrs[s.ATTR_DEVICE_MS].double_value
                elif sp.name == s.SPAN_RANK_STEP:
                    assert [v.string_value for v in attrs[s.ATTR_SUMMARY_COLLECTIVE].array_value.values] == [
                        "backward-compute"]
    assert min(bwd, key=bwd.__getitem__) == 2
    excess = fwd[2] - sorted(fwd.values())[1]
    for r in (0, 1, 3):
        assert abs((bwd[r] - bwd[2]) - excess) < 0.25 * excess

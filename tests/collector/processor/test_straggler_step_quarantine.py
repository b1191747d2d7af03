"""Step quarantine: step numbers far beyond a cohort's current range (a rank reporting a wrong step, a client
writing far-future steps into a job) are rejected as ``quarantined`` and never open or close a window, so the
job's real samples are never made late and its straggler verdict still arrives. Without the quarantine the
same 70 one-span requests end the job's detection (the control case), so the tests can fail."""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from straggler_build import request, span

import otel_straggler_schema as s
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.processor import StragglerProcessor
from collector_processor.telemetry import Telemetry
from jobsim.arrival import Batching, SimClock, batched, drive
from jobsim.faults import Fault
from jobsim.job import Layout, StepModel, ranks_of
from jobsim.stream import JobStream, SimConfig

SLOW_RANK = 5
ONSET = 100
JOB = "sim-job"
LAYOUT = Layout(tp=1, dp=8)
COHORT_KEY = ranks_of(LAYOUT)[0].cohort
FAR = 1_000_000


def _attack(ranks: Callable[[int], int], n: int = 70, job: str = JOB) -> list[ExportTraceServiceRequest]:
    """``n`` one-span requests of steps near 10^6, request i from rank ``ranks(i)``."""
    return [request({ranks(i): [span("forward-compute", FAR + 7 * i, 12.0, 12.5)]}, cohort=COHORT_KEY, job=job)
            for i in range(n)]


def _run(config: Config, attack: list[ExportTraceServiceRequest], at_fraction: float = 0.33, steps: int = 300
         ) -> tuple[StragglerProcessor, list, dict[str, int]]:
    """8 ranks, ~72 ms steps in SDK batches, rank 5 +10 % on the GPU from step 100; ``attack`` is sent once
    ``at_fraction`` of the job has passed (0: before the job's first request). Returns the processor, the
    verdicts and the late rejections of the job's own spans."""
    cfg = SimConfig(layout=LAYOUT, steps=steps, step_model=StepModel.with_forward_ms(12.0), seed=3)
    fault = Fault("device", SLOW_RANK, ("forward-compute",), 0.10, ONSET)
    verdicts: list = []
    clock = SimClock()
    proc = StragglerProcessor(config, Telemetry(), verdicts.extend, clock=clock)
    batching = Batching()
    when = clock.t + steps * batching.step_s * at_fraction
    sent = [False]
    late = {"job": 0, "rank_steps": 0}

    def process(req: ExportTraceServiceRequest) -> None:
        if not sent[0] and clock.t >= when:
            sent[0] = True
            for a in attack:
                proc.process_traces(a)
        before = proc.stats()["rejected_late"]
        proc.process_traces(req)
        late["job"] += proc.stats()["rejected_late"] - before
        late["rank_steps"] += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans
                                  if ss.scope.name == s.SCOPE_STEP_NAME)

    drive(batched(JobStream(cfg, [fault]), batching, seed=3), process, proc.tick, clock)
    proc.shutdown(5.0)
    return proc, verdicts, late


def _convicted(verdicts: list) -> list[tuple[int, str]]:
    return [(v.rank, v.stage) for v in verdicts if v.verdict == s.VERDICT_STRAGGLER and v.job == JOB]


def test_one_rank_reporting_far_future_steps_cannot_end_its_jobs_detection() -> None:
    """Rank 2 of the job sends 70 one-span requests with steps near 10^6 a third into the job: every one is
    quarantined, none of the job's real samples is late and rank 5 is still convicted. Without the quarantine
    the same requests close the job's windows, hundreds of its real spans are rejected late and the verdict
    never comes."""
    proc, verdicts, late = _run(Config(), _attack(lambda i: 2))
    st = proc.stats()
    assert st["rejected_quarantined"] == 70
    assert late["job"] <= 0.005 * late["rank_steps"]
    assert _convicted(verdicts) == [(SLOW_RANK, "forward-compute")]

    proc, verdicts, late = _run(Config(step_quarantine_windows=0), _attack(lambda i: 2))
    assert late["job"] > 0.5 * late["rank_steps"]
    assert _convicted(verdicts) == []


def test_many_new_ranks_with_far_future_steps_cannot_move_the_range() -> None:
    """70 ranks never seen before, each with one far-future step: their samples are all quarantined, so they
    never count in the cohort's range, and the job is judged as without them."""
    proc, verdicts, late = _run(Config(), _attack(lambda i: 1000 + i))
    assert proc.stats()["rejected_quarantined"] == 70
    assert late["job"] <= 0.005 * late["rank_steps"]
    assert _convicted(verdicts) == [(SLOW_RANK, "forward-compute")]


def test_far_future_steps_before_the_job_starts_are_dropped_unjudged() -> None:
    """The attack comes first, into a cohort that has no range yet: its windows open (the ones its own progress
    closes hold only its samples); at the first tick after the job's ranks arrived the one still open is
    dropped unjudged (counted) and the fence it moved comes back to the job's range. At most a tick of the
    job's samples is late, and the verdict comes. Without the quarantine the job never leaves the fence."""
    proc, verdicts, late = _run(Config(), _attack(lambda i: 2, n=5), at_fraction=0.0)
    st = proc.stats()
    assert st["windows_quarantined"] >= 1 and st["fences_rolled_back"] == 1
    assert late["job"] <= 0.02 * late["rank_steps"]
    assert _convicted(verdicts) == [(SLOW_RANK, "forward-compute")]

    proc, verdicts, late = _run(Config(step_quarantine_windows=0), _attack(lambda i: 2, n=5), at_fraction=0.0)
    assert late["job"] > 0.9 * late["rank_steps"]
    assert _convicted(verdicts) == []


def test_a_whole_cohort_jumping_ahead_is_followed_within_a_second() -> None:
    """Every rank jumps 10^6 steps at once (a job restarted with other step numbers): the first samples after
    the jump are quarantined until a tick moves the range (the range is recomputed at most once a second), then
    windows open and close at the new steps."""
    t = [1000.0]
    proc = StragglerProcessor(Config(), Telemetry(), lambda v: None, clock=lambda: t[0])
    ranks = range(4)

    def step(n: int) -> None:
        proc.process_traces(request({r: [span("forward-compute", n, 12.0, 12.5)] for r in ranks},
                                    cohort=COHORT_KEY, job=JOB))
        t[0] += 0.1

    for n in range(40):
        step(n)
    proc.tick(t[0])
    closed = proc.stats()["windows_closed"]
    step(FAR)
    assert proc.stats()["rejected_quarantined"] == len(ranks)
    t[0] += 1.0
    proc.tick(t[0])
    for n in range(FAR + 1, FAR + 40):
        step(n)
    st = proc.stats()
    assert st["rejected_quarantined"] == len(ranks)
    assert st["windows_closed"] >= closed + 6
    assert st["windows_quarantined"] == 0

"""The collective signal (``collective_signal.py``): time a cohort loses in its collectives beyond its own baseline,
said at job level as a metric and a non-paging event, with the ring it was seen in, and naming the member whose
links are the cause only where evidence shows it.

The jobs are simulated Megatron span streams (``jobsim``: DP 8 x TP 2, 1 % jitter) fed to the
processor as OTLP requests. A ``link`` fault slows the DP gradient all-reduce of one rank's ring (its cohort) for
every member, compute normal; with NVML the rank's PCIe replay errors grow. CUDA and NVML cannot run here, so device
times and NVML samples are the simulator's numbers in the attributes the emitter would set."""

from __future__ import annotations

from prometheus_client import generate_latest

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory
from collector_processor.processor.straggler.events import event_attributes, severity, verdict_to_dict
from collector_processor.processor.straggler.model import Verdict
from collector_processor.telemetry import Telemetry
from jobsim.faults import Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, SimConfig

LAYOUT = Layout(tp=2, dp=8)  # cohort tp0: even ranks, tp1: odd ranks
TP1 = s.cohort_key(topology_epoch=0, stage_schema="megatron-v1", tp=1, pp=0, cp=0, ep=0)


def _run(fault: Fault | None, seed: int = 3, nvml: bool = False, **overrides: object
         ) -> tuple[list[Verdict], str]:
    verdicts: list[Verdict] = []
    telemetry = Telemetry()
    cfg = factory.create_default_config().model_copy(update=overrides)
    proc = factory.create_processor(cfg, telemetry, verdicts.extend)
    proc.start()
    sim = SimConfig(layout=LAYOUT, steps=150, seed=seed, nvml=nvml)
    scrape = ""
    for step, req in JobStream(sim, [fault] if fault else []):
        proc.process_traces(req)
        proc.tick(0.0)
        if step == 100:
            scrape = generate_latest(telemetry.registry).decode()
    proc.shutdown(5.0)
    return verdicts, scrape


def _signals(verdicts: list[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if v.reason == "collective_slow"]


def _lost_lines(scrape: str) -> list[str]:
    return [ln for ln in scrape.splitlines() if ln.startswith(s.M_COLLECTIVE_LOST + "{")]


def test_one_ranks_slow_all_reduce_is_said_at_job_level_and_pages_nobody() -> None:
    """Rank 5's link slows its ring's gradient all-reduce by half (+9 ms on 18 ms) from step 50 to 110: every
    member of cohort tp1 waits the same in ``all-grads-sync``. No straggler verdict; one ``uncertain/collective_slow``
    event on that ring (``grad-sync``, its 8 ranks) within 2 windows, with the time lost per step and its GPU-hours,
    at INFO; ``otel_straggler_collective_lost_seconds`` carries it for the ring, 0 for the other cohort's; the signal
    ends with ``recovered`` after the link recovers. Nobody is named: interval times cannot tell whose link."""
    verdicts, scrape = _run(Fault("link", 5, (), 0.5, 50, 110))
    assert [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER] == []
    sig = _signals(verdicts)
    assert len(sig) == 1
    v = sig[0]
    assert v.verdict == s.VERDICT_UNCERTAIN and v.cohort == TP1 and v.stage == "all-grads-sync"
    assert v.ring == "grad-sync" and v.group_ranks == tuple(range(1, 16, 2)) and v.link_rank is None
    assert v.step is not None and 50 <= v.step <= 60
    assert 7.0 <= v.step_time_lost_ms <= 11.0 and v.gpu_seconds_per_hour > 0 and v.derived
    attrs = dict(event_attributes(v))
    assert attrs[s.EV_COLLECTIVE_RING] == "grad-sync" and s.EV_COLLECTIVE_RANK not in attrs
    assert severity(v)[1] == "INFO"
    assert "collective slow: grad-sync ring" in str(verdict_to_dict(v)["summary"])
    ends = [e for e in verdicts if e.ring and e.verdict == s.VERDICT_RECOVERED]
    assert len(ends) == 1 and ends[0].step is not None and ends[0].step >= 110
    lines = _lost_lines(scrape)
    slow = [ln for ln in lines if TP1 in ln]
    assert len(slow) == 1 and 'ring="grad-sync"' in slow[0] and float(slow[0].split()[-1]) > 0.005
    assert all(float(ln.split()[-1]) == 0.0 for ln in lines if TP1 not in ln)
    # the paging series: none for the ring's ranks
    assert not [ln for ln in scrape.splitlines() if ln.startswith(s.M_STRAGGLER_ACTIVE + "{")]


def test_the_rank_whose_link_errors_show_it_is_named() -> None:
    """With NVML samples, rank 5's PCIe replay errors grow while its ring's other members have none: the event names
    rank 5 (``dl.rank``, ``straggler.collective.rank``, its host and GPU, the hint), and the gauge's ``rank``."""
    verdicts, scrape = _run(Fault("link", 5, (), 0.5, 50, 110), nvml=True)
    sig = _signals(verdicts)
    assert len(sig) == 1 and sig[0].link_rank == 5 and sig[0].rank == 5 and sig[0].gpu == "GPU-sim-00005"
    assert dict(event_attributes(sig[0]))[s.EV_COLLECTIVE_RANK] == 5 and "PCIe replays" in sig[0].hint
    assert [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER] == []
    assert any('rank="5"' in ln and TP1 in ln for ln in _lost_lines(scrape))


def test_a_compute_straggler_and_a_healthy_job_raise_no_collective_signal() -> None:
    """A rank slow in forward-compute makes its peers wait longer in the all-reduce, but it arrives last and waits
    for nobody: the per-step minimum stays at the baseline. It is convicted as before; no ring is said slow."""
    verdicts, _ = _run(Fault("device", 5, ("forward-compute",), 0.30, 50, 110))
    assert {(v.rank, v.stage) for v in verdicts if v.verdict == s.VERDICT_STRAGGLER} == {(5, "forward-compute")}
    assert _signals(verdicts) == []
    for seed in (3, 4):
        assert _signals(_run(None, seed=seed)[0]) == []


def test_the_signal_switched_off_says_nothing() -> None:
    verdicts, scrape = _run(Fault("link", 5, (), 0.5, 50, 110), collective_signal=False)
    assert _signals(verdicts) == [] and _lost_lines(scrape) == []

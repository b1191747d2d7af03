"""Host contention (``rules/host_contention.py``): ranks sharing one machine's oversubscribed CPUs are
descheduled in turn; a rank slow on host time (or on device time its host starved) whose comparable peers all run
on its host, and spike there too, is ``uncertain/host_contention``, attributed to the host, and pages nobody.

The simulated jobs are 8-rank DDP jobs on one host (``contention`` faults: every rank of the host descheduled on
30 % of its stage-steps, one rank three times as often), timed on the host only (a CPU job) or on the device."""

from __future__ import annotations

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory
from collector_processor.processor.straggler.model import Verdict
from collector_processor.telemetry import Telemetry
from jobsim.faults import COMPUTE_STAGES, Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, SimConfig

STAGES = ("batch-generator", *COMPUTE_STAGES, "optimizer-inner-step")
HOST_ONLY = 10**9  # device_every: never timed on the device


def _run(layout: Layout, fault: Fault, seed: int, device_every: int, **overrides: object
         ) -> tuple[list[Verdict], dict[str, int]]:
    verdicts: list[Verdict] = []
    cfg = factory.create_default_config().model_copy(update=overrides)
    proc = factory.create_processor(cfg, Telemetry(), verdicts.extend)
    proc.start()
    sim = SimConfig(layout=layout, steps=150, seed=seed, ddp=True, device_every=device_every)
    for _step, req in JobStream(sim, [fault]):
        proc.process_traces(req)
        proc.tick(0.0)
    proc.shutdown(5.0)
    return verdicts, proc.stats()


def test_contention_on_one_machine_pages_nobody_and_is_said_as_the_hosts() -> None:
    for device_every in (HOST_ONLY, 1):
        for seed in (1, 2):
            verdicts, stats = _run(Layout(tp=1, dp=8), Fault("contention", 3, STAGES, 1.0, 1), seed, device_every)
            assert not [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER], (device_every, seed)
            said = [v for v in verdicts if v.reason == "host_contention"]
            assert said and all(v.verdict == s.VERDICT_UNCERTAIN and v.attribution == s.ATTRIBUTION_HOST
                                for v in said)
            assert stats["host_contention_windows"] > 0


def test_without_the_rule_contention_convicts_a_healthy_rank() -> None:
    verdicts, _ = _run(Layout(tp=1, dp=8), Fault("contention", 3, STAGES, 1.0, 1), 1, HOST_ONLY,
                       host_contention=False)
    assert [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER]


def test_one_rank_stalled_on_a_quiet_machine_still_pages() -> None:
    """DP 8 on one host, no contention: one rank's steady host stall (the demo's injected fault) is its own, the
    peers run steadily, and it is convicted as before."""
    fault = Fault("host", 3, ("forward-compute",), 0.0, 40, 120, stall_ms=30.0)
    verdicts, _ = _run(Layout(tp=1, dp=8), fault, 1, HOST_ONLY)
    slow = [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER]
    assert slow and {v.rank for v in slow} == {3} and all(v.attribution == s.ATTRIBUTION_HOST for v in slow)


def test_a_host_stall_with_peers_on_other_hosts_still_pages() -> None:
    """DP 16 over two hosts: one rank's host stall is compared with peers outside its machine, and convicted."""
    fault = Fault("host", 3, ("forward-compute",), 0.0, 40, 120, stall_ms=30.0)
    verdicts, stats = _run(Layout(tp=1, dp=16), fault, 1, 1)
    slow = [v for v in verdicts if v.verdict == s.VERDICT_STRAGGLER]
    assert {v.rank for v in slow} == {3} and all(v.attribution == s.ATTRIBUTION_HOST for v in slow)
    assert stats["host_contention_windows"] == 0

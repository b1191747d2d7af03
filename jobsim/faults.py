"""Labelled faults injected into a simulated job, and what the detector is expected to say about them."""

from __future__ import annotations

from dataclasses import dataclass

import otel_straggler_schema as s
from jobsim.job import timers

COMPUTE_STAGES = timers("forward-compute", "backward-compute")


@dataclass(frozen=True)
class Fault:
    """One labelled fault. How a fault shows in the host and device intervals depends on the stage's regime
    (``stream.py``: ``launch``, the host never blocked by the GPU, or ``gpu_bound``, the host blocked on a full
    launch queue).

    kind:
      device        stage device time x (1 + size): expect straggler, gpu_stream_stall. Launch regime: the host
                    interval stays flat; GPU-bound: the blocked host's interval stretches by as much
      host          a host stall of ``stall_ms`` (default ``size`` x the stage's device time) inside the stage
                    (CPU contention, a stalled launch): the host interval grows by it; the stream starves only
                    for what exceeds the work already queued (launch regime: the device time minus the launch
                    time), so a short stall leaves the device flat: expect straggler, host_only_stall
      dataloader    batch-generator waits ``size`` x forward time on the host: expect straggler, host_only_stall
      ramp          device slowdown rising linearly from onset to ``size`` over ``ramp_steps`` steps, then held
                    (a thermal ramp): expect straggler, gpu_stream_stall, and no recovery while it lasts
      intermittent  device slowdown on a random ``duty`` fraction of steps: detection optional, reported
      flapping      device slowdown alternating ``period`` steps on / off: expect straggler
      periodic      device slowdown on one step in every ``period`` from onset (a periodic background job): expect
                    straggler when it costs what a steady straggler does (``intermittent_excess``)
      burst         device slowdown on ``period`` consecutive steps from onset, once (one GC pause, a checkpoint
                    step of one rank): expect NO straggler
      link          the rank's link slow: the DP gradient all-reduce of its cohort (its ring) takes (1 + size) x its
                    time on every member, compute normal; with NVML the rank's PCIe replay errors grow: expect NO
                    straggler, a ``collective_slow`` event on the ring (naming the rank with NVML)
      cohort        every DP rank of the cohort slowed together: expect NO rank verdict (no slower peer)
      node          every rank on the host of ``rank`` slowed on the device x (1 + size) (a bad node): expect one
                    node verdict naming that host (``node.py``), and each of its ranks convicted
      workload      rank does (1 + size) x the tokens and time: expect NO straggler (workload_incomparable)
      contention    the CPUs of the host of ``rank`` oversubscribed: on a ``duty`` fraction of its stage-steps each
                    rank of the host is descheduled for U(0, size) x the stage's device time on the host (the
                    stream starves beyond the queued work); ``rank`` itself three times as often (the scheduler
                    is not fair): expect NO straggler (the whole machine shares it; ``host_contention``)

    expect: None (by kind, as above), or whether a straggler verdict on ``rank`` is expected (False: the rank
    cannot be told from its peers, e.g. a DP = 2 pair under DDP without a marked collective stage; a verdict
    on it is not counted as a false alarm, one on any other rank is).
    """

    kind: str
    rank: int
    stages: tuple[str, ...]
    size: float
    onset: int
    end: int | None = None  # first step back at par (None: never)
    duty: float = 0.3
    period: int = 20
    expect: bool | None = None
    stall_ms: float | None = None  # host: the stall in ms (None: size x the stage's device time)
    ramp_steps: int = 60  # ramp: steps from onset to the full size

    @property
    def expect_straggler(self) -> bool:
        if self.expect is not None:
            return self.expect
        return self.kind in ("device", "host", "dataloader", "flapping", "ramp", "node", "periodic")

    @property
    def expected_attribution(self) -> str:
        if self.kind in ("host", "dataloader"):
            return s.ATTRIBUTION_HOST
        return s.ATTRIBUTION_GPU

    @property
    def due(self) -> int:
        """The step from which detection is due: the onset, or for a ramp the step its slowdown reaches +5 %
        (the size a straggler must be found at; ``bench/detection.py``)."""
        if self.kind == "ramp" and self.size > 0:
            return self.onset + round(self.ramp_steps * min(1.0, 0.05 / self.size))
        return self.onset

    def slowdown(self, step: int) -> float:
        """The device slowdown of a ``ramp`` at ``step`` (0 before onset), else ``size``."""
        if self.kind != "ramp":
            return self.size
        return self.size * min(1.0, max(0, step - self.onset + 1) / self.ramp_steps)

    def active(self, step: int, rng_value: float) -> bool:
        if step < self.onset or (self.end is not None and step >= self.end):
            return False
        if self.kind == "intermittent":
            return rng_value < self.duty
        if self.kind == "flapping":
            return ((step - self.onset) // self.period) % 2 == 0
        if self.kind == "periodic":
            return (step - self.onset) % self.period == 0
        if self.kind == "burst":
            return step < self.onset + self.period
        return True

    def label(self) -> str:
        stage = "all-compute" if self.stages == COMPUTE_STAGES else ",".join(self.stages)
        if self.stall_ms is not None:
            return f"{self.kind}:{stage}:+{self.stall_ms:g}ms"
        if self.kind in ("periodic", "burst"):
            return f"{self.kind}:{stage}:+{self.size:.0%}/{self.period}"
        return f"{self.kind}:{stage}:+{self.size:.0%}"

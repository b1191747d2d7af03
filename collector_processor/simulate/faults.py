"""Labelled faults injected into a simulated job, and what the detector is expected to say about them."""

from __future__ import annotations

from dataclasses import dataclass

from otel_straggler import schema as s

COMPUTE_STAGES = ("forward-compute", "backward-compute")


@dataclass(frozen=True)
class Fault:
    """One labelled fault.

    kind:
      device        stage device time x (1 + size) (host flat): expect straggler, gpu_stream_stall
      host          stage host time + size x device time, the starved stream stretches the device interval
                    as much: expect straggler, host_only_stall
      dataloader    batch-generator waits ``size`` x forward time on the host: expect straggler, host_only_stall
      intermittent  device slowdown on a random ``duty`` fraction of steps: detection optional, reported
      flapping      device slowdown alternating ``period`` steps on / off: expect straggler
      cohort        every DP rank of the cohort slowed together: expect NO rank verdict (no slower peer)
      workload      rank does (1 + size) x the tokens and time: expect NO straggler (workload_incomparable)

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

    @property
    def expect_straggler(self) -> bool:
        if self.expect is not None:
            return self.expect
        return self.kind in ("device", "host", "dataloader", "flapping")

    @property
    def expected_attribution(self) -> str:
        if self.kind in ("host", "dataloader"):
            return s.ATTRIBUTION_HOST
        return s.ATTRIBUTION_GPU

    def active(self, step: int, rng_value: float) -> bool:
        if step < self.onset or (self.end is not None and step >= self.end):
            return False
        if self.kind == "intermittent":
            return rng_value < self.duty
        if self.kind == "flapping":
            return ((step - self.onset) // self.period) % 2 == 0
        return True

    def label(self) -> str:
        stage = "all-compute" if self.stages == COMPUTE_STAGES else ",".join(self.stages)
        return f"{self.kind}:{stage}:+{self.size:.0%}"

"""Job layout (TP/PP/CP/EP/DP) and the per-step stage model of a simulated Megatron job."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import otel_straggler_schema as s
from otel_straggler_schema.stages import STAGE_GROUP_BY_NAME, STAGE_SCHEMA, stage_group


def timers(*names: str) -> tuple[str, ...]:
    """``names``, each a Megatron timer of the stage schema (``otel_straggler_schema.stages``): the simulator
    names no other."""
    unknown = [n for n in names if n not in STAGE_GROUP_BY_NAME]
    if unknown:
        raise ValueError(f"not timers of the stage schema: {unknown}")
    return names


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 8

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.ep * self.dp

    @property
    def cohorts(self) -> int:
        return self.tp * self.pp * self.cp * self.ep


@dataclass(frozen=True)
class RankInfo:
    rank: int
    cohort: str
    dp_rank: int
    pp_rank: int
    host: str
    gpu: str


def ranks_of(layout: Layout, gpus_per_host: int = 8) -> list[RankInfo]:
    """Megatron's default order: TP fastest, then CP, EP, DP, PP slowest."""
    out: list[RankInfo] = []
    rank = 0
    for pp in range(layout.pp):
        for dp in range(layout.dp):
            for ep in range(layout.ep):
                for cp in range(layout.cp):
                    for tp in range(layout.tp):
                        key = s.cohort_key(topology_epoch=0, stage_schema=STAGE_SCHEMA, tp=tp, pp=pp, cp=cp,
                                           ep=ep)
                        out.append(RankInfo(rank=rank, cohort=key, dp_rank=dp, pp_rank=pp,
                                            host=f"node{rank // gpus_per_host:04d}",
                                            gpu=f"GPU-sim-{rank:05d}"))
                        rank += 1
    return out


@dataclass(frozen=True)
class StageModel:
    """Nominal per-step device time (ms) of each stage for one rank, and its Megatron identity."""

    name: str
    level: int
    device_ms: float
    host_fraction: float  # host (launch) time as a fraction of device time when not stalled
    count: int = 1  # per-microbatch repeats aggregated into the step span

    @property
    def group(self) -> str:
        return stage_group(self.name)


@dataclass
class StepModel:
    microbatches: int = 8
    stages: list[StageModel] = field(default_factory=lambda: [
        StageModel("batch-generator", 2, 0.4, 1.0, 8),
        StageModel("forward-compute", 2, 48.0, 0.35, 8),
        StageModel("backward-compute", 2, 96.0, 0.25, 8),
        StageModel("optimizer-inner-step", 1, 12.0, 0.3),
        StageModel("optimizer-copy-main-to-model-params", 1, 1.5, 0.5),
    ])
    grad_sync_ms: float = 18.0  # all-reduce time when every peer arrives together
    step_overhead_ms: float = 4.0

    def __post_init__(self) -> None:
        timers(*(st.name for st in self.stages))

    @classmethod
    def with_forward_ms(cls, forward_ms: float) -> StepModel:
        """The default model with forward-compute at ``forward_ms`` and backward at twice that (a smaller
        model or shorter sequences): the target scenario's 20 ms stage."""
        m = cls()
        scale = {"forward": 1, "backward": 2}
        m.stages = [replace(st, device_ms=forward_ms * scale[st.group]) if st.group in scale else st
                    for st in m.stages]
        return m

from __future__ import annotations

from otel_straggler import schema
from otel_straggler.stages import P2P_TIMERS, STAGE_GROUP_BY_NAME, STAGE_SCHEMA, stage_group

# Inventory of megatron-core 0.16 / training.py timer names (reference: megatron-timers.md).
LEVEL2 = ["forward-compute", "backward-compute", "batch-generator", *P2P_TIMERS]
LEVEL1 = [
    "forward-backward",
    "all-grads-sync",
    "conditional-embedder-grads-all-reduce",
    "non-tensor-parallel-grads-all-reduce",
    "embedding-grads-all-reduce",
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "params-all-gather",
    "optimizer",
]
LEVEL0 = [
    "interval-time",
    "eval-time",
    "save-checkpoint",
    "save-checkpoint-non-persistent",
    "load-checkpoint",
    "model-and-optimizer-setup",
    "train/valid/test-data-iterators-setup",
    "evaluate",
    "startup-program",
]


def test_every_megatron_name_has_a_known_group() -> None:
    for name in LEVEL0 + LEVEL1 + LEVEL2:
        group = stage_group(name)
        assert group in schema.STAGE_GROUPS
        assert group != "other", name


def test_exact_groups() -> None:
    assert len(P2P_TIMERS) == 9
    assert {stage_group(n) for n in P2P_TIMERS} == {"p2p"}
    assert stage_group("forward-compute") == "forward"
    assert stage_group("backward-compute") == "backward"
    assert stage_group("batch-generator") == "data"
    assert stage_group("interval-time") == "step"
    assert stage_group("params-all-gather") == "param-gather"
    assert stage_group("all-grads-sync") == "grad-sync"
    assert stage_group("optimizer-inner-step") == "optimizer"
    assert stage_group("save-checkpoint-non-persistent") == "checkpoint"
    assert stage_group("evaluate") == "eval"
    assert stage_group("startup-time-to-initialize") == "setup"
    assert stage_group("train-data-iterators-setup") == "setup"
    assert STAGE_SCHEMA == "megatron-v1"


def test_unknown_names_are_other_never_guessed() -> None:
    for name in ["forward-computex", "my-forward", "attention", "moe-router", "optimizer-foo", "startup-", "", "p2p"]:
        assert stage_group(name) == "other", name
    assert "attention" not in STAGE_GROUP_BY_NAME


def test_degraded_reason_constants_follow_the_schema() -> None:
    from otel_straggler import counters

    assert (
        counters.NO_CUDA,
        counters.SAMPLED_OUT,
        counters.POOL_EXHAUSTED,
        counters.READOUT_TIMEOUT,
        counters.CUDA_ERROR,
        counters.UNBALANCED,
    ) == ("no_cuda", "sampled_out", "pool_exhausted", "readout_timeout", "cuda_error", "unbalanced")

from __future__ import annotations

import otel_straggler_schema as schema
from otel_straggler_schema.stages import P2P_TIMERS, STAGE_GROUP_BY_NAME, STAGE_SCHEMA, stage_group

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


def test_stage_marked_collective_reaches_the_spans_and_the_summary(sink) -> None:  # type: ignore[no-untyped-def]
    """``stage(name, collective=True)`` marks the timer: its intervals carry the mark through the pipe to the
    export child, and the step's spans say so (stage span attribute, the summary's list of marked names);
    unmarked stages carry neither."""
    import otel_straggler
    from otel_straggler.export.aggregate import KIND_RANK_STEP, KIND_STAGE, StepAggregator
    from otel_straggler.export.wire import WireDecoder, WireEncoder

    t = otel_straggler.configure(enabled=True, sink=sink, readout_interval_ms=5, register_lifecycle=False)
    try:
        for step in range(2):
            otel_straggler.step(step)
            with otel_straggler.stage("forward-compute"):
                pass
            with otel_straggler.stage("backward-compute", collective=True):
                pass

        @otel_straggler.stage("my-allreduce", collective=True)
        def sync() -> None:
            return None

        otel_straggler.step(2)
        sync()
        with otel_straggler.stage("backward-compute"):  # the mark stays on the timer name
            pass
        assert t is not None and t.flush(2.0)
    finally:
        otel_straggler.shutdown(1.0)
    marks = {(iv.name, iv.step): iv.collective for iv in sink.intervals}
    assert marks == {("forward-compute", 0): False, ("backward-compute", 0): True,
                     ("forward-compute", 1): False, ("backward-compute", 1): True,
                     ("my-allreduce", 2): True, ("backward-compute", 2): True}
    # through the pipe to the export child
    enc, dec = WireEncoder(), WireDecoder()
    raw = enc.encode_intervals(sink.intervals)
    enc.commit()
    (_, decoded), = dec.feed(raw)
    assert [iv.collective for iv in decoded] == [iv.collective for iv in sink.intervals]
    # the spans of a step
    out: list = []
    agg = StepAggregator(rank=0)
    agg.add(decoded, 0, out)
    agg.close_all(out)
    stage_spans = {(r.name, r.step): r.attributes for r in out if r.kind == KIND_STAGE}
    assert stage_spans[("backward-compute", 0)][schema.ATTR_STAGE_COLLECTIVE] is True
    assert schema.ATTR_STAGE_COLLECTIVE not in stage_spans[("forward-compute", 0)]
    summaries = {r.step: r.attributes for r in out if r.kind == KIND_RANK_STEP}
    assert summaries[0][schema.ATTR_SUMMARY_COLLECTIVE] == ["backward-compute"]
    assert sorted(summaries[2][schema.ATTR_SUMMARY_COLLECTIVE]) == ["backward-compute", "my-allreduce"]
    unmarked: list = []
    agg2 = StepAggregator(rank=1)
    agg2.add([iv for iv in decoded if iv.name == "forward-compute"], 0, unmarked)
    agg2.close_all(unmarked)
    assert all(schema.ATTR_SUMMARY_COLLECTIVE not in r.attributes and schema.ATTR_STAGE_COLLECTIVE not in r.attributes
               for r in unmarked)

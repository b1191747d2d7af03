from __future__ import annotations

import pytest

from otel_straggler import schema
from otel_straggler.identity import Identity, job_id_from_env, resolve_identity


def test_env_fallbacks_and_resource_attributes() -> None:
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "SLURM_JOB_ID": "777",
        "OTEL_STRAGGLER_TP_RANK": "1",
        "OTEL_STRAGGLER_TP_SIZE": "2",
        "OTEL_STRAGGLER_PP_RANK": "0",
        "OTEL_STRAGGLER_PP_SIZE": "2",
        "OTEL_STRAGGLER_DP_RANK": "2",
        "OTEL_STRAGGLER_DP_SIZE": "2",
    }
    ident = resolve_identity(env=env, topology_epoch=3, use_parallel_state=False)
    assert (ident.rank, ident.local_rank, ident.world_size, ident.job_id) == (5, 1, 8, "777")
    assert (ident.tp_rank, ident.tp_size, ident.dp_rank, ident.dp_size) == (1, 2, 2, 2)
    assert ident.source == "env"
    assert (ident.gpu_uuid, ident.gpu_pci_bus_id, ident.gpu_index) == ("cpu", "", -1)
    attrs = ident.resource_attributes()
    # every resource attribute of the schema but the step-summary flag, which the export side adds
    expected = {v for k, v in vars(schema).items() if k.startswith("RES_")} - {schema.RES_STEP_SUMMARY}
    assert set(attrs) == expected
    assert attrs[schema.RES_COHORT_KEY] == "e3/megatron-v1/tp1.pp0.vpp0.cp0.ep0.etp0.c0"
    assert attrs[schema.RES_STAGE_SCHEMA] == "megatron-v1"
    assert attrs[schema.RES_SCHEMA_VERSION] == schema.SCHEMA_VERSION


def test_cohort_key_excludes_dp_includes_epoch() -> None:
    a = Identity(tp_rank=1, dp_rank=0)
    b = Identity(tp_rank=1, dp_rank=7)
    c = Identity(tp_rank=1, dp_rank=0, topology_epoch=1)
    d = Identity(tp_rank=0)
    assert a.cohort_key == b.cohort_key
    assert a.cohort_key != c.cohort_key
    assert a.cohort_key != d.cohort_key


def test_args_win_over_env_and_defaults() -> None:
    ident = resolve_identity(env={}, rank=3, world_size=4, tp_rank=1, tp_size=2, use_parallel_state=False)
    assert (ident.rank, ident.world_size, ident.tp_rank, ident.source) == (3, 4, 1, "args")
    assert ident.job_id == "local"
    ident = resolve_identity(env={"OTEL_STRAGGLER_TP_RANK": "x"}, use_parallel_state=False)
    assert ident.tp_rank == 0  # bad env value: default, no raise


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OTEL_STRAGGLER_JOB_ID": "a", "SLURM_JOB_ID": "b", "TORCHELASTIC_RUN_ID": "c"}, "a"),
        ({"SLURM_JOB_ID": "b", "TORCHELASTIC_RUN_ID": "c"}, "b"),
        ({"TORCHELASTIC_RUN_ID": "c"}, "c"),
        ({}, "local"),
    ],
)
def test_job_id_order(env: dict, expected: str) -> None:
    assert job_id_from_env(env) == expected


def test_parallel_state_when_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real megatron.core.parallel_state module; its getters are replaced (no process group on CPU)."""
    from megatron.core import parallel_state as ps

    values = {
        "get_tensor_model_parallel_rank": 1,
        "get_tensor_model_parallel_world_size": 2,
        "get_pipeline_model_parallel_rank": 3,
        "get_pipeline_model_parallel_world_size": 4,
        "get_virtual_pipeline_model_parallel_rank": None,  # VPP unused
        "get_virtual_pipeline_model_parallel_world_size": None,
        "get_context_parallel_rank": 0,
        "get_context_parallel_world_size": 1,
        "get_data_parallel_rank": 5,
        "get_data_parallel_world_size": 6,
    }
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
    for name, v in values.items():
        monkeypatch.setattr(ps, name, lambda v=v: v)

    def broken():
        raise RuntimeError("expert groups not initialised")

    monkeypatch.setattr(ps, "get_expert_model_parallel_rank", broken)
    ident = resolve_identity(env={"OTEL_STRAGGLER_TP_RANK": "0"})
    assert ident.source == "parallel_state"
    assert (ident.tp_rank, ident.tp_size, ident.pp_rank, ident.pp_size) == (1, 2, 3, 4)
    assert (ident.vpp_rank, ident.vpp_size, ident.dp_rank, ident.dp_size) == (0, 1, 5, 6)
    assert ident.ep_rank == 0  # guarded getter failed open
    assert ident.cohort_key.endswith("tp1.pp3.vpp0.cp0.ep0.etp0.c0")


def test_parallel_state_not_initialised_falls_back() -> None:
    ident = resolve_identity(env={"OTEL_STRAGGLER_PP_RANK": "1"})
    assert ident.pp_rank == 1 and ident.source == "env"

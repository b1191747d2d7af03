from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import otel_straggler_schema as schema
from otel_straggler import hot_path
from otel_straggler.identity import Identity, job_id_from_env, resolve_identity, run_id_from_env
from otel_straggler_demo.run import free_port

HERE = Path(__file__).resolve().parent


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
    expected = {v for k, v in vars(schema).items()
                if k.startswith("RES_") and isinstance(v, str)} - {schema.RES_STEP_SUMMARY}
    assert set(attrs) == expected
    assert attrs[schema.RES_COHORT_KEY] == "e3/megatron-v1/tp1.pp0.vpp0.cp0.ep0.etp0.c0"
    assert attrs[schema.RES_STAGE_SCHEMA] == "megatron-v1"
    assert attrs[schema.RES_SCHEMA_VERSION] == schema.SCHEMA_VERSION
    assert attrs[schema.RES_HOT_PATH] == hot_path.NAME and hot_path.NAME in ("native", "python")


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


def test_plain_ddp_takes_the_data_parallel_position_from_the_world() -> None:
    """torchrun + DDP: no Megatron parallel state, no DP position given, every other dimension of size 1. Every
    rank is a data-parallel replica, so it publishes its rank and the world size as its DP position (the real DP
    size the collector expects in the cohort); all ranks share one cohort."""
    idents = [resolve_identity(env={"RANK": str(r), "WORLD_SIZE": "4"}, use_parallel_state=False) for r in range(4)]
    assert [(i.dp_rank, i.dp_size) for i in idents] == [(r, 4) for r in range(4)]
    assert all((i.tp_size, i.pp_size, i.cp_size, i.ep_size) == (1, 1, 1, 1) for i in idents)
    assert len({i.cohort_key for i in idents}) == 1 and all(i.source == "world" for i in idents)
    attrs = idents[3].resource_attributes()
    assert (attrs[schema.RES_DP_RANK], attrs[schema.RES_DP_SIZE]) == (3, 4)
    ident = resolve_identity(env={}, rank=1, world_size=2, use_parallel_state=False)  # the keywords' world
    assert (ident.dp_rank, ident.dp_size) == (1, 2)
    ident = resolve_identity(env={"OTEL_STRAGGLER_TP_SIZE": "1"}, rank=1, world_size=2, use_parallel_state=False)
    assert (ident.dp_rank, ident.dp_size, ident.source) == (1, 2, "env")  # a size-1 dimension changes nothing
    single = resolve_identity(env={}, use_parallel_state=False)
    assert (single.dp_rank, single.dp_size, single.source) == (0, 1, "default")


@pytest.mark.parametrize(("env", "kwargs", "expected"), [
    ({"OTEL_STRAGGLER_DP_RANK": "1", "OTEL_STRAGGLER_DP_SIZE": "2"}, {}, (1, 2)),  # given: it wins
    ({}, {"dp_rank": 0, "dp_size": 2}, (0, 2)),
    ({"OTEL_STRAGGLER_DP_SIZE": "8"}, {}, (0, 8)),  # half given: nothing guessed for the rest
    ({"OTEL_STRAGGLER_TP_SIZE": "2"}, {}, (0, 1)),  # model parallel: the DP size is not the world size
    ({}, {"pp_size": 2}, (0, 1)),
    ({"OTEL_STRAGGLER_CP_SIZE": "2"}, {}, (0, 1)),
    ({"OTEL_STRAGGLER_EP_SIZE": "4"}, {}, (0, 1)),
])
def test_the_world_is_not_the_data_parallel_position_when_something_says_otherwise(
        env: dict[str, str], kwargs: dict[str, int], expected: tuple[int, int]) -> None:
    ident = resolve_identity(env={"RANK": "5", "WORLD_SIZE": "8", **env}, use_parallel_state=False, **kwargs)
    assert (ident.dp_rank, ident.dp_size) == expected
    assert ident.source in ("env", "args")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OTEL_STRAGGLER_JOB_ID": "a", "SLURM_JOB_ID": "b", "TORCHELASTIC_RUN_ID": "c"}, "a"),
        ({"SLURM_JOB_ID": "b", "TORCHELASTIC_RUN_ID": "c"}, "b"),
        ({"SLURM_JOB_ID": "b", "SLURM_STEP_ID": "2", "TORCHELASTIC_RUN_ID": "c"}, "b.2"),
        ({"TORCHELASTIC_RUN_ID": "c"}, "c"),
        ({"OTEL_STRAGGLER_JOB_ID": "none", "TORCHELASTIC_RUN_ID": "c"}, "c"),
        ({"OTEL_STRAGGLER_JOB_ID": " none ", "TORCHELASTIC_RUN_ID": "c"}, "c"),
        ({"WORLD_SIZE": "4"}, "local"),
    ],
)
def test_job_id_order(env: dict, expected: str) -> None:
    assert job_id_from_env(env).value == expected


@pytest.mark.parametrize(("job_id", "expected"), [
    ("a", "a"), (" a ", "a"), ("none", "c"), (" none ", "c"), (" NONE ", "c"), ("", "c"), ("  ", "c"), (None, "c"),
])
def test_an_explicit_job_id_is_read_as_the_variables_are(job_id: str | None, expected: str) -> None:
    """The ``job_id`` argument: stripped, and empty or ``none`` (any case, any padding) falls back to the
    environment, as ``OTEL_STRAGGLER_JOB_ID`` does."""
    ident = resolve_identity(env={"TORCHELASTIC_RUN_ID": "c"}, job_id=job_id, use_parallel_state=False)
    assert ident.job_id == expected
    assert job_id_from_env({"OTEL_STRAGGLER_JOB_ID": job_id or "", "TORCHELASTIC_RUN_ID": "c"}).value == expected


TORCHRUN = {  # what torchrun gives a worker (torch 2.13, static rendezvous, no --rdzv-id)
    "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_k2/none_8x1q/attempt_0/0/error.json",
}


def _worker(**changes: str) -> dict[str, str]:
    return {**TORCHRUN, **changes}


def test_torchrun_none_is_not_an_id_and_one_launch_agrees() -> None:
    rank0 = job_id_from_env(_worker())
    rank1 = job_id_from_env(_worker(TORCHELASTIC_ERROR_FILE="/tmp/torchelastic_k2/none_8x1q/attempt_0/1/error.json"))
    restarted = job_id_from_env(_worker(TORCHELASTIC_RESTART_COUNT="1",
                                        TORCHELASTIC_ERROR_FILE="/tmp/torchelastic_k2/none_8x1q/attempt_1/0/error.json"))
    again = job_id_from_env(_worker(TORCHELASTIC_ERROR_FILE="/tmp/torchelastic_p0/none_u7c2/attempt_0/0/error.json"))
    assert rank0.value.startswith("launch-") and rank0.value != "none" and rank0.per_launch
    assert rank0 == rank1 == restarted  # every worker of the launch, and its restarts
    assert again.value != rank0.value  # the same command run again: a new launch, a new id


def test_multi_host_ids_share_only_the_master_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    """Across hosts only MASTER_ADDR/MASTER_PORT are common: the id is the same on every host but repeats when a
    later launch reuses the port, which is warned about once on rank 0."""
    node_a = job_id_from_env(_worker(GROUP_WORLD_SIZE="2", WORLD_SIZE="4"))
    node_b = job_id_from_env(_worker(GROUP_WORLD_SIZE="2", WORLD_SIZE="4",
                                     TORCHELASTIC_ERROR_FILE="/tmp/torchelastic_zz/none_q9/attempt_0/1/error.json"))
    assert node_a == node_b and not node_a.per_launch
    assert job_id_from_env(_worker(GROUP_WORLD_SIZE="2", WORLD_SIZE="4", MASTER_PORT="29501")) != node_a
    caplog.set_level("INFO", logger="otel_straggler.identity")
    env = _worker(GROUP_WORLD_SIZE="2", WORLD_SIZE="4", MASTER_PORT="29777", RANK="0")
    resolve_identity(env=env, use_parallel_state=False)
    resolve_identity(env=env, use_parallel_state=False)
    resolve_identity(env={**env, "RANK": "1"}, use_parallel_state=False)
    lines = [r.getMessage() for r in caplog.records if "job id" in r.getMessage()]
    assert len(lines) == 1 and "repeats" in lines[0] and "OTEL_STRAGGLER_JOB_ID" in lines[0]


def test_a_single_process_gets_its_own_id() -> None:
    """Without any launcher the only rank's own process identifies the run: two runs, two ids."""
    code = "from otel_straggler.identity import job_id_from_env; print(job_id_from_env({}).value)"
    ids = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
           for _ in range(2)]
    assert all(i.startswith("launch-") for i in ids) and ids[0] != ids[1]


@pytest.mark.slow
def test_two_torchrun_launches_get_two_ids_and_ranks_agree() -> None:
    """The same torchrun command twice (2 workers, a fixed --master-port, no --rdzv-id: TORCHELASTIC_RUN_ID=none),
    the default export child, a real receiver: each launch's ranks report one id, the launches differ, every
    rank-step span id is unique across both (nothing a collector would reject as a duplicate)."""
    from export_e2e_support import otlp_env
    from export_otlp_receiver import GrpcReceiver

    rcv = GrpcReceiver()
    try:
        env = {k: v for k, v in otlp_env(rcv.endpoint).items() if k not in ("OTEL_STRAGGLER_JOB_ID", "SLURM_JOB_ID",
                                                                             "TORCHELASTIC_RUN_ID")}
        env["OTEL_STRAGGLER_ENABLED"] = "1"
        port = str(free_port())
        launches = []
        for _ in range(2):
            out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                  "--master-port", port, str(HERE / "torchrun_rank.py")],
                                 capture_output=True, text=True, timeout=180, env=env)
            assert out.returncode == 0, out.stderr[-3000:]
            ranks = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            assert sorted(r["rank"] for r in ranks) == [0, 1]
            assert len({r["job_id"] for r in ranks}) == 1
            assert out.stderr.count("derived from the torchrun agent's run directory") == 1  # rank 0, once
            launches.append(ranks[0]["job_id"])
        assert launches[0] != launches[1] and all(j.startswith("launch-") for j in launches)

        def rank_steps() -> list:
            return [s for s in rcv.store.spans() if s.name == schema.SPAN_RANK_STEP]

        assert rcv.store.wait_for(lambda: len(rank_steps()) >= 12, 10.0)
        spans = rank_steps()
        assert {(s.r(schema.RES_JOB_ID), s.r(schema.RES_RANK)) for s in spans} == {
            (j, r) for j in launches for r in (0, 1)}
        # no DP position given: torchrun's RANK / WORLD_SIZE are the data-parallel position of a plain DDP job
        assert {(s.r(schema.RES_RANK), s.r(schema.RES_DP_RANK), s.r(schema.RES_DP_SIZE)) for s in spans} == {
            (0, 0, 2), (1, 1, 2)}
        ids = [s.span_id for s in spans]
        assert len(ids) == len(set(ids)) == 12
    finally:
        rcv.stop()


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
    ident = resolve_identity(env={"OTEL_STRAGGLER_TP_RANK": "0", "RANK": "29", "WORLD_SIZE": "48"})
    assert ident.source == "parallel_state"  # and its DP position, not the world's
    assert (ident.tp_rank, ident.tp_size, ident.pp_rank, ident.pp_size) == (1, 2, 3, 4)
    assert (ident.vpp_rank, ident.vpp_size, ident.dp_rank, ident.dp_size) == (0, 1, 5, 6)
    assert ident.ep_rank == 0  # guarded getter failed open
    assert ident.cohort_key.endswith("tp1.pp3.vpp0.cp0.ep0.etp0.c0")


def test_parallel_state_not_initialised_falls_back() -> None:
    ident = resolve_identity(env={"OTEL_STRAGGLER_PP_RANK": "1"})
    assert ident.pp_rank == 1 and ident.source == "env"


def test_a_run_id_tells_launches_of_one_job_id_apart() -> None:
    """``OTEL_STRAGGLER_JOB_ID`` exported once in a shell names every torchrun started from it: the run id is the
    launch, the same on every worker and restart of one launch, new with the next launch."""
    job = {"OTEL_STRAGGLER_JOB_ID": "pretrain-7"}
    rank0 = run_id_from_env(_worker(**job))
    err = "TORCHELASTIC_ERROR_FILE"
    rank1 = run_id_from_env(_worker(**job, **{err: "/tmp/torchelastic_k2/none_8x1q/attempt_0/1/error.json"}))
    again = run_id_from_env(_worker(**job, **{err: "/tmp/torchelastic_p0/none_u7c2/attempt_0/0/error.json"}))
    assert rank0 == rank1 and rank0.per_launch and rank0.value
    assert again.value != rank0.value
    assert run_id_from_env({**job, "OTEL_STRAGGLER_RUN_ID": " attempt-3 "}).value == "attempt-3"
    # Slurm names the srun in the job id; a requeued job keeps it, its restart count is the run
    assert run_id_from_env({"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0"}).value == "r0"
    assert run_id_from_env({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}).value == "r2"
    ident = resolve_identity(env=_worker(**job), use_parallel_state=False)
    assert ident.job_id == "pretrain-7" and ident.run_id == rank0.value
    assert ident.resource_attributes()[schema.RES_RUN_ID] == rank0.value


def test_step_ids_of_two_runs_of_one_job_differ_and_without_a_run_are_as_before() -> None:
    a, b = (schema.trace_id_for_step("j", 5, run) for run in ("r0", "r1"))
    assert a != b
    assert schema.trace_id_for_step("j", 5, "") == schema.trace_id_for_step("j", 5)
    assert schema.rank_step_span_id("j", 5, 2, "r0") != schema.rank_step_span_id("j", 5, 2, "r1")
    assert schema.job_step_span_id("j", 5, "r0") != schema.job_step_span_id("j", 5)
    key = schema.run_cohort("e0/s/tp0.pp0", "r1")
    assert schema.cohort_run(key) == "r1" and schema.cohort_run("e0/s/tp0.pp0") == ""


@pytest.mark.parametrize(("attrs", "node"), [
    ("host.name=node-7", "node-7"),  # set by hand: the SDK's precedence, the variable over detection
    ("k8s.node.name=node-3", "node-3"),  # a pod's downward API (deploy/kubernetes/training/job-example.yaml)
    ("k8s.node.name=node-3,host.name=node-7", "node-7"),
    ("service.name=x,host.name=gpu%2Dnode-1", "gpu-node-1"),  # URL-encoded values
])
def test_in_a_pod_the_host_is_the_node_the_environment_names(attrs: str, node: str) -> None:
    """A pod-shaped environment: ``gethostname()`` is the pod's name; the resource's ``host.name`` (what node
    verdicts and the alerts' ``host`` group by) is the node from ``OTEL_RESOURCE_ATTRIBUTES``."""
    import socket

    from otel_straggler.export.provider import build_resource

    env = {"RANK": "0", "WORLD_SIZE": "2", "OTEL_RESOURCE_ATTRIBUTES": attrs}
    ident = resolve_identity(env=env, use_parallel_state=False)
    assert ident.host == node != socket.gethostname()
    assert ident.resource_attributes()[schema.RES_HOST_NAME] == node
    assert build_resource(ident.resource_attributes()).attributes[schema.RES_HOST_NAME] == node


def test_without_a_named_host_the_host_is_gethostname() -> None:
    import socket

    ident = resolve_identity(env={"RANK": "0", "WORLD_SIZE": "2"}, use_parallel_state=False)
    assert ident.host == socket.gethostname()

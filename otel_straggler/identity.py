"""Who this training process is: rank, host, GPU, job, parallel position, cohort key.

Resolved once at install (never on the hot path), every probe guarded and failing open:

* rank / local rank / world size: the keyword arguments when given, else ``torch.distributed`` when
  initialised, else env ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (default 0 / 0 / 1);
* job id: the ``job_id`` argument (stripped) unless empty or ``none``, else ``job_id_from_env``
  (``OTEL_STRAGGLER_JOB_ID``, ``SLURM_JOB_ID[.SLURM_STEP_ID]``, ``TORCHELASTIC_RUN_ID`` unless ``none``, else
  derived per launch); logged once on rank 0;
* run id: ``run_id_from_env`` (``OTEL_STRAGGLER_RUN_ID``, ``SLURM_RESTART_COUNT``, else the launch as derived
  for the job id): a re-run under the same job id is a new run;
* GPU: ``torch.cuda.get_device_properties(index)`` (``uuid``, PCI domain/bus/device) for the current
  device; ``cpu`` / ``""`` / -1 without CUDA, ``unknown`` when a probe fails (no nvidia-smi);
* service name: ``OTEL_SERVICE_NAME``, else ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, else
  ``megatron-training``;
* parallel position from ``megatron.core.parallel_state`` getters when the program imported it and model
  parallel is initialised (keyword arguments override single dimensions); otherwise keyword arguments, else env
  ``OTEL_STRAGGLER_{TP,PP,VPP,CP,EP,ETP,DP}_{RANK,SIZE}`` and
  ``OTEL_STRAGGLER_MODEL_CHUNK``; defaults rank 0 / size 1, except data parallel in a plain
  ``torch.distributed`` (DDP) job: without parallel state, without a DP rank or size given, and with TP, PP, CP and
  EP of size 1, every rank is a data-parallel replica, so the DP rank / size are the rank / world size above
  (source ``world``);
* cohort key: ``schema.cohort_key`` (DP excluded; topology epoch and stage schema included).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import otel_straggler_schema as schema
from otel_straggler import hot_path
from otel_straggler_schema.stages import STAGE_SCHEMA

_log = logging.getLogger(__name__)

DIMS = ("tp", "pp", "vpp", "cp", "ep", "etp", "dp")
DEFAULT_SERVICE_NAME = "megatron-training"  # without OTEL_SERVICE_NAME

# parallel_state getter names per dimension: (rank getter, size getter)
_PS_GETTERS: dict[str, tuple[str, str]] = {
    "tp": ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"),
    "pp": ("get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size"),
    "vpp": ("get_virtual_pipeline_model_parallel_rank", "get_virtual_pipeline_model_parallel_world_size"),
    "cp": ("get_context_parallel_rank", "get_context_parallel_world_size"),
    "ep": ("get_expert_model_parallel_rank", "get_expert_model_parallel_world_size"),
    "etp": ("get_expert_tensor_parallel_rank", "get_expert_tensor_parallel_world_size"),
    "dp": ("get_data_parallel_rank", "get_data_parallel_world_size"),
}


@dataclass(frozen=True, slots=True)
class Identity:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    host: str = "unknown"
    pid: int = 0
    job_id: str = "local"
    run_id: str = ""
    service_name: str = DEFAULT_SERVICE_NAME
    gpu_uuid: str = "cpu"
    gpu_pci_bus_id: str = ""
    gpu_index: int = -1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    vpp_rank: int = 0
    vpp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    model_chunk: int = 0
    topology_epoch: int = 0
    stage_schema: str = STAGE_SCHEMA
    source: str = "default"  # where the parallel position came from: parallel_state, args, env, default

    @property
    def cohort_key(self) -> str:
        return schema.cohort_key(
            topology_epoch=self.topology_epoch,
            stage_schema=self.stage_schema,
            tp=self.tp_rank,
            pp=self.pp_rank,
            vpp=self.vpp_rank,
            cp=self.cp_rank,
            ep=self.ep_rank,
            etp=self.etp_rank,
            chunk=self.model_chunk,
        )

    def resource_attributes(self) -> dict[str, Any]:
        return {
            schema.RES_SERVICE_NAME: self.service_name,
            schema.RES_HOST_NAME: self.host,
            schema.RES_PROCESS_PID: self.pid,
            schema.RES_RANK: self.rank,
            schema.RES_WORLD_SIZE: self.world_size,
            schema.RES_LOCAL_RANK: self.local_rank,
            schema.RES_TP_RANK: self.tp_rank,
            schema.RES_TP_SIZE: self.tp_size,
            schema.RES_PP_RANK: self.pp_rank,
            schema.RES_PP_SIZE: self.pp_size,
            schema.RES_VPP_RANK: self.vpp_rank,
            schema.RES_VPP_SIZE: self.vpp_size,
            schema.RES_CP_RANK: self.cp_rank,
            schema.RES_CP_SIZE: self.cp_size,
            schema.RES_EP_RANK: self.ep_rank,
            schema.RES_EP_SIZE: self.ep_size,
            schema.RES_ETP_RANK: self.etp_rank,
            schema.RES_ETP_SIZE: self.etp_size,
            schema.RES_DP_RANK: self.dp_rank,
            schema.RES_DP_SIZE: self.dp_size,
            schema.RES_MODEL_CHUNK: self.model_chunk,
            schema.RES_JOB_ID: self.job_id,
            schema.RES_RUN_ID: self.run_id,
            schema.RES_GPU_UUID: self.gpu_uuid,
            schema.RES_GPU_PCI_BUS_ID: self.gpu_pci_bus_id,
            schema.RES_GPU_INDEX: self.gpu_index,
            schema.RES_COHORT_KEY: self.cohort_key,
            schema.RES_TOPOLOGY_EPOCH: self.topology_epoch,
            schema.RES_STAGE_SCHEMA: self.stage_schema,
            schema.RES_SCHEMA_VERSION: schema.SCHEMA_VERSION,
            schema.RES_HOT_PATH: hot_path.NAME,
        }


def _safe(fn: Callable[[], Any], default: Any = None) -> Any:
    try:
        return fn()
    except Exception:  # every probe fails open
        return default


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    v = env.get(key)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        return None


def _dist_rank_world() -> tuple[int, int] | None:
    def probe() -> tuple[int, int] | None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
        return None

    return _safe(probe)


def service_name_from_env(env: Mapping[str, str]) -> str | None:
    """``OTEL_SERVICE_NAME``, else ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES`` (the specification's
    order), else None (then the caller's default)."""
    name = (env.get("OTEL_SERVICE_NAME") or "").strip()
    if name:
        return name
    for item in (env.get("OTEL_RESOURCE_ATTRIBUTES") or "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip() == schema.RES_SERVICE_NAME and value.strip():
            return unquote(value.strip())
    return None


def resource_attribute_from_env(env: Mapping[str, str], key: str) -> str | None:
    """The value of ``key`` in ``OTEL_RESOURCE_ATTRIBUTES`` (``k=v,k2=v2``, URL-encoded values), else None."""
    for item in (env.get("OTEL_RESOURCE_ATTRIBUTES") or "").split(","):
        k, sep, value = item.partition("=")
        if sep and k.strip() == key and value.strip():
            return unquote(value.strip())
    return None


K8S_NODE_NAME = "k8s.node.name"


def host_from_env(env: Mapping[str, str]) -> str | None:
    """The machine the rank runs on, as the environment names it: ``host.name`` in ``OTEL_RESOURCE_ATTRIBUTES``
    (the SDK's precedence: the variable over what is detected), else ``k8s.node.name`` there (a pod's downward
    API: ``gethostname()`` in a pod is the pod's name, not the node's), else None (then ``gethostname()``)."""
    return resource_attribute_from_env(env, schema.RES_HOST_NAME) or resource_attribute_from_env(env, K8S_NODE_NAME)


@dataclass(frozen=True, slots=True)
class JobId:
    value: str
    source: str  # the variable it came from, or "launch" (derived), or "local"
    per_launch: bool  # False: the same value may come back in a later launch (then warned about)
    basis: str = ""  # what a derived id was computed from (for the log line)


_UNSET = ("", "none")  # torchrun's TORCHELASTIC_RUN_ID is "none" unless --rdzv-id is given


def _set(value: str | None) -> str | None:
    """``value`` stripped, or None when it is empty or ``none`` (any case, any padding)."""
    v = (value or "").strip()
    return None if v.lower() in _UNSET else v


def _given(env: Mapping[str, str], key: str) -> str | None:
    return _set(env.get(key))


def _process_token(pid: int, proc: str = "/proc") -> str | None:
    """``pid`` with its start time (clock ticks since boot) and the boot id: unique per process on a host."""
    try:
        start = Path(f"{proc}/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        boot = Path(f"{proc}/sys/kernel/random/boot_id").read_text().strip()
    except (OSError, IndexError):
        return None
    return f"{boot}/{pid}/{start}"


def _torchrun_run_dir(env: Mapping[str, str]) -> str | None:
    """The log directory the torchrun agent created for this launch, ``<base>/<run_id>_<random>``: the same for
    every worker of the agent and for its restarts, new with every launch (from ``TORCHELASTIC_ERROR_FILE``,
    ``<run dir>/attempt_<n>/<local rank>/error.json``; empty when the agent logs to /dev/null)."""
    path = (env.get("TORCHELASTIC_ERROR_FILE") or "").strip()
    head, sep, _ = path.rpartition("/attempt_")
    return head if sep and head else None


def job_id_from_env(env: Mapping[str, str], world_size: int | None = None) -> JobId:
    """The job id every rank of one launch derives alike, without talking to the others.

    1. ``OTEL_STRAGGLER_JOB_ID``, as given.
    2. ``SLURM_JOB_ID``, with ``.SLURM_STEP_ID`` when set (sacct's notation): every task of one ``srun`` has
       both, and a second ``srun`` in the same allocation is a new step.
    3. ``TORCHELASTIC_RUN_ID`` (torchrun ``--rdzv-id``) unless it is torchrun's default ``none``.
    4. Derived per launch, ``launch-<12 hex>``: a hash of ``MASTER_ADDR``/``MASTER_PORT`` and, when every rank
       runs on this host (torchrun with one agent, ``GROUP_WORLD_SIZE=1``; ``LOCAL_WORLD_SIZE`` =
       ``WORLD_SIZE``; a single process), a token of this launch on this host: the torchrun agent's run
       directory (random per launch), else the parent process (pid, start time, boot id) of the ranks, or
       this process when it is the only rank. Across hosts only the master address and port are common:
       with torchrun's c10d rendezvous the port is picked per launch, with a fixed ``--master-port`` it
       repeats, and so does the id (warned about once; set ``OTEL_STRAGGLER_JOB_ID`` or ``--rdzv-id``).
       The torchrun restart count is not used: agents on different hosts count restarts differently (a
       membership change restarts the others uncounted), so a restarted launch keeps its id.
    5. ``local`` when nothing identifies the launch (several ranks, no launcher variables; warned about).
    """
    explicit = _given(env, "OTEL_STRAGGLER_JOB_ID")
    if explicit:
        return JobId(explicit, "OTEL_STRAGGLER_JOB_ID", True)
    slurm = _given(env, "SLURM_JOB_ID")
    if slurm:
        step = _given(env, "SLURM_STEP_ID")
        return JobId(f"{slurm}.{step}" if step else slurm, "SLURM_JOB_ID", True)
    run_id = _given(env, "TORCHELASTIC_RUN_ID")
    if run_id:
        return JobId(run_id, "TORCHELASTIC_RUN_ID", True)
    launch = _launch(env, world_size)
    if launch is None:
        return JobId("local", "local", False, "nothing (no launcher variables)")
    return JobId(f"launch-{launch.value}", "launch", launch.per_launch, launch.basis)


def _launch(env: Mapping[str, str], world_size: int | None) -> JobId | None:
    """This launch as every rank derives it alike (``job_id_from_env``, 4.): 12 hex digits, or None when nothing
    identifies it."""
    world = world_size if world_size is not None else (_env_int(env, "WORLD_SIZE") or 1)
    group_world = _env_int(env, "GROUP_WORLD_SIZE")
    local_world = _env_int(env, "LOCAL_WORLD_SIZE")
    one_host = world <= 1 or group_world == 1 or (local_world is not None and local_world == world)
    parts = [f"{k}={env[k]}" for k in ("MASTER_ADDR", "MASTER_PORT") if env.get(k)]
    basis = ["MASTER_ADDR/MASTER_PORT"] if parts else []
    token = None
    if one_host:
        run_dir = _torchrun_run_dir(env)
        if run_dir:
            token, what = f"torchrun:{run_dir}", "the torchrun agent's run directory"
        else:
            token = _process_token(os.getppid() if world > 1 else os.getpid())
            what = "the launching process" if world > 1 else "this process"
        if token is not None:
            parts.append(token)
            basis.insert(0, what)
    if not parts:
        return None
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
    return JobId(digest, "launch", token is not None, " and ".join(basis))


def run_id_from_env(env: Mapping[str, str], world_size: int | None = None) -> JobId:
    """One launch of the job, which a re-run under the same job id does not share: the collector judges each run
    apart and step trace ids include it (``schema.trace_id_for_step``).

    1. ``OTEL_STRAGGLER_RUN_ID``, as given (a scheduler's attempt id, say).
    2. Under Slurm: ``SLURM_RESTART_COUNT`` (``r<n>``, ``r0`` before any requeue); the job id already names the
       ``srun`` (``job_id_from_env``).
    3. The launch as ``job_id_from_env`` derives it (4.): new with every launch on one host; across hosts the
       master address and port, which a fixed ``--master-port`` repeats (``per_launch`` False).
    4. Empty when nothing identifies the launch: the collector then tells runs apart only by their job ids.
    """
    explicit = _given(env, "OTEL_STRAGGLER_RUN_ID")
    if explicit:
        return JobId(explicit, "OTEL_STRAGGLER_RUN_ID", True)
    if _given(env, "SLURM_JOB_ID"):
        return JobId(f"r{_env_int(env, 'SLURM_RESTART_COUNT') or 0}", "SLURM_RESTART_COUNT", True)
    launch = _launch(env, world_size)
    return launch if launch is not None else JobId("", "none", False, "nothing (no launcher variables)")


_logged: set[str] = set()


def _log_job_id(job: JobId, rank: int) -> None:
    """Once per id and process, on rank 0: where the job id came from (a derived one as a warning, so it is
    seen: dashboards and verdicts are keyed by it)."""
    if rank != 0 or job.value in _logged:
        return
    _logged.add(job.value)
    if job.source in ("launch", "local"):
        repeat = "" if job.per_launch else "; it repeats in every launch like this one"
        _log.warning("otel-straggler: job id %r derived from %s%s (set OTEL_STRAGGLER_JOB_ID to choose one)",
                     job.value, job.basis, repeat)
    else:
        _log.info("otel-straggler: job id %r from %s", job.value, job.source)


def gpu_identity(cuda: bool) -> tuple[str, str, int]:
    """(uuid, pci bus id, index) of the current CUDA device; (cpu, '', -1) without CUDA."""
    if not cuda:
        return "cpu", "", -1

    def probe() -> tuple[str, str, int]:
        import torch

        index = int(torch.cuda.current_device())
        props = torch.cuda.get_device_properties(index)
        raw = getattr(props, "uuid", None)
        uuid = "unknown"
        if raw is not None:
            s = str(raw)
            uuid = s if s.startswith("GPU-") else f"GPU-{s}"
        pci = "unknown"
        if hasattr(props, "pci_bus_id"):
            pci = "{:08X}:{:02X}:{:02X}.0".format(
                int(getattr(props, "pci_domain_id", 0)), int(props.pci_bus_id), int(getattr(props, "pci_device_id", 0))
            )
        return uuid, pci, index

    return _safe(probe, ("unknown", "unknown", -1))


def _parallel_state_position() -> dict[str, int] | None:
    """Megatron's parallel position, read only when the program already imported ``parallel_state`` (a
    Megatron program has; importing megatron-core here would cost seconds and warnings elsewhere)."""

    def probe() -> dict[str, int] | None:
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is None or not ps.model_parallel_is_initialized():
            return None
        out: dict[str, int] = {}
        for dim, (rank_getter, size_getter) in _PS_GETTERS.items():
            rg = getattr(ps, rank_getter, None)
            sg = getattr(ps, size_getter, None)
            r = _safe(rg) if rg is not None else None
            s = _safe(sg) if sg is not None else None
            out[f"{dim}_rank"] = int(r) if r is not None else 0
            out[f"{dim}_size"] = int(s) if s is not None else 1
        return out

    return _safe(probe)


def resolve_identity(
    *,
    env: Mapping[str, str] | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    job_id: str | None = None,
    cuda: bool = False,
    topology_epoch: int = 0,
    model_chunk: int | None = None,
    use_parallel_state: bool = True,
    **position: int,
) -> Identity:
    """Build the identity; ``position`` takes ``tp_rank=``, ``tp_size=`` ... ``dp_size=``."""
    env = os.environ if env is None else env
    dist = _dist_rank_world()
    if dist is not None:
        r, w = dist
    else:
        r = _env_int(env, "RANK")
        w = _env_int(env, "WORLD_SIZE")
        r = r if r is not None else 0
        w = w if w is not None else 1
    # explicit arguments win (e.g. independent replicas that each run a one-process world)
    r = rank if rank is not None else r
    w = world_size if world_size is not None else w
    lr = local_rank if local_rank is not None else _env_int(env, "LOCAL_RANK")
    lr = lr if lr is not None else 0
    pos: dict[str, int] = {}
    source = "default"
    ps = _parallel_state_position() if use_parallel_state else None
    if ps is not None:
        pos, source = ps, "parallel_state"
        for key, value in position.items():
            if value is not None and key in pos:
                pos[key] = int(value)
                source = "parallel_state+args"
    else:
        for dim in DIMS:
            for kind in ("rank", "size"):
                key = f"{dim}_{kind}"
                if key in position and position[key] is not None:
                    pos[key] = int(position[key])
                    source = "args"
                else:
                    v = _env_int(env, f"OTEL_STRAGGLER_{dim.upper()}_{kind.upper()}")
                    if v is not None:
                        pos[key] = v
                        if source == "default":
                            source = "env"
        if ("dp_rank" not in pos and "dp_size" not in pos and int(w) > 1
                and all(pos.get(f"{dim}_size", 1) == 1 for dim in ("tp", "pp", "cp", "ep"))):
            pos["dp_rank"], pos["dp_size"] = int(r), int(w)  # plain DDP: every rank is a DP replica
            source = "world" if source == "default" else source
    chunk = model_chunk if model_chunk is not None else _env_int(env, "OTEL_STRAGGLER_MODEL_CHUNK")
    if chunk is None:
        chunk = pos.get("vpp_rank", 0) if pos.get("vpp_size", 1) > 1 else 0
    uuid, pci, index = gpu_identity(cuda)
    given_job = _set(job_id)
    job = JobId(given_job, "job_id", True) if given_job else job_id_from_env(env, int(w))
    _log_job_id(job, int(r))
    run = run_id_from_env(env, int(w))
    return Identity(
        rank=int(r),
        local_rank=int(lr),
        world_size=int(w),
        host=host_from_env(env) or _safe(socket.gethostname, "unknown") or "unknown",
        pid=os.getpid(),
        job_id=job.value,
        run_id=run.value,
        service_name=service_name_from_env(env) or DEFAULT_SERVICE_NAME,
        gpu_uuid=uuid,
        gpu_pci_bus_id=pci,
        gpu_index=index,
        model_chunk=int(chunk),
        topology_epoch=int(topology_epoch),
        source=source,
        **{k: int(v) for k, v in pos.items() if k.endswith(("_rank", "_size"))},
    )

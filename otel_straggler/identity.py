"""Who this training process is: rank, host, GPU, job, parallel position, cohort key.

Resolved once at install (never on the hot path), every probe guarded and failing open:

* rank / local rank / world size: the keyword arguments when given, else ``torch.distributed`` when
  initialised, else env ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (default 0 / 0 / 1);
* job id: ``OTEL_STRAGGLER_JOB_ID``, ``SLURM_JOB_ID``, ``TORCHELASTIC_RUN_ID``, else ``local``
  (a non-empty ``job_id`` argument wins);
* GPU: ``torch.cuda.get_device_properties(index)`` (``uuid``, PCI domain/bus/device) for the current
  device; ``cpu`` / ``""`` / -1 without CUDA, ``unknown`` when a probe fails (no nvidia-smi);
* service name: ``OTEL_SERVICE_NAME``, else ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, else
  ``megatron-training``;
* parallel position from ``megatron.core.parallel_state`` getters when the program imported it and model
  parallel is initialised (keyword arguments override single dimensions); otherwise keyword arguments, else env
  ``OTEL_STRAGGLER_{TP,PP,VPP,CP,EP,ETP,DP}_{RANK,SIZE}`` and
  ``OTEL_STRAGGLER_MODEL_CHUNK``; defaults rank 0 / size 1;
* cohort key: ``schema.cohort_key`` (DP excluded; topology epoch and stage schema included).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from otel_straggler import schema
from otel_straggler.stages import STAGE_SCHEMA

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
            schema.RES_GPU_UUID: self.gpu_uuid,
            schema.RES_GPU_PCI_BUS_ID: self.gpu_pci_bus_id,
            schema.RES_GPU_INDEX: self.gpu_index,
            schema.RES_COHORT_KEY: self.cohort_key,
            schema.RES_TOPOLOGY_EPOCH: self.topology_epoch,
            schema.RES_STAGE_SCHEMA: self.stage_schema,
            schema.RES_SCHEMA_VERSION: schema.SCHEMA_VERSION,
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


def job_id_from_env(env: Mapping[str, str]) -> str:
    for key in ("OTEL_STRAGGLER_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        v = env.get(key)
        if v:
            return str(v)
    return "local"


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
    chunk = model_chunk if model_chunk is not None else _env_int(env, "OTEL_STRAGGLER_MODEL_CHUNK")
    if chunk is None:
        chunk = pos.get("vpp_rank", 0) if pos.get("vpp_size", 1) > 1 else 0
    uuid, pci, index = gpu_identity(cuda)
    return Identity(
        rank=int(r),
        local_rank=int(lr),
        world_size=int(w),
        host=_safe(socket.gethostname, "unknown") or "unknown",
        pid=os.getpid(),
        job_id=job_id if job_id else job_id_from_env(env),
        service_name=service_name_from_env(env) or DEFAULT_SERVICE_NAME,
        gpu_uuid=uuid,
        gpu_pci_bus_id=pci,
        gpu_index=index,
        model_chunk=int(chunk),
        topology_epoch=int(topology_epoch),
        source=source,
        **{k: int(v) for k, v in pos.items() if k.endswith(("_rank", "_size"))},
    )

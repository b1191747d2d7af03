"""One reading of a resource's identity (job, run, rank, cohort, node, GPU), shared by the receivers' tenant check
and the straggler processor, so the two can never disagree about whose a span is. A resource that names an identity
attribute (``otel_straggler_schema.RES_IDENTITY_KEYS``) twice is marked ``duplicate``: the receivers refuse its
request as invalid, the processor rejects its spans as ``malformed``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from opentelemetry.proto.resource.v1.resource_pb2 import Resource

import otel_straggler_schema as s

_isfinite = math.isfinite
_IDENTITY_KEYS = frozenset(s.RES_IDENTITY_KEYS)


@dataclass(slots=True)
class ResourceIdentity:
    job: str = ""
    cohort: str = ""  # the cohort key, with the run id once the resource is read (schema.run_cohort)
    run: str = ""
    rank: int = -1
    host: str = ""
    gpu: str = ""
    world_size: int = 0
    dp_size: int = 0
    dp_rank: int = -1
    service: str = ""
    summary: bool = False
    duplicate: str = ""  # the first identity attribute the resource names twice ("" when none)

    @property
    def usable(self) -> bool:
        return self.rank >= 0 and bool(self.cohort) and not self.duplicate


def int_of(v: object) -> int:
    """An AnyValue read as an int: int, a decimal string, a finite double (truncated); -1 otherwise."""
    which = v.WhichOneof("value")  # type: ignore[attr-defined]
    if which == "int_value":
        return v.int_value  # type: ignore[attr-defined]
    if which == "string_value":
        try:
            return int(v.string_value)  # type: ignore[attr-defined]
        except ValueError:
            return -1
    if which == "double_value" and _isfinite(v.double_value):  # type: ignore[attr-defined]
        return int(v.double_value)  # type: ignore[attr-defined]
    return -1


def read_identity(resource: Resource) -> ResourceIdentity:
    """The identity ``resource`` states, read once attribute by attribute."""
    ident = ResourceIdentity()
    seen: set[str] = set()
    for kv in resource.attributes:
        k = kv.key
        if k not in _IDENTITY_KEYS:
            continue
        if k in seen:
            if not ident.duplicate:
                ident.duplicate = k
            continue
        seen.add(k)
        v = kv.value
        if k == s.RES_RANK:
            ident.rank = v.int_value if v.WhichOneof("value") == "int_value" else int_of(v)
        elif k == s.RES_COHORT_KEY:
            ident.cohort = v.string_value
        elif k == s.RES_JOB_ID:
            ident.job = v.string_value
        elif k == s.RES_RUN_ID:
            ident.run = v.string_value
        elif k == s.RES_HOST_NAME:
            ident.host = v.string_value
        elif k == s.RES_GPU_UUID:
            ident.gpu = v.string_value
        elif k == s.RES_WORLD_SIZE:
            ident.world_size = int_of(v)
        elif k == s.RES_DP_SIZE:
            ident.dp_size = int_of(v)
        elif k == s.RES_DP_RANK:
            ident.dp_rank = int_of(v)
        elif k == s.RES_SERVICE_NAME:
            ident.service = v.string_value
        elif k == s.RES_STEP_SUMMARY:
            ident.summary = v.bool_value
    if ident.run and ident.cohort:
        ident.cohort = s.run_cohort(ident.cohort, ident.run)
    return ident


_IDENTITY_MAX = 8192  # distinct resources remembered (one per rank of each job): cleared when full
_IDENTITY_BYTES = 2048  # a resource of more wire bytes is read every time (a rank's: ~600)
_identities: dict[bytes, ResourceIdentity] = {}


def identity(resource: Resource) -> ResourceIdentity:
    """``read_identity(resource)``, remembered by the resource's wire bytes: a rank sends the same resource in
    every request, and the receiver and the processor read it once between them. The identity returned is shared:
    read it, never change it."""
    raw = resource.SerializeToString()
    ident = _identities.get(raw)
    if ident is None:
        if len(raw) > _IDENTITY_BYTES:  # not a rank's resource as the emitter sends it: read, not remembered
            return read_identity(resource)
        if len(_identities) >= _IDENTITY_MAX:
            _identities.clear()
        ident = _identities[raw] = read_identity(resource)
    return ident

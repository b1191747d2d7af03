"""A tenant writes only its own jobs: every resource of a request must name (``straggler.job.id``) a job the
request's token may write, or the request is refused as a whole (HTTP 403 / PERMISSION_DENIED), before any of it
reaches a pipeline."""

from __future__ import annotations

from google.protobuf.message import Message

import otel_straggler_schema as s
from collector_processor.receiver.auth import Tenant

_RESOURCES = {"traces": "resource_spans", "metrics": "resource_metrics", "logs": "resource_logs"}


class Forbidden(ValueError):
    """The request names a job its token may not write."""


def foreign_job(signal: str, msg: Message, tenant: Tenant) -> str | None:
    """The first job named by a resource of ``msg`` that ``tenant`` may not write (``""`` for a resource that names
    none); None when every resource is the tenant's."""
    if tenant.every_job:
        return None
    key = s.RES_JOB_ID
    for res in getattr(msg, _RESOURCES[signal]):
        job = ""
        for kv in res.resource.attributes:
            if kv.key == key:
                job = kv.value.string_value
                break
        if not tenant.allows(job):
            return job
    return None


def check_tenant(signal: str, msg: Message, tenant: Tenant | None) -> None:
    """Raise ``Forbidden`` when ``msg`` names a job outside ``tenant``'s."""
    if tenant is None:
        return
    job = foreign_job(signal, msg, tenant)
    if job is not None:
        shown = job[:80] if job else "(no straggler.job.id)"
        raise Forbidden(f"token of {tenant.name} may not write job {shown!r}")

"""Whose a request is, read once (``resource_identity``) before any of it reaches a pipeline: a resource that names
an identity attribute twice makes the request invalid (HTTP 400 / INVALID_ARGUMENT), whoever sends it; with
tenants, every resource must name (``straggler.job.id``) a job the request's token may write, or the request is
refused as a whole (HTTP 403 / PERMISSION_DENIED)."""

from __future__ import annotations

from google.protobuf.message import Message

from collector_processor.receiver.auth import Tenant
from collector_processor.receiver.decode import DecodeFailure
from collector_processor.resource_identity import identity

_RESOURCES = {"traces": "resource_spans", "metrics": "resource_metrics", "logs": "resource_logs"}


class Forbidden(ValueError):
    """The request names a job its token may not write."""


class DuplicateIdentity(DecodeFailure):
    """A resource of the request names an identity attribute twice."""


def check_resources(signal: str, msg: Message, tenant: Tenant | None) -> None:
    """Raise ``DuplicateIdentity`` when a resource of ``msg`` names an identity attribute twice, ``Forbidden`` when
    one names a job outside ``tenant``'s (None: every job)."""
    every_job = tenant is None or tenant.every_job
    for i, res in enumerate(getattr(msg, _RESOURCES[signal])):
        ident = identity(res.resource)
        if ident.duplicate:
            raise DuplicateIdentity(f"resource {i} names {ident.duplicate} more than once")
        if not every_job and not tenant.allows(ident.job):  # type: ignore[union-attr]
            shown = ident.job[:80] if ident.job else "(no straggler.job.id)"
            raise Forbidden(f"token of {tenant.name} may not write job {shown!r}")  # type: ignore[union-attr]

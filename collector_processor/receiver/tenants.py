"""Whose a request is, read once (``resource_identity``) before any of it reaches a pipeline: a resource that names
an identity attribute twice makes the request invalid (HTTP 400 / INVALID_ARGUMENT), whoever sends it; with
tenants, every resource must name (``straggler.job.id``) a job the request's token may write, or the request is
refused as a whole (HTTP 403 / PERMISSION_DENIED). A tenant's spans must also stay in their own step traces: each
span's trace id is the one the schema derives from its resource's job, run and rank and the span's step
(``dl.iteration``), and none may pose as the collector's own (``straggler.verdict``, ``service.name``
``otel-straggler-collector``); the all-jobs token writes every trace."""

from __future__ import annotations

from google.protobuf.message import Message

import otel_straggler_schema as s
from collector_processor.receiver.auth import Tenant
from collector_processor.receiver.decode import DecodeFailure
from collector_processor.resource_identity import ResourceIdentity, identity

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
        if every_job:
            continue
        assert tenant is not None
        if not tenant.allows(ident.job):
            shown = ident.job[:80] if ident.job else "(no straggler.job.id)"
            raise Forbidden(f"token of {tenant.name} may not write job {shown!r}")
        if signal == "traces":
            _check_traces(res, ident, tenant.name)


def _check_traces(rs: object, ident: ResourceIdentity, who: str) -> None:
    """``Forbidden`` unless every span of ``rs`` sits in the step trace its own resource and step derive, and none
    poses as the collector's."""
    if ident.service == s.SERVICE_COLLECTOR:
        raise Forbidden(f"token of {who} may not send spans as service.name {s.SERVICE_COLLECTOR!r}")
    if "/run/" in ident.job or "/" in ident.run or "@" in ident.run:  # step keys another job could spell alike
        raise Forbidden(f"token of {who}: a job id with '/run/' or a run id with '/' or '@' names no trace of its "
                        "own")
    block = s.trace_block(ident.rank)
    expected: dict[int, bytes] = {}  # step -> its trace id: a request carries a few steps
    for ss in rs.scope_spans:  # type: ignore[attr-defined]
        for span in ss.spans:
            if span.name == s.SPAN_VERDICT:
                raise Forbidden(f"token of {who} may not send {s.SPAN_VERDICT!r} spans: only the collector does")
            step = _step_of(span)
            tid = expected.get(step)
            if tid is None:
                if step < 0:
                    raise Forbidden(f"token of {who}: span {span.name[:40]!r} names no step ({s.ATTR_ITERATION}, "
                                    "one int), so no trace of its job")
                if len(expected) >= _MAX_STEPS:
                    expected.clear()
                tid = expected[step] = s.trace_id_for_step(ident.job, step, ident.run, block).to_bytes(16, "big")
            if span.trace_id != tid:
                raise Forbidden(f"token of {who}: span {span.name[:40]!r} of step {step} is outside its job's "
                                "step trace")


_MAX_STEPS = 64  # step trace ids remembered per resource while a request is checked


def _step_of(span: object) -> int:
    """The span's ``dl.iteration`` as the emitter sends it (one int attribute); -1 when absent, -2 when named
    twice or not an int (the processor reads ints only: a step read two ways is refused)."""
    step = -1
    for kv in span.attributes:  # type: ignore[attr-defined]
        if kv.key == s.ATTR_ITERATION:
            if step != -1 or kv.value.WhichOneof("value") != "int_value":
                return -2
            step = kv.value.int_value
    return step

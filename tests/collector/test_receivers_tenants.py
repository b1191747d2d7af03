"""Tenants at the receivers: each token of ``auth.tenants`` writes only its jobs (exact ids or a prefix ending in
``*``); a request with any resource naming another job, or none, is refused as a whole (gRPC PERMISSION_DENIED,
HTTP 403 with a google.rpc.Status body), counted, and never reaches a pipeline. The all-jobs ``bearer_token``
still writes everything."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from service_support import BASE_RECEIVER, DOUBLE_TRACES, DoubleProcessor

import otel_straggler_schema as s
from collector_processor.config.loader import ConfigError, load_text
from collector_processor.config.validate import validate
from collector_processor.receiver.auth import AuthConfig, BearerAuth

TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
AUTH = """    auth:
      bearer_token: admin-tok
      tenants:
        - {name: a, bearer_token: tok-a, jobs: [job-a]}
        - {name: b, bearer_token: tok-b, jobs: ["team-b/*", job-b-exact]}
"""
CFG = BASE_RECEIVER + AUTH + DOUBLE_TRACES


def _req(*jobs: str | tuple[str, ...] | None, step: int = 7) -> bytes:
    """One resource per item: a job id, None (no job), or a tuple (the resource names the job once per value);
    its span sits in the job's trace of ``step``."""
    req = trace_service_pb2.ExportTraceServiceRequest()
    for job in jobs:
        rs = req.resource_spans.add()
        for value in (() if job is None else job if isinstance(job, tuple) else (job,)):
            a = rs.resource.attributes.add()
            a.key, a.value.string_value = s.RES_JOB_ID, value
        first = job[0] if isinstance(job, tuple) else job or ""
        span = rs.scope_spans.add().spans.add(trace_id=s.trace_id_for_step(first, step).to_bytes(16, "big"),
                                              span_id=b"\x02" * 8, name="forward-compute")
        a = span.attributes.add()
        a.key, a.value.int_value = s.ATTR_ITERATION, step
    return req.SerializeToString()


def _forged(job: str, rank: int = 3, *, trace_of: str | None = None, trace_block: int | None = None,
            name: str = "forward-compute", service: str = "train", step: int | None = 7) -> bytes:
    """A span of ``job``'s rank ``rank`` whose trace is ``trace_of``'s step trace (its own by default)."""
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for key, value in ((s.RES_JOB_ID, job), (s.RES_SERVICE_NAME, service)):
        a = rs.resource.attributes.add()
        a.key, a.value.string_value = key, value
    a = rs.resource.attributes.add()
    a.key, a.value.int_value = s.RES_RANK, rank
    block = s.trace_block(rank) if trace_block is None else trace_block
    tid = s.trace_id_for_step(trace_of or job, step or 0, "", block)
    span = rs.scope_spans.add().spans.add(trace_id=tid.to_bytes(16, "big"), span_id=b"\x02" * 8, name=name)
    if step is not None:
        a = span.attributes.add()
        a.key, a.value.int_value = s.ATTR_ITERATION, step
    return req.SerializeToString()


@pytest.mark.parametrize(("body", "allowed", "why"), [
    (_forged("job-a"), True, ""),
    (_forged("job-a", rank=70), True, ""),  # rank 70's spans sit in block 1's trace
    (_forged("job-a", rank=70, trace_block=0), False, "outside its job's step trace"),
    (_forged("job-a", trace_of="job-b-exact"), False, "outside its job's step trace"),  # into B's trace
    (_forged("job-a", step=None), False, "names no step"),
    (_forged("job-a", name=s.SPAN_VERDICT), False, "only the collector does"),
    (_forged("job-a", service=s.SERVICE_COLLECTOR), False, "as service.name"),
])
def test_a_tenants_spans_stay_in_its_own_step_traces(start_service, body: bytes, allowed: bool, why: str) -> None:  # type: ignore[no-untyped-def]
    """Step trace ids are computable by anyone who knows a job id: a tenant could once put spans into another
    job's step traces, or a ``straggler.verdict`` span into its own. A tenant's span is now taken only in the trace
    its own resource and step derive, and never as the collector's; the all-jobs token writes every trace."""
    run = start_service(CFG)
    code = _grpc(run.grpc, body, "tok-a")
    status, answer = _http(run.http, body, "tok-a")
    if allowed:
        assert (code, status) == (grpc.StatusCode.OK, 200)
    else:
        assert code == grpc.StatusCode.PERMISSION_DENIED and status == 403
        assert why in Status.FromString(answer).message
        assert DoubleProcessor.instances[0].requests == []
        assert run.sample("otel_straggler_collector_tenant_refused_total", receiver="otlp/http") == 1
        assert _grpc(run.grpc, body, "admin-tok") == grpc.StatusCode.OK


def _grpc(target: str, body: bytes, token: str) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as ch:
        try:
            ch.unary_unary(TRACE_EXPORT)(body, timeout=10, metadata=(("authorization", f"Bearer {token}"),))
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def _http(url: str, body: bytes, token: str) -> tuple[int, bytes]:
    req = urllib.request.Request(url + "/v1/traces", data=body, method="POST", headers={
        "Content-Type": "application/x-protobuf", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize(("token", "jobs", "allowed"), [
    ("tok-a", ("job-a",), True),
    ("tok-a", ("job-a", "job-a"), True),
    ("tok-a", ("job-b-exact",), False),
    ("tok-a", ("job-a", "job-ab"), False),  # one foreign resource refuses the whole request
    ("tok-a", (None,), False),  # a resource that names no job is nobody's
    ("tok-b", ("team-b/run-7",), True),
    ("tok-b", ("job-b-exact",), True),
    ("tok-b", ("team-c/run-7",), False),
    ("tok-b", ("job-b-exactly",), False),
    ("admin-tok", ("job-a", "team-c/x", None), True),
])
def test_a_token_writes_only_its_jobs(start_service, token: str, jobs: tuple, allowed: bool) -> None:  # type: ignore[no-untyped-def]
    run = start_service(CFG)
    body = _req(*jobs)
    code = _grpc(run.grpc, body, token)
    status, answer = _http(run.http, body, token)
    if allowed:
        assert code == grpc.StatusCode.OK and status == 200
        assert len(DoubleProcessor.instances[0].requests) == 2
        assert run.sample("otel_straggler_collector_tenant_refused_total", receiver="otlp/grpc") == 0
    else:
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert status == 403 and Status.FromString(answer).code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert DoubleProcessor.instances[0].requests == []
        for rcv in ("otlp/grpc", "otlp/http"):
            assert run.sample("otel_straggler_collector_tenant_refused_total", receiver=rcv) == 1
            assert run.sample("otel_straggler_collector_requests_total", receiver=rcv, outcome="forbidden") == 1
    assert _grpc(run.grpc, body, "tok-nobody") == grpc.StatusCode.UNAUTHENTICATED


def test_tenant_config_is_checked_and_never_shows_a_token() -> None:
    def check(auth: str) -> str:
        raw, marks = load_text(CFG.replace(AUTH, auth), "t.yaml", {})
        with pytest.raises(ConfigError) as ei:
            validate(raw, marks)
        return str(ei.value)

    msg = check("    auth:\n      tenants: [{bearer_token: sekrit-1, jobs: []}]\n")
    assert "receivers.otlp.auth.tenants.0.jobs" in msg and "sekrit-1" not in msg
    msg = check("    auth:\n      tenants: [{bearer_token: sekrit-1, jobs: ['a*b']}]\n")
    assert "prefix ending in '*'" in msg
    assert "exactly one of" in check("    auth:\n      tenants: [{jobs: [a]}]\n")
    with pytest.raises(ValueError, match="share one token"):
        BearerAuth(AuthConfig.model_validate({"bearer_token": "x", "tenants": [{"bearer_token": "x", "jobs": ["a"]}]}))
    assert "sekrit" not in repr(AuthConfig.model_validate({"tenants": [{"bearer_token": "sekrit", "jobs": ["a"]}]}))


@pytest.mark.parametrize(("token", "job"), [
    ("tok-a", ("job-a", "job-b-exact")),  # the tenant's own job first, the victim's last
    ("tok-a", ("job-b-exact", "job-a")),
    ("tok-a", ("job-a", "job-a")),  # even twice the same: one reading, no second opinion
    ("admin-tok", ("job-a", "job-b-exact")),  # whoever sends it
])
def test_a_resource_naming_its_job_twice_is_refused(start_service, token: str, job: tuple) -> None:  # type: ignore[no-untyped-def]
    """A tenant's check and the processor once read different values of a doubled ``straggler.job.id``: tenant A
    wrote into job B. Now no reader resolves a doubled identity attribute: the request is invalid for everyone."""
    run = start_service(CFG)
    body = _req(job)
    code = _grpc(run.grpc, body, token)
    status, answer = _http(run.http, body, token)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert status == 400 and b"straggler.job.id more than once" in Status.FromString(answer).message.encode()
    assert DoubleProcessor.instances[0].requests == []
    for rcv in ("otlp/grpc", "otlp/http"):
        assert run.sample("otel_straggler_collector_duplicate_identity_total", receiver=rcv) == 1
        assert run.sample("otel_straggler_collector_requests_total", receiver=rcv, outcome="invalid") == 1
        assert run.sample("otel_straggler_collector_tenant_refused_total", receiver=rcv) == 0


@pytest.mark.parametrize("key", s.RES_IDENTITY_KEYS)
def test_every_identity_attribute_named_twice_is_refused(start_service, key: str) -> None:  # type: ignore[no-untyped-def]
    run = start_service(CFG)
    req = trace_service_pb2.ExportTraceServiceRequest.FromString(_req("job-a"))
    res = req.resource_spans[0].resource
    for _ in range(2):
        a = res.attributes.add()
        a.key, a.value.string_value = key, "x"
    code = _grpc(run.grpc, req.SerializeToString(), "admin-tok")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # an attribute outside the identity, twice, is the sender's business
    req2 = trace_service_pb2.ExportTraceServiceRequest.FromString(_req("job-a"))
    for _ in range(2):
        a = req2.resource_spans[0].resource.attributes.add()
        a.key, a.value.string_value = "deployment.environment", "x"
    assert _grpc(run.grpc, req2.SerializeToString(), "admin-tok") == grpc.StatusCode.OK


def _mutated(change: str) -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest.FromString(_forged("job-a"))
    rs = req.resource_spans[0]
    span = rs.scope_spans[0].spans[0]
    if change == "step-twice":  # a second dl.iteration: the check and the processor could read different ones
        a = span.attributes.add()
        a.key, a.value.int_value = s.ATTR_ITERATION, 8
    elif change == "step-as-string":
        span.attributes[0].value.string_value = "7"
    elif change in ("run-with-slash", "run-with-at"):
        run = "x/7" if change == "run-with-slash" else "x@7"
        a = rs.resource.attributes.add()
        a.key, a.value.string_value = s.RES_RUN_ID, run
        span.trace_id = s.trace_id_for_step("job-a", 7, run).to_bytes(16, "big")
    return req.SerializeToString()


@pytest.mark.parametrize("change", ["step-twice", "step-as-string", "run-with-slash", "run-with-at"])
def test_a_step_or_run_read_two_ways_is_refused_for_a_tenant(start_service, change: str) -> None:  # type: ignore[no-untyped-def]
    """The step a tenant's span is checked by is the one the processor uses (one int ``dl.iteration``), and run ids
    that could spell another job's step key (``/``, or ``@`` that ends a cohort's run) are refused."""
    run = start_service(CFG)
    assert _grpc(run.grpc, _mutated(change), "tok-a") == grpc.StatusCode.PERMISSION_DENIED
    assert _grpc(run.grpc, _forged("job-a"), "tok-a") == grpc.StatusCode.OK


def test_tenant_names_the_collector_uses_are_refused() -> None:
    for name in ("all-jobs", "job-tokens", "job:x"):
        with pytest.raises(ValueError, match="collector's own"):
            AuthConfig.model_validate({"tenants": [{"name": name, "bearer_token": "t", "jobs": ["a"]}]})

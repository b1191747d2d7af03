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
from service_support import BASE_RECEIVER, DoubleProcessor

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
CFG = BASE_RECEIVER + AUTH + """
processors:
  double: {}
exporters:
  debug: {}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [double], exporters: [debug]}
"""


def _req(*jobs: str | tuple[str, ...] | None) -> bytes:
    """One resource per item: a job id, None (no job), or a tuple (the resource names the job once per value)."""
    req = trace_service_pb2.ExportTraceServiceRequest()
    for job in jobs:
        rs = req.resource_spans.add()
        for value in (() if job is None else job if isinstance(job, tuple) else (job,)):
            a = rs.resource.attributes.add()
            a.key, a.value.string_value = s.RES_JOB_ID, value
        rs.scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="forward-compute")
    return req.SerializeToString()


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

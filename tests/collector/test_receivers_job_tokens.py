"""Job tokens at the receivers: with ``auth.job_secret`` every job has a token of its own,
``otel_straggler_schema.job_token(secret, job)``, and no job is listed anywhere. A job token writes its job alone:
a request any of whose resources names another job, or none, is refused as a whole (gRPC PERMISSION_DENIED, HTTP
403, ``tenant_refused_total``); a token whose MAC is not the job's is no credential (UNAUTHENTICATED, 401, checked
on the headers). The all-jobs token and the tenants keep working beside it."""

from __future__ import annotations

import base64
from pathlib import Path

import grpc
import pytest
from google.rpc.status_pb2 import Status
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from service_support import BASE_RECEIVER, DOUBLE_TRACES, DoubleProcessor, make_spans, wait_for
from test_receivers_tenants import _grpc, _http, _req

import otel_straggler_schema as s
from collector_processor.config.loader import ConfigError, load_text
from collector_processor.config.validate import validate
from collector_processor.receiver.auth import AuthConfig, BearerAuth
from otel_straggler.job_token import header

SECRET = "cluster-secret-0123456789abcdef0123456789"
AUTH = f"""    auth:
      bearer_token: admin-tok
      job_secret: {SECRET}
      tenants:
        - {{name: a, bearer_token: tok-a, jobs: [job-a]}}
"""
CFG = BASE_RECEIVER + AUTH + DOUBLE_TRACES
TOK_A = s.job_token(SECRET, "job-a")


def _refused(run, body: bytes, token: str) -> None:  # type: ignore[no-untyped-def]
    assert _grpc(run.grpc, body, token) == grpc.StatusCode.PERMISSION_DENIED
    status, answer = _http(run.http, body, token)
    assert status == 403 and Status.FromString(answer).code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert DoubleProcessor.instances[0].requests == []
    for rcv in ("otlp/grpc", "otlp/http"):
        assert run.sample("otel_straggler_collector_tenant_refused_total", receiver=rcv) == 1
        assert run.sample("otel_straggler_collector_requests_total", receiver=rcv, outcome="forbidden") == 1


@pytest.mark.parametrize(("token", "jobs", "allowed"), [
    (TOK_A, ("job-a",), True),
    (TOK_A, ("job-a", "job-a"), True),  # one job in every resource
    (s.job_token(SECRET, "team-b/run 7 \u00fc"), ("team-b/run 7 \u00fc",), True),
    (TOK_A, ("job-b",), False),
    (TOK_A, ("job-a", "job-b"), False),  # mixed jobs: one foreign resource refuses the whole request
    (TOK_A, ("job-b", "job-a"), False),
    (TOK_A, (None,), False),  # a resource that names no job is nobody's
    (TOK_A, ("job-ab",), False),  # exact, never a prefix
    ("admin-tok", ("job-a", "job-b", None), True),
    ("tok-a", ("job-a",), True),
    ("tok-a", ("job-b",), False),
])
def test_a_job_token_writes_its_job_alone(start_service, token: str, jobs: tuple, allowed: bool) -> None:  # type: ignore[no-untyped-def]
    run = start_service(CFG)
    body = _req(*jobs)
    if not allowed:
        _refused(run, body, token)
        return
    assert _grpc(run.grpc, body, token) == grpc.StatusCode.OK
    assert _http(run.http, body, token)[0] == 200
    assert len(DoubleProcessor.instances[0].requests) == 2
    assert run.sample("otel_straggler_collector_tenant_refused_total", receiver="otlp/grpc") == 0


def _forged() -> dict[str, str]:
    other = base64.urlsafe_b64encode(b"job-b").decode().rstrip("=")
    mac_a = TOK_A.rsplit(".", 1)[1]
    return {
        "another secret's": s.job_token("not-the-cluster-secret-0123456789abcdef", "job-a"),
        "job swapped, MAC kept": f"{s.JOB_TOKEN_PREFIX}.{other}.{mac_a}",
        "bare MAC": mac_a,
        "MAC cut": TOK_A[:-1],
        "padded job": f"{s.JOB_TOKEN_PREFIX}.{base64.urlsafe_b64encode(b'job-a').decode()}.{mac_a}",
        "no job": f"{s.JOB_TOKEN_PREFIX}..{mac_a}",
    }


@pytest.mark.parametrize("what", list(_forged()))
def test_a_forged_job_token_is_no_credential(start_service, what: str) -> None:  # type: ignore[no-untyped-def]
    """Refused on the headers, before the body is read: 401 / UNAUTHENTICATED, not a tenant refusal."""
    run = start_service(CFG)
    token = _forged()[what]
    body = _req("job-a")
    assert _grpc(run.grpc, body, token) == grpc.StatusCode.UNAUTHENTICATED
    assert _http(run.http, body, token)[0] == 401
    assert DoubleProcessor.instances[0].requests == []
    for rcv in ("otlp/grpc", "otlp/http"):
        assert run.sample("otel_straggler_collector_unauthenticated_total", endpoint=rcv) == 1
        assert run.sample("otel_straggler_collector_tenant_refused_total", receiver=rcv) == 0


def test_a_job_token_naming_its_job_twice_is_refused(start_service) -> None:  # type: ignore[no-untyped-def]
    """The duplicate trick: job A's token, a resource naming job A then job B. No reader resolves a doubled
    identity attribute, so the request is invalid (it never reaches the processor, which would read job A too)."""
    run = start_service(CFG)
    for jobs in (("job-a", "job-b"), ("job-b", "job-a")):
        body = _req(jobs)
        assert _grpc(run.grpc, body, TOK_A) == grpc.StatusCode.INVALID_ARGUMENT
        status, answer = _http(run.http, body, TOK_A)
        assert status == 400 and "straggler.job.id more than once" in Status.FromString(answer).message
    assert DoubleProcessor.instances[0].requests == []
    assert run.sample("otel_straggler_collector_duplicate_identity_total", receiver="otlp/grpc") == 2


def test_the_stock_sdk_exporters_send_the_job_token_from_the_environment(start_service,  # type: ignore[no-untyped-def]
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """What a rank does: ``OTEL_EXPORTER_OTLP_HEADERS`` as ``otel-straggler token --header`` prints it, read by the
    OTel SDK's own gRPC and HTTP exporters. The job's spans are taken; another job's spans are refused. The
    collector reads the secret from a file."""
    secret_file = tmp_path / "job-secret"
    secret_file.write_text(SECRET + "\n")
    run = start_service(CFG.replace(f"job_secret: {SECRET}", f"job_secret_file: {secret_file}"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", header(TOK_A))
    g = GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=5)
    h = HttpSpanExporter(endpoint=run.http + "/v1/traces", timeout=5)
    try:
        assert g.export(make_spans(3, rank=1, job="job-a")) == SpanExportResult.SUCCESS
        assert h.export(make_spans(4, rank=2, job="job-a")) == SpanExportResult.SUCCESS
        assert g.export(make_spans(3, rank=1, job="job-b")) == SpanExportResult.FAILURE
        assert h.export(make_spans(4, rank=2, job="job-b")) == SpanExportResult.FAILURE
    finally:
        g.shutdown()
        h.shutdown()
    proc = DoubleProcessor.instances[0]
    assert wait_for(lambda: len(proc.requests) == 2)
    jobs = {kv.value.string_value for r in proc.requests for rs in r.resource_spans for kv in rs.resource.attributes
            if kv.key == s.RES_JOB_ID}
    assert jobs == {"job-a"}
    for rcv in ("otlp/grpc", "otlp/http"):
        assert run.sample("otel_straggler_collector_tenant_refused_total", receiver=rcv) == 1


def _error(cfg: str) -> str:
    raw, marks = load_text(cfg, "t.yaml", {})
    with pytest.raises(ConfigError) as ei:
        validate(raw, marks)
    return str(ei.value)


def test_the_job_secret_is_checked_and_never_shown(tmp_path: Path) -> None:
    short = "too-short-secret"
    msg = _error(CFG.replace(SECRET, short))
    assert "at least 32 bytes" in msg and short not in msg
    both = CFG.replace(f"job_secret: {SECRET}", f"job_secret: {SECRET}\n      job_secret_file: /x")
    assert "not both" in _error(both)
    assert SECRET not in repr(AuthConfig(job_secret=SECRET))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        BearerAuth(AuthConfig(job_secret_file=str(empty)))
    weak = tmp_path / "weak"
    weak.write_text(short)
    with pytest.raises(ValueError, match="job_secret_file: 32 to"):
        BearerAuth(AuthConfig(job_secret_file=str(weak)))
    auth = BearerAuth(AuthConfig(job_secret=SECRET))
    assert auth.enabled and auth.scoped and auth.job_tokens
    tenant = auth.identify(f"bearer {TOK_A}")
    assert tenant is not None and tenant.allows("job-a") and not tenant.allows("job-b") and not tenant.every_job
    assert auth.identify(None) is None and auth.identify(f"Basic {TOK_A}") is None


def test_a_job_token_never_reads_metrics() -> None:
    """/metrics shows every job's series: a job secret there is refused."""
    cfg = BASE_RECEIVER + f"""
exporters:
  prometheus: {{endpoint: "127.0.0.1:0", auth: {{job_secret: {SECRET}}}}}
service:
  pipelines:
    metrics: {{receivers: [otlp], exporters: [prometheus]}}
"""
    msg = _error(cfg)
    assert "never reads /metrics" in msg and SECRET not in msg

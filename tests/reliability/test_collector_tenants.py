"""Tenants on a real collector process: a token writes only the jobs it is given. Another job's spans, a false
straggler for another job, or far-future steps into another job are refused as whole requests (counted), and
the other job's real verdict arrives; far-future steps into a tenant's own job are quarantined and cost that job
nothing either. A tenant flooding its own job with new cohorts before each of another job's steps evicts only its
own cohorts."""

from __future__ import annotations

import time

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from rel_support import (
    CollectorProcess,
    collector_config,
    evidence_lines,
    grpc_call,
    healthy_request,
    http_post,
    rank_resource,
    request,
    stage_span,
    total,
    wait_for,
)

import otel_straggler_schema as s
from jobsim.faults import Fault
from jobsim.job import Layout
from jobsim.stream import JobStream, Noise, SimConfig

pytestmark = pytest.mark.slow

TOK_A = "tok-team-a-7d1c"
TOK_B = "tok-team-b-90fe"
AUTH = f"""    auth:
      tenants:
        - {{name: team-a, bearer_token: {TOK_A}, jobs: [job-a]}}
        - {{name: team-b, bearer_token: {TOK_B}, jobs: ["job-b-*"]}}"""
FAR = 1_000_000


def _md(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def _stream(job: str, faults: list[Fault], steps: int = 60) -> JobStream:
    return JobStream(SimConfig(layout=Layout(dp=8), steps=steps, job=job,
                               noise=Noise(jitter=0.01, spike_prob=0.0, late_ranks=0, warmup_steps=3)), faults)


def _far(job: str, i: int, cohort: str) -> bytes:
    """One span of one rank at a step near 10^6."""
    return request(rank_resource(2, cohort, job), [stage_span(FAR + 7 * i, 2, job=job)]).SerializeToString()


def _cohort_flood(n: int, cohorts: int = 300) -> bytes:
    """``cohorts`` new cohorts of job-a, one span each: more than the processor's ``max_cohorts`` (256)."""
    req = ExportTraceServiceRequest()
    for i in range(cohorts):
        req.resource_spans.extend(request(rank_resource(i, f"flood-{n}-{i}", "job-a", world=cohorts),
                                          [stage_span(n, i, trace_id=s.trace_id_for_step(
                                              "job-a", n, "", s.trace_block(i)).to_bytes(16, "big"))]).resource_spans)
    return req.SerializeToString()


def test_a_tenant_cannot_write_another_job_and_its_own_attack_stays_in_its_job(tmp_path) -> None:
    c = CollectorProcess(tmp_path, collector_config(tmp_path, auth=AUTH), name="tenants").start()
    evidence = tmp_path / "evidence" / "verdicts.jsonl"
    refused = 0
    try:
        victim = list(_stream("job-b-1", [Fault("device", rank=5, stages=("backward-compute",), size=0.5,
                                                 onset=15)]))
        false_verdict = [req for _, req in _stream("job-b-1", [Fault("device", rank=2, stages=("forward-compute",),
                                                                     size=0.8, onset=0)], steps=40)]
        cohort = victim[0][1].resource_spans[0].resource.attributes
        key = next(a.value.string_value for a in cohort if a.key == s.RES_COHORT_KEY)
        with grpc.insecure_channel(c.grpc_target) as ch:
            for j in range(12):  # team-a's own job first, so that its cohort has a range
                assert grpc_call(ch, healthy_request(j, job="job-a").SerializeToString(), metadata=_md(TOK_A)).code \
                    == "OK"
            time.sleep(0.6)  # a few pipeline ticks: the ranges are set
            for n, (_, req) in enumerate(victim):
                assert grpc_call(ch, req.SerializeToString(), metadata=_md(TOK_B)).code == "OK"
                if n == 20:  # the attacks, from team-a's token
                    for i in range(70):  # N4 into job-b-1: refused
                        assert grpc_call(ch, _far("job-b-1", i, key), metadata=_md(TOK_A)).code == \
                            "PERMISSION_DENIED"
                    refused += 70
                    for fake in false_verdict:  # N5: a false straggler for job-b-1: refused
                        assert grpc_call(ch, fake.SerializeToString(), metadata=_md(TOK_A)).code == \
                            "PERMISSION_DENIED"
                    refused += len(false_verdict)
                    for i in range(70):  # the same far steps into its own job: taken, and quarantined there
                        assert grpc_call(ch, _far("job-a", i, "c0"), metadata=_md(TOK_A)).code == "OK"
                    mixed = ExportTraceServiceRequest()
                    mixed.resource_spans.extend(healthy_request(13, job="job-a").resource_spans)
                    mixed.resource_spans.extend(req.resource_spans)
                    assert grpc_call(ch, mixed.SerializeToString(), metadata=_md(TOK_A)).code == "PERMISSION_DENIED"
                    refused += 1
                    a = http_post(c.http_base, "/v1/traces", false_verdict[0].SerializeToString(),
                                  headers={"Authorization": f"Bearer {TOK_A}"})
                    assert a.code == "403", a
                    refused += 1
            # team-b's token cannot write job-a either (the prefix is its only job space)
            assert grpc_call(ch, healthy_request(14, job="job-a").SerializeToString(), metadata=_md(TOK_B)).code \
                == "PERMISSION_DENIED"
            refused += 1
        m = c.metrics()
        assert total(m, s.M_TENANT_REFUSED) == refused
        assert total(m, s.M_REQUESTS, outcome="forbidden") == refused
        assert wait_for(lambda: total(c.metrics(), s.M_SPANS_REJECTED, reason="quarantined") == 70, 10.0)
        assert total(m, s.M_SPANS_REJECTED, reason="late") == 0
    finally:
        c.stop()
    lines = evidence_lines(evidence)
    stragglers = {(x.get("job"), x.get("rank")) for x in lines if x.get("verdict") == s.VERDICT_STRAGGLER}
    assert ("job-b-1", 5) in stragglers, lines[-5:]
    assert ("job-b-1", 2) not in stragglers
    assert not any(job == "job-a" for job, _ in stragglers)
    for secret in (TOK_A, TOK_B):
        assert secret not in c.log()


def test_a_tenants_cohort_flood_evicts_only_its_own_cohorts(tmp_path) -> None:
    """Before each step of job-b-1, team-a sends 300 new one-span cohorts of its own job (``max_cohorts`` is 64):
    cohorts are budgeted per tenant, so job-b-1's cohort is never evicted and its real straggler is found."""
    c = CollectorProcess(tmp_path, collector_config(tmp_path, auth=AUTH), name="tenant-flood").start()
    evidence = tmp_path / "evidence" / "verdicts.jsonl"
    try:
        victim = _stream("job-b-1", [Fault("device", rank=5, stages=("backward-compute",), size=0.5, onset=15)])
        with grpc.insecure_channel(c.grpc_target) as ch:
            for n, (_, req) in enumerate(victim):
                assert grpc_call(ch, _cohort_flood(n), metadata=_md(TOK_A)).code == "OK"
                assert grpc_call(ch, req.SerializeToString(), metadata=_md(TOK_B)).code == "OK"
        assert wait_for(lambda: ("job-b-1", 5) in {(x.get("job"), x.get("rank")) for x in evidence_lines(evidence)
                                                   if x.get("verdict") == s.VERDICT_STRAGGLER}, 30.0)
        m = c.metrics()
        assert total(m, s.M_TENANT_EVICTIONS, tenant="team-a", structure="cohorts") > 10_000
        assert total(m, s.M_TENANT_EVICTIONS, tenant="team-b", structure="cohorts") == 0
    finally:
        c.stop()

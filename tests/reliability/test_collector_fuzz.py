"""Fuzzing both OTLP receivers (gRPC and HTTP; protobuf and JSON) of a real collector process on ephemeral ports.

Properties checked after each batch: the process is alive and healthy (``/healthz`` and gRPC health), every
request is counted in ``requests_total`` (exactly one outcome per request), every refusal is counted as a non-ok
outcome, a valid request still works afterwards, label cardinality stays under the configured caps, and the
peak RSS (VmHWM) stays under the configured memory limit.
"""

from __future__ import annotations

import base64
import json
import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric, NumberDataPoint, ResourceMetrics, ScopeMetrics, Sum
from rel_support import (
    CORPUS,
    METRICS_METHOD,
    CollectorProcess,
    collector_config,
    grpc_call,
    healthy_request,
    http_declared,
    http_post,
    rank_resource,
    request,
    stage_span,
    total,
)

import otel_straggler_schema as s

pytestmark = pytest.mark.slow

LIMIT_MIB = 400
REQ = s.M_REQUESTS
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("fuzz")
    c = CollectorProcess(tmp, collector_config(tmp, limit_mib=LIMIT_MIB, spike_mib=80, max_series=200,
                                               proc_series=300, max_cohorts=16, max_ranks=64), name="fuzz").start()
    c.channel = grpc.insecure_channel(c.grpc_target)  # type: ignore[attr-defined]
    yield c
    c.channel.close()  # type: ignore[attr-defined]
    c.stop()


class Ledger:
    """What the test sent and how it was answered, to compare with the collector's own counts."""

    def __init__(self, c: CollectorProcess) -> None:
        self.c = c
        m = c.metrics()
        self.req0 = total(m, REQ)
        self.bad0 = total(m, REQ) - total(m, REQ, outcome="ok") - total(m, REQ, outcome="partial")
        self.sent = 0
        self.refused = 0

    def grpc(self, raw: bytes, method: str | None = None) -> str:
        a = grpc_call(self.c.channel, raw, **({"method": method} if method else {}))  # type: ignore[attr-defined]
        assert a.code in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE"), a
        self.sent += 1
        self.refused += a.code != "OK"
        return a.code

    def http(self, body: bytes, ctype: str, path: str = "/v1/traces", headers: dict | None = None) -> str:
        a = http_post(self.c.http_base, path, body, ctype, headers)
        assert a.code in ("200", "400", "404", "411", "413", "415", "503"), (a.code, a.body[:200])
        if a.code not in ("200", "503"):
            # every refusal carries a google.rpc.Status in the requested encoding
            assert a.body, a
        self.sent += 1
        self.refused += a.code != "200"
        return a.code

    def check(self) -> None:
        c = self.c
        assert c.healthy(), c.log()[-2000:]
        m = c.metrics()
        assert total(m, REQ) - self.req0 == self.sent  # exactly one outcome per request
        bad = total(m, REQ) - total(m, REQ, outcome="ok") - total(m, REQ, outcome="partial")
        assert bad - self.bad0 == self.refused  # every refusal counted as such
        assert http_post(c.http_base, "/v1/traces", healthy_request(1, 2).SerializeToString()).code == "200"
        assert grpc_call(c.channel, healthy_request(1, 2).SerializeToString()).code == "OK"  # type: ignore[attr-defined]
        _, peak = c.rss()
        print(f"fuzz peak_rss={peak / 2**20:.0f}MiB")
        assert peak < LIMIT_MIB * 1024 * 1024, f"peak RSS {peak / 2**20:.0f} MiB"


def test_random_bytes_on_every_receiver(collector: CollectorProcess) -> None:
    led = Ledger(collector)

    @FUZZ
    @given(st.binary(max_size=2048), st.sampled_from(["grpc", "pb", "json", "ctype"]))
    def run(data: bytes, where: str) -> None:
        if where == "grpc":
            led.grpc(data)
        elif where == "pb":
            led.http(data, "application/x-protobuf")
        elif where == "json":
            led.http(data, "application/json")
        else:
            assert led.http(data, "text/plain") == "415"

    run()
    led.check()


def test_committed_corpus(collector: CollectorProcess) -> None:
    led = Ledger(collector)
    files = sorted(CORPUS.iterdir())
    assert len(files) >= 10
    for f in files:
        data = f.read_bytes()
        if f.suffix == ".json":
            assert led.http(data, "application/json") in ("200", "400"), f.name
        else:
            led.grpc(data)
            led.http(data, "application/x-protobuf")
    # wrong paths, missing length, wrong encodings
    assert led.http(b"{}", "application/json", path="/v1/nothing") == "404"
    assert led.http(b"\x00" * 10, "application/x-protobuf", headers={"Content-Encoding": "br"}) == "400"
    assert led.http(b"not gzip", "application/x-protobuf", headers={"Content-Encoding": "gzip"}) == "400"
    a = http_declared(collector.http_base, "/v1/traces", 5 * 2**20)  # over max_request_body_size_mib
    assert a.code == "413" and a.body
    led.sent += 1
    led.refused += 1
    assert led.grpc(b"\x0a" + b"\x00" * (4 * 2**20 + 1024)) == "RESOURCE_EXHAUSTED"  # counted by the receiver
    # far beyond the limit gRPC core refuses the message itself; the receiver still counts it
    assert led.grpc(b"\x0a" + b"\x00" * (5 * 2**20)) == "RESOURCE_EXHAUSTED"
    led.check()


finite = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
nasty_float = st.one_of(finite, st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -0.0, 1e308, 5e-324]))
ident = st.one_of(st.binary(min_size=0, max_size=24), st.sampled_from([b"", b"\x00" * 8, b"\x00" * 16]))


@st.composite
def nasty_requests(draw: st.DrawFn) -> bytes:
    """Syntactically valid OTLP with hostile content: non-finite/negative durations, ids of any length,
    huge attribute values, duplicates, out-of-order steps, clock skew, many ranks and cohorts."""
    spans_by_rank: dict[tuple[int, str], list] = {}
    for _ in range(draw(st.integers(1, 12))):
        rank = draw(st.integers(-3, 5000))
        cohort = draw(st.sampled_from(["c0", "c1", ""]) | st.text(max_size=12))
        step = draw(st.integers(-5, 10**12))
        skew_ns = draw(st.integers(-10**15, 10**15))
        extra = {}
        if draw(st.booleans()):
            extra["huge"] = "x" * draw(st.integers(0, 200_000))
        sp = stage_span(step, abs(rank), draw(st.sampled_from(["forward-compute", "optimizer", "weird" * 50])),
                        host_ms=draw(nasty_float), device_ms=draw(st.none() | nasty_float),
                        start_ns=max(0, 1_800_000_000_000_000_000 + skew_ns), span_id=draw(ident),
                        trace_id=draw(ident), extra=extra)
        lst = spans_by_rank.setdefault((rank, cohort), [])
        lst.append(sp)
        if draw(st.booleans()):
            lst.append(sp)  # duplicate
    req = request(rank_resource(0), [])
    del req.resource_spans[:]
    for (rank, cohort), spans in spans_by_rank.items():
        r = request(rank_resource(rank, cohort, world=5000), spans)
        req.resource_spans.extend(r.resource_spans)
    return req.SerializeToString()


def test_hostile_but_wellformed_spans(collector: CollectorProcess) -> None:
    led = Ledger(collector)
    m0 = collector.metrics()
    sent_spans = 0

    @FUZZ
    @given(nasty_requests(), st.sampled_from(["grpc", "pb", "json"]))
    def run(raw: bytes, where: str) -> None:
        nonlocal sent_spans
        if where == "grpc":
            code = led.grpc(raw)
        elif where == "pb":
            code = led.http(raw, "application/x-protobuf")
        else:
            from google.protobuf import json_format
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

            doc = json_format.MessageToDict(ExportTraceServiceRequest.FromString(raw))
            bad_ids = False
            for rs in doc.get("resourceSpans", []):  # OTLP/JSON carries ids as hex, not base64
                for ss in rs.get("scopeSpans", []):
                    for sp in ss.get("spans", []):
                        for key in ("traceId", "spanId"):
                            if key in sp:
                                raw_id = base64.b64decode(sp[key])
                                bad_ids |= len(raw_id) != (16 if key == "traceId" else 8)
                                sp[key] = raw_id.hex()
            code = led.http(json.dumps(doc).encode(), "application/json")
            if bad_ids:  # OTLP/JSON ids of the wrong length are refused (400, counted) as the OTel Collector does
                assert code in ("200", "400", "503")
                return
        # well-formed OTLP is never refused as invalid; it may only be throttled
        assert code in ("OK", "200", "UNAVAILABLE", "503")

    run()
    led.check()
    m = collector.metrics()
    rejected = total(m, s.M_SPANS_REJECTED)
    rejected0 = total(m0, s.M_SPANS_REJECTED)
    assert rejected > rejected0  # non-finite / malformed / duplicate spans were counted, not silently used
    # label cardinality of the processor's series stays under its cap (300) however many ranks/cohorts came
    series = [k for k in m if k.startswith("otel_straggler_") and "rank=" in k]
    assert len(series) <= 300 + 50, len(series)


def test_emitter_metric_cardinality_capped(collector: CollectorProcess) -> None:
    """Emitter self-metrics from 2000 distinct ranks: /metrics re-exports at most max_series (200) of them and
    counts the rest in evictions_total{structure="metric_series"}."""
    ev_name = s.M_EVICTIONS
    ev0 = total(collector.metrics(), ev_name, structure="metric_series")
    for chunk in range(10):
        req = ExportMetricsServiceRequest()
        for rank in range(chunk * 200, chunk * 200 + 200):
            pt = NumberDataPoint(as_int=rank, time_unix_nano=1)
            metric = Metric(name=s.SM_SPANS_EXPORTED, sum=Sum(data_points=[pt], is_monotonic=True,
                                                                aggregation_temporality=2))
            req.resource_metrics.append(ResourceMetrics(resource=rank_resource(rank, job=f"job-{rank % 7}"),
                                                        scope_metrics=[ScopeMetrics(metrics=[metric])]))
        assert grpc_call(collector.channel, req.SerializeToString(), METRICS_METHOD).code == "OK"  # type: ignore[attr-defined]
    m = collector.metrics()
    emitter = [k for k in m if k.startswith("otel_straggler_emitter_")]
    assert 0 < len(emitter) <= 200
    assert total(m, ev_name, structure="metric_series") - ev0 >= 2000 - 200
    assert collector.healthy()


def test_json_bodies_with_any_structure(collector: CollectorProcess) -> None:
    led = Ledger(collector)
    leaf = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    tree = st.recursive(leaf, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(
        st.sampled_from(["resourceSpans", "scopeSpans", "spans", "resource", "attributes", "key", "value",
                         "traceId", "spanId", "intValue", "doubleValue", "startTimeUnixNano"]) | st.text(max_size=5),
        ch, max_size=4), max_leaves=30)

    @FUZZ
    @given(tree)
    def run(doc: object) -> None:
        led.http(json.dumps(doc).encode(), "application/json")

    run()
    led.check()


def test_stalled_connections_do_not_starve_valid_clients(collector: CollectorProcess) -> None:
    """200 clients that connect and send half a request line (HTTP) or nothing (gRPC) and then stall: valid
    requests on both receivers are still served promptly, health stays OK, memory stays bounded."""
    import socket
    import time

    socks = []
    t_connect = time.monotonic()
    try:
        for i in range(200):
            port = collector.ports["http"] if i % 2 else collector.ports["grpc"]
            so = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:
                so.sendall(b"POST /v1/traces HTTP/1.1\r\nContent-Length: 1000\r\n")
            socks.append(so)
        # a short listen backlog would make bursts of connects wait for SYN retries (1 s each, ~200 s in all)
        assert time.monotonic() - t_connect < 60.0
        body = healthy_request(2, 2).SerializeToString()
        t0 = time.monotonic()
        assert http_post(collector.http_base, "/v1/traces", body).code == "200"
        assert grpc_call(collector.channel, body).code == "OK"  # type: ignore[attr-defined]
        assert time.monotonic() - t0 < 30.0  # served, not held behind the idle connections (generous bound)
        assert collector.healthy()
        assert collector.rss()[1] < LIMIT_MIB * 2**20
    finally:
        for so in socks:
            so.close()

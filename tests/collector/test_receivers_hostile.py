"""Hostile clients against the OTLP receivers: bounded gzip across members, admission by memory before a body is
read or decoded, authentication on headers and metadata before any body or worker, 503 + Retry-After instead of a
reset when busy, aborted requests counted and logged once, and the small protocol cases (huge JSON integers,
conflicting Content-Length, the bearer scheme's case). Every check is on behaviour: answers, counters, bytes held;
waits are bounded by generous timeouts, never measured."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import socket
import threading
import time
import tracemalloc
import urllib.error
import urllib.request

import grpc
import pytest
from google.rpc.error_details_pb2 import RetryInfo
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from service_support import BASE_RECEIVER, DoubleProcessor, wait_for

from collector_processor.allocator import trim
from collector_processor.processor.memory_limiter import rss_bytes
from collector_processor.receiver import otlp_http
from collector_processor.receiver.decode import TooLarge, gunzip_bounded
from jobsim.load import length_delimited

TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
MIB = 2**20
CFG = BASE_RECEIVER + """
%(receiver_extra)s
processors:
  double: {delay: %(delay)s}
%(limiter)s
exporters:
  debug: {}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [%(procs)s], exporters: [debug]}
"""


def _cfg(receiver_extra: str = "", delay: str = "0s", limiter: str = "") -> str:
    procs = "memory_limiter, double" if limiter else "double"
    return CFG % {"receiver_extra": receiver_extra, "delay": delay, "limiter": limiter, "procs": procs}


def _request(n: int = 2) -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for _ in range(n):
        ss.spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="forward-compute")
    return req.SerializeToString()


def _post(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/x-protobuf", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def _raw(port: int, head: str, body: bytes = b"", timeout: float = 10.0, wait_close: bool = True
         ) -> tuple[bytes, bool]:
    """Send ``head`` (and ``body``) on a fresh connection; return the answer and whether the server then closed
    the connection (within the timeout; not waited for with ``wait_close=False``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as so:
        so.sendall(head.encode("latin-1") + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = so.recv(65536)
            if not chunk:
                return data, True
            data += chunk
        head_part, _, rest = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head_part.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            chunk = so.recv(65536)
            if not chunk:
                break
            rest += chunk
        try:
            closed = wait_close and so.recv(1) == b""
        except TimeoutError:
            closed = False
        return head_part + b"\r\n\r\n" + rest, closed


def _read_answer(f) -> tuple[int, dict[str, str], bytes]:  # type: ignore[no-untyped-def]
    """One HTTP/1.1 answer from a socket file."""
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, f.read(int(headers.get("content-length", "0")))


# ---- gzip ----------------------------------------------------------------------------------------------------


def test_gzip_members_are_inflated_with_one_bound_on_their_total() -> None:
    member = gzip.compress(b"\0" * MIB)
    bomb = member * 64  # 64 MiB once inflated, ~65 KiB on the wire
    tracemalloc.start()
    try:
        with pytest.raises(TooLarge):
            gunzip_bounded(bomb, 2 * MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MIB, f"{peak / MIB:.0f} MiB held while refusing a 64 MiB bomb with a 2 MiB limit"
    assert gunzip_bounded(gzip.compress(b"ab") + gzip.compress(b"cd") + b"\0\0", 10) == b"abcd"


def test_multi_member_gzip_bomb_over_http_is_a_counted_413(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg())
    code, body, _ = _post(run.http + "/v1/traces", gzip.compress(b"\0" * MIB) * 40, {"Content-Encoding": "gzip"})
    assert code == 413 and Status.FromString(body).code == 8
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="too_large") == 1


# ---- admission by memory before reading / decoding ----------------------------------------------------------


def _limited(run) -> object:  # type: ignore[no-untyped-def]
    return run.svc.processors["memory_limiter"].impl


def test_admission_refuses_a_body_before_reading_it_while_memory_is_reserved(start_service) -> None:  # type: ignore[no-untyped-def]
    trim()  # what earlier tests freed is given back first (a refusal would trim it and find more room)
    limit = rss_bytes() // MIB + 600
    run = start_service(_cfg(receiver_extra="    retry_delay: 2s",
                             limiter=f"  memory_limiter: {{limit_mib: {limit}, spike_limit_mib: 100}}").replace(
        "http: {endpoint: 127.0.0.1:0}", "http: {endpoint: 127.0.0.1:0, max_request_body_size_mib: 64}"))
    limiter = _limited(run)
    hold = limiter.soft - rss_bytes() - 20 * MIB  # type: ignore[attr-defined]  # what requests being decoded hold
    assert limiter.reserve(hold) is None  # type: ignore[attr-defined]
    # headers only: the 48 MiB body is never sent, so only an answer on the headers can come back
    ans, _ = _raw(run.port("http"), "POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf"
                  f"\r\nContent-Length: {48 * MIB}\r\n\r\n", wait_close=False)
    assert ans.startswith(b"HTTP/1.1 503") and b"Retry-After: 2" in ans, ans[:300]
    # a client that sends such a body reads the same answer, and the connection carries its next request
    small = _request()
    with socket.create_connection(("127.0.0.1", run.port("http")), timeout=20) as so:
        f = so.makefile("rb")
        so.sendall(f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                   f"Content-Length: {48 * MIB}\r\n\r\n".encode() + bytes(48 * MIB))
        assert _read_answer(f)[0] == 503
        so.sendall(f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                   f"Content-Length: {len(small)}\r\n\r\n".encode() + small)
        assert _read_answer(f)[0] == 200
    # gRPC: decoding a 2 MiB body of empty spans may take ~250 MiB: refused with the retry delay, not decoded
    empty_spans = length_delimited(1, length_delimited(2, b"\x12\x00" * MIB))  # resource > scope > 2^20 empty spans
    with grpc.insecure_channel(run.grpc) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            ch.unary_unary(TRACE_EXPORT)(empty_spans, timeout=10)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    trailer = dict(ei.value.trailing_metadata())["google.rpc.retryinfo-bin"]
    assert RetryInfo.FromString(trailer).retry_delay.seconds == 2
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="throttled") == 2
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/grpc", outcome="throttled") == 1
    limiter.release(hold)  # type: ignore[attr-defined]
    assert _post(run.http + "/v1/traces", _request())[0] == 200
    with grpc.insecure_channel(run.grpc) as ch:
        ch.unary_unary(TRACE_EXPORT)(_request(), timeout=10)
    assert wait_for(lambda: len(DoubleProcessor.instances[0].requests) == 3)


def test_a_body_whose_decoding_could_never_fit_is_refused_for_good(start_service) -> None:  # type: ignore[no-untyped-def]
    limit = rss_bytes() // MIB + 120
    run = start_service(_cfg(limiter=f"  memory_limiter: {{limit_mib: {limit}, spike_limit_mib: 20}}"))
    bomb = b'{"resourceSpans":[' + b"{}," * (2 * MIB // 3) + b"{}]}"  # ~700 k empty objects in 2 MiB
    code, body, _ = _post(run.http + "/v1/traces", bomb, {"Content-Type": "application/json"})
    assert code == 413
    assert json.loads(body)["code"] == 8 and "limit" in json.loads(body)["message"]
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="too_large") == 1
    assert DoubleProcessor.instances[0].requests == []


# ---- authentication first ------------------------------------------------------------------------------------


AUTH = "    auth: {bearer_token: s3cret}"


def test_http_answers_401_on_the_headers_and_closes_without_reading_the_body(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg(receiver_extra=AUTH))
    head = ("POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Authorization: Bearer wrong\r\nContent-Length: {MIB}\r\n\r\n")
    ans, closed = _raw(run.port("http"), head)  # the announced MiB is never sent
    assert ans.startswith(b"HTTP/1.1 401") and b"WWW-Authenticate: Bearer" in ans
    assert closed
    assert run.sample("otel_straggler_collector_unauthenticated_total", endpoint="otlp/http") == 1
    # many such connections take no slot from a client with the token
    socks = [socket.create_connection(("127.0.0.1", run.port("http")), timeout=10) for _ in range(80)]
    try:
        for so in socks:
            so.sendall(head.encode())
        assert _post(run.http + "/v1/traces", _request(), {"Authorization": "Bearer s3cret"})[0] == 200
    finally:
        for so in socks:
            so.close()


def _stalled_stream(channel: grpc.Channel, metadata: tuple = (), method: str = TRACE_EXPORT
                    ) -> tuple[grpc.Future, threading.Event]:
    """A call that sends its metadata and never its message (until released)."""
    release = threading.Event()

    def requests():  # type: ignore[no-untyped-def]
        release.wait(30)
        yield from ()

    fut = channel.stream_unary(method).future(requests(), timeout=20, metadata=metadata or None)
    return fut, release


def test_grpc_checks_the_token_before_the_message_arrives(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg(receiver_extra=AUTH).replace("grpc: {endpoint: 127.0.0.1:0}",
                                                          "grpc: {endpoint: 127.0.0.1:0, max_workers: 2}"))
    with grpc.insecure_channel(run.grpc) as ch:
        stalled = [_stalled_stream(ch, (("authorization", "Bearer wrong"),)) for _ in range(6)]
        try:
            for fut, _ in stalled:
                with pytest.raises(grpc.RpcError) as ei:
                    fut.result(timeout=10)
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ch.unary_unary(TRACE_EXPORT)(_request(), timeout=10, metadata=(("authorization", "Bearer s3cret"),))
        finally:
            for _, release in stalled:
                release.set()
    assert run.sample("otel_straggler_collector_unauthenticated_total", endpoint="otlp/grpc") == 6


def test_grpc_streams_that_never_send_take_no_worker(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg().replace("grpc: {endpoint: 127.0.0.1:0}",
                                       "grpc: {endpoint: 127.0.0.1:0, max_workers: 2}"))
    with grpc.insecure_channel(run.grpc) as ch:
        stalled = [_stalled_stream(ch) for _ in range(6)]
        try:
            time.sleep(0.5)  # let the streams start
            ch.unary_unary(TRACE_EXPORT)(_request(), timeout=10)  # answered while 6 streams wait (2 workers)
        finally:
            for fut, release in stalled:
                release.set()
                fut.cancel()
    assert wait_for(lambda: len(DoubleProcessor.instances[0].requests) == 1)


def test_grpc_answers_a_signal_without_pipeline_before_reading_or_reserving(start_service) -> None:  # type: ignore[no-untyped-def]
    limit = rss_bytes() // MIB + 600
    run = start_service(_cfg(limiter=f"  memory_limiter: {{limit_mib: {limit}, spike_limit_mib: 100}}"))
    limiter = _limited(run)
    held: list[int] = []
    real_hold = limiter.hold  # type: ignore[attr-defined]

    def hold(nbytes: int) -> None:
        held.append(nbytes)
        real_hold(nbytes)

    limiter.hold = hold  # type: ignore[attr-defined]
    with grpc.insecure_channel(run.grpc) as ch:
        # no metrics pipeline: the answer comes on the metadata, the message is never sent
        stalled = [_stalled_stream(ch, method=METRICS_EXPORT) for _ in range(3)]
        try:
            for fut, _ in stalled:
                with pytest.raises(grpc.RpcError) as ei:
                    fut.result(timeout=15)
                assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            for _, release in stalled:
                release.set()
        assert held == []  # no read slot's memory was counted at the gate for them
        ch.unary_unary(TRACE_EXPORT)(_request(), timeout=10)
    assert held  # a traces request is counted at the gate while it is read
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/grpc", outcome="invalid") == 3


@pytest.mark.parametrize("header", ["bearer s3cret", "BEARER s3cret", "Bearer  s3cret"])
def test_the_bearer_scheme_is_case_insensitive(start_service, header: str) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg(receiver_extra=AUTH))
    assert _post(run.http + "/v1/traces", _request(), {"Authorization": header})[0] == 200
    assert _post(run.http + "/v1/traces", _request(), {"Authorization": "Basic s3cret"})[0] == 401
    with grpc.insecure_channel(run.grpc) as ch:
        ch.unary_unary(TRACE_EXPORT)(_request(), timeout=10, metadata=(("authorization", header),))


# ---- busy, aborted -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _busy_http(start_service, monkeypatch):  # type: ignore[no-untyped-def]
    """An HTTP receiver allowed one request at a time, busy with one that is being processed (1.5 s); the
    block's own request is the second. After it: exactly one request was refused as throttled."""
    monkeypatch.setattr(otlp_http, "MAX_CONCURRENT", 1)
    run = start_service(_cfg(receiver_extra="    wait_for_processing: 5s", delay="1500ms"))
    first = threading.Thread(target=_post, args=(run.http + "/v1/traces", _request()))
    first.start()
    try:
        proc = DoubleProcessor.instances[0]
        assert wait_for(lambda: proc.concurrent == 1, timeout=10)
        yield run
    finally:
        first.join(20)
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="throttled") == 1


def test_a_busy_http_receiver_answers_503_with_retry_after_not_a_reset(start_service, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with _busy_http(start_service, monkeypatch) as run:
        big = _request(1) + b"\x0a\x00" * (2 * MIB)  # a 4 MiB body the client sends in full
        code, body, headers = _post(run.http + "/v1/traces", big)
        assert code == 503 and headers.get("Retry-After") == "1"
        assert Status.FromString(body).code == 14


def test_a_busy_http_receiver_refuses_before_reading_the_body(start_service, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with _busy_http(start_service, monkeypatch) as run:
        # headers only: the 4 MiB body is never sent, so only an answer on the headers can come back
        ans, _ = _raw(run.port("http"), "POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      f"application/x-protobuf\r\nContent-Length: {4 * MIB}\r\n\r\n", wait_close=False)
        assert ans.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in ans, ans[:300]


def test_aborted_requests_are_counted_and_logged_once(start_service, caplog, capfd) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg())
    caplog.set_level(logging.WARNING)
    head = (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 100000\r\n\r\n")
    for _ in range(30):
        so = socket.create_connection(("127.0.0.1", run.port("http")), timeout=10)
        so.sendall(head + b"\x0a" * 1000)  # part of the body, then a reset
        so.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        so.close()
    assert wait_for(lambda: run.sample("otel_straggler_collector_requests_total", receiver="otlp/http",
                                       outcome="aborted") == 30, timeout=20)
    assert _post(run.http + "/v1/traces", _request())[0] == 200
    lines = [r for r in caplog.records if "aborted" in r.getMessage()]
    assert len(lines) == 1
    assert "Traceback" not in capfd.readouterr().err


# ---- protocol details ----------------------------------------------------------------------------------------


def test_a_json_integer_over_4300_digits_is_a_counted_400(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg())
    body = b'{"resourceSpans": [], "x": ' + b"9" * 5000 + b"}"
    code, answer, _ = _post(run.http + "/v1/traces", body, {"Content-Type": "application/json"})
    assert code == 400 and json.loads(answer)["code"] == 3
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="invalid") == 1


def test_two_different_content_lengths_are_refused(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg())
    body = _request()
    head = ("POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {len(body)}\r\nContent-Length: {len(body) + 5}\r\n\r\n")
    ans, closed = _raw(run.port("http"), head, body)
    assert ans.startswith(b"HTTP/1.1 400") and closed
    same = ("POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {len(body)}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    assert _raw(run.port("http"), same, body)[0].startswith(b"HTTP/1.1 200")
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="invalid") == 1

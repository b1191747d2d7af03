"""Chunked request bodies (``Transfer-Encoding: chunked``) on the OTLP/HTTP receiver: accepted plain and gzip, with
extensions and trailers, on a kept-alive connection; bounded while they stream (the size limit and the memory
reservation checked when each chunk's size line arrives, before its bytes are read, so the answer comes while the
client still holds them); broken or smuggling framing refused and the connection closed; a stalled body aborted
within the read timeout with its reservation released. Raw sockets, so that every byte the client sends and when
is the test's; waits are bounded by generous timeouts, never measured."""

from __future__ import annotations

import gzip
import json
import os
import socket

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from service_support import BASE_RECEIVER, DoubleProcessor, wait_for

from collector_processor.allocator import trim
from collector_processor.processor.memory_limiter import rss_bytes
from collector_processor.receiver import otlp_http

MIB = 2**20
CFG = BASE_RECEIVER + """
%(receiver_extra)s
processors:
  double: {}
%(limiter)s
exporters:
  debug: {}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [%(procs)s], exporters: [debug]}
"""
HEAD = "POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
CHUNKED = HEAD + "Transfer-Encoding: chunked\r\n\r\n"


def _cfg(receiver_extra: str = "", limiter: str = "", body_mib: int = 16) -> str:
    procs = "memory_limiter, double" if limiter else "double"
    text = CFG % {"receiver_extra": receiver_extra, "limiter": limiter, "procs": procs}
    return text.replace("http: {endpoint: 127.0.0.1:0}",
                        f"http: {{endpoint: 127.0.0.1:0, max_request_body_size_mib: {body_mib}}}")


def _request(n: int = 2) -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for _ in range(n):
        ss.spans.add(trace_id=os.urandom(16), span_id=os.urandom(8), name="forward-compute")
    return req.SerializeToString()


def _chunks(body: bytes, size: int, ext: bytes = b"") -> bytes:
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(body[i:i + size]), ext, body[i:i + size])
                   for i in range(0, len(body), size))
    return out + b"0\r\n"


def _answer(f) -> tuple[int, dict[str, str], bytes]:  # type: ignore[no-untyped-def]
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, f.read(int(headers.get("content-length", "0")))


def _closed(so: socket.socket) -> bool:
    try:
        return so.recv(1) == b""
    except (TimeoutError, ConnectionResetError):
        return False


def _connect(run) -> socket.socket:  # type: ignore[no-untyped-def]
    return socket.create_connection(("127.0.0.1", run.port("http")), timeout=20)


def _spans(proc: DoubleProcessor) -> list[int]:
    return [sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans) for r in proc.requests]


def test_chunked_bodies_plain_and_gzip_are_accepted_on_one_connection(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg())
    plain, zipped = _request(3), gzip.compress(_request(5))
    with _connect(run) as so:
        f = so.makefile("rb")
        # several chunks, a chunk extension, a trailer field
        so.sendall(CHUNKED.encode() + _chunks(plain, 7, b";name=value") + b"X-Checksum: 1\r\n\r\n")
        status, headers, body = _answer(f)
        assert status == 200 and headers["content-type"] == "application/x-protobuf", body
        assert trace_service_pb2.ExportTraceServiceResponse.FromString(body) == \
            trace_service_pb2.ExportTraceServiceResponse()
        so.sendall((HEAD + "Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
                   + _chunks(zipped, 100) + b"\r\n")
        assert _answer(f)[0] == 200
        # the connection carries a request framed by Content-Length after them
        small = _request(1)
        so.sendall(f"{HEAD}Content-Length: {len(small)}\r\n\r\n".encode() + small)
        assert _answer(f)[0] == 200
    assert wait_for(lambda: len(DoubleProcessor.instances[0].requests) == 3)
    assert _spans(DoubleProcessor.instances[0]) == [3, 5, 1]
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="ok") == 3


def test_a_chunked_json_body_is_answered_in_json(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg())
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": "ab" * 16, "spanId": "cd" * 8, "name": "forward-compute"}]}]}]}).encode()
    with _connect(run) as so:
        so.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n" + _chunks(body, 16) + b"\r\n")
        status, headers, answer = _answer(so.makefile("rb"))
    assert status == 200 and headers["content-type"] == "application/json" and json.loads(answer) == {}


def test_a_chunked_body_over_the_limit_is_refused_before_the_chunk_that_passes_it(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg(body_mib=1))
    with _connect(run) as so:
        so.sendall(CHUNKED.encode() + b"80000\r\n" + bytes(0x80000) + b"\r\n")  # 512 KiB: within the limit
        so.sendall(b"90000\r\n")  # 576 KiB more would pass 1 MiB: the answer comes before any of it is sent
        status, _, body = _answer(so.makefile("rb"))
        assert status == 413, body
        assert _closed(so)
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="too_large") == 1
    assert DoubleProcessor.instances[0].requests == []
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="ok") == 0


def test_a_chunked_body_reserves_memory_chunk_by_chunk_and_is_refused_when_it_cannot(start_service) -> None:  # type: ignore[no-untyped-def]
    trim()  # what earlier tests freed is given back first (a refusal would trim it and find more room)
    limit = rss_bytes() // MIB + 600
    run = start_service(_cfg(receiver_extra="    retry_delay: 2s", body_mib=64,
                             limiter=f"  memory_limiter: {{limit_mib: {limit}, spike_limit_mib: 100}}"))
    limiter = run.svc.processors["memory_limiter"].impl
    hold = limiter.soft - rss_bytes() - 40 * MIB  # room for about 40 MiB of requests
    assert limiter.reserve(hold) is None
    try:
        with _connect(run) as so:
            so.sendall(CHUNKED.encode() + b"400000\r\n")  # a 4 MiB chunk announced: 8 MiB reserved for it
            assert wait_for(lambda: limiter._reserved >= hold + 8 * MIB, timeout=20)
            so.sendall(bytes(4 * MIB) + b"\r\n")
            so.sendall(b"1000000\r\n")  # 16 MiB more: 40 MiB in all would not fit, refused before it is sent
            status, headers, _ = _answer(so.makefile("rb"))
            assert status == 503 and headers["retry-after"] == "2"
            assert _closed(so)
        assert wait_for(lambda: limiter._reserved == hold, timeout=20)  # everything it held is given back
        assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="throttled") == 1
    finally:
        limiter.release(hold)
    with _connect(run) as so:  # and the same body is taken once memory is free
        so.sendall(CHUNKED.encode() + _chunks(_request(4), 5) + b"\r\n")
        assert _answer(so.makefile("rb"))[0] == 200
    assert wait_for(lambda: limiter._reserved == 0, timeout=20)


@pytest.mark.parametrize(("head", "body", "code"), [
    (HEAD + "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n", 400),
    (HEAD + "Transfer-Encoding: gzip, chunked\r\n\r\n", b"0\r\n\r\n", 501),
    (HEAD + "Transfer-Encoding: identity\r\n\r\n", b"", 501),
    (HEAD.replace("HTTP/1.1", "HTTP/1.0") + "Transfer-Encoding: chunked\r\n\r\n", b"0\r\n\r\n", 400),
    (CHUNKED, b"zz\r\nhello\r\n0\r\n\r\n", 400),
    (CHUNKED, b" 5\r\nhello\r\n0\r\n\r\n", 400),
    (CHUNKED, b"0x5\r\nhello\r\n0\r\n\r\n", 400),
    (CHUNKED, b"5\r\nhello!!\r\n0\r\n\r\n", 400),  # data longer than its size
    (CHUNKED, b"1" * 2000 + b"\r\n", 400),  # a size line over its bound
    (CHUNKED, b"".join(b"1;" + b"x" * 1000 + b"\r\na\r\n" for _ in range(80)) + b"0\r\n\r\n", 400),  # framing
    (CHUNKED, b"0\r\n" + b"".join(b"X-A: 1\r\n" for _ in range(otlp_http.MAX_HEADERS + 2)) + b"\r\n", 400),
    (HEAD + "\r\n", b"", 411),  # neither a length nor chunked
])
def test_broken_or_ambiguous_framing_is_refused_and_the_connection_closed(start_service, head: str, body: bytes,
                                                                          code: int) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg(body_mib=1))
    with _connect(run) as so:
        so.sendall(head.encode() + body)
        status, headers, answer = _answer(so.makefile("rb"))
        assert status == code, answer
        assert headers.get("connection") == "close" and _closed(so)
    assert DoubleProcessor.instances[0].requests == []
    assert run.sample("otel_straggler_collector_requests_total", receiver="otlp/http", outcome="invalid") == 1


def test_a_chunked_request_refused_on_its_headers_closes_the_connection(start_service) -> None:  # type: ignore[no-untyped-def]
    """Its body is not read, so it cannot be skipped: what follows on the connection is never taken as a request."""
    run = start_service(_cfg())
    inner = _request(1)
    smuggled = f"{HEAD}Content-Length: {len(inner)}\r\n\r\n".encode() + inner
    with _connect(run) as so:
        so.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n" + _chunks(smuggled, 4096) + b"\r\n")
        f = so.makefile("rb")
        status, headers, _ = _answer(f)
        assert status == 415 and headers.get("connection") == "close"
        assert f.read() == b""  # one answer, then the end
    assert DoubleProcessor.instances[0].requests == []


def test_a_stalled_chunked_body_is_aborted_and_gives_back_what_it_held(start_service, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(otlp_http, "READ_TIMEOUT_S", 0.5)
    limit = rss_bytes() // MIB + 600
    run = start_service(_cfg(body_mib=64, limiter=f"  memory_limiter: {{limit_mib: {limit}, spike_limit_mib: 100}}"))
    limiter = run.svc.processors["memory_limiter"].impl
    with _connect(run) as so:
        so.sendall(CHUNKED.encode() + b"400000\r\n" + bytes(MIB))  # 1 MiB of a 4 MiB chunk, then nothing
        assert wait_for(lambda: run.sample("otel_straggler_collector_requests_total", receiver="otlp/http",
                                           outcome="aborted") == 1, timeout=30)
        assert _closed(so)
    assert wait_for(lambda: limiter._reserved == 0, timeout=20)
    with _connect(run) as so:
        so.sendall(CHUNKED.encode() + _chunks(_request(2), 50) + b"\r\n")
        assert _answer(so.makefile("rb"))[0] == 200

"""Connections and calls are a budget, before any token is seen and after: authenticated gRPC calls that never send
their message cannot starve calls that do (under pressure the oldest call still without its message after
``stall_timeout`` is ended to make room, counted); a listener full of idle or never-handshaking connections makes
room for a new one the same way; TLS handshakes and idle connections are timed out on both ports."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from service_support import BASE_RECEIVER, DoubleProcessor, wait_for

from collector_processor.processor.memory_limiter import rss_bytes

TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
MIB = 2**20
TOKEN = (("authorization", "Bearer s3cret"),)
CFG = BASE_RECEIVER + """    auth: {bearer_token: s3cret}
%(tls)s
processors:
  double: {}
  memory_limiter: {limit_mib: %(limit)s, spike_limit_mib: 64, check_interval: 1s}
exporters:
  debug: {}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [memory_limiter, double], exporters: [debug]}
"""


def _cfg(grpc_extra: str = "", http_extra: str = "", budget_mib: int = 4096, tls: str = "") -> str:
    """``budget_mib``: what the memory limiter leaves for requests above this process's RSS now (the tests run in
    the pytest process, whose RSS depends on what ran before)."""
    limit = int(rss_bytes() / MIB) + 64 + budget_mib
    text = CFG % {"limit": limit, "tls": tls}
    text = text.replace("grpc: {endpoint: 127.0.0.1:0}", "grpc: {endpoint: 127.0.0.1:0" + grpc_extra + "}")
    return text.replace("http: {endpoint: 127.0.0.1:0}", "http: {endpoint: 127.0.0.1:0" + http_extra + "}")


def _request() -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    req.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="x")
    return req.SerializeToString()


def _stalled(channel: grpc.Channel, n: int) -> tuple[list[grpc.Future], threading.Event]:
    release = threading.Event()

    def requests():  # type: ignore[no-untyped-def]
        release.wait(60)
        yield from ()

    futs = [channel.stream_unary(TRACE_EXPORT).future(requests(), timeout=60, metadata=TOKEN) for _ in range(n)]
    return futs, release


def test_authenticated_calls_that_never_send_cannot_block_valid_exports(start_service) -> None:  # type: ignore[no-untyped-def]
    """16 calls with the token that never send their message, against a memory budget with room for few reads
    at once: every valid export still succeeds well within its 10 s deadline, the stalled calls are ended
    (DEADLINE_EXCEEDED) and counted. Before, 16 such calls held every read slot for 30 s (0/4 exports)."""
    run = start_service(_cfg(", stall_timeout: 1s", budget_mib=200))  # 4 read slots of 3 x 16 MiB
    assert run.svc.receivers["otlp"].servers[0].calls.has_slots
    with grpc.insecure_channel(run.grpc) as attack, grpc.insecure_channel(run.grpc) as ch:
        futs, release = _stalled(attack, 16)
        try:
            time.sleep(1.5)
            for _ in range(4):
                ch.unary_unary(TRACE_EXPORT)(_request(), timeout=10, metadata=TOKEN)
        finally:
            release.set()
        ended = 0
        for f in futs:
            try:
                f.result(timeout=30)
            except grpc.RpcError as e:
                ended += e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(DoubleProcessor.instances[0].requests) == 4
    assert ended >= 1
    assert run.sample("otel_straggler_collector_connections_closed_total", receiver="otlp/grpc",
                      reason="stalled") == ended


def test_a_listener_full_of_stalled_calls_makes_room(start_service) -> None:  # type: ignore[no-untyped-def]
    """More stalled calls than max_concurrent_calls (here 32; 2000 against the default 1024 before gave
    RESOURCE_EXHAUSTED to everyone): a valid call ends the oldest stalled one and is served."""
    run = start_service(_cfg(", stall_timeout: 1s, max_concurrent_calls: 32, max_streams_per_connection: 1000"))
    with grpc.insecure_channel(run.grpc) as attack, grpc.insecure_channel(run.grpc) as ch:
        futs, release = _stalled(attack, 120)
        try:
            time.sleep(1.5)
            for _ in range(4):
                ch.unary_unary(TRACE_EXPORT)(_request(), timeout=10, metadata=TOKEN)
        finally:
            release.set()
        codes = []
        for f in futs:
            try:
                f.result(timeout=30)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
    assert len(DoubleProcessor.instances[0].requests) == 4
    refused = run.sample("otel_straggler_collector_connections_closed_total", receiver="otlp/grpc", reason="refused")
    stalled = run.sample("otel_straggler_collector_connections_closed_total", receiver="otlp/grpc", reason="stalled")
    assert refused + stalled >= 120 - 32  # every call beyond the cap was refused or ended
    assert codes.count(grpc.StatusCode.OK) == 0


def test_a_full_http_listener_closes_idle_connections_to_make_room(start_service) -> None:  # type: ignore[no-untyped-def]
    run = start_service(_cfg(http_extra=", max_connections: 20, stall_timeout: 1s"))
    idle = [socket.create_connection(("127.0.0.1", run.port("http")), timeout=5) for _ in range(60)]
    try:
        time.sleep(1.5)
        for _ in range(3):
            req = urllib.request.Request(run.http + "/v1/traces", data=_request(), method="POST", headers={
                "Content-Type": "application/x-protobuf", "Authorization": "Bearer s3cret"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
    finally:
        for so in idle:
            so.close()
    assert run.sample("otel_straggler_collector_connections_closed_total", receiver="otlp/http", reason="refused") \
        >= 60 - 20 - 1
    # the first request closed the oldest idle connection; each one's own connection then left room for the next
    assert run.sample("otel_straggler_collector_connections_closed_total", receiver="otlp/http",
                      reason="stalled") >= 1


def _closed_within(port: int, seconds: float) -> bool:
    """A TCP connection that never starts TLS is closed by the server within ``seconds``."""
    with socket.create_connection(("127.0.0.1", port), timeout=seconds + 5) as so:
        so.settimeout(seconds + 5)
        t0 = time.monotonic()
        try:
            while so.recv(4096):
                pass
        except (ConnectionResetError, TimeoutError):
            pass
        return time.monotonic() - t0 < seconds + 4


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary for a test cert")
def test_tls_handshakes_are_timed_out_on_both_ports(start_service, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", "s.key", "-out", "s.crt"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=30)
    tls = f"    tls: {{cert_file: {tmp_path / 's.crt'}, key_file: {tmp_path / 's.key'}}}"
    run = start_service(_cfg(", handshake_timeout: 1s", ", handshake_timeout: 1s, max_connections: 20, "
                             "stall_timeout: 1s", tls=tls))
    assert _closed_within(run.port("http"), 1.0)
    assert _closed_within(run.port("grpc"), 1.0)
    half_open = [socket.create_connection(("127.0.0.1", run.port("http")), timeout=5) for _ in range(40)]
    try:
        ctx = ssl.create_default_context(cafile=str(tmp_path / "s.crt"))
        req = urllib.request.Request(f"https://127.0.0.1:{run.port('http')}/v1/traces", data=_request(),
                                     method="POST", headers={"Content-Type": "application/x-protobuf",
                                                             "Authorization": "Bearer s3cret"})
        def post() -> bool:  # refused while every place is young (< stall_timeout): the client retries
            try:
                with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
                    return resp.status == 200
            except OSError:
                return False

        assert wait_for(post, 20.0, interval=0.2)
        creds = grpc.ssl_channel_credentials((tmp_path / "s.crt").read_bytes())
        with grpc.secure_channel(run.grpc, creds) as ch:
            ch.unary_unary(TRACE_EXPORT)(_request(), timeout=10, metadata=TOKEN)
    finally:
        for so in half_open:
            so.close()

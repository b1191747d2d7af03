"""The HTTP connection budget is shared fairly between peer addresses: a flood of connections that never start TLS
from one address does not refuse a client of another (the flooding address gives up its oldest connection before
auth), what is shed or refused is counted, and the per-address state stays within its caps. On loopback the flood
comes from 127.0.0.2, the client from 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from service_support import BASE_RECEIVER, DOUBLE_TRACES, DoubleProcessor, Running, wait_for

from collector_processor.receiver.auth import BearerAuth
from collector_processor.receiver.common import Config, Dispatcher, HttpProtocol
from collector_processor.receiver.otlp_http import OtlpHttpReceiver
from collector_processor.telemetry import Telemetry

ATTACKER = "127.0.0.2"
CFG = BASE_RECEIVER + """    auth: {bearer_token: s3cret}
    tls: {cert_file: %(crt)s, key_file: %(key)s}
""" + DOUBLE_TRACES
CLOSED = "otel_straggler_collector_connections_closed_total"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary for a test cert")


def _start(start_service, tmp_path: Path, http_extra: str) -> Running:  # type: ignore[no-untyped-def]
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", "s.key", "-out", "s.crt"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=30)
    text = CFG % {"crt": tmp_path / "s.crt", "key": tmp_path / "s.key"}
    return start_service(text.replace("http: {endpoint: 127.0.0.1:0}", "http: {endpoint: 127.0.0.1:0" + http_extra
                                      + "}"))


def _receiver(run: Running) -> OtlpHttpReceiver:
    return next(s for s in run.svc.receivers["otlp"].servers if isinstance(s, OtlpHttpReceiver))


def _budget(srv: OtlpHttpReceiver) -> dict[str, tuple[int, int]]:
    """{peer address: (connections, of them before auth)}, read on the receiver's loop; checks the totals agree."""
    async def snapshot() -> dict[str, tuple[int, int]]:
        peers = {addr: (st.n, len(st.preauth)) for addr, st in srv._peers.items()}
        assert sum(n for n, _ in peers.values()) == len(srv._conns)
        return peers

    assert srv._loop is not None
    return srv._loop.call(snapshot(), 5.0)


def _flood(port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections from ``ATTACKER`` that never start TLS (the server may close any of them at once)."""
    socks = []
    for _ in range(n):
        so = socket.socket()
        so.bind((ATTACKER, 0))
        so.connect(("127.0.0.1", port))
        socks.append(so)
    return socks


def _post(run: Running, tmp_path: Path) -> int:
    """An export on a fresh TLS connection from 127.0.0.1, no retry: its status (0: the connection failed)."""
    req = urllib.request.Request(f"https://127.0.0.1:{run.port('http')}/v1/traces", data=_request(), method="POST",
                                 headers={"Content-Type": "application/x-protobuf", "Authorization": "Bearer s3cret"})
    ctx = ssl.create_default_context(cafile=str(tmp_path / "s.crt"))
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return resp.status
    except OSError:
        return 0


def _request() -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest()
    req.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="x")
    return req.SerializeToString()


def _fill(port: int, srv: OtlpHttpReceiver, flood: list[socket.socket], n: int) -> None:
    """Open flood connections until the attacker holds ``n`` (those refused are kept open by the client, closed)."""
    end = time.monotonic() + 10
    while _budget(srv).get(ATTACKER, (0, 0))[0] < n and time.monotonic() < end:
        flood += _flood(port, 1)
        time.sleep(0.01)
    assert _budget(srv)[ATTACKER][0] == n


def test_a_flood_from_one_address_does_not_refuse_a_client_of_another(start_service, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """300 connections from 127.0.0.2 against max_connections 40, and a stall_timeout that no connection reaches
    during the test (so room can only come from the flooding address), the flood topped up to the cap before each
    export: every export from 127.0.0.1 on a fresh connection is served, each taking the place of the flood's
    oldest connection before auth (``shed``); the flood beyond the cap is refused and counted. Before connections
    were shared by address, each export was refused."""
    run = _start(start_service, tmp_path, ", max_connections: 40, stall_timeout: 600s, handshake_timeout: 300s")
    srv = _receiver(run)
    port = run.port("http")
    flood = _flood(port, 300)
    codes = []
    try:
        assert wait_for(lambda: _budget(srv).get(ATTACKER, (0, 0))[0] == 40, 10.0)
        for _ in range(5):
            _fill(port, srv, flood, 40)
            codes.append(_post(run, tmp_path))
            budget = _budget(srv)
            assert sum(n for n, _ in budget.values()) <= 40
            assert budget[ATTACKER] == (39, 39)
    finally:
        for so in flood:
            so.close()
    assert codes == [200] * 5
    assert len(DoubleProcessor.instances[0].requests) == 5
    assert run.sample(CLOSED, receiver="otlp/http", reason="shed") == 5  # one of the flood's per export
    assert run.sample(CLOSED, receiver="otlp/http", reason="refused") >= 300 - 40  # the flood beyond the cap
    assert run.sample(CLOSED, receiver="otlp/http", reason="stalled") == 0
    assert wait_for(lambda: _budget(srv) == {}, 10.0)  # the per-address map empties with its connections


def test_connections_before_auth_are_capped_per_address_and_counted(start_service, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With max_preauth_connections_per_peer 25 one address holds at most 25 connections that have not yet passed
    auth, however many it opens (the rest refused as ``peer_limit``), leaving the listener's other places free; a
    connection whose request passed auth no longer counts against that cap."""
    run = _start(start_service, tmp_path, ", max_connections: 100, max_preauth_connections_per_peer: 25, "
                                          "stall_timeout: 600s, handshake_timeout: 300s")
    srv = _receiver(run)
    flood = _flood(run.port("http"), 200)
    try:
        assert wait_for(lambda: run.sample(CLOSED, receiver="otlp/http", reason="peer_limit") >= 200 - 25, 10.0)
        assert _budget(srv) == {ATTACKER: (25, 25)}
        assert [_post(run, tmp_path) for _ in range(3)] == [200] * 3
        assert run.sample(CLOSED, receiver="otlp/http", reason="shed") == 0  # room without shedding anyone
        flood.pop(0).close()  # one place before auth free for the flooding address
        assert wait_for(lambda: _budget(srv) == {ATTACKER: (24, 24)}, 10.0)
        ctx = ssl.create_default_context(cafile=str(tmp_path / "s.crt"))
        with socket.create_connection(("127.0.0.1", run.port("http")), timeout=10, source_address=(ATTACKER, 0)) \
                as raw, ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            body = _request()
            tls.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                        b"Authorization: Bearer s3cret\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            assert tls.recv(4096).startswith(b"HTTP/1.1 200")
            assert _budget(srv) == {ATTACKER: (25, 24)}  # kept alive, past auth
            flood += _flood(run.port("http"), 1)  # so one more before auth fits
            assert wait_for(lambda: _budget(srv) == {ATTACKER: (26, 25)}, 10.0)
    finally:
        for so in flood:
            so.close()
    assert run.sample(CLOSED, receiver="otlp/http", reason="peer_limit") >= 200 - 25
    assert wait_for(lambda: _budget(srv) == {}, 10.0)


def test_the_busiest_address_is_shed_first_and_peers_with_fewer_keep_theirs() -> None:
    """The admission rule on the receiver's own structures (not started): at the listener's cap a newcomer of an
    address holding fewer connections takes the oldest connection before auth of the address holding the most; a
    newcomer of the busiest address is refused and closes nobody else's; the per-address map holds only addresses
    with a connection."""
    t = Telemetry()
    cfg = Config()
    srv = OtlpHttpReceiver("otlp", cfg, HttpProtocol(max_connections=10, stall_timeout=600),
                           Dispatcher("otlp/http", t, {}, 1.0), t, BearerAuth(None))

    def closed(reason: str) -> float:
        return t.registry.get_sample_value(CLOSED, {"receiver": "otlp/http", "reason": reason}) or 0.0

    async def main() -> None:
        tasks: dict[str, list[asyncio.Task[None]]] = {"a": [], "b": [], "c": []}

        def admit(peer: str) -> str | None:
            task = asyncio.ensure_future(asyncio.sleep(60))
            why = srv._admit(task, peer)
            if why is None:
                tasks[peer].append(task)
            else:
                task.cancel()
            return why

        assert [admit("a") for _ in range(7)] + [admit("b") for _ in range(3)] == [None] * 10
        assert admit("a") == "refused"  # the busiest address: nobody else's connection is closed for it
        assert admit("c") is None  # a newcomer: a's oldest connection is shed
        await asyncio.sleep(0)
        assert tasks["a"][0].cancelled() and not any(t.cancelled() for t in tasks["a"][1:] + tasks["b"])
        assert admit("b") is None  # b held 3 against a's 6: now 4 and 5
        assert admit("b") == "refused"  # 5 and 4 the other way round would be no fairer
        assert {p: st.n for p, st in srv._peers.items()} == {"a": 5, "b": 4, "c": 1}
        assert (closed("shed"), closed("stalled")) == (2, 0)  # (a refusal is counted by the connection)
        for ts in tasks.values():
            for task in ts:
                srv._forget(task)
                task.cancel()
        assert srv._peers == {} and srv._conns == {}

    asyncio.run(main())


def test_a_connection_that_replaces_its_addresss_last_one_is_counted_for_it() -> None:
    """A newcomer of an address whose only connection is closed to make room (its own stale one) is counted for
    that address again: its end leaves the per-address map empty, with no error."""
    t = Telemetry()
    srv = OtlpHttpReceiver("otlp", Config(), HttpProtocol(max_connections=2, max_connections_per_peer=1,
                                                          stall_timeout=0.001),
                           Dispatcher("otlp/http", t, {}, 1.0), t, BearerAuth(None))

    async def main() -> None:
        first = asyncio.ensure_future(asyncio.sleep(60))
        assert srv._admit(first, "a") is None
        await asyncio.sleep(0.01)  # stale now
        second = asyncio.ensure_future(asyncio.sleep(60))
        assert srv._admit(second, "a") is None  # a's stale one closed for it
        await asyncio.sleep(0)
        assert first.cancelled() and {p: st.n for p, st in srv._peers.items()} == {"a": 1}
        srv._forget(second)
        second.cancel()
        assert srv._peers == {} and srv._conns == {}

    asyncio.run(main())

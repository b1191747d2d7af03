"""Attack sequences on ONE long-lived collector (``python bench/hostile.py``): ``configs/collector.yaml`` as shipped
(memory limiter 1024 MiB, spike 256) with TLS on both ports and two tenants (``auth.tenants``): the valid clients'
token writes ``valid-job``, the attacker's token ``attacker-*``. Two real OTel SDK exporters (gRPC and HTTP, TLS,
the valid token, default 10 s timeout and retries) export 20 spans every 0.25 s each throughout.

Each attack runs ``--duration`` seconds, then valid clients are watched for ``--after-s`` seconds (60 by default)
before the next attack starts, on the same process; the whole sequence (amplification twice) runs ``--rounds``
times (1 by default). The attackers run in the bench's process beside the valid clients (they share its GIL):

  amplification   4 MiB bodies of empty spans (2 million spans each) from 16 gRPC and 4 HTTP clients, attacker token
  stalled-calls   64 authenticated gRPC calls that never send their message, re-opened as they end
  half-open-tls   TCP connections to both ports that never start the TLS handshake (--half-open each), re-opened
  idle-tls        TLS connections that finish the handshake and then say nothing (--half-open / 4 per port)
  gzip-bomb       HTTPS bodies of 64 gzip members (1 GiB inflated), attacker token
  far-steps       the attacker's token: 70 one-span requests with steps near 10^6 and a false straggler for
                  valid-job (another tenant's job), and the same far steps into its own job
  slow-inline     the attacker's token: 8 gRPC clients sending 250 KiB requests of one-span cohorts (under the
                  256 KiB up to which the gRPC receiver processes a request on its event loop when the pipeline is
                  idle; the costliest such request per byte the bench knows), each processed in well under the
                  250 ms after which that path is turned off: together they keep the event loop busy
  chunked-slow    the attacker's token: chunked HTTPS bodies that never end, one byte a second each
                  (--half-open / 15 connections, re-opened as the server closes them)
  chunked-oversize  the attacker's token: chunked bodies sent 1 MiB at a time past the 16 MiB limit (4 clients),
                  a chunk announcing 64 GiB, a chunked gzip bomb of 64 members (1 GiB inflated)
  cross-tenant    the attacker's token against valid-job: the job named twice in one resource, its own spans in
                  valid-job's step traces, a straggler.verdict span, a resource posing as the collector's service
  cohort-flood    the attacker's token: requests of ~300 new one-span cohorts of its own job, back to back
  connection-flood  --flood (3000) TCP connections to the HTTP port from another address (127.0.0.2) that never
                  start TLS, re-opened as the server closes them; beside the exporters, a valid client from
                  127.0.0.1 opens a fresh TLS connection for each export (4 a second, no retry): its exports count
                  with the valid ones

Per attack: the collector's RSS (peak during, at the end), valid exports that succeeded during the attack and in
the window after it (and the slowest 5 % of their durations: p95), and recover_s: seconds from the attack's end
until the RSS is under the soft limit and a valid export has succeeded again. tenants_crossed, measured: attacker
requests for valid-job (far-steps, cross-tenant) answered OK, plus the valid tenant's cohorts evicted during
cohort-flood (0 expected).

Last line: peak_rss_mb= valid_client_success_during= valid_client_success_after= recover_s_max= tenants_crossed=
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import re
import selectors
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from hostile import MIB, TRACE_METHOD, Collector, Tally, cohort_spans, empty_spans, log, run_threads

VALID_TOKEN = "valid-team-token-5b1e"
ATTACK_TOKEN = "attacker-team-token-9c07"
SOFT_MIB = 1024 - 256


def make_cert(tmp: Path) -> tuple[Path, Path]:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", "s.key", "-out", "s.crt"],
                   cwd=tmp, check=True, capture_output=True, timeout=60)
    return tmp / "s.crt", tmp / "s.key"


def overrides(crt: Path, key: Path, preauth_per_peer: int = 0) -> str:
    http = f"    protocols: {{http: {{max_preauth_connections_per_peer: {preauth_per_peer}}}}}\n" \
        if preauth_per_peer else ""
    return f"""receivers:
  otlp:
{http}    tls: {{cert_file: "{crt}", key_file: "{key}"}}
    auth:
      tenants:
        - {{name: valid, bearer_token: {VALID_TOKEN}, jobs: [valid-job]}}
        - {{name: attacker, bearer_token: {ATTACK_TOKEN}, jobs: ["attacker-*"]}}
"""


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


# ---- valid clients ---------------------------------------------------------------------------------------------


def _VerifiedSession(ca: str):  # type: ignore[no-untyped-def]
    """A requests Session that verifies every request against ``ca`` (the exporter's own ``certificate_file``
    alone was not applied to some reconnections: CERTIFICATE_VERIFY_FAILED every ~8 s in a calm run)."""
    import requests

    class Session(requests.Session):
        def request(self, method, url, **kw):  # type: ignore[no-untyped-def, override]
            kw["verify"] = ca
            return super().request(method, url, **kw)

    return Session()


class Valid:
    """The OTel SDK's gRPC and HTTP span exporters over TLS with the valid tenant's token; every export's time and
    result is kept."""

    def __init__(self, c: Collector, crt: Path) -> None:
        import grpc
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        headers = {"authorization": f"Bearer {VALID_TOKEN}"}
        session = _VerifiedSession(str(crt))
        self.exporters = [
            GrpcExporter(endpoint=c.grpc, insecure=False, credentials=grpc.ssl_channel_credentials(crt.read_bytes()),
                         timeout=10, headers=headers),
            HttpExporter(endpoint=f"https://127.0.0.1:{c.ports['http']}/v1/traces", certificate_file=str(crt),
                         timeout=10, headers=headers, session=session)]
        self.results: list[tuple[float, float, bool]] = []  # (started, ended, succeeded)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, e), daemon=True)
                         for i, e in enumerate(self.exporters)]

    def start(self) -> Valid:
        for t in self._threads:
            t.start()
        return self

    def _run(self, i: int, exporter) -> None:  # type: ignore[no-untyped-def]
        from valid_client import export_valid_spans

        def record(started: float, ended: float, ok: bool) -> None:
            with self._lock:
                self.results.append((started, ended, ok))

        export_valid_spans(i, exporter, self._stop, record)

    def between(self, t0: float, t1: float) -> tuple[int, int]:
        """(succeeded, sent) of the exports that started in [t0, t1) (an export retries for up to its 10 s
        timeout: one that started during an attack counts there, whenever it ended)."""
        with self._lock:
            done = [ok for t, _, ok in self.results if t0 <= t < t1]
        return sum(done), len(done)

    def p95_s(self, t0: float, t1: float) -> float:
        """The 95th percentile of the durations of the exports that started in [t0, t1) (nan: none)."""
        with self._lock:
            took = sorted(end - t for t, end, _ in self.results if t0 <= t < t1)
        return took[min(len(took) - 1, int(0.95 * len(took)))] if took else float("nan")

    def first_ok_after(self, t0: float) -> float | None:
        """When the first export that started at or after ``t0`` succeeded."""
        with self._lock:
            return next((end for t, end, ok in self.results if t >= t0 and ok), None)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        for e in self.exporters:
            e.shutdown()


# ---- attacker clients (TLS) ------------------------------------------------------------------------------------


@dataclass
class Env:
    c: Collector
    crt: Path
    a: argparse.Namespace
    tally: Tally
    valid: Valid | None = None

    def ctx(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.crt))

    def channel(self):  # type: ignore[no-untyped-def]
        import grpc

        return grpc.secure_channel(self.c.grpc, grpc.ssl_channel_credentials(self.crt.read_bytes()),
                                   options=[("grpc.max_send_message_length", -1)])

    def post(self, body: bytes, token: str = ATTACK_TOKEN, headers: dict | None = None, timeout: float = 30.0) -> str:
        req = urllib.request.Request(f"https://127.0.0.1:{self.c.ports['http']}/v1/traces", data=body,
                                     method="POST", headers={"Content-Type": "application/x-protobuf",
                                                             "Authorization": f"Bearer {token}", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.ctx()) as r:
                r.read()
                return str(r.status)
        except urllib.error.HTTPError as e:
            e.read()
            return str(e.code)
        except (OSError, urllib.error.URLError) as e:
            return f"error({type(e).__name__})"


def grpc_send(ch, body: bytes, token: str = ATTACK_TOKEN, timeout: float = 30.0) -> str:  # type: ignore[no-untyped-def]
    import grpc

    try:
        ch.unary_unary(TRACE_METHOD)(body, timeout=timeout, metadata=(("authorization", f"Bearer {token}"),))
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def attack_amplification(e: Env) -> str:
    body = empty_spans((1 if e.a.quick else 4) * MIB)

    def grpc_client(stop: threading.Event) -> None:
        with e.channel() as ch:
            while not stop.is_set():
                e.tally.add("grpc " + grpc_send(ch, body))

    def http_client(stop: threading.Event) -> None:
        while not stop.is_set():
            e.tally.add("http " + e.post(body))

    run_threads(e.a.duration, [grpc_client] * 16 + [http_client] * 4)
    return f"{len(body) / MIB:.0f} MiB of empty spans, 16 gRPC + 4 HTTP clients"


def attack_stalled_calls(e: Env) -> str:
    import grpc

    def stall(stop: threading.Event) -> None:
        with e.channel() as ch:
            while not stop.is_set():
                release = threading.Event()

                def never(release: threading.Event = release):  # type: ignore[no-untyped-def]
                    release.wait(60)
                    yield from ()

                futs = [ch.stream_unary(TRACE_METHOD).future(
                    never(), timeout=60, metadata=(("authorization", f"Bearer {ATTACK_TOKEN}"),)) for _ in range(16)]
                for f in futs:
                    try:
                        f.result(timeout=max(0.1, e.a.duration + 5))
                        e.tally.add("stalled OK")
                    except grpc.RpcError as err:
                        e.tally.add(f"stalled {err.code().name}")
                    except grpc.FutureTimeoutError:
                        e.tally.add("stalled still waiting")
                        f.cancel()
                release.set()

    run_threads(e.a.duration, [stall] * 4)
    return "64 authenticated calls that never send"


def _hold_sockets(e: Env, n: int, tls_handshake: bool, stop: threading.Event, port: str) -> None:
    socks: list[socket.socket] = []
    ctx = e.ctx()
    while not stop.is_set():
        while len(socks) < n and not stop.is_set():
            try:
                so = socket.create_connection(("127.0.0.1", e.c.ports[port]), timeout=5)
                if tls_handshake:
                    so = ctx.wrap_socket(so, server_hostname="127.0.0.1")
                    if port == "grpc":  # an HTTP/2 client preface, then silence
                        so.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                so.setblocking(False)
                socks.append(so)
            except (OSError, ssl.SSLError):
                e.tally.add(f"{port} connect refused")
                break
        for so in list(socks):  # closed by the server: count, open another
            try:
                data = so.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError):
                continue
            except OSError:
                data = b""
            if not data:
                e.tally.add(f"{port} closed by server")
                socks.remove(so)
                so.close()
        stop.wait(0.1)
    for so in socks:
        so.close()


def attack_half_open(e: Env) -> str:
    n = e.a.half_open
    run_threads(e.a.duration, [lambda stop, p=p: _hold_sockets(e, n, False, stop, p) for p in ("http", "grpc")])
    return f"{n} connections per port that never start TLS"


def attack_idle_tls(e: Env) -> str:
    n = max(1, e.a.half_open // 4)
    run_threads(e.a.duration, [lambda stop, p=p: _hold_sockets(e, n, True, stop, p) for p in ("http", "grpc")])
    return f"{n} TLS connections per port, handshake done, then silent"


def attack_gzip(e: Env) -> str:
    bomb = gzip.compress(b"\0" * (16 * MIB), 9) * 64

    def client(stop: threading.Event) -> None:
        while not stop.is_set():
            e.tally.add("http " + e.post(bomb, headers={"Content-Encoding": "gzip"}))

    run_threads(e.a.duration, [client] * 4)
    return f"{len(bomb) / MIB:.2f} MiB on the wire, 1 GiB inflated"


def _chunked_head(e: Env, extra: str = "") -> ssl.SSLSocket:
    """A TLS connection to the HTTP port that has sent an authenticated chunked POST's head."""
    so = e.ctx().wrap_socket(socket.create_connection(("127.0.0.1", e.c.ports["http"]), timeout=10),
                             server_hostname="127.0.0.1")
    so.sendall(("POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                f"Authorization: Bearer {ATTACK_TOKEN}\r\n{extra}Transfer-Encoding: chunked\r\n\r\n").encode())
    return so


def _status(so: ssl.SSLSocket, first: bytes = b"") -> str:
    """The status code the server answered on ``so`` (``first``: what of it was read already; "closed" when it
    closed without one)."""
    try:
        data = first + so.recv(4096)
    except (OSError, ssl.SSLError) as ex:
        return f"error({type(ex).__name__})"
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"


def attack_chunked_slow(e: Env) -> str:
    """Chunked bodies that never end: each connection sends a 1-byte chunk every second (within the read
    timeout), so only the connection budget and the memory reserved chunk by chunk bound them."""
    n = e.a.half_open // 15

    def client(stop: threading.Event) -> None:
        socks: list[ssl.SSLSocket] = []
        while not stop.is_set():
            while len(socks) < n and not stop.is_set():
                try:
                    socks.append(_chunked_head(e))
                except (OSError, ssl.SSLError):
                    e.tally.add("slow connect refused")
                    break
            for so in list(socks):
                try:
                    so.sendall(b"1\r\nx\r\n")
                except (OSError, ssl.SSLError):
                    e.tally.add("slow closed by server")
                    socks.remove(so)
                    so.close()
            stop.wait(1.0)
        for so in socks:
            so.close()

    run_threads(e.a.duration, [client])
    return f"{n} chunked bodies that never end, 1 byte a second each"


def attack_chunked_oversize(e: Env) -> str:
    """Chunked bodies past the 16 MiB limit: 1 MiB chunks sent until the server answers; a chunk announcing
    64 GiB; a chunked gzip bomb (64 members, 1 GiB inflated)."""
    piece = b"100000\r\n" + bytes(MIB) + b"\r\n"
    bomb = gzip.compress(b"\0" * (16 * MIB), 9) * 64

    def endless(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                so = _chunked_head(e)
                so.settimeout(0.0)
                sent, first = 0, b""
                while sent < 64 and not stop.is_set():
                    try:
                        first = so.recv(1)
                        if first:
                            break  # answered: stop sending
                    except (BlockingIOError, ssl.SSLWantReadError):
                        pass
                    so.settimeout(10)
                    so.sendall(piece)
                    so.settimeout(0.0)
                    sent += 1
                so.settimeout(10)
                e.tally.add(f"oversize {_status(so, first) if sent < 64 else 'not answered'}")
                so.close()
            except (OSError, ssl.SSLError) as ex:
                e.tally.add(f"oversize error({type(ex).__name__})")

    def huge(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                so = _chunked_head(e)
                so.sendall(b"1000000000\r\n")  # 64 GiB announced, nothing of it sent
                e.tally.add(f"huge-chunk {_status(so)}")
                so.close()
            except (OSError, ssl.SSLError) as ex:
                e.tally.add(f"huge-chunk error({type(ex).__name__})")

    def gzip_bomb(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                so = _chunked_head(e, "Content-Encoding: gzip\r\n")
                for i in range(0, len(bomb), 64 * 1024):
                    part = bomb[i:i + 64 * 1024]
                    so.sendall(b"%x\r\n%s\r\n" % (len(part), part))
                so.sendall(b"0\r\n\r\n")
                e.tally.add(f"gzip-chunked {_status(so)}")
                so.close()
            except (OSError, ssl.SSLError) as ex:
                e.tally.add(f"gzip-chunked error({type(ex).__name__})")

    run_threads(e.a.duration, [endless] * 4 + [huge, gzip_bomb])
    return (f"chunked: 1 MiB chunks past the 16 MiB limit (4 clients), a 64 GiB chunk announced, "
            f"a {len(bomb) / MIB:.2f} MiB gzip bomb")


def _far_request(job: str, i: int) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    import otel_straggler_schema as s
    from collector_processor.otlp_values import key_value

    res = Resource(attributes=[key_value(k, v) for k, v in {
        s.RES_RANK: 0, s.RES_WORLD_SIZE: 2, s.RES_JOB_ID: job, s.RES_COHORT_KEY: "valid"}.items()])
    step = 1_000_000 + 7 * i
    sp = Span(trace_id=s.trace_id_for_step(job, step).to_bytes(16, "big"), span_id=(i + 1).to_bytes(8, "big"),
              name="forward-compute",
              start_time_unix_nano=1_800_000_000_000_000_000, end_time_unix_nano=1_800_000_000_040_000_000,
              attributes=[key_value(k, v) for k, v in {s.ATTR_STAGE: "forward-compute", s.ATTR_ITERATION: step,
                                                       s.ATTR_HOST_MS: 4000.0, s.ATTR_COUNT: 1}.items()])
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=res, scope_spans=[ScopeSpans(spans=[sp])])]).SerializeToString()


def attack_far_steps(e: Env) -> str:
    end = time.monotonic() + e.a.duration
    crossed = 0
    with e.channel() as ch:
        while time.monotonic() < end:
            for i in range(70):
                code = grpc_send(ch, _far_request("valid-job", i))
                e.tally.add("other-job " + code)
                crossed += code == "OK"
                e.tally.add("own-job " + grpc_send(ch, _far_request("attacker-job", i)))
            code = e.post(_far_request("valid-job", 0))
            e.tally.add("other-job-http " + code)
            crossed += code == "200"
    e.a.tenants_crossed += crossed
    return "70 far-step requests into valid-job and into attacker-job, repeated"


def attack_slow_inline(e: Env) -> str:
    bodies = [cohort_spans(250 * 1024, job=f"attacker-inline-{k}") for k in range(8)]
    took: list[float] = []
    health: list[float] = []
    lock = threading.Lock()

    def client(stop: threading.Event, k: int) -> None:
        with e.channel() as ch:
            i = k
            while not stop.is_set():
                t0 = time.monotonic()
                code = grpc_send(ch, bodies[i % len(bodies)])
                with lock:
                    took.append(time.monotonic() - t0)
                e.tally.add("grpc " + code)
                i += 1

    def probe(stop: threading.Event) -> None:
        """The receiver's event loop as any call sees it: gRPC health checks (answered on the loop), 10 a second."""
        with e.channel() as ch:
            check = ch.unary_unary("/grpc.health.v1.Health/Check")
            while not stop.wait(0.1):
                t0 = time.monotonic()
                try:
                    check(b"", timeout=10)
                except Exception:  # a failed check counts as its full wait
                    pass
                health.append(time.monotonic() - t0)

    deferred0 = _inline_deferred(e.c)
    run_threads(e.a.duration, [lambda stop, k=k: client(stop, k) for k in range(8)] + [probe])
    deferred = _inline_deferred(e.c) - deferred0
    took.sort()
    health.sort()
    med = took[len(took) // 2] * 1000 if took else float("nan")
    p95 = health[min(len(health) - 1, int(0.95 * len(health)))] * 1000 if health else float("nan")
    return (f"{len(bodies[0]) / 1024:.0f} KiB of one-span cohorts, 8 gRPC clients; {len(took)} requests, "
            f"answered in {med:.0f} ms (median); health check p95 {p95:.0f} ms, max "
            f"{(health[-1] * 1000 if health else float('nan')):.0f} ms; {deferred:.0f} queued by the inline budget")


def _inline_deferred(c: Collector) -> float:
    """The collector's ``inline_deferred_total`` over its pipelines (nan where it has none or does not answer)."""
    try:
        text = c.metrics()
    except OSError:
        return float("nan")
    found = re.findall(r"^otel_straggler_collector_inline_deferred_total\{[^}]*\} (\S+)", text, re.M)
    return sum(float(x) for x in found) if found else float("nan")


ATTACKER_ADDRESS = "127.0.0.2"  # on loopback any 127.0.0.0/8 address is this host: another peer to the collector


def _flood(e: Env, n: int, stop: threading.Event) -> tuple[int, int]:
    """Hold ``n`` TCP connections from ``ATTACKER_ADDRESS`` to the HTTP port, saying nothing; each one the server
    closes is counted and opened again. Returns (connections opened, most held at once)."""
    sel = selectors.DefaultSelector()
    opened = held_max = 0
    try:
        while not stop.is_set():
            while len(sel.get_map()) < n and not stop.is_set():
                so = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    so.settimeout(5)
                    so.bind((ATTACKER_ADDRESS, 0))
                    so.connect(("127.0.0.1", e.c.ports["http"]))
                    so.setblocking(False)
                    sel.register(so, selectors.EVENT_READ)
                    opened += 1
                except OSError:
                    so.close()
                    e.tally.add("flood connect failed")
                    break
            held_max = max(held_max, len(sel.get_map()))
            for key, _ in sel.select(timeout=0.05):  # readable: closed by the server (it never answers them)
                so = key.fileobj  # type: ignore[assignment]
                sel.unregister(so)
                so.close()
                e.tally.add("flood closed by server")
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        sel.close()
    return opened, held_max


def _newcomer_request(i: int) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    import otel_straggler_schema as s
    from collector_processor.otlp_values import key_value

    res = Resource(attributes=[key_value(k, v) for k, v in {
        s.RES_RANK: 2, s.RES_JOB_ID: "valid-job", s.RES_COHORT_KEY: "newcomer"}.items()])
    start = time.time_ns()
    sp = Span(trace_id=s.trace_id_for_step("valid-job", i).to_bytes(16, "big"), span_id=(i + 1).to_bytes(8, "big"),
              name="forward-compute",
              start_time_unix_nano=start, end_time_unix_nano=start + 10_000_000,
              attributes=[key_value(k, v) for k, v in {s.ATTR_STAGE: "forward-compute", s.ATTR_ITERATION: i,
                                                       s.ATTR_HOST_MS: 10.0, s.ATTR_COUNT: 1}.items()])
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=res, scope_spans=[ScopeSpans(spans=[sp])])]).SerializeToString()


def attack_connection_flood(e: Env) -> str:
    """--flood connections held from another address while a valid client from 127.0.0.1 connects afresh for every
    export: is a newcomer from another address served?"""
    n = e.a.flood
    held: list[tuple[int, int]] = []
    outcomes = Tally()
    ctx = e.ctx()

    def newcomer(stop: threading.Event) -> None:
        i = 0
        while not stop.wait(0.25):
            t0 = time.monotonic()
            conn = http.client.HTTPSConnection("127.0.0.1", e.c.ports["http"], context=ctx, timeout=10,
                                               source_address=("127.0.0.1", 0))
            try:
                conn.request("POST", "/v1/traces", _newcomer_request(i), {
                    "Content-Type": "application/x-protobuf", "Authorization": f"Bearer {VALID_TOKEN}",
                    "Connection": "close"})
                resp = conn.getresponse()
                resp.read()
                what = str(resp.status)
            except (OSError, ssl.SSLError, http.client.HTTPException) as ex:
                what = f"error({type(ex).__name__})"
            finally:
                conn.close()
            outcomes.add(what)
            if e.valid is not None:
                with e.valid._lock:
                    e.valid.results.append((t0, time.monotonic(), what == "200"))
            i += 1

    def attacker(stop: threading.Event) -> None:
        held.append(_flood(e, n, stop))

    closed0 = _http_closed(e.c)
    flood_stop = threading.Event()
    flood = threading.Thread(target=attacker, args=(flood_stop,), daemon=True)
    flood.start()
    time.sleep(min(3.0, e.a.duration / 4))  # the flood builds up first
    run_threads(e.a.duration, [newcomer])
    flood_stop.set()
    flood.join(60)
    closed = {k: int(v - closed0.get(k, 0.0)) for k, v in _http_closed(e.c).items() if v != closed0.get(k, 0.0)}
    opened, held_max = held[0] if held else (0, 0)
    ok = outcomes.counts.get("200", 0)
    total = sum(outcomes.counts.values())
    return (f"{n} connections from {ATTACKER_ADDRESS} that never start TLS ({opened} opened, at most {held_max} "
            f"held at once); newcomer from 127.0.0.1, a fresh TLS connection per export: {ok}/{total} "
            f"({outcomes.text()}); closed by the HTTP connection budget: {closed}")


def _http_closed(c: Collector) -> dict[str, float]:
    """The collector's ``connections_closed_total`` of its HTTP receiver, by reason ({} when it does not answer)."""
    try:
        text = c.metrics()
    except OSError:
        return {}
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^otel_straggler_collector_connections_closed_total\{reason="(\w+)",receiver="otlp/http"\} (\S+)', text,
        re.M)}


def _span_request(resource: dict[str, object] | list[tuple[str, object]], step: int, trace_of: str,
                  name: str = "forward-compute") -> bytes:
    """One stage span of ``resource`` (a dict, or (key, value) pairs: a key may come twice) at ``step``, in
    ``trace_of``'s step trace."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    import otel_straggler_schema as s
    from collector_processor.otlp_values import key_value

    pairs = resource.items() if isinstance(resource, dict) else resource
    sp = Span(trace_id=s.trace_id_for_step(trace_of, step).to_bytes(16, "big"), span_id=(step + 1).to_bytes(8, "big"),
              name=name, start_time_unix_nano=1_800_000_000_000_000_000, end_time_unix_nano=1_800_000_000_040_000_000,
              attributes=[key_value(k, v) for k, v in {s.ATTR_STAGE: "forward-compute", s.ATTR_ITERATION: step,
                                                       s.ATTR_HOST_MS: 4000.0, s.ATTR_COUNT: 1}.items()])
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=Resource(attributes=[key_value(k, v) for k, v in pairs]),
        scope_spans=[ScopeSpans(spans=[sp])])]).SerializeToString()


def attack_cross_tenant(e: Env) -> str:
    """The attacker's token against valid-job: the job named twice (its own first), spans of its own job in
    valid-job's step traces, a span posing as the collector's verdict in valid-job's trace, and one with the
    collector's service.name. Each answered OK is a crossing."""
    import otel_straggler_schema as s

    end = time.monotonic() + e.a.duration
    crossed = 0
    step = 0
    with e.channel() as ch:
        while time.monotonic() < end:
            step += 1
            own = {s.RES_RANK: 0, s.RES_WORLD_SIZE: 2, s.RES_JOB_ID: "attacker-job", s.RES_COHORT_KEY: "x"}
            bodies = {
                "job-twice": _span_request([*own.items(), (s.RES_JOB_ID, "valid-job")], step, "valid-job"),
                "foreign-trace": _span_request(own, step, "valid-job"),
                "posed-verdict": _span_request(own, step, "valid-job", name=s.SPAN_VERDICT),
                "collector-service": _span_request({**own, s.RES_SERVICE_NAME: s.SERVICE_COLLECTOR}, step,
                                                   "attacker-job"),
            }
            for what, body in bodies.items():
                code = grpc_send(ch, body)
                e.tally.add(f"{what} {code}")
                crossed += code == "OK"
                code = e.post(body)
                e.tally.add(f"{what}-http {code}")
                crossed += code == "200"
    e.a.tenants_crossed += crossed
    return "job named twice, spans into valid-job's traces, posed verdicts and collector spans (gRPC and HTTP)"


def _tenant_evictions(e: Env, tenant: str) -> float:
    return e.c.total("otel_straggler_collector_tenant_evictions_total", tenant=tenant, structure="cohorts")


def attack_cohort_flood(e: Env) -> str:
    """The attacker's token: requests of 300 new one-span cohorts of its own job, as fast as they are taken. Each
    cohort of the valid tenant evicted meanwhile is a crossing (its straggler would go unseen)."""
    before_valid, before_own = _tenant_evictions(e, "valid"), _tenant_evictions(e, "attacker")
    end = time.monotonic() + e.a.duration
    n = 0
    with e.channel() as ch:
        while time.monotonic() < end:
            body = cohort_spans(300 * 305, job=f"attacker-flood-{n}")
            e.tally.add("flood " + grpc_send(ch, body))
            n += 1
    crossed = int(_tenant_evictions(e, "valid") - before_valid)
    e.a.tenants_crossed += crossed
    own = _tenant_evictions(e, "attacker") - before_own
    return f"{n} requests of ~300 new cohorts; attacker's own evicted {own:.0f}, valid's {crossed}"


SEQUENCE = [("amplification", attack_amplification), ("stalled-calls", attack_stalled_calls),
            ("half-open-tls", attack_half_open), ("amplification", attack_amplification),
            ("idle-tls", attack_idle_tls), ("gzip-bomb", attack_gzip), ("far-steps", attack_far_steps),
            ("slow-inline", attack_slow_inline), ("chunked-slow", attack_chunked_slow),
            ("chunked-oversize", attack_chunked_oversize), ("cross-tenant", attack_cross_tenant),
            ("cohort-flood", attack_cohort_flood), ("connection-flood", attack_connection_flood)]


@dataclass
class Row:
    round: int
    attack: str
    peak_mb: float
    end_mb: float
    after_mb: float
    during: tuple[int, int]
    after: tuple[int, int]
    p95_s: tuple[float, float]  # valid exports' durations, during and after
    recover_s: float
    answers: str
    notes: str

    @staticmethod
    def rate(x: tuple[int, int]) -> float:
        return x[0] / x[1] if x[1] else float("nan")


def main(a: argparse.Namespace) -> None:
    if a.quick:
        a.duration, a.after_s, a.rounds = min(a.duration, 4.0), min(a.after_s, 10.0), 1
    a.half_open = 300 if a.quick else 2000
    a.tenants_crossed = 0
    import logging
    import resource

    logging.getLogger("opentelemetry").setLevel(logging.ERROR)  # the SDK's own retry messages, expected here
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, max(4 * a.half_open, a.flood) + 1024)), hard))
    except (ValueError, OSError):
        pass
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        crt, key = make_cert(tmp)
        c = Collector(tmp, "sequence", limit_mib=a.limit_mib, spike_mib=a.spike_mib,
                      extra_yaml=overrides(crt, key, a.preauth_per_peer))
        peak = [0.0]
        stop_sampling = threading.Event()

        def sample() -> None:
            while not stop_sampling.is_set():
                peak[0] = max(peak[0], rss_mb(c.proc.pid))
                stop_sampling.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        valid = Valid(c, crt).start()
        time.sleep(3.0)
        log(f"collector up (TLS, tenants), RSS {rss_mb(c.proc.pid):.0f} MiB; valid clients exporting")
        try:
            only = {x.strip() for x in a.only.split(",") if x.strip()}
            for rnd in range(1, a.rounds + 1):
                for name, fn in SEQUENCE:
                    if only and name not in only:
                        continue
                    tally = Tally()
                    peak[0] = rss_mb(c.proc.pid)
                    t0 = time.monotonic()
                    notes = fn(Env(c, crt, a, tally, valid))
                    t1 = time.monotonic()
                    during_peak = peak[0]
                    end_mb = rss_mb(c.proc.pid)
                    under: float | None = None
                    while time.monotonic() < t1 + a.after_s:
                        if under is None and rss_mb(c.proc.pid) < SOFT_MIB:
                            under = time.monotonic()
                        time.sleep(0.2)
                    t2 = time.monotonic()
                    time.sleep(0.5)  # (the last exports that started in the window end)
                    first_ok = valid.first_ok_after(t1)
                    recover = (max(under, first_ok) - t1) if under is not None and first_ok is not None \
                        else float("inf")
                    row = Row(rnd, name, during_peak, end_mb, rss_mb(c.proc.pid), valid.between(t0, t1),
                              valid.between(t1, t2), (valid.p95_s(t0, t1), valid.p95_s(t1, t2)), recover,
                              tally.text(), notes)
                    rows.append(row)
                    log(f"[round {rnd}] {name}: peak {row.peak_mb:.0f} MiB, at end {row.end_mb:.0f}, after "
                        f"{row.after_mb:.0f}; valid during {row.during[0]}/{row.during[1]}, after "
                        f"{row.after[0]}/{row.after[1]}; valid p95 {row.p95_s[0]:.2f} s / {row.p95_s[1]:.2f} s; "
                        f"recover {row.recover_s:.1f} s; {row.answers}; {notes}")
                    if c.proc.poll() is not None:
                        raise RuntimeError(f"the collector exited:\n{c.log()[-3000:]}")
        finally:
            valid.stop()
            stop_sampling.set()
            hwm = c.peak_rss_mb()
            c.stop()
    log("")
    log(f"| round | attack | peak RSS MiB | at end | {a.after_s:.0f} s after | valid during | valid after | "
        "valid p95 s during / after | recover s | attacker answers | notes |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r.round} | {r.attack} | {r.peak_mb:.0f} | {r.end_mb:.0f} | {r.after_mb:.0f} | "
            f"{r.during[0]}/{r.during[1]} | {r.after[0]}/{r.after[1]} | {r.p95_s[0]:.2f} / {r.p95_s[1]:.2f} | "
            f"{r.recover_s:.1f} | {r.answers} | {r.notes} |")
    during = [Row.rate(r.during) for r in rows if r.during[1]]
    after = [Row.rate(r.after) for r in rows if r.after[1]]
    log(f"peak_rss_mb={hwm:.0f} valid_client_success_during={min(during) if during else float('nan'):.3f} "
        f"valid_client_success_after={min(after) if after else float('nan'):.3f} "
        f"recover_s_max={max(r.recover_s for r in rows):.1f} tenants_crossed={a.tenants_crossed}")

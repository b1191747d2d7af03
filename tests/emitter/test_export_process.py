"""The export child process and the failure modes around it: collector absent, pipe full, child crash,
parent SIGKILL / SIGTERM, fork. Real child processes, real OTLP exporters, real receiver."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from export_e2e_support import check_spans, otlp_env, run_ranks, start_rank
from export_otlp_receiver import GrpcReceiver
from export_rank_driver import identity, make_intervals

import otel_straggler_schema as schema
from otel_straggler.config import DEFAULTS
from otel_straggler.export import wire
from otel_straggler.export.process_sink import ProcessSink
from otel_straggler.export.thread_sink import ThreadSink
from otel_straggler.interval import MAX_NAME_BYTES
from otel_straggler.timers import Timers

pytestmark = pytest.mark.slow


@pytest.fixture
def grpc_receiver():
    rcv = GrpcReceiver()
    yield rcv
    rcv.stop()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def use_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def process_sink(job: str, command: list[str] | None = None, **settings) -> ProcessSink:
    """A ProcessSink of rank 0; ``settings`` are ``EmitterConfig`` fields."""
    return ProcessSink(identity(0, 1, job).resource_attributes(), rank=0, job_id=job,
                       config=replace(DEFAULTS, **settings), command=command)


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def assert_never_blocks(durations: list[float]) -> None:
    """No submit waited on the pipe or the network: a blocking pipe write would wait for the stuck child
    (30 s), a blocking export for the exporter's 1 s timeout on every submit. The bounds are generous, so a
    fully loaded machine passes; submit latency itself is measured in bench/emitter_cost.py."""
    assert max(durations) < 5.0, f"worst submit {max(durations):.2f} s"
    assert sum(durations) < 0.25 * len(durations), f"mean submit {sum(durations) / len(durations):.3f} s"


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_collector_absent_never_blocks_and_counts(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    use_env(
        monkeypatch,
        otlp_env(
            f"http://127.0.0.1:{closed_port()}", OTEL_EXPORTER_OTLP_TIMEOUT="1000", OTEL_METRIC_EXPORT_INTERVAL="60000"
        ),
    )
    job = f"absent-{mode}"
    sink = (
        process_sink(job, shutdown_timeout_s=2.0)
        if mode == "process"
        else ThreadSink(identity(0, 1, job).resource_attributes(), rank=0, job_id=job)
    )
    durations, cpu = [], []
    for step in range(200):
        t0, c0 = time.perf_counter(), time.thread_time()
        sink.submit(make_intervals(0, step))
        durations.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    if mode == "process":
        assert_never_blocks(durations)
    else:
        # In-process span building competes for the GIL with the batch processor's worker (Python hands the
        # GIL over every 5 ms), so wall time can exceed 5 ms without any blocking on the network: check
        # the caller's own CPU time, and that the worst wall time is far below the exporter's 1 s timeout.
        assert_never_blocks(cpu)
        assert_never_blocks(durations)
    assert sink.flush(3.0) is False  # nothing could be exported
    deadline = time.monotonic() + 60  # the child reports its counters in a flush ack, late on a loaded machine
    while True:
        counters = sink.child_counters if mode == "process" else sink.counters.snapshot()
        if counters.get("dropped_export_failed", 0) > 0 or time.monotonic() > deadline:
            break
        sink.flush(3.0)
    assert counters.get("dropped_export_failed", 0) > 0
    assert counters.get("spans_exported", 0) == 0
    t0 = time.monotonic()
    sink.shutdown(2.0)
    assert time.monotonic() - t0 < 2.0 + 15  # bounded: unbounded retries would take ~60 s


def test_pipe_full_drops_batches_and_shutdown_kills_stuck_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that never reads: the pipe fills, batches are dropped and counted, nothing blocks."""
    stuck = [sys.executable, "-c", "import sys, time; sys.stdin.readline(); time.sleep(30)"]
    sink = process_sink("stuck", command=stuck, shutdown_timeout_s=1.0)
    durations = []
    for step in range(6000):  # ~3.4 MB of records: beyond any pipe buffer
        t0 = time.perf_counter()
        sink.submit(make_intervals(0, step))
        durations.append(time.perf_counter() - t0)
    assert_never_blocks(durations)
    dropped = sink.counters.get("dropped_pipe_full")
    assert dropped > 0 and dropped % 7 == 0  # whole batches
    pid = sink.child_pid
    t0 = time.monotonic()
    sink.shutdown(1.0)
    assert time.monotonic() - t0 < 1.0 + 15  # bounded: the stuck child would hold it 30 s
    assert sink.counters.get("sidecar_killed") == 1 and wait_gone(pid, 15.0)


def test_child_crash_is_counted_restarted_then_given_up() -> None:
    crashing = [sys.executable, "-c", "import sys; sys.stdin.readline(); sys.exit(3)"]
    sink = process_sink("crash", command=crashing, sidecar_max_restarts=2, sidecar_restart_backoff_s=0.05)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline and sink.counters.get("sidecar_deaths") < 3:
        sink.submit(make_intervals(0, 0))  # must never raise
        time.sleep(0.02)
    c = sink.counters.snapshot()
    assert c["sidecar_deaths"] == 3 and c["sidecar_restarts"] == 2
    assert c["dropped_sidecar_down"] > 0
    before = c["dropped_sidecar_down"]
    sink.submit(make_intervals(0, 1))  # given up: dropped and counted, no new child
    assert sink.counters.get("dropped_sidecar_down") == before + 7 and sink.child_pid is None
    sink.shutdown(1.0)


def test_real_child_killed_restarts_and_exports_again(monkeypatch, grpc_receiver: GrpcReceiver) -> None:
    use_env(monkeypatch, otlp_env(grpc_receiver.endpoint))
    job = f"restart-{uuid.uuid4().hex[:6]}"
    sink = process_sink(job, sidecar_restart_backoff_s=0.05)
    sink.submit(make_intervals(0, 0))
    assert sink.flush(10.0)
    first = sink.child_pid
    os.kill(first, signal.SIGINT)  # ignored: Ctrl-C on the process group must not kill the exporter
    time.sleep(0.2)
    assert not gone(first)
    os.kill(first, signal.SIGKILL)
    assert wait_gone(first, 30.0)
    deadline = time.monotonic() + 30.0
    step = 1
    while time.monotonic() < deadline and (sink.child_pid in (None, first)):
        sink.submit(make_intervals(0, step))
        step += 1
        time.sleep(0.02)
    assert sink.child_pid not in (None, first)
    sink.submit(make_intervals(0, 100))
    assert sink.flush(10.0)
    assert sink.counters.get("sidecar_restarts") == 1 and sink.counters.get("sidecar_deaths") == 1
    names = {(s.name, s.a(schema.ATTR_ITERATION)) for s in grpc_receiver.store.spans() if s.r(schema.RES_JOB_ID) == job}
    assert ("forward-compute", 0) in names and ("forward-compute", 100) in names
    sink.shutdown(2.0)

    def restarts_metric() -> bool:  # the parent's counters travel over the pipe into the new child's metrics
        return any(
            res.get(schema.RES_JOB_ID) == job and name == schema.SM_SIDECAR_RESTARTS and value == 1
            for res, name, _, value in grpc_receiver.store.metric_points()
        )

    assert grpc_receiver.store.wait_for(restarts_metric, 30.0)


def test_a_batch_begun_before_a_child_restart_is_dropped_and_counted(monkeypatch, grpc_receiver: GrpcReceiver) -> None:
    """The readout packs into a frame from ``new_batch`` with the encoder's ids; a child started meanwhile has
    none of them, so ``submit_batch`` drops that frame (counted) and the next one goes out with its names."""
    use_env(monkeypatch, otlp_env(grpc_receiver.endpoint))
    job = f"gen-{uuid.uuid4().hex[:6]}"
    sink = process_sink(job)
    sink.submit(make_intervals(0, 0))
    assert sink.flush(10.0)
    stale = sink.new_batch(64)
    assert stale is not None
    for iv in make_intervals(0, 1):
        assert stale.add(iv)
    sink._encoder.reset()  # what a new child's start does (_spawn)
    sink.submit_batch(stale)
    assert sink.counters.get("dropped_sidecar_down") == stale.count == 7
    fresh = sink.new_batch(64)
    for iv in make_intervals(0, 2):
        fresh.add(iv)
    sink.submit_batch(fresh)
    assert sink.flush(10.0)
    steps = {s.a(schema.ATTR_ITERATION) for s in grpc_receiver.store.spans() if s.r(schema.RES_JOB_ID) == job}
    assert {0, 2} <= steps and 1 not in steps
    sink.shutdown(2.0)


def _ready(proc) -> dict:
    line = proc.stdout.readline()
    assert line, proc.stderr.read()[-3000:]
    return json.loads(line)


def test_parent_sigkill_child_flushes_on_eof(grpc_receiver: GrpcReceiver) -> None:
    job = f"sigkill-{uuid.uuid4().hex[:6]}"
    env = otlp_env(grpc_receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="30000")  # nothing leaves before EOF
    proc = start_rank(env, rank=0, world=1, job_id=job, mode="process", steps=5, scenario="hang")
    info = _ready(proc)
    proc.kill()
    proc.wait(5)
    # The last step is still open in the child and the batch processor holds everything: EOF flushes it all.
    assert grpc_receiver.store.wait_for(
        lambda: len([s for s in grpc_receiver.store.spans() if s.r(schema.RES_JOB_ID) == job]) >= 25, 60.0
    )
    check_spans(grpc_receiver.store, job, 1, 5)
    assert wait_gone(info["child_pid"], 30.0)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_sigterm_handler_flushes_within_bound(grpc_receiver: GrpcReceiver, mode: str) -> None:
    job = f"sigterm-{mode}-{uuid.uuid4().hex[:6]}"
    # nothing leaves on the batch schedule (120 s) before the process is gone: only the handler's flush delivers;
    # its bound is generous (20 s) because a loaded machine needs more than a few seconds to export
    env = otlp_env(grpc_receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="120000")
    proc = start_rank(
        env, rank=0, world=1, job_id=job, mode=mode, steps=4, scenario="lifecycle", shutdown_timeout_s=20.0
    )
    _ready(proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == -signal.SIGTERM  # the default action still ran after the flush
    assert elapsed < 20.0 + 20  # bounded by the shutdown timeout, far below the 120 s batch delay
    check_spans(grpc_receiver.store, job, 1, 4)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_forked_copy_exports_nothing(grpc_receiver: GrpcReceiver, mode: str) -> None:
    job = f"fork-{mode}-{uuid.uuid4().hex[:6]}"
    (res,) = run_ranks(otlp_env(grpc_receiver.endpoint), 1, job_id=job, mode=mode, steps=3, scenario="fork")
    assert res["flush"] is True
    time.sleep(0.5)
    check_spans(grpc_receiver.store, job, 1, 3)  # exact count: steps 3 and 4 of the forked copy never arrive


@pytest.mark.skipif(
    importlib.util.find_spec("otel_straggler.timers") is None,
    reason="otel_straggler.timers (training-thread side) is not in the tree",
)
def test_sigterm_with_real_timers_drains_ring_and_exports(grpc_receiver: GrpcReceiver) -> None:
    """SIGTERM right after the last stop: the handler's Timers.shutdown drains the readout into the sink
    and the export child flushes, within the bound; the default action then ends the process."""
    job = f"sigterm-timers-{uuid.uuid4().hex[:6]}"
    env = otlp_env(grpc_receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="120000")  # only the handler's flush delivers
    proc = start_rank(
        env,
        rank=0,
        world=1,
        job_id=job,
        mode="process",
        steps=3,
        scenario="timers",
        sigterm=True,
        shutdown_timeout_s=20.0,  # generous: a loaded machine needs more than a few seconds to export
    )
    info = _ready(proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert proc.returncode == -signal.SIGTERM and time.monotonic() - t0 < 20.0 + 20  # bounded, below the 120 s delay
    spans = [s for s in grpc_receiver.store.spans() if s.r(schema.RES_JOB_ID) == job]
    for step in range(3):
        names = {s.name for s in spans if s.a(schema.ATTR_ITERATION) == step}
        assert names == {
            schema.SPAN_JOB_STEP,
            schema.SPAN_RANK_STEP,
            "forward-backward",
            "forward-compute",
            "backward-compute",
            "optimizer",
        }
    assert wait_gone(info["child_pid"], 3.0)


@pytest.mark.parametrize("nice", [10, 0])
def test_export_child_lowers_its_own_priority(monkeypatch, grpc_receiver: GrpcReceiver, nice: int) -> None:
    """The export child adds ``export_nice`` to its niceness (yields to training on shared cores); 0 leaves
    it at the parent's. Read from the real child through the OS."""
    use_env(monkeypatch, otlp_env(grpc_receiver.endpoint))
    sink = process_sink(f"nice-{uuid.uuid4().hex[:6]}", export_nice=nice)
    sink.submit(make_intervals(0, 0))
    assert sink.flush(10.0)
    pid = sink.child_pid
    assert pid is not None
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    sink.shutdown(2.0)


BAD_STANDARD = {  # each used to crash the export child inside the SDK, losing all telemetry unseen
    "OTEL_BSP_MAX_QUEUE_SIZE": "0",
    "OTEL_EXPORTER_OTLP_TIMEOUT": "ten",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "ten",
    "OTEL_EXPORTER_OTLP_COMPRESSION": "zstd",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1",
    "OTEL_EXPORTER_OTLP_PROTOCOL": "grcp",
}


def test_bad_standard_settings_are_warned_once_and_the_child_keeps_exporting(grpc_receiver: GrpcReceiver) -> None:
    """Real Timers, the default export child, a real receiver named by the per-signal endpoints (which win over
    the broken general one): every step arrives, each bad variable is warned about once in the training
    process's log and counted in ``faults{where=config_error}``."""
    job = f"badenv-{uuid.uuid4().hex[:6]}"
    env = otlp_env(grpc_receiver.endpoint, **BAD_STANDARD, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=grpc_receiver.endpoint,
                   OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=grpc_receiver.endpoint)
    proc = start_rank(env, rank=0, world=1, job_id=job, mode="process", steps=3, scenario="timers")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    for name in BAD_STANDARD:
        assert sum(f"{name} is invalid" in line for line in err.splitlines()) == 1, (name, err[-3000:])
    assert "Traceback" not in err
    spans = [s for s in grpc_receiver.store.spans() if s.r(schema.RES_JOB_ID) == job]
    assert {s.a(schema.ATTR_ITERATION) for s in spans if s.name == schema.SPAN_RANK_STEP} == {0, 1, 2}

    def config_errors() -> float | None:
        pts = [v for res, name, attrs, v in grpc_receiver.store.metric_points() if res.get(schema.RES_JOB_ID) == job
               and name == schema.SM_FAULTS and attrs.get("where") == "config_error"]
        return pts[-1] if pts else None

    assert grpc_receiver.store.wait_for(lambda: config_errors() == len(BAD_STANDARD), 10.0), config_errors()


def test_a_fatal_error_in_the_child_is_logged_and_counted(monkeypatch, capfd, caplog) -> None:  # type: ignore[no-untyped-def]
    """The real export child dies of an error while starting (a header it cannot read): its traceback reaches
    the shared stderr, the training process logs the death with the error and counts it, restarts it within
    its bound, then gives up, dropping (and counting) what it cannot hand over."""
    use_env(monkeypatch, otlp_env(f"http://127.0.0.1:{closed_port()}"))
    sink = process_sink("fatal", sidecar_max_restarts=1, sidecar_restart_backoff_s=0.05)
    sink._header["otel"] = {"bogus_setting": 1}  # what a broken header looks like to the child
    caplog.set_level("WARNING", logger="otel_straggler.export.process_sink")
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline and sink.counters.get("sidecar_deaths") < 2:
        sink.submit(make_intervals(0, 0))  # must never raise
        time.sleep(0.05)
    c = sink.counters.snapshot()
    assert c["sidecar_deaths"] == 2 and c["sidecar_restarts"] == 1 and c["faults_sidecar_fatal"] == 2
    assert c["dropped_sidecar_down"] > 0
    deaths = [r.getMessage() for r in caplog.records if "export child" in r.getMessage()]
    assert len(deaths) == 2 and all("exited with status 1" in m and "TypeError" in m for m in deaths), deaths
    assert "restarting" in deaths[0] and "giving up" in deaths[1]
    err = capfd.readouterr().err
    assert err.count("otel-straggler export child: fatal error") == 2 and "Traceback" in err
    sink.shutdown(1.0)


def test_a_long_timer_name_does_not_drop_the_batch(monkeypatch, grpc_receiver: GrpcReceiver) -> None:
    """Real Timers, the real export child and receiver: a 256 KiB timer name goes out bounded (interval.py
    ``bound_name``), so the batch that carries its spans is small and every span of every step arrives."""
    use_env(monkeypatch, otlp_env(grpc_receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="30000"))
    job = f"longname-{uuid.uuid4().hex[:6]}"
    sink = process_sink(job)
    timers = Timers(2, "minmax", config=replace(DEFAULTS, enabled=True), sink=sink)
    long = "x" * (256 * 1024)
    for step in range(40):
        timers.set_step(step)
        for name in ("forward-compute", long, "optimizer"):
            timers(name).start()
            timers(name).stop()
    assert timers.flush(20.0)
    timers.shutdown(5.0)
    spans = [s for s in grpc_receiver.store.spans() if s.r(schema.RES_JOB_ID) == job]
    stages = {s.name for s in spans if s.name not in (schema.SPAN_RANK_STEP, schema.SPAN_JOB_STEP)}
    (bounded,) = stages - {"forward-compute", "optimizer"}
    assert bounded.startswith("x" * 200) and len(bounded.encode()) <= MAX_NAME_BYTES
    assert {s.a(schema.ATTR_ITERATION) for s in spans if s.name == schema.SPAN_RANK_STEP} == set(range(40))
    assert timers.counters.names_truncated == 1


def test_a_stream_out_of_frame_ends_the_child_with_its_reason() -> None:
    """A frame longer than the wire allows: the child exports what it decoded, then exits with status 1 and one
    ``X`` line saying why (the training process logs and counts it), not with status 0 and no word."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(otlp_env(f"http://127.0.0.1:{closed_port()}"))
    proc = subprocess.Popen([sys.executable, "-m", "otel_straggler.export.sidecar"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    header = json.dumps({"rank": 0, "job_id": "frame", "config": {"shutdown_timeout_s": 1.0},
                         "parent_pid": os.getpid()})
    out, err = proc.communicate(header.encode() + b"\n" + wire.FRAME.pack(wire.T_NAME, wire.MAX_FRAME + 1), 60)
    assert proc.returncode == 1, err[-2000:]
    (line,) = [ln for ln in out.decode().splitlines() if ln.startswith("X ")]
    assert "out of frame" in json.loads(line[2:])["error"]

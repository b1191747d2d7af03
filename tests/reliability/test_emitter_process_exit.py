"""Trainer process ends (normal exit, SIGTERM, SIGKILL) with the REAL Timers and the default export child:
exit is bounded even when the collector stalls, and a SIGKILL loses at most what the readout had not handed over."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from rel_support import Stalling

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "emitter"))
from export_e2e_support import otlp_env
from export_otlp_receiver import GrpcReceiver

import otel_straggler_schema as schema

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
SHUTDOWN_S = 2.0


def start(endpoint: str, job: str, end: str, steps: int = 20, **extra: object) -> subprocess.Popen[str]:
    env = otlp_env(endpoint, OTEL_BSP_SCHEDULE_DELAY="30000",  # nothing leaves before the end
                   OTEL_METRIC_EXPORT_INTERVAL="60000", OTEL_EXPORTER_OTLP_TIMEOUT="30000")
    args = {"job": job, "steps": steps, "end": end, "shutdown_timeout_s": SHUTDOWN_S, **extra}
    return subprocess.Popen([sys.executable, str(HERE / "trainer_driver.py"), json.dumps(args)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ready(proc: subprocess.Popen[str]) -> dict:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line, proc.stderr.read()[-3000:]  # type: ignore[union-attr]
    return json.loads(line)


def gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state in ("Z", "X"):
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("end", ["exit", "sigterm"])
def test_exit_is_bounded_when_the_collector_stalls(end: str) -> None:
    """The exporter's own timeout is 30 s, yet the trainer and its export child are gone within the configured
    shutdown bound (2 s) plus 3 s of slack: lifecycle waits at most the bound + 1 s, and interpreter teardown
    (torch and megatron are imported) takes up to ~1.7 s on a loaded 2-core runner."""
    stall = Stalling()
    try:
        proc = start(f"http://127.0.0.1:{stall.port}", f"stall-{end}", "exit" if end == "exit" else "wait")
        info = ready(proc)
        t0 = time.monotonic()
        if end == "sigterm":
            proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        elapsed = time.monotonic() - t0
        print(f"{end}: trainer exit {elapsed:.2f} s with a stalled collector")
        assert elapsed < SHUTDOWN_S + 20.0  # bounded: the exporter's own 30 s would exceed it (load slack)
        assert proc.returncode == (0 if end == "exit" else -signal.SIGTERM)
        assert gone(info["child_pid"], SHUTDOWN_S + 20.0)  # the export child does not linger either
    finally:
        stall.stop()


def test_a_second_sigterm_leaves_no_export_child_behind() -> None:
    """SIGTERM twice (a scheduler's, then an impatient user's) while the collector stalls: the first starts the
    bounded shutdown (the child blocks in the flush it asked for), the second ends the trainer under the default
    action. The export child is gone within 5 s of the trainer (``sidecar.ORPHAN_EXIT_S``)."""
    stall = Stalling()
    try:
        proc = start(f"http://127.0.0.1:{stall.port}", "stall-double", "wait", shutdown_timeout_s=5.0)
        info = ready(proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the first shutdown is under way: the child is in its flush
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        assert proc.returncode == -signal.SIGTERM
        assert gone(info["child_pid"], 5.0)
    finally:
        stall.stop()


def test_sigkill_loses_only_what_was_not_handed_over() -> None:
    rcv = GrpcReceiver()
    try:
        job = f"kill-{uuid.uuid4().hex[:6]}"
        proc = start(rcv.endpoint, job, "wait", steps=20)
        info = ready(proc)
        t0 = time.monotonic()
        proc.kill()
        proc.wait(5)

        def steps() -> set[int]:
            return {sp.a(schema.ATTR_ITERATION) for sp in rcv.store.spans()
                    if sp.r(schema.RES_JOB_ID) == job and sp.name == "forward-compute"}

        assert rcv.store.wait_for(lambda: len(steps()) >= 20, 60.0), sorted(steps())
        print(f"sigkill: all {len(steps())} steps delivered {time.monotonic() - t0:.2f} s after the kill")
        assert steps() == set(range(1, 21))
        assert gone(info["child_pid"], SHUTDOWN_S + 30)
    finally:
        rcv.stop()


@pytest.mark.parametrize("end", ["checkpoint", "ignore"])
def test_sigterm_the_program_survives_keeps_telemetry_flowing(end: str) -> None:
    """A trainer that handles SIGTERM itself (checkpoint on signal) or ignores it goes on after the signal: so
    does its export. Steps after the signal arrive, the export child lives on, and the trainer's normal exit
    runs the one bounded shutdown."""
    rcv = GrpcReceiver()
    try:
        job = f"survive-{end}-{uuid.uuid4().hex[:6]}"
        proc = start(rcv.endpoint, job, end, steps=5, more_steps=5)
        info = ready(proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the handler (when there is one) has run
        assert proc.poll() is None and not gone(info["child_pid"], 0.1)
        out, err = proc.communicate("go\n", timeout=30)
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["signals"] == (1 if end == "checkpoint" else 0)

        def steps() -> set[int]:
            return {sp.a(schema.ATTR_ITERATION) for sp in rcv.store.spans()
                    if sp.r(schema.RES_JOB_ID) == job and sp.name == "forward-compute"}

        assert rcv.store.wait_for(lambda: len(steps()) >= 10, 10.0), sorted(steps())
        assert steps() == set(range(1, 11))
        assert gone(info["child_pid"], SHUTDOWN_S + 5)
    finally:
        rcv.stop()

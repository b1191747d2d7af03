"""Export child process: ``python -m otel_straggler.export.sidecar``, one per training process.

stdin: one JSON header line (resource attributes, rank, job id, the ``EmitterConfig``, CPUs to keep off), then
``wire`` frames. stdout: flush acks.
The child aggregates, builds and encodes the SDK spans and runs the OTLP exporters, so none of that
holds the training process's GIL.

A fatal error (anything ``run`` raises) is printed with its traceback on stderr, which the child shares
with the training process, and reported as one ``X {"error": ...}`` line on the ack channel before the child
exits with status 1: the parent logs it and counts it (``process_sink``).

Lifetime: the child exits on EOF of stdin after a flush bounded by ``shutdown_timeout_s`` (the parent
closed the pipe, exited, or was SIGKILLed: what already sat in the pipe is still exported). It ignores
SIGINT/SIGTERM, which a Ctrl-C or a scheduler sends to the whole process group, so the parent's own
shutdown (or its death -> EOF) decides when the child flushes and leaves. Backstop: if the parent pid
goes away without EOF (a forked descendant still holds the pipe), the child runs the same bounded
flush and exits; and whatever it is doing, it exits ``ORPHAN_EXIT_S`` after the parent is gone (a trainer
killed in its own shutdown, by a second SIGTERM, leaves no child behind for longer). A stream out of frame
(a frame over ``wire.MAX_FRAME``) ends the child with status 1 and its reason, after what was decoded is
exported. PR_SET_PDEATHSIG is deliberately not used: it fires when the *thread* that spawned
the child exits (the readout thread), and it would kill the child before it flushed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from typing import Any

from otel_straggler.config import EmitterConfig
from otel_straggler.export import wire
from otel_straggler.export.otel_env import OtelSettings
from otel_straggler.export.pipeline import ExportPipeline

POLL_S = 0.2
PARENT_POLL_S = 0.1
# an export child outlives its training process by at most this (then it exits wherever it is), plus teardown
ORPHAN_EXIT_S = 4.0


def _read_header(fd: int, deadline: float) -> dict[str, Any]:
    buf = bytearray()
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no header")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1)  # byte-wise: the frames after the header stay in the pipe
        if not chunk:
            raise EOFError("no header")
        buf += chunk
    return json.loads(buf.decode())


def _ack(fd: int, seq: int, ok: bool, counters: dict[str, Any]) -> None:
    try:
        os.write(fd, f"F{seq} {1 if ok else 0} {json.dumps(counters, separators=(',', ':'))}\n".encode())
    except OSError:
        pass


def _avoid_cpus(avoid: Any) -> None:
    """Run on the allowed CPUs other than ``avoid`` (the training thread's core), before any thread starts so
    that the exporters' threads inherit it; left as is when nothing would remain or the call fails."""
    try:
        allowed = os.sched_getaffinity(0)
        keep = allowed - {int(c) for c in avoid}
        if keep and keep != allowed:
            os.sched_setaffinity(0, keep)
    except (AttributeError, OSError, TypeError, ValueError):
        pass


def run(in_fd: int, ack_fd: int) -> int:
    header = _read_header(in_fd, time.monotonic() + 30.0)
    config = EmitterConfig.from_dict(header.get("config", {}))
    shutdown_timeout_s = config.shutdown_timeout_s
    parent_pid = int(header.get("parent_pid", os.getppid()))
    nice = config.export_nice
    if nice > 0:
        try:
            os.nice(nice)  # yield to the training processes on shared cores
        except OSError:
            pass
    _avoid_cpus(header.get("avoid_cpus") or ())
    _watch_parent(parent_pid, min(ORPHAN_EXIT_S, shutdown_timeout_s))
    pipeline = ExportPipeline(
        header.get("resource", {}),
        rank=int(header.get("rank", 0)),
        job_id=str(header.get("job_id", "local")),
        config=config,
        otel=OtelSettings.from_dict(header["otel"]) if "otel" in header else None,
    )
    decoder = wire.WireDecoder()
    counters = pipeline.counters
    out_of_frame: Exception | None = None
    while True:
        ready, _, _ = select.select([in_fd], [], [], POLL_S)
        if ready:
            try:
                data = os.read(in_fd, 1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            try:
                messages = decoder.feed(data)
            except Exception as exc:
                counters.add("faults_sidecar_decode")
                out_of_frame = exc
                break  # the stream is out of frame: nothing after this can be trusted
            for kind, value in messages:
                try:
                    if kind == wire.T_INTERVALS:
                        pipeline.add(value)
                    elif kind == wire.T_STATS:
                        pipeline.set_stats(value)
                    elif kind == wire.T_FLUSH:
                        seq, timeout_ms = value
                        ok = pipeline.flush(timeout_ms / 1000.0)
                        _ack(ack_fd, seq, ok, pipeline.export_counters())
                except Exception:
                    counters.add("faults_sidecar")
        try:
            pipeline.tick()
        except Exception:
            counters.add("faults_sidecar")
        if os.getppid() != parent_pid:
            break
    # Leave a little of the bound for process teardown.
    pipeline.shutdown(max(0.1, shutdown_timeout_s * 0.9 - 0.1))
    if out_of_frame is not None:  # what was decoded went out; the rest is lost, and the exit says why
        raise RuntimeError(f"the wire stream from the training process is out of frame ({out_of_frame})")
    return 0


def _watch_parent(parent_pid: int, bound_s: float) -> None:
    """A daemon thread that ends the child ``bound_s`` after the training process is gone, whatever the child is
    doing then (a flush the training process asked for, blocked on a stalled collector, say): a trainer killed in
    the middle of its shutdown (a second SIGTERM) leaves no export child behind for longer than that."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        time.sleep(bound_s)
        try:
            os.write(2, b"otel-straggler export child: the training process is gone; exiting\n")
        finally:
            os._exit(0)

    threading.Thread(target=watch, name="otel-straggler-parent-watch", daemon=True).start()


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    ack_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the ack channel
    code = 1
    try:
        code = run(0, ack_fd)
    except (EOFError, TimeoutError):
        code = 0
    except BaseException as exc:  # a fatal error must reach the training process's log and counters
        _report_fatal(ack_fd, exc)
        code = 1
    finally:
        sys.stderr.flush()
        os._exit(code)  # daemon export threads must not hold the exit past the bound


def _report_fatal(ack_fd: int, exc: BaseException) -> None:
    """The traceback on stderr (the training process's), and one line on the ack channel that the parent
    logs and counts (``faults_sidecar_fatal``) when it sees this child die."""
    try:
        print("otel-straggler export child: fatal error", file=sys.stderr)
        traceback.print_exception(exc, file=sys.stderr)
        line = json.dumps({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        os.write(ack_fd, b"X " + line.encode() + b"\n")
    except Exception:
        pass


if __name__ == "__main__":
    main()

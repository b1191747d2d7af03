"""``ProcessSink``: packs intervals onto a pipe to one export child per training process.

The readout thread packs each interval into a wire frame (``new_batch``: a ``wire.RecordBatch``, filled by the
readout's C drain or one ``struct.pack_into`` per interval; ``submit`` does the same for ``Interval`` objects) and
pays one non-blocking ``write`` per batch (``submit_batch``), which carries the latest stats too
(``publish_stats`` keeps them for the next batch's write, and writes them itself only when no batch went out
since the previous publish); the child (``sidecar``) does aggregation, span
building, encoding and OTLP. Nothing on the readout thread's path releases the GIL: the pipe is written with
``write(2)`` called through ``ctypes.PyDLL`` (``os.write`` releases the GIL, and the training thread would take
it at every write and hand it back), and the child's liveness comes from the write itself (``EPIPE``), not from
polling the child (``waitpid`` releases the GIL too). The child is spawned lazily on the first
``submit``/``publish_stats`` (after torchrun or multiprocessing created the rank, never at import). It runs
niced (``export_nice``) and, with ``export_affinity="auto"``, on the process's allowed CPUs other than the
core the training thread (the thread that built the sink) runs on when the child starts.

Failure handling (all fail open, all counted):
* pipe full -> the batch is dropped (``dropped_pipe_full``); a partially written frame is kept and
  finished first on the next call, so the stream never loses framing;
* child dead (a write fails with ``EPIPE``, or ``flush`` finds it gone) -> ``sidecar_deaths`` and a warning
  with its exit status and the error it reported (an error exit also counts ``faults_sidecar_fatal``; the
  child's traceback is on the shared stderr); restarted up to ``sidecar_max_restarts`` times with exponential
  backoff (``sidecar_restarts``); intervals meanwhile and after are dropped (``dropped_sidecar_down``);
* a forked copy of the process (DataLoader worker) is inert: pid check on every call, and the
  fork hook (``lifecycle``) closes its copy of the pipe so the child still sees EOF when the trainer dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from otel_straggler.config import DEFAULTS, EmitterConfig
from otel_straggler.export import wire
from otel_straggler.export.fork_guard import ForkGuarded
from otel_straggler.export.otel_env import OtelSettings, child_env
from otel_straggler.export.provider import Counters
from otel_straggler.interval import Interval

F_SETPIPE_SZ = 1031  # Linux
PIPE_BYTES = 1 << 20
FATAL_PREFIX = b"X "  # the child's last line on the ack channel when it dies of an error (sidecar.py)

_log = logging.getLogger(__name__)


def _gil_keeping_write() -> Any:
    """``write(2)`` of the C library through ``ctypes.PyDLL`` (the GIL kept during the call; errno kept by
    ctypes), or None where it cannot be had. Only for a non-blocking descriptor: it never waits."""
    try:
        fn = ctypes.PyDLL(None, use_errno=True).write
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    fn.restype = ctypes.c_ssize_t
    return fn


_WRITE = _gil_keeping_write()


def write_nonblocking(fd: int, data: bytes) -> int:
    """``os.write(fd, data)`` for a non-blocking ``fd`` without releasing the GIL: the bytes written; raises
    ``BlockingIOError`` when the pipe is full and ``OSError`` (``BrokenPipeError``: the reader is gone) like
    ``os.write``."""
    if _WRITE is None:
        return os.write(fd, data)
    while True:
        n = int(_WRITE(fd, data, len(data)))
        if n >= 0:
            return n
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err))  # OSError picks the subclass (BlockingIOError, BrokenPipeError)


class ProcessSink(ForkGuarded):
    def __init__(
        self,
        resource_attributes: Mapping[str, Any],
        *,
        rank: int,
        job_id: str,
        config: EmitterConfig = DEFAULTS,
        otel: OtelSettings | None = None,
        counters: Counters | None = None,
        command: Sequence[str] | None = None,
    ) -> None:
        """``config``: the child gets all of it (aggregation, ``shutdown_timeout_s``, ``export_nice``); this
        side uses ``sidecar_max_restarts`` and ``sidecar_restart_backoff_s``. ``otel``: the validated standard
        settings (read from the environment when not given); the child builds its SDK objects from them and
        starts without the variables they came from."""
        self.counters = counters if counters is not None else Counters()
        otel = otel if otel is not None else OtelSettings.from_env()
        self._header = {
            "resource": dict(resource_attributes),
            "rank": int(rank),
            "job_id": str(job_id),
            "config": config.as_dict(),
            "otel": otel.as_dict(),
        }
        self._affinity = config.export_affinity
        # the thread that builds the sink is the training thread (install_megatron/configure run on it)
        self._train_tid = threading.get_native_id()
        self.shutdown_timeout_s = float(config.shutdown_timeout_s)
        self.max_restarts = int(config.sidecar_max_restarts)
        self.restart_backoff_s = float(config.sidecar_restart_backoff_s)
        self._command = list(command) if command else [sys.executable, "-m", "otel_straggler.export.sidecar"]
        self._init_guard()
        self._lock = threading.Lock()  # the pipe: readout thread vs. flush/shutdown caller; never the training thread
        self._ack_lock = threading.Lock()  # the ack channel (flush callers)
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd = -1
        self._ack_buf = bytearray()
        self._pending = b""
        self._encoder = wire.WireEncoder()
        self._starts = 0
        self._next_start = 0.0
        self._stats: dict[str, Any] = {}
        self._stats_sent: dict[str, Any] | None = None
        self._stats_waiting = False  # published stats not yet carried by a batch's write
        self._write_fn = os.write  # _spawn sets write_nonblocking once it made the pipe non-blocking
        self._flush_seq = 0
        self.child_counters: dict[str, int] = {}  # the export child's counters, as of the last flush ack

    # --- child management -----------------------------------------------------------------------
    @property
    def child_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _env(self) -> dict[str, str]:
        env = child_env(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def _avoid_cpus(self) -> list[int]:
        """``affinity="auto"``: the core the training thread runs on now and its SMT siblings, which the child
        keeps off, so that its CPU time never comes out of the training thread's core, wherever the scheduler
        would place it. Empty when unknown or ``affinity="all"``."""
        if self._affinity != "auto":
            return []
        core = _core_of(self._train_tid)
        if core is None:
            return []
        cpus = {core}
        try:
            with open(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list") as f:
                for part in f.read().strip().split(","):
                    lo, _, hi = part.partition("-")
                    cpus.update(range(int(lo), int(hi or lo) + 1))
        except (OSError, ValueError):
            pass
        return sorted(cpus)

    def _spawn(self) -> bool:
        header = dict(self._header, parent_pid=os.getpid(), avoid_cpus=self._avoid_cpus())
        try:
            proc = subprocess.Popen(
                self._command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
                env=self._env(),
            )
        except Exception:
            self.counters.add("faults_sidecar_spawn")
            return False
        assert proc.stdin is not None and proc.stdout is not None
        fd = proc.stdin.fileno()
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
        try:
            os.write(fd, json.dumps(header).encode() + b"\n")  # empty pipe: fits, never blocks
        except OSError:
            self.counters.add("faults_sidecar_spawn")
            proc.kill()
            return False
        os.set_blocking(fd, False)
        os.set_blocking(proc.stdout.fileno(), False)
        # a write that keeps the GIL must never wait: the descriptor is non-blocking from here on
        self._write_fn = write_nonblocking
        self._proc, self._fd = proc, fd
        self._pending = b""
        self._encoder.reset()
        self._stats_sent = None
        self._starts += 1
        if self._starts > 1:
            self.counters.add("sidecar_restarts")
        return True

    def _child_alive(self) -> bool:
        proc = self._proc
        if proc is None:
            return False
        if proc.poll() is None:
            return True
        self._on_child_death()
        return False

    def _on_child_death(self) -> None:
        proc = self._proc
        if proc is None:
            return
        self.counters.add("sidecar_deaths")
        error = self._fatal_report(proc)
        with contextlib.suppress(Exception):
            proc.wait(0.5)  # the pipe saw EOF: the exit status is about to be there
        code = proc.returncode
        if error is not None or code:
            self.counters.add("faults_sidecar_fatal")
        left = self.max_restarts - self._starts + 1
        _log.warning(
            "otel-straggler: export child (pid %d) %s%s; %s",
            proc.pid,
            f"exited with status {code}" if code is not None else "is gone",
            f": {error}" if error else "",
            f"restarting ({left} restart(s) left)" if left > 0 else "giving up: intervals are dropped and counted",
        )
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()
        self._proc, self._fd, self._pending = None, -1, b""
        self._next_start = time.monotonic() + self.restart_backoff_s * (2 ** max(0, self._starts - 1))

    def _fatal_report(self, proc: subprocess.Popen[bytes]) -> str | None:
        """The error the child reported on the ack channel before it died, if this thread can read it now
        (a flush waiting for its ack holds the channel; it is never waited for here)."""
        if proc.stdout is None or not self._ack_lock.acquire(blocking=False):
            return None
        try:
            with contextlib.suppress(OSError, ValueError):
                while chunk := os.read(proc.stdout.fileno(), 1 << 16):
                    self._ack_buf += chunk
            for line in bytes(self._ack_buf).splitlines():
                if line.startswith(FATAL_PREFIX):
                    with contextlib.suppress(ValueError):
                        return str(json.loads(line[len(FATAL_PREFIX):]).get("error", "error"))
            return None
        finally:
            self._ack_buf = bytearray()
            self._ack_lock.release()

    def _ensure_child(self) -> bool:
        """A child to write to: the running one (a dead one shows as ``EPIPE`` on the next write), else a new
        one when the restart budget and backoff allow."""
        if self._proc is not None:
            return True
        if self._starts > self.max_restarts or time.monotonic() < self._next_start:
            return False
        return self._spawn()

    # --- writing ---------------------------------------------------------------------------------
    def _write(self, data: bytes) -> bool:
        """One non-blocking write of what is left of a partly written frame and ``data``; True when ``data``
        was accepted (maybe partially, the remainder kept and written first next time)."""
        pending = self._pending
        buf = pending + data if pending else data
        if not buf:
            return True
        try:
            n = self._write_fn(self._fd, buf)
        except BlockingIOError:
            return False
        except OSError:  # EPIPE: the child is gone
            self._on_child_death()
            return False
        if n < len(pending):  # not even the old frame went out: ``data`` was not accepted
            self._pending = pending[n:]
            return False
        self._pending = buf[n:]
        return True

    # --- IntervalSink (interval.py) ----------------------------------------------------------------------------
    def submit(self, intervals: Sequence[Interval]) -> None:
        if not intervals or not self._usable():
            return
        for start in range(0, len(intervals), wire.MAX_BATCH):
            chunk = intervals[start : start + wire.MAX_BATCH]
            batch = self.new_batch(len(chunk))
            try:
                for iv in chunk:
                    batch.add(iv)
            except Exception:  # a malformed interval: the chunk is dropped, and so are the ids it assigned
                with self._lock:
                    self._encoder.rollback()
                self.counters.add("faults_process_sink")
                continue
            self.submit_batch(batch)

    # --- packed batches (the readout's C drain fills them: readout.py) ----------------------------
    def new_batch(self, capacity: int = wire.MAX_BATCH) -> wire.RecordBatch:
        """An empty frame to pack up to ``capacity`` intervals into, for ``submit_batch`` (a child is started first
        when none runs and one may). Without a child the batch is still packed (in C, as usual) and
        ``submit_batch`` drops it, counted; closed or in another process's copy, a frame of a throwaway encoder,
        which ``submit_batch`` ignores."""
        if not self._usable():
            return wire.WireEncoder().batch(capacity)
        with self._lock:
            if self._closed:
                return wire.WireEncoder().batch(capacity)
            try:
                self._ensure_child()
            except Exception:
                self.counters.add("faults_process_sink")
            return self._encoder.batch(capacity)

    def submit_batch(self, batch: wire.RecordBatch) -> None:
        """Write a batch from ``new_batch`` (with the latest stats); a full pipe, a child gone or restarted since
        the batch began (its ids are the old child's), or a closed sink drops it, counted."""
        n = batch.count
        if batch.dropped:
            self.counters.add("dropped_overflow", batch.dropped)
        if (n == 0 and not batch.names) or not self._usable() or batch.encoder is not self._encoder:
            return
        with self._lock:
            if self._closed:
                return
            try:
                if batch.generation != self._encoder.generation or self._proc is None:
                    self._encoder.rollback()
                    self.counters.add("dropped_sidecar_down", n)
                    return
                data = batch.finish()
                merged = self._merged_stats()
                if merged is not None:
                    data += wire.encode_stats(merged)  # the stats ride in the batch's one write
                if self._write(data):
                    self._encoder.commit()
                    if merged is not None:
                        self._stats_sent = merged
                    self._stats_waiting = False
                else:
                    self._encoder.rollback()
                    key = "dropped_pipe_full" if self._proc is not None else "dropped_sidecar_down"
                    self.counters.add(key, n)
            except Exception:
                self._encoder.rollback()
                self.counters.add("faults_process_sink")

    def publish_stats(self, stats: dict[str, int]) -> None:
        """Keep ``stats`` for the next batch's write; write them now only when the previous stats are still
        waiting (no batch went out since: training is idle or the ring is held), so they are at most one
        publish period late."""
        if not self._usable():
            return
        with self._lock:
            if self._closed:
                return
            try:
                self._stats = dict(stats)
                if self._stats_waiting and self._ensure_child():
                    self._send_stats_locked()
                    self._stats_waiting = False
                else:
                    self._stats_waiting = True
            except Exception:
                self.counters.add("faults_process_sink")

    def _merged_stats(self) -> dict[str, Any] | None:
        """The published stats plus this sink's own counters, None when the child already has them."""
        merged: dict[str, Any] = dict(self._stats)
        for key, value in self.counters.snapshot().items():
            merged[key] = merged.get(key, 0) + value
        return None if merged == self._stats_sent else merged

    def _send_stats_locked(self) -> None:
        merged = self._merged_stats()
        if merged is None or self._proc is None:
            return
        if self._write(wire.encode_stats(merged)):
            self._stats_sent = merged

    def _drain_pending(self, deadline: float) -> bool:
        while self._pending and self._proc is not None:
            if not self._write(b""):
                left = deadline - time.monotonic()
                if left <= 0 or self._proc is None:
                    return False
                select.select([], [self._fd], [], min(left, 0.05))
        return not self._pending

    def _write_until(self, data: bytes, deadline: float) -> bool:
        if not self._drain_pending(deadline):
            return False
        while self._proc is not None:
            if self._write(data):
                return self._drain_pending(deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([], [self._fd], [], min(left, 0.05))
        return False

    def flush(self, timeout_s: float) -> bool:
        """Ask the child to close its open steps and export; wait for its ack. The pipe lock is held only
        to write the request, so the readout thread's ``submit`` keeps going while the child works."""
        if not self._usable():
            return False
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            with self._lock:
                if self._proc is None or not self._child_alive():
                    return False
                self._send_stats_locked()
                self._flush_seq += 1
                seq = self._flush_seq
                child_budget = max(0.0, (deadline - time.monotonic()) * 0.8)
                if not self._write_until(wire.encode_flush(seq, child_budget), deadline):
                    return False
                proc = self._proc
            with self._ack_lock:
                return self._wait_ack(proc, seq, deadline)
        except Exception:
            self.counters.add("faults_process_sink")
            return False

    def _wait_ack(self, proc: subprocess.Popen[bytes] | None, seq: int, deadline: float) -> bool:
        if proc is None or proc.stdout is None or proc.stdout.closed:
            return False
        fd = proc.stdout.fileno()
        want = f"F{seq} ".encode()
        while True:
            while b"\n" in self._ack_buf:
                line, _, rest = bytes(self._ack_buf).partition(b"\n")
                self._ack_buf = bytearray(rest)
                if line.startswith(want):
                    parts = line.split(b" ", 2)
                    if len(parts) == 3:
                        with contextlib.suppress(ValueError):
                            self.child_counters = json.loads(parts[2])
                    return len(parts) >= 2 and parts[1] == b"1"
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except BlockingIOError:
                    continue
                if not chunk:
                    return False
                self._ack_buf += chunk

    def shutdown(self, timeout_s: float) -> None:
        """Hand the final stats to the child, close its stdin (EOF -> it flushes), wait bounded, else kill.
        New submits are refused from the first moment (``_closed``); the wait runs outside the pipe lock."""
        if not self._usable():
            return
        deadline = time.monotonic() + max(0.0, timeout_s)
        self._closed = True
        with self._lock:
            proc = self._proc
            self._proc, self._fd = None, -1
            if proc is None:
                return
            try:
                if proc.poll() is None:
                    self._fd = proc.stdin.fileno() if proc.stdin is not None else -1
                    self._proc = proc
                    self._send_stats_locked()
                    self._drain_pending(deadline - 0.5 * max(0.0, timeout_s))
                    self._proc, self._fd = None, -1
                with contextlib.suppress(Exception):
                    if proc.stdin is not None:
                        proc.stdin.close()
            except Exception:
                self.counters.add("faults_process_sink")
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.counters.add("sidecar_killed")
            proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(timeout=1.0)
        except Exception:
            self.counters.add("faults_process_sink")
        finally:
            with self._ack_lock, contextlib.suppress(Exception):
                if proc.stdout is not None:
                    proc.stdout.close()

    # --- fork --------------------------------------------------------------------------------------
    def after_fork_in_child(self) -> None:
        """In a forked copy of the training process: inert; drop only this copy's reference to the pipe.

        The pipe fds are pointed at /dev/null (not closed) so the copied file objects stay valid, and the
        copied ``Popen`` is kept referenced so its finalizer never waits on a process that is not ours.
        """
        self._inert = True
        proc = self._proc
        if proc is not None:
            _FORKED_LEFTOVERS.append(proc)
            try:
                null = os.open(os.devnull, os.O_RDWR)
            except OSError:
                null = -1
            for stream in (proc.stdin, proc.stdout):
                with contextlib.suppress(Exception):
                    if stream is not None and null >= 0:
                        os.dup2(null, stream.fileno())
            if null >= 0:
                os.close(null)
        self._proc = None
        self._fd = -1
        self._lock = threading.Lock()
        self._ack_lock = threading.Lock()


_FORKED_LEFTOVERS: list[Any] = []


def _core_of(tid: int) -> int | None:
    """The CPU a thread of this process last ran on (``/proc``), None when unknown."""
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None

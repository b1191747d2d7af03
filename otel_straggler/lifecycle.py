"""Process lifecycle: bounded shutdown at exit and on SIGTERM, inert sinks in forked children.

``register(timers, timeout_s)`` installs
* an ``atexit`` hook that calls ``timers.shutdown(timeout_s)`` on a helper thread and waits at most
  ``timeout_s`` + 1 s (any object with ``.shutdown(timeout_s)`` works): the one shutdown, at the real exit;
* a SIGTERM handler that shuts down only when SIGTERM ends the process. Under the default action it runs
  the same bounded shutdown, restores ``SIG_DFL`` and re-raises the signal. When the program has its own
  handler (checkpoint on signal, a flag for the training loop), it flushes what was measured so far
  (``timers.flush(timeout_s)``, bounded the same way) and calls that handler: a program that goes on keeps
  exporting, one that exits gets the atexit shutdown. A SIGTERM the program ignores (``SIG_IGN``) stays
  ignored: nothing is installed, the export goes on. Python only lets the main thread install signal
  handlers: from another thread the SIGTERM part is skipped and counted (``STATE.sigterm_skipped``), the
  atexit part still works.
* ``register_sink_fallback``: every sink from ``export.create_sink`` is also shut down at exit (bounded,
  idempotent) in case no Timers was registered.
* ``os.register_at_fork(after_in_child=...)``: every sink created by ``export.create_sink`` becomes inert in a
  forked child (DataLoader workers), so it neither exports duplicates nor touches the parent's pipe,
  threads or locks.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref
from dataclasses import dataclass
from typing import Any

_sinks: weakref.WeakSet[Any] = weakref.WeakSet()
_fork_hook_installed = False
_lock = threading.Lock()


@dataclass
class LifecycleState:
    registered: int = 0
    sigterm_installed: int = 0
    sigterm_skipped: int = 0
    shutdowns: int = 0
    shutdown_timeouts: int = 0
    shutdown_faults: int = 0
    sigterm_flushes: int = 0
    sigterm_ignored: int = 0  # SIGTERM ignored by the program: no handler installed


STATE = LifecycleState()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    for sink in list(_sinks):
        hook = getattr(sink, "after_fork_in_child", None)
        if hook is not None:
            try:
                hook()
            except Exception:
                pass


def track_sink(sink: Any) -> None:
    """Make ``sink`` inert in forked children."""
    global _fork_hook_installed
    with _lock:
        _sinks.add(sink)
        if not _fork_hook_installed and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook_installed = True


def register_sink_fallback(sink: Any, timeout_s: float) -> None:
    """atexit: shut ``sink`` down (bounded) if nothing did before. Registered at sink creation, so it runs
    after a later ``register(timers)`` hook (atexit is LIFO), which drains the readout into the sink first;
    sink shutdown is idempotent. Without it a thread-mode sink would lose its batch queue at exit."""
    atexit.register(bounded_shutdown, sink, timeout_s)


def bounded_shutdown(target: Any, timeout_s: float) -> bool:
    """``target.shutdown(timeout_s)`` on a daemon helper thread, waited at most ``timeout_s`` + 1 s."""
    STATE.shutdowns += 1
    return _bounded(target.shutdown, timeout_s, "shutdown")


def _bounded(call: Any, timeout_s: float, name: str) -> bool:
    done = threading.Event()

    def run() -> None:
        try:
            call(timeout_s)
        except Exception:
            STATE.shutdown_faults += 1
        finally:
            done.set()

    try:
        threading.Thread(target=run, name=f"otel-straggler-{name}", daemon=True).start()
    except RuntimeError:  # interpreter shutdown: Python 3.12 starts no thread from atexit; the call is bounded itself
        run()
    ok = done.wait(max(0.0, timeout_s) + 1.0)
    if not ok:
        STATE.shutdown_timeouts += 1
    return ok


class Registration:
    """What ``register`` installed; ``unregister`` removes it (tests, re-initialisation)."""

    def __init__(self, timers: Any, timeout_s: float) -> None:
        self._timers = weakref.ref(timers) if _weakrefable(timers) else (lambda t=timers: t)
        self.timeout_s = float(timeout_s)
        self._done = False
        self._prev_handler: Any = None
        self.sigterm_installed = False

    def shutdown_once(self) -> bool:
        if self._done:
            return True
        self._done = True
        timers = self._timers()
        if timers is None:
            return True
        return bounded_shutdown(timers, self.timeout_s)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        prev = self._prev_handler
        if callable(prev):  # the program decides whether this is the end: flush, then its handler
            timers = self._timers()
            flush = getattr(timers, "flush", None) if timers is not None and not self._done else None
            if flush is not None:
                STATE.sigterm_flushes += 1
                _bounded(flush, self.timeout_s, "flush")
            prev(signum, frame)
        elif prev == signal.SIG_IGN:  # installed as ignored after register(): still ignored
            return
        else:  # SIG_DFL or unknown (None: installed from C): terminate as the default would
            self.shutdown_once()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def unregister(self) -> None:
        atexit.unregister(self.shutdown_once)
        if self.sigterm_installed and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev_handler if self._prev_handler is not None else signal.SIG_DFL)
            self.sigterm_installed = False


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
        return True
    except TypeError:
        return False


def register(timers: Any, timeout_s: float) -> Registration:
    reg = Registration(timers, timeout_s)
    atexit.register(reg.shutdown_once)
    STATE.registered += 1
    if threading.current_thread() is threading.main_thread():
        try:
            reg._prev_handler = signal.getsignal(signal.SIGTERM)
            if reg._prev_handler == signal.SIG_IGN:
                STATE.sigterm_ignored += 1  # the process outlives SIGTERM: nothing to do on it
            else:
                signal.signal(signal.SIGTERM, reg._on_sigterm)
                reg.sigterm_installed = True
                STATE.sigterm_installed += 1
        except (ValueError, OSError):
            STATE.sigterm_skipped += 1
    else:
        STATE.sigterm_skipped += 1
    return reg

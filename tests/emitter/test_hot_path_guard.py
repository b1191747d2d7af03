"""The training thread's start/stop path: no device sync, no collective, no I/O, no logging, no lock.

Three guards: a static one over the source of the Python hot functions, one over the C hot path's source
(``_hotpath.c``), and a runtime spy that replaces the
forbidden entry points with raisers on the training thread while the real start/stop path runs many
steps (device side on the fake event backend: CUDA cannot run on the CI machines).
"""

from __future__ import annotations

import ast
import builtins
import gc
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch

import otel_straggler
import otel_straggler._hotpath_py as hot_path_py
from otel_straggler import hot_path
from otel_straggler import timers as timers_mod
from otel_straggler.inject import Injector
from otel_straggler.interval import NullSink

PKG = Path(otel_straggler.__file__).parent
# the checkout's C source (the package may be installed from a wheel, which carries no source)
C_SOURCE = Path(__file__).resolve().parents[2] / "otel_straggler" / "_hotpath.c"

# (module file, qualified function names on the hot path; "*" = every function in the module)
HOT = {
    "_hotpath_py.py": ["TimerCore.start", "TimerCore.stop", "TimersCore.__call__", "_same_stream", "Ring.__init__",
                       "Ring.__len__", "SharedEvent.recorded"],  # SharedEvent.recorded: the event to reuse
    "timers.py": ["Timers._get"],
    "step_context.py": ["*"],
    "ring.py": ["*"],
    "inject.py": ["Injector.apply"],
    "event_pool.py": ["driver_recorder.record"],  # pool.record: the driver's cuEventRecord through ctypes
}
# calls the start/stop path is allowed to make, by attribute or function name
ALLOWED_CALLS = {
    "AssertionError",  # Megatron's misuse errors (a start of a started timer, a stop of a stopped one)
    "OverflowError",  # set_step: a step or workload beyond the record's 64 bits
    "_clock",
    "popleft",
    "record",
    "_record",  # the pool's record (driver or torch)
    "fn",  # cuEventRecord (ctypes)
    "raw_stream",  # torch._C._cuda_getCurrentRawStream: the current stream's raw handle
    "stream_of",  # the same through functools.partial (the pool's ``stream``; a reused event's stream check)
    "_same_stream",  # that check, False when the lookup raises
    "recorded",  # SharedEvent.recorded: the new record becomes the one later boundaries may reuse
    "append",
    "extend",  # the ring-full branch hands its events to the orphans in one call
    "_abandon",  # a start/stop the program's exception (KeyboardInterrupt) interrupted lets go of its events
    "bound_name",  # first lookup of a name only: its bounded str for the wire
    "apply",
    "step_timer_started",
    "len",
    "_apply",
    "_opt_int",
    "int",
    "bool",
    "max",
    "_pow2",
    "_pack",  # the stop's one write: its record into the ring's bytes (RECORD.pack_into)
    "_storage",  # Ring.__init__: the ring's bytes, made once at install
    "_get",  # TimersCore.__call__: a name it does not answer goes to Timers._get
    "bytearray",
    "array",
    "Record",  # record_at (tests, debugging): a record's fields
    "unpack_from",
    "range",
    "sleep",
    "_gpu_fn",
    "list",
    "get",  # dict.get in the name lookup
    "Timer",  # first lookup of a name only: creates its Timer
    # adaptive device sampling, once per step change: one clock read, the ring's head, arithmetic
    "_adapt",
    "perf_counter",
    "_intervals",
    "_records",  # the timers' record count (once per step change)
    "ceil",
    "sqrt",
    "min",
    "float",
    "getattr",
}
FORBIDDEN = {
    "synchronize",
    "item",
    "tolist",
    "cpu",
    "barrier",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "send",
    "recv",
    "isend",
    "irecv",
    "gather",
    "scatter",
    "print",
    "open",
    "socket",
    "write",
    "flush",
    "info",
    "debug",
    "warning",
    "error",
    "exception",
    "log",
    "acquire",
    "wait",
    "set",
    "put",
    "submit",
    "publish_stats",
}


def _functions(tree: ast.Module, wanted: list[str]):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and ("*" in wanted or node.name in wanted):
            yield node.name, node
        if isinstance(node, ast.FunctionDef):  # closures a factory returns
            for item in node.body:
                q = f"{node.name}.{item.name}" if isinstance(item, ast.FunctionDef) else None
                if q and q in wanted:
                    yield q, item
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                q = f"{node.name}.{item.name}" if isinstance(item, ast.FunctionDef) else None
                if q and ("*" in wanted or q in wanted):
                    yield q, item


def _call_name(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        return f.id
    return "?"


def test_static_guard_over_hot_functions() -> None:
    seen = []
    for fname, wanted in HOT.items():
        tree = ast.parse((PKG / fname).read_text())
        for qual, fn in _functions(tree, wanted):
            seen.append(qual)
            for node in ast.walk(fn):
                assert not isinstance(node, (ast.Import, ast.ImportFrom)), f"{fname}:{qual} imports"
                assert not isinstance(node, (ast.With, ast.AsyncWith)), f"{fname}:{qual} uses a context manager/lock"
                if isinstance(node, ast.Name):
                    assert node.id not in {"torch", "logging", "_log", "socket", "print", "open"}, f"{fname}:{qual}"
                if isinstance(node, ast.Call):
                    name = _call_name(node)
                    assert name not in FORBIDDEN, f"{fname}:{qual} calls {name}"
                    if fname != "inject.py":
                        assert name in ALLOWED_CALLS, f"{fname}:{qual} calls {name} (not on the allow-list)"
    assert {"TimerCore.start", "TimerCore.stop", "TimersCore.__call__", "Timers._get", "StepContext.set_step",
            "Injector.apply", "driver_recorder.record", "SharedEvent.recorded"} <= set(seen)


# The C hot path (_hotpath.c): the only functions outside the Python C API it may call, and words that must not
# appear in it at all (a sync, a lock, I/O, a thread switch). Its calls into Python objects go through the API and
# meet the runtime spy below like the Python path's.
C_LIBC_CALLS = {"__builtin_add_overflow", "_Static_assert", "clock_gettime", "memcpy", "memset", "offsetof", "sizeof"}
C_FORBIDDEN = re.compile(
    r"Synchronize|synchronize|pthread_|sem_|mutex|Py_BEGIN_ALLOW_THREADS|PyEval_SaveThread|PyGILState|printf|"
    r"fopen|fwrite|\bwrite\(|\bread\(|socket|malloc|calloc|realloc|PyMem_|sleep|PyErr_Print|PySys_Write"
)


C_READOUT_PART = "/* ---- the readout's driver calls"  # from here on: functions the readout thread calls


def test_static_guard_over_the_c_hot_path() -> None:
    src = C_SOURCE.read_text()
    training, marker, readout = src.partition(C_READOUT_PART)
    assert marker and "Timer_start" in training and "Timer_stop" in training and "Timer_" not in readout
    code = re.sub(r"/\*.*?\*/", "", src, flags=re.S)  # comments may name what the code must not do
    code = re.sub(r'"(?:[^"\\]|\\.)*"', '""', code)  # nor may strings
    hot = re.sub(r'"(?:[^"\\]|\\.)*"', '""', re.sub(r"/\*.*?\*/", "", training, flags=re.S))
    assert not C_FORBIDDEN.findall(hot), C_FORBIDDEN.findall(hot)
    # the readout's part may release the GIL around the batch's driver calls, and nothing else on the list: the
    # per-slot calls (event_elapsed, event_query) keep it, like the training thread's record
    rest = set(C_FORBIDDEN.findall(code)) - {"Py_BEGIN_ALLOW_THREADS"}
    assert not rest, rest
    batch = code[code.index("static PyObject *elapsed_batch("):]
    batch = batch[:batch.index("\n}\n")]
    assert code.count("Py_BEGIN_ALLOW_THREADS") == batch.count("Py_BEGIN_ALLOW_THREADS") == 1
    called = set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", code))
    keywords = {"if", "for", "while", "return", "sizeof", "switch", "defined", "int", "void"}  # and casts
    own = set(re.findall(r"^static [^;{]*?\b(\w+)\s*\(", code, flags=re.M)) | {"PyInit__hotpath"}
    macros = set(re.findall(r"^#define\s+(\w+)", code, flags=re.M))
    foreign = {n for n in called - keywords - own - macros - C_LIBC_CALLS
               if not n.startswith(("Py", "PY"))
               and n not in {"cu_event_record_fn", "uintptr_t", "tp_alloc", "tp_free"}}
    assert foreign == set(), foreign  # anything else is a call the guard has not vetted


def test_the_c_hot_path_uses_the_public_c_api_only() -> None:
    """No private CPython name (``_Py*``: ``_PyType_Lookup``, say) and no reach into another type's internals (a
    member descriptor's offset, a type's version tag, its MRO or dict), so a CPython release cannot break it
    silently; the objects it writes through memory are its own types' C fields and buffers it holds."""
    code = re.sub(r"/\*.*?\*/", "", C_SOURCE.read_text(), flags=re.S)
    code = re.sub(r'"(?:[^"\\]|\\.)*"', '""', code)  # strings name the Python classes
    private = sorted(set(re.findall(r"\b_Py\w+", code)))
    assert private == [], private
    internals = re.findall(r"tp_version_tag|PyMemberDescrObject|d_member|tp_mro|tp_dict\b|Py_TPFLAGS_VALID_VERSION_TAG|"
                           r"ob_item|ob_refcnt|->ob_type", code)
    assert internals == [], internals


def _can_compile() -> bool:
    return (shutil.which("cc") or shutil.which("gcc")) is not None and (
        Path(sysconfig.get_paths()["include"]) / "Python.h").exists()


def test_the_chosen_hot_path_is_the_one_tested() -> None:
    """The C hot path is built wherever the package installs with a C compiler and the Python headers (setup.py)
    and runs unless ``OTEL_STRAGGLER_HOT_PATH=python`` asks for the Python one; scripts/test runs the emitter
    tests on both."""
    if os.environ.get(hot_path.ENV, "auto") == "python":
        assert hot_path.core is None and hot_path.NAME == "python"
        assert timers_mod.TimerCore is hot_path_py.TimerCore
    elif hot_path.core is None and hot_path.REASON == "not built" and not (PKG / "_hotpath.c").exists():
        # installed from the pure wheel (scripts/test runs the emitter tests so): nothing was built, the Python
        # hot path runs
        assert hot_path.NAME == "python" and timers_mod.TimerCore is hot_path_py.TimerCore
    elif hot_path.core is None and not _can_compile():
        pytest.skip(f"no C compiler or Python headers here: the Python hot path runs ({hot_path.REASON})")
    else:
        assert hot_path.NAME == "native", f"the C hot path is not in use: {hot_path.REASON}"
        assert timers_mod.TimerCore is hot_path.core.TimerCore


def _choice_in_a_fresh_process(env: str | None, prelude: str = "pass") -> tuple[str, str]:
    """``hot_path.NAME REASON`` as a new process sees it, and its log (warnings)."""
    code = (f"import logging, sys, types; logging.basicConfig(level=logging.WARNING); {prelude}; "
            "from otel_straggler import hot_path; print(hot_path.NAME, hot_path.REASON)")
    environ = {k: v for k, v in os.environ.items() if k != hot_path.ENV}
    if env is not None:
        environ[hot_path.ENV] = env
    p = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip(), p.stderr


def test_the_python_path_runs_where_the_c_one_cannot_load() -> None:
    """Fail open: not built (an import that fails), or a module that loads but cannot be set up (one built from
    other sources), leaves the Python path running; asked for by name, the C path's absence is a warning."""
    out, log = _choice_in_a_fresh_process("python")
    assert out == f"python {hot_path.ENV}=python" and log == ""
    out, log = _choice_in_a_fresh_process("native", "sys.modules['otel_straggler._hotpath'] = None")
    assert out == "python not built" and "the C hot path is not built" in log and "circular" not in log
    out, log = _choice_in_a_fresh_process(None, "sys.modules['otel_straggler._hotpath'] = None")
    assert out == "python not built" and log == ""  # auto: the Python path without a word
    stale = "sys.modules['otel_straggler._hotpath'] = types.ModuleType('otel_straggler._hotpath')"
    out, log = _choice_in_a_fresh_process(None, stale)
    assert out == "python failed to load: AttributeError" and "failed to load" in log
    auto, _ = _choice_in_a_fresh_process(None)
    out, log = _choice_in_a_fresh_process("fast")
    assert out == auto and "is not one of auto, native, python; using auto" in log


def test_static_guard_catches_a_violation() -> None:
    bad = textwrap.dedent(
        """
        class Timer:
            def stop(self):
                torch.cuda.synchronize()
        """
    )
    tree = ast.parse(bad)
    calls = [
        _call_name(n) for _, fn in _functions(tree, ["Timer.stop"]) for n in ast.walk(fn) if isinstance(n, ast.Call)
    ]
    assert "synchronize" in calls and FORBIDDEN & set(calls)


class _Spy:
    def __init__(self, training: threading.Thread) -> None:
        self.training = training
        self.calls: list[str] = []

    def wrap(self, name: str, real):
        def spy(*a, **k):
            if threading.current_thread() is self.training:
                self.calls.append(name)
                raise AssertionError(f"forbidden call on the training thread: {name}")
            return real(*a, **k)

        return spy


# every boundary records / adjacent ones reuse events / and one repeat per step records (device_repeats)
@pytest.mark.parametrize(("gap_us", "repeats"), [(0.0, "all"), (10_000.0, "all"), (10_000.0, "middle")])
def test_runtime_spy_zero_forbidden_calls(make_timers, sink, device, monkeypatch: pytest.MonkeyPatch,
                                          gap_us: float, repeats: str) -> None:
    inj = Injector("batch-generator", host_ms=0.01, from_step=5, until_step=6)
    t = make_timers(start_readout=True, ring_size=8192, pool_size=64, device_every=2, injector=inj,
                    share_gap_us=gap_us, device_repeats=repeats)
    spy = _Spy(threading.current_thread())
    targets = [
        (torch.cuda, "synchronize"),
        (torch.distributed, "barrier"),
        (torch.distributed, "all_reduce"),
        (torch.distributed, "all_gather"),
        (torch.distributed, "all_gather_into_tensor"),
        (torch.distributed, "broadcast"),
        (torch.distributed, "reduce_scatter_tensor"),
        (torch.distributed, "send"),
        (torch.distributed, "recv"),
        (torch.Tensor, "item"),
        (torch.Tensor, "tolist"),
        (socket, "socket"),
        (builtins, "open"),
        (builtins, "print"),
        (logging.Logger, "_log"),
        (logging.Logger, "isEnabledFor"),  # every logger call asks this first, even at a disabled level
        (threading.Event, "set"),
        (threading.Condition, "wait"),
    ]
    for obj, attr in targets:
        monkeypatch.setattr(obj, attr, spy.wrap(f"{getattr(obj, '__name__', obj)}.{attr}", getattr(obj, attr)))
    for s in range(300):
        t.set_step(s, tokens=1000)
        fb = t("forward-backward", 1)
        fb.start(barrier=True)
        for _ in range(4):
            t("forward-compute").start()
            t("batch-generator").start()
            t("batch-generator").stop()
            device.work(0.2)
            t("forward-compute").stop()
            t("backward-compute").start()
            device.work(0.4)
            t("backward-compute").stop()
        fb.stop(barrier=True)
        t("optimizer", 1).start()
        t("optimizer").stop()
    monkeypatch.undo()
    assert spy.calls == []
    assert t.counters.faults_training == 0
    assert t.flush(3.0)
    n = 300 * (1 + 4 * 3 + 1)
    assert len(sink.intervals) + t.counters.dropped_ring_full == n
    assert len(sink.intervals) > 0
    assert sum(iv.injected for iv in sink.intervals) == 8


@pytest.mark.parametrize(("gap_us", "repeats"), [(0.0, "all"), (10_000.0, "all"), (10_000.0, "middle")])
def test_steady_state_start_stop_allocates_nothing_that_grows(make_timers, device, gap_us: float,
                                                              repeats: str) -> None:
    class Null(NullSink):
        def submit(self, b):
            pass

        def publish_stats(self, s):
            pass

        def flush(self, t):
            return True

        def shutdown(self, t):
            pass

    t = make_timers(ring_size=256, sink_=Null(), share_gap_us=gap_us, device_repeats=repeats)
    x = t("forward-compute")

    def cycle(n: int) -> None:
        for _ in range(n):
            x.start()
            x.stop()
        t.readout.drain()

    for _ in range(20):
        cycle(200)  # wrap the ring a few times: every slot already holds an int
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(100):
            t.set_step(0)
            for _ in range(200):
                x.start()
                x.stop()
            # drain outside the measured path allocates Intervals; they are dropped right away
            t.readout.drain()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, grown
    assert type(x).start is timers_mod.TimerCore.start  # the chosen implementation's, not a wrapper

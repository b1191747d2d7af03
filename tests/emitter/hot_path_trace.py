"""Random sequences of timer operations, and the emitter's whole state after each: the differential test of the
two hot paths (``test_hot_path_parity.py`` runs this file once per implementation and compares the outputs).

Usage: ``OTEL_STRAGGLER_HOT_PATH=native|python python hot_path_trace.py FIRST_SEED SEEDS OPS``; prints one JSON
object per seed. The operations: nested and unbalanced start/stop (some with a barrier), reset, elapsed,
set_elapsed, set_step, the host clock advancing (fake, across the reuse gap), device work, completion, stream
switches, record and stream-lookup failures, query failures, an injector and readout drains, on fake CUDA events
(``fake_cuda.py``), small pools and rings (exhausted, full). The state: every timer's fields, the shared event's,
the ring's indices and its unread records byte for byte, the free list and orphans in order with their tags, each
event's refs, tag and taint, the counters, the quarantine and the step fields.
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_cuda import FakeDevice
from recording_sink import RecordingSink

import otel_straggler._hotpath_py as hot_path_py
import otel_straggler.readout as readout_mod
import otel_straggler.timers as timers_mod
from otel_straggler import hot_path
from otel_straggler.config import EmitterConfig
from otel_straggler.event_pool import EventPool
from otel_straggler.ring import RECORD

WALL_OFFSET = 1_700_000_000_000_000_000


class FrameSink(RecordingSink):
    """Keeps the bytes of every frame the readout hands over, before decoding them."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[bytes] = []

    def submit_batch(self, batch: Any) -> None:
        self.frames.append(bytes(batch.finish()))
        super().submit_batch(batch)


# Deliberate mistakes, one of which a run applies to the Python implementation (``PARITY_MUTANT=<name>``): the
# parity test must see every one of them (test_hot_path_parity.py). (module, function, text, replacement)
MUTANTS = {
    "skipped_counter": ("_hotpath_py", "TimerCore.stop", "self._c.dropped_ring_full += 1", "pass"),
    "duration_off_by_one": ("_hotpath_py", "TimerCore.stop", "self._t0, now, w[0]", "self._t0, now + 1, w[0]"),
    "wrong_flag_bit": ("_hotpath_py", "TimerCore.stop", "injected = F_INJECTED", "injected = F_INJECTED << 1"),
    "repeat_pick": ("_hotpath_py", "TimerCore.start", "self._pick = pick = nxt >> 1", "self._pick = pick = nxt"),
    "reuse_gap_inclusive": ("_hotpath_py", "TimerCore.start", "t - sh.ns < sh.gap_ns", "t - sh.ns <= sh.gap_ns"),
}


def apply_mutant(name: str) -> None:
    """Replace one function of the Python implementation with its source mutated by ``MUTANTS[name]``."""
    import importlib
    import inspect
    import textwrap

    module_name, qualname, old, new = MUTANTS[name]
    module = importlib.import_module(f"otel_straggler.{module_name}")
    owner_name, func_name = qualname.split(".")
    owner = getattr(module, owner_name)
    src = textwrap.dedent(inspect.getsource(getattr(owner, func_name)))
    assert src.count(old) == 1, (name, old)
    ns: dict[str, Any] = {}
    exec(compile(src.replace(old, new), f"<mutant {name}>", "exec"), module.__dict__, ns)
    setattr(owner, func_name, ns[func_name])


def misuse(call: Any) -> str | None:
    """Run ``call``; the message of the AssertionError it raised (a start of a started timer, a stop of a stopped
    one: Megatron's misuse errors), else None."""
    try:
        call()
    except AssertionError as exc:
        return str(exc)
    return None


def trace(seed: int, n_ops: int) -> dict[str, Any]:
    """The state after each of ``n_ops`` random operations drawn from ``seed``, and the intervals shipped."""
    rng = random.Random(seed)

    class Clock:
        ns = 1_000_000_000

        def __call__(self) -> int:
            return self.ns

    clock = Clock()
    timers_mod._clock = hot_path_py._clock = clock
    readout_mod._clock = clock

    dev = FakeDevice(auto_complete=rng.random() < 0.5)
    flags = {"stream_raise": False}

    def stream_of() -> Any:
        if flags["stream_raise"]:
            raise RuntimeError("stream lookup failed")
        return dev.stream

    class Inj:
        stage = "forward-compute"

        def apply(self, step: int) -> bool:
            clock.ns += 7
            return step % 3 == 0

    sink = FrameSink()
    pool_size = rng.choice([2, 3, 5, 8, 32])
    ring_size = rng.choice([1, 2, 4, 16, 64])
    cfg = EmitterConfig(enabled=True, device_every=rng.choice([1, 1, 2, 3]), pool_size=pool_size,
                        ring_size=ring_size, share_gap_us=rng.choice([0.0, 50.0, 50.0, 1000.0]),
                        device_repeats=rng.choice(["all", "middle"]), readout_timeout_s=1e9)
    pool = EventPool(pool_size, dev.factory, synchronize=None,
                     stream=stream_of if rng.random() < 0.8 else None)
    t = timers_mod.Timers(2, "minmax", config=cfg, pool=pool, sink=sink, injector=Inj())
    t.readout._wall_offset = WALL_OFFSET  # the frames' times: the same on both runs
    # Megatron's names and levels of any kind: a long name (truncated on the wire), a tuple, a fractional level
    t("x" * 300, 1)
    t(("embedding", 0), 1.5)
    names = ["forward-backward", "forward-compute", "backward-compute", "optimizer", "all-grads-sync", "x" * 300,
             ("embedding", 0)]
    states: list[dict[str, Any]] = []
    tb = pool.table

    def snap(op: tuple) -> None:
        c = t.counters
        tm = {}
        for n, x in t._timers.items():
            tm[str(n)] = [x._started, x._t0, x._elapsed_ns, x._active_ns, x._rep_step, x._rep, x._pick, x._sstep,
                          x._starts, x._reason, x._sev, x._elapsed_base, x._id, x.collective]
        sh = t.share
        r = t.ring
        evs = [[tb.refs[i], tb.tag[i], tb.tainted[i], e.records, e.recorded_at] for i, e in enumerate(dev.events)]
        unread = b"".join(bytes(r.buf[(i & r.mask) * RECORD.size:((i & r.mask) + 1) * RECORD.size])
                          for i in range(r.tail, r.head))
        states.append({
            "op": op,
            "c": c.snapshot(),
            "deg": dict(c.degraded),
            "t": tm,
            "sh": [sh.ev, sh.ns, sh.at_stop, sh.records, sh.stream, sh.gap_ns],
            "ring": [r.head, r.tail],
            "free": list(pool.free),
            "orph": [[e, tb.tag[e]] for e in pool.orphans],
            "q": [list(g) for g in t.readout.quarantine],
            "ctx": [t.ctx.step, list(t.ctx.binding), list(t.ctx.wire), t.ctx.device_on, t.ctx.host_code],
            "evs": evs,
            "records": unread.hex(),
            "pre": [None if v != v else v for v in (r.pre[i & r.mask] for i in range(r.tail, r.head))],
        })

    step = 0
    stack = []
    transient = 0
    for k in range(n_ops):
        if transient and transient < k:
            dev.raise_on_record = False
            flags["stream_raise"] = False
            transient = 0
        r = rng.random()
        name = rng.choice(names)
        if r < 0.60 and rng.random() < 0.7:  # mostly balanced nesting
            if stack and (r >= 0.30 or len(stack) >= 3):
                name = stack.pop()
                r = 0.45
            else:
                free_names = [n for n in names if n not in stack]
                if free_names:
                    name = rng.choice(free_names)
                    stack.append(name)
                r = 0.1
        x = t(name)
        if r < 0.30:
            b = rng.random() < 0.1
            kw = rng.random() < 0.5
            call = functools.partial(x.start, barrier=b) if kw else (functools.partial(x.start, b) if b else x.start)
            op = ("start", name, b, misuse(call))
        elif r < 0.60:
            b = rng.random() < 0.1
            op = ("stop", name, b, misuse(functools.partial(x.stop, barrier=b) if b else x.stop))
        elif r < 0.63:
            x.reset()
            op = ("reset", name)
        elif r < 0.66:
            v = x.elapsed(reset=rng.random() < 0.5)
            op = ("elapsed", name, v)
        elif r < 0.67:
            x.set_elapsed(rng.random())
            op = ("set_elapsed", name)
        elif r < 0.72:
            step += rng.choice([0, 1, 1, 1, 2])
            t.set_step(step, rng.choice([None, 100]), None, rng.choice([None, 4]))
            op = ("set_step", step)
        elif r < 0.84:
            d = rng.choice([1, 10, 30, 30, 30, 49_000, 50_000, 60_000, 2_000_000])  # 50_000: the reuse gap exactly
            clock.ns += d
            op = ("clock", d)
        elif r < 0.88:
            dev.work(rng.choice([0.5, 1.0, 2.0]))
            op = ("work",)
        elif r < 0.90:
            dev.complete_all()
            op = ("complete",)
        elif r < 0.92:
            dev.stream = rng.choice([None, 1, 2])
            op = ("stream", dev.stream)
        elif r < 0.93:
            dev.raise_on_record = not dev.raise_on_record
            transient = k + 1
            op = ("raise_rec", dev.raise_on_record)
        elif r < 0.94:
            flags["stream_raise"] = not flags["stream_raise"]
            transient = k + 1
            op = ("raise_stream", flags["stream_raise"])
        elif r < 0.945:
            dev.raise_on_query = not dev.raise_on_query
            op = ("raise_query", dev.raise_on_query)
        else:
            t.readout.drain()
            op = ("drain",)
        snap(op)
    dev.raise_on_record = dev.raise_on_query = False
    flags["stream_raise"] = False
    dev.complete_all()
    t.readout.drain()
    t.shutdown(1.0)
    snap(("shutdown",))
    off = t.readout._wall_offset
    ivs = [[iv.name, iv.step, iv.repeat, iv.host_start_ns - off, iv.host_end_ns - off, iv.device_ms, iv.degraded,
            iv.tokens, iv.microbatches, iv.injected] for iv in sink.intervals]
    return {"impl": hot_path.NAME, "trace": states, "intervals": ivs, "frames": b"".join(sink.frames).hex(),
            "counters": t.counters.snapshot(),
            "cfg": [pool_size, ring_size, cfg.device_every, cfg.share_gap_us, cfg.device_repeats]}


def main(argv: list[str]) -> int:
    first, seeds, ops = (int(a) for a in argv[:3])
    mutant = os.environ.get("PARITY_MUTANT")
    if mutant:
        apply_mutant(mutant)
    for seed in range(first, first + seeds):
        print(json.dumps(trace(seed, ops), default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

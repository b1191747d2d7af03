"""GIL time the readout thread takes per interval, on CPU: its drain and the export side's packing.

Every microsecond the readout thread holds the GIL is taken from a launch-bound training thread once per
interval (``bench/results/gpu-h200.md`` section 3). This bench times ``Readout.drain`` into the process sink's wire
format over a readout period of steps in Megatron's timer order (``megatron_step``: 21 intervals, 4 microbatches),
through the real ``Timers`` and ring, without the CUDA driver (CPU machines), two ways side by side:

* ``objects``: the drain reads each record in Python and ``RecordBatch.put`` packs it (``PyRecordBatch``): the path
  without the C module;
* ``packed``: the drain packs the records straight into the frame (``RecordBatch.pack_records``, the C module),
  the records it leaves to readout.py through ``RecordBatch.put``.

Two samplings: ``device`` (device time on every step, the default repeat sampling) and ``host`` (host-only steps,
what most steps are with the default ``device_every``). The events are ``tests/emitter/fake_cuda.py``'s; their
device times are read into the ring's ``pre`` before each timed drain (what ``elapsed_many``, the batch driver read with
the GIL released, does on CUDA), so neither arm pays the fake ``elapsed_time``. Arms alternate drain by drain;
medians and means over ``--reps`` drains of ``--steps`` steps each.

Usage: ``python bench/readout_cost.py`` (last line: ``objects_device_us=<x> packed_device_us=<y>
objects_host_us=<z> packed_host_us=<w>``, us per interval, means).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "emitter"))

from fake_cuda import FakeDevice  # noqa: E402

from otel_straggler.config import EmitterConfig  # noqa: E402
from otel_straggler.event_pool import EventPool  # noqa: E402
from otel_straggler.export.wire import RecordBatch, WireEncoder  # noqa: E402
from otel_straggler.interval import NullSink  # noqa: E402
from otel_straggler.ring import NO_EVENT, record_at  # noqa: E402
from otel_straggler.timers import Timers  # noqa: E402
from otel_straggler_schema.stages import OPTIMIZER_TIMERS  # noqa: E402


def megatron_step(t: Any, step: int, work: Callable[[], Any], microbatches: int = 4) -> None:
    """Megatron's timer order for one step without pipelining (21 intervals with 4 microbatches): forward-backward
    holds per microbatch forward-compute (holding batch-generator) and backward-compute, then all-grads-sync;
    optimizer holds its stages. ``work()`` runs inside every innermost interval (GPU work, or the fake device's)."""
    t.set_step(step)
    t("forward-backward", 1).start()
    for _ in range(microbatches):
        t("forward-compute", 2).start()
        t("batch-generator", 2).start()
        work()
        t("batch-generator").stop()
        work()
        t("forward-compute").stop()
        t("backward-compute", 2).start()
        work()
        t("backward-compute").stop()
    t("all-grads-sync", 1).start()
    work()
    t("all-grads-sync").stop()
    t("forward-backward").stop()
    t("optimizer", 1).start()
    for name in OPTIMIZER_TIMERS:
        t(name, 1).start()
        work()
        t(name).stop()
    t("optimizer").stop()


class ObjectSink(NullSink):
    """The readout's Python drain: each slot read into an ``Interval`` packed by ``RecordBatch.add``, without the
    pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = WireEncoder()
        self.bytes = 0

    def new_batch(self, capacity: int) -> RecordBatch:
        return self.encoder.batch(capacity, native=False)

    def submit_batch(self, batch: RecordBatch) -> None:
        self.bytes += len(batch.finish())
        self.encoder.commit()


class PackedSink(ObjectSink):
    """The process sink's packed batches (the C drain where it runs), without the pipe."""

    def new_batch(self, capacity: int) -> RecordBatch:
        return self.encoder.batch(capacity)

    def submit_batch(self, batch: RecordBatch) -> None:
        self.bytes += len(batch.finish())
        self.encoder.commit()


def read_device_times(t: Timers) -> None:
    """What ``elapsed_many`` does before a drain on CUDA: each pending device-timed slot's ms into its ``pre``."""
    r = t.ring
    events = t.pool.events
    for i in range(r.tail, r.head):
        rec = record_at(r, i)
        if rec.start_ev != NO_EVENT and rec.end_ev != NO_EVENT and rec.reason == 0:
            r.pre[i & r.mask] = events[rec.start_ev].elapsed_time(events[rec.end_ev])


def build(sink: ObjectSink, device_every: int) -> tuple[Timers, FakeDevice]:
    dev = FakeDevice()
    cfg = EmitterConfig(enabled=True, device_every=device_every, pool_size=4096)
    pool = EventPool(cfg.pool_size, dev.factory, synchronize=None)
    pool.elapsed_many = None  # read by read_device_times, untimed
    t = Timers(2, "minmax", config=cfg, pool=pool, sink=sink)
    return t, dev


def drain_once(t: Timers, work: Callable[[], Any], step: int, steps: int,
               settle: Callable[[], Any] | None = None) -> tuple[float, int]:
    """``steps`` ``megatron_step``s from ``step``, ``settle()`` (a device sync, the device times read ahead), then
    one timed ``Readout.drain`` into the timers' sink: (us per interval, intervals drained)."""
    for k in range(steps):
        megatron_step(t, step + k, work)
    if settle is not None:
        settle()
    n = len(t.ring)
    t0 = time.perf_counter_ns()
    t.readout.drain()
    return (time.perf_counter_ns() - t0) / max(1, n) / 1000, n


def time_arms(device_every: int, steps: int, reps: int, warm: int = 10) -> tuple[dict[str, list[float]], int, int]:
    """Per arm, each timed drain's us per interval; the intervals of the last drain; the bytes per arm agree."""
    arms = {"objects": build(ObjectSink(), device_every), "packed": build(PackedSink(), device_every)}
    out: dict[str, list[float]] = {k: [] for k in arms}
    n = 0
    for rep in range(reps + warm):
        for name, (t, dev) in arms.items():
            us, n = drain_once(t, lambda d=dev: d.work(0.1), rep * steps, steps, lambda t=t: read_device_times(t))
            if rep >= warm and n:  # warm: names known, caches filled
                out[name].append(us)
    sizes = {name: t.readout.sink.bytes for name, (t, _) in arms.items()}
    for t, _ in arms.values():
        t.shutdown(1.0)
    assert sizes["objects"] == sizes["packed"], sizes
    return out, n, sizes["packed"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=13, help="steps per drain (a 500 ms period of 37 ms steps)")
    args = ap.parse_args(argv)
    print(f"C drain available: {RecordBatch.packs}; {args.reps} drains of {args.steps} steps, arms alternating")
    last: dict[str, float] = {}
    for sampling, every in (("device", 1), ("host", 1 << 40)):
        res, n, nbytes = time_arms(every, args.steps, args.reps)
        for arm, vals in res.items():
            q = statistics.quantiles(vals, n=10)
            mean = statistics.fmean(vals)
            last[f"{arm}_{sampling}_us"] = mean
            print(f"{sampling:6s} {arm:8s} {n} intervals/drain: mean {mean:.3f} us/interval, median "
                  f"{statistics.median(vals):.3f} (p10-p90 {q[0]:.3f}-{q[-1]:.3f})")
        ratio = last[f"packed_{sampling}_us"] / last[f"objects_{sampling}_us"]
        print(f"{sampling:6s} packed/objects mean ratio {ratio:.3f} (same {nbytes} bytes)")
    print(" ".join(f"{k}={v:.3f}" for k, v in last.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

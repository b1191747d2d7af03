"""GIL time the readout thread takes per interval, on CPU: its drain and the export side's encoding.

Every microsecond the readout thread holds the GIL is taken from a launch-bound training thread once per
interval (``bench/results/gpu-h200.md`` section 3: its wakes cost 0.7 % of a 37 ms step with device time on every
step). This bench isolates the two Python parts of that work, without the CUDA driver (CPU machines):

* ``drain``: ``Readout.drain`` over a readout period of steps in Megatron's timer order (``megatron_step``: 21
  intervals, 4 microbatches), timed through the real ``Timers`` and ring with device time on every repeat of every
  step; the events are ``tests/emitter/fake_cuda.py``'s (a
  Python ``elapsed_time`` where CUDA has one driver call), into a sink that keeps nothing;
* ``encode``: ``WireEncoder.encode_intervals`` of the same intervals (what the process sink writes to its pipe).

Medians over ``--reps`` repetitions of ``--steps`` steps each.

Usage: ``python bench/readout_cost.py`` (last line: ``drain_us_per_interval=<x> encode_us_per_interval=<y>``).
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
from otel_straggler.export.wire import WireEncoder  # noqa: E402
from otel_straggler.interval import Interval, NullSink  # noqa: E402
from otel_straggler.timers import Timers  # noqa: E402

OPTIMIZER = ("optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
             "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params")


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
    for name in OPTIMIZER:
        t(name, 1).start()
        work()
        t(name).stop()
    t("optimizer").stop()


class Keep(NullSink):
    """Keeps the latest batch (to encode it after the drain)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: list[Interval] = []

    def submit(self, intervals: list[Interval]) -> None:  # type: ignore[override]
        self.last = list(intervals)


def time_drains(t: Timers, sink: Keep, work: Callable[[], Any], steps: int, reps: int, warm: int,
                settle: Callable[[], Any] | None = None) -> tuple[list[float], list[float], int]:
    """``reps`` drains of ``steps`` ``megatron_step``s each (after ``warm`` untimed ones; ``settle()`` before each
    drain, e.g. a device sync): per drain, its us per interval and the wire encoding's of the same intervals, and
    the intervals of the last drain."""
    encoder = WireEncoder()
    drains: list[float] = []
    encodes: list[float] = []
    step = n = 0
    for rep in range(reps + warm):
        for _ in range(steps):
            megatron_step(t, step, work)
            step += 1
        if settle is not None:
            settle()
        n = len(t.ring)
        t0 = time.perf_counter_ns()
        t.readout.drain()
        t1 = time.perf_counter_ns()
        encoder.encode_intervals(sink.last)
        encoder.commit()
        t2 = time.perf_counter_ns()
        if rep >= warm and n:  # warm: names known, caches filled
            drains.append((t1 - t0) / n / 1000)
            encodes.append((t2 - t1) / n / 1000)
    return drains, encodes, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=13, help="steps per drain (a 500 ms period of 37 ms steps)")
    args = ap.parse_args(argv)
    dev = FakeDevice()
    sink = Keep()
    cfg = EmitterConfig(enabled=True, device_every=1, pool_size=4096, device_repeats="all")
    t = Timers(2, "minmax", config=cfg, pool=EventPool(cfg.pool_size, dev.factory, synchronize=None), sink=sink)
    drains, encodes, n = time_drains(t, sink, lambda: dev.work(0.1), args.steps, args.reps, warm=10)
    t.shutdown(1.0)
    d, e = statistics.median(drains), statistics.median(encodes)
    print(f"{args.reps} drains of {n} intervals ({args.steps} steps), device time on every repeat (fake events)")
    print(f"drain   median {d:.3f} us/interval (p10-p90 {statistics.quantiles(drains, n=10)[0]:.3f}-"
          f"{statistics.quantiles(drains, n=10)[-1]:.3f})")
    print(f"encode  median {e:.3f} us/interval (p10-p90 {statistics.quantiles(encodes, n=10)[0]:.3f}-"
          f"{statistics.quantiles(encodes, n=10)[-1]:.3f})")
    print(f"drain_us_per_interval={d:.3f} encode_us_per_interval={e:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

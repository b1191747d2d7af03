"""GIL time the readout thread takes per interval, on CPU: its drain and the export side's encoding.

Every microsecond the readout thread holds the GIL is taken from a launch-bound training thread once per
interval (``bench/results/gpu-h200.md`` section 3: its wakes cost 0.7 % of a 37 ms step with device time on every
step). This bench isolates the two Python parts of that work, without the CUDA driver (CPU machines):

* ``drain``: ``Readout.drain`` over a readout period of Megatron-like steps (forward-backward, 4 microbatches x
  batch-generator, forward-compute, backward-compute, 4 optimizer stages: 21 intervals), timed through the
  real ``Timers`` and ring on device-sampled steps; the events are ``tests/emitter/fake_cuda.py``'s (a
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "emitter"))

from fake_cuda import FakeDevice  # noqa: E402

from otel_straggler.config import EmitterConfig  # noqa: E402
from otel_straggler.event_pool import EventPool  # noqa: E402
from otel_straggler.export.wire import WireEncoder  # noqa: E402
from otel_straggler.interval import Interval, NullSink  # noqa: E402
from otel_straggler.timers import Timers  # noqa: E402

STEP = (["forward-backward"] + ["batch-generator", "forward-compute", "backward-compute"] * 4
        + ["optimizer-copy-to-main-grad", "optimizer-inner-step", "optimizer-copy-main-to-model-params",
           "optimizer"])


class _Keep(NullSink):
    def __init__(self) -> None:
        super().__init__()
        self.last: list[Interval] = []

    def submit(self, intervals: list[Interval]) -> None:  # type: ignore[override]
        self.last = list(intervals)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=13, help="steps per drain (a 500 ms period of 37 ms steps)")
    args = ap.parse_args(argv)
    dev = FakeDevice()
    sink = _Keep()
    cfg = EmitterConfig(enabled=True, device_every=1, pool_size=4096)
    t = Timers(2, "minmax", config=cfg, pool=EventPool(cfg.pool_size, dev.factory, synchronize=None), sink=sink)
    encoder = WireEncoder()
    drains: list[float] = []
    encodes: list[float] = []
    step = 0
    for rep in range(args.reps + 10):
        for _ in range(args.steps):
            t.set_step(step)
            step += 1
            for name in STEP:
                t(name).start()
                dev.work(0.1)
                t(name).stop()
        n = len(t.ring)
        t0 = time.perf_counter_ns()
        t.readout.drain()
        t1 = time.perf_counter_ns()
        encoder.encode_intervals(sink.last)
        encoder.commit()
        t2 = time.perf_counter_ns()
        if rep >= 10:  # warm: names known, caches filled
            drains.append((t1 - t0) / n / 1000)
            encodes.append((t2 - t1) / n / 1000)
    t.shutdown(1.0)
    d, e = statistics.median(drains), statistics.median(encodes)
    print(f"{args.reps} drains of {args.steps} steps x {len(STEP)} intervals, device time on every step (fake events)")
    print(f"drain   median {d:.3f} us/interval (p10-p90 {statistics.quantiles(drains, n=10)[0]:.3f}-"
          f"{statistics.quantiles(drains, n=10)[-1]:.3f})")
    print(f"encode  median {e:.3f} us/interval (p10-p90 {statistics.quantiles(encodes, n=10)[0]:.3f}-"
          f"{statistics.quantiles(encodes, n=10)[-1]:.3f})")
    print(f"drain_us_per_interval={d:.3f} encode_us_per_interval={e:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What one timer start+stop costs between a step's operations, where its code and data are cold.

In a tight loop (``bench/hot_path.py``) a start+stop finds everything it touches in the cache; between a
launch-bound step's kernel launches it does not, and on the lent H200 VM that, not the instruction count, is
most of what the timers cost a step (``bench/results/gpu-h200.md`` run 9). Each iteration runs ``ops`` small
tensor operations then one timed interval around one more; blocks of iterations of every arm take turns
(rotating order) and each arm's cost is its mean iteration time minus the ``none`` arm's of the same round:

  noop    a timers object whose ``timers(name, log_level)`` returns a no-op timer (the call shape's own cost)
  host    the real ``Timers`` on a step that is not device-sampled (host clock, one ring record)
  device  the same on a device-sampled step (two event records; CUDA only)

The ring is drained between blocks, untimed. Usage: ``python bench/in_situ.py`` (CPU tensors; ``--device cuda``
for CUDA); ``bench/gpu/driver_calls.py`` runs it on the GPU. Last line: ``in_situ_host_us_ops3=
in_situ_host_us_ops30= in_situ_noop_us_ops30=``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from otel_straggler.config import EmitterConfig  # noqa: E402
from otel_straggler.event_pool import EventPool, HostOnlyPool  # noqa: E402
from otel_straggler.interval import NullSink  # noqa: E402
from otel_straggler.timers import DummyTimer, Timers  # noqa: E402


class NoopTimers:
    dummy = DummyTimer()

    def __call__(self, name: str, log_level: int | None = None) -> DummyTimer:
        return self.dummy


def boundaries_in_situ(ops: int, iters: int, blocks: int, device: str = "cpu",
                       extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Mean (and median, standard error) extra microseconds per start+stop of each arm over ``blocks`` rounds;
    ``extra``: more arms (name -> a timers object with Megatron's call shape)."""
    import torch

    cuda = device == "cuda"
    x = torch.zeros(1024, device=device)

    def real(every: int) -> Timers:
        cfg = EmitterConfig(enabled=True, device_every=every, pool_size=4096, device_repeats="all")
        pool = EventPool(cfg.pool_size) if cuda else HostOnlyPool()
        t = Timers(2, "minmax", config=cfg, pool=pool, sink=NullSink())
        t.set_step(1)  # step 0 is device-sampled whatever the period: the host arm's step must not be
        assert t.ctx.device_on == (cuda and every == 1)
        return t

    arms: dict[str, Any] = {"none": None, "noop": NoopTimers(), "host": real(1 << 40)}
    if cuda:
        arms["device"] = real(1)
    arms.update(extra or {})

    def run(t: Any) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            for _ in range(ops):
                x.add_(1.0)
            if t is not None:
                t("forward-compute", 2).start()
            x.add_(1.0)
            if t is not None:
                t("forward-compute").stop()
        if cuda:
            torch.cuda.synchronize()
        dt = (time.perf_counter_ns() - t0) / iters / 1000
        if getattr(t, "readout", None) is not None:
            t.readout.drain()
        return dt

    names = list(arms)
    per: dict[str, list[float]] = {n: [] for n in names}
    base = []
    for k in range(blocks):
        order = names[k % len(names):] + names[: k % len(names)]
        vals = {n: run(arms[n]) for n in order}
        base.append(vals["none"])
        for n in names:
            per[n].append(vals[n] - vals["none"])
    out: dict[str, Any] = {"iteration_us": statistics.fmean(base)}
    for n in names[1:]:
        out[n] = {"mean_us": statistics.fmean(per[n]), "median_us": statistics.median(per[n]),
                  "sem_us": statistics.stdev(per[n]) / len(per[n]) ** 0.5}
    for t in arms.values():
        if isinstance(t, Timers):
            t.shutdown(2.0)
    return out


def arguments(doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--iters", type=int, default=1200, help="iterations per block with 1 op between intervals")
    ap.add_argument("--blocks", type=int, default=300)
    return ap.parse_args(argv)


def after_3_and_30(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """``boundaries_in_situ`` after 3 and after 30 operations, each printed."""
    res = {}
    for ops in (3, 30):
        res[ops] = boundaries_in_situ(ops, max(50, args.iters // ops), args.blocks, args.device, extra)
        print(f"start+stop between {ops} ops:", json.dumps(res[ops]), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    res = after_3_and_30(arguments(__doc__, argv))
    print(f"in_situ_host_us_ops3={res[3]['host']['mean_us']:.2f} "
          f"in_situ_host_us_ops30={res[30]['host']['mean_us']:.2f} "
          f"in_situ_noop_us_ops30={res[30]['noop']['mean_us']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of one timer start+stop on the training thread versus its floor.

Floor: on CPU two ``time.perf_counter_ns()`` calls (the clock reads a start/stop cannot avoid); on CUDA
two bare ``record()`` of pre-created events. On CUDA the pool records through the driver's ``cuEventRecord``
(``event_pool.py``); the rows also show start+stop with torch's ``Event.record`` and two bare driver records.
Arms are interleaved over many repetitions and compared by medians. The ring is drained between
repetitions (untimed), as the readout thread would.

Last line: ``hot_path_ratio=<x> start_stop_ns=<ns> floor_ns=<ns>`` (plus, on CUDA, ``record_api=<api>
start_stop_torch_record_ns=<ns> floor_driver_ns=<ns> start_stop_shared_ns=<ns> shared_records=<n>``: the pair
back to back with the default ``share_gap_us``, each start reusing the previous stop's event).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from otel_straggler.config import EmitterConfig
from otel_straggler.event_pool import EventPool, HostOnlyPool
from otel_straggler.interval import NullSink
from otel_straggler.timers import Timers


class _NullSink(NullSink):
    def submit(self, intervals: object) -> None:
        pass

    def publish_stats(self, stats: object) -> None:
        pass

    def flush(self, timeout_s: float) -> bool:
        return True

    def shutdown(self, timeout_s: float) -> None:
        pass


def _pairs(first: Callable[[], object], second: Callable[[], object]) -> Callable[[int], None]:
    """A loop of ``n`` calls of ``first()`` then ``second()`` (a start/stop pair, or a floor's two calls)."""

    def run(n: int) -> None:
        for _ in range(n):
            first()
            second()

    return run


def _per_call_ns(fn: Callable[[int], None], n: int) -> float:
    t0 = time.perf_counter_ns()
    fn(n)
    return (time.perf_counter_ns() - t0) / n


def train_loop_overhead(rounds: int, steps: int, device_every_arms: list[int]) -> None:
    """Launch-bound training loop (CUDA): median step time with the timers vs with no-op timers.

    Small transformer (hidden 256, 2 layers, seq 128), 8 microbatches per step, Megatron-like timer
    calls (forward-backward, per microbatch batch-generator/forward-compute/backward-compute,
    optimizer: 26 intervals per step). Arms interleaved over ``rounds``; one device sync per step end.
    """
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [torch.randn(4, 128, 256, device="cuda") for _ in range(8)]

    class _Dummy:
        def start(self, barrier: bool = False) -> None:
            pass

        def stop(self, barrier: bool = False) -> None:
            pass

    class _Off:
        _d = _Dummy()

        def __call__(self, name: str, log_level: int | None = None) -> _Dummy:
            return self._d

        def set_step(self, *a: object, **k: object) -> None:
            pass

        def shutdown(self, timeout_s: float) -> None:
            pass

    def make(every: int) -> object:
        if every == 0:
            return _Off()
        cfg = EmitterConfig(enabled=True, device_every=every, pool_size=512)
        return Timers(2, "minmax", config=cfg, pool=EventPool(512), sink=_NullSink(), start_readout=True)

    def step(timers: object, n: int) -> None:
        timers.set_step(n)
        timers("forward-backward", 1).start()
        for x in data:
            timers("batch-generator", 2).start()
            y = x.clone()
            timers("batch-generator").stop()
            timers("forward-compute", 2).start()
            loss = model(y).float().pow(2).mean()
            timers("forward-compute").stop()
            timers("backward-compute", 2).start()
            loss.backward()
            timers("backward-compute").stop()
        timers("forward-backward").stop()
        timers("optimizer", 1).start()
        opt.step()
        opt.zero_grad(set_to_none=True)
        timers("optimizer").stop()

    arms = [0, *device_every_arms]
    timers_by_arm = {a: make(a) for a in arms}
    times: dict[int, list[float]] = {a: [] for a in arms}
    for a in arms:  # warm-up
        for n in range(5):
            step(timers_by_arm[a], n)
    torch.cuda.synchronize()
    for r in range(rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        for a in order:
            t = timers_by_arm[a]
            for n in range(steps):
                t0 = time.perf_counter()
                step(t, r * steps + n)
                torch.cuda.synchronize()
                times[a].append(time.perf_counter() - t0)
    base = statistics.median(times[0])
    print(f"train loop: {rounds} rounds x {steps} steps per arm, 26 intervals per step")
    print(f"{'arm':<28}{'median step ms':>16}{'ratio':>8}")
    for a in arms:
        med = statistics.median(times[a])
        label = "no timing" if a == 0 else f"otel timers device_every={a}"
        print(f"{label:<28}{med * 1e3:>16.2f}{med / base:>8.3f}")
    for a in arms:
        timers_by_arm[a].shutdown(2.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--n", type=int, default=2000, help="start/stop pairs per repetition")
    ap.add_argument("--cpu", action="store_true", help="ignore CUDA even when present")
    ap.add_argument("--train-loop", action="store_true", help="also time a launch-bound training loop (CUDA)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", default="1,4", help="device_every values of the timed train-loop arms")
    args = ap.parse_args(argv)

    cuda = False
    if not args.cpu:
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False

    # pool large enough that a repetition never exhausts it (events return only at the untimed drain)
    if cuda and args.train_loop:
        train_loop_overhead(args.rounds, args.steps, [int(x) for x in args.every.split(",")])

    # every start and stop records its own event (share_gap_us=0): back to back, a start would reuse the previous
    # stop's event (shared_event.py); that case is its own row
    cfg = EmitterConfig(enabled=True, device_every=1, ring_size=max(8192, args.n * 2), pool_size=2 * args.n + 16,
                        share_gap_us=0.0)
    pool = EventPool(cfg.pool_size) if cuda else HostOnlyPool()
    timers = Timers(2, "minmax", config=cfg, pool=pool, sink=_NullSink())
    timers.set_step(0)  # step 0 % device_every == 0: device timing on (CUDA) for every call
    timer = timers("forward-compute", 2)
    readout = timers.readout

    if cuda:
        import torch

        # two warm events of the pool (the driver's record needs their handle), recorded by torch and by the pool
        i1, i2 = pool.free.popleft(), pool.free.popleft()
        e1, e2 = pool.events[i1], pool.events[i2]
        torch.cuda.synchronize()

        floor = _pairs(e1.record, e2.record)
        floor_name = "2x event.record()"
        drec = pool.record

        def floor_driver(n: int) -> None:
            for _ in range(n):
                drec(i1)
                drec(i2)

        # the same start/stop with torch's Event.record (record_api=torch), for reference
        tpool = EventPool(cfg.pool_size, record_api="torch")
        ttimers = Timers(2, "minmax", config=cfg, pool=tpool, sink=_NullSink())
        ttimers.set_step(0)
        ttimer = ttimers("forward-compute", 2)
        ours_torch = _pairs(ttimer.start, ttimer.stop)
    else:
        floor = _pairs(time.perf_counter_ns, time.perf_counter_ns)
        floor_name = "2x perf_counter_ns()"

    ours = _pairs(timer.start, timer.stop)

    # back to back with the default share gap: each start reuses the previous stop's event (one record per pair)
    scfg = EmitterConfig(enabled=True, device_every=1, ring_size=cfg.ring_size, pool_size=cfg.pool_size)
    stimers = Timers(2, "minmax", config=scfg, pool=EventPool(cfg.pool_size) if cuda else HostOnlyPool(),
                     sink=_NullSink())
    stimers.set_step(0)
    stimer = stimers("forward-compute", 2)
    shared = _pairs(stimer.start, stimer.stop)

    # the same path on a step that is not device-sampled (host clock only), for reference
    hcfg = EmitterConfig(enabled=True, device_every=4, ring_size=cfg.ring_size, pool_size=64)
    htimers = Timers(2, "minmax", config=hcfg, pool=pool, sink=_NullSink())
    htimers.set_step(1)
    htimer = htimers("forward-compute", 2)
    host_only = _pairs(htimer.start, htimer.stop)

    def settle() -> None:
        if cuda:
            torch.cuda.synchronize()
        readout.drain(force=True)
        htimers.readout.drain(force=True)
        stimers.readout.drain(force=True)
        if cuda:
            ttimers.readout.drain(force=True)

    floors: list[float] = []
    arms: list[float] = []
    hosts: list[float] = []
    shareds: list[float] = []
    torch_arms: list[float] = []
    driver_floors: list[float] = []
    for _ in range(10):  # warm-up
        ours(200)
        floor(200)
        settle()
    for rep in range(args.reps):
        if rep % 2 == 0:
            arms.append(_per_call_ns(ours, args.n))
            settle()
            floors.append(_per_call_ns(floor, args.n))
        else:
            floors.append(_per_call_ns(floor, args.n))
            arms.append(_per_call_ns(ours, args.n))
        hosts.append(_per_call_ns(host_only, args.n))
        shareds.append(_per_call_ns(shared, args.n))
        if cuda:
            torch_arms.append(_per_call_ns(ours_torch, args.n))
            driver_floors.append(_per_call_ns(floor_driver, args.n))
        settle()
    snap = timers.counters.snapshot()
    timers.shutdown(1.0)
    htimers.shutdown(1.0)
    stimers.shutdown(1.0)
    if cuda:
        ttimers.shutdown(1.0)
    med_arm, med_floor = statistics.median(arms), statistics.median(floors)
    ratio = med_arm / med_floor
    print(f"device: {'cuda' if cuda else 'cpu'}; reps={args.reps} x n={args.n}; medians per start+stop pair")
    print(f"{'arm':<34}{'median ns':>12}{'p10 ns':>10}{'p90 ns':>10}")
    rows = [("timer.start()+timer.stop()", arms), (floor_name, floors)]
    if cuda:
        rows += [("start+stop, step not sampled", hosts), ("start+stop, start reusing the stop's", shareds),
                 ("start+stop, torch Event.record", torch_arms),
                 (f"2x pool.record ({pool.record_api})", driver_floors)]
    for name, xs in rows:
        q = statistics.quantiles(xs, n=10)
        print(f"{name:<34}{statistics.median(xs):>12.1f}{q[0]:>10.1f}{q[-1]:>10.1f}")
    print(
        f"intervals={snap['intervals']} dropped_ring_full={snap['dropped_ring_full']} faults={snap['faults']} "
        f"degraded_no_cuda={snap['degraded_no_cuda']} degraded_pool_exhausted={snap['degraded_pool_exhausted']} "
        f"device_intervals={snap['intervals'] - sum(v for k, v in snap.items() if k.startswith('degraded_'))}"
    )
    extra = ""
    if cuda:
        extra = (f" record_api={pool.record_api} start_stop_torch_record_ns={statistics.median(torch_arms):.1f}"
                 f" floor_driver_ns={statistics.median(driver_floors):.1f}"
                 f" start_stop_shared_ns={statistics.median(shareds):.1f} shared_records={stimers.share.records}")
    print(f"hot_path_ratio={ratio:.2f} start_stop_ns={med_arm:.1f} floor_ns={med_floor:.1f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

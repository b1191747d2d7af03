"""One simulated rank for the export tests: run as a subprocess (``python export_rank_driver.py '<json>'``).

Feeds deterministic ``Interval``s (``make_intervals``, shared with the tests for expected values) to a
real sink from ``otel_straggler.export.create_sink`` on a readout-like thread, then flushes and shuts down.
Scenarios: ``normal``; ``hang`` (submit, print READY, sleep: the test SIGKILLs or SIGTERMs it);
``fork`` (a forked copy submits more steps through the inherited sink, which must stay inert).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import otel_straggler_schema as schema
from otel_straggler.config import EmitterConfig
from otel_straggler.identity import Identity
from otel_straggler.interval import Interval

BASE_NS = 1_700_000_000_000_000_000
MICROBATCHES = 3
TIMERS = (("forward-compute", "forward", 1), ("backward-compute", "backward", 1), ("optimizer", "optimizer", 0))


def identity(rank: int, world: int, job_id: str) -> Identity:
    """A real ``Identity`` of rank ``rank`` in a pure data-parallel job of ``world`` ranks on one node."""
    return Identity(rank=rank, local_rank=rank, world_size=world, host="node-test", pid=os.getpid(), job_id=job_id,
                    dp_rank=rank, dp_size=world)


def make_intervals(rank: int, step: int) -> list[Interval]:
    """Per step: forward/backward x MICROBATCHES, optimizer x1. Backward repeat 1 is host-only
    (sampled_out), so its aggregate's device time is the other repeats' scaled to all; forward keeps device time
    on every repeat."""
    out = []
    base = BASE_NS + step * 1_000_000_000
    t = base + rank * 1000
    for repeat in range(MICROBATCHES):
        for name, group, level in TIMERS[:2]:
            dur_ns = int((2.0 + 0.5 * rank + 0.1 * repeat + (0.3 if group == "backward" else 0.0)) * 1e6)
            host_only = group == "backward" and repeat == 1
            out.append(
                Interval(
                    name=name,
                    level=level,
                    group=group,
                    step=step,
                    repeat=repeat,
                    host_start_ns=t,
                    host_end_ns=t + dur_ns,
                    device_ms=None if host_only else dur_ns / 1e6 * 0.9,
                    degraded="sampled_out" if host_only else None,
                    tokens=4096 * (repeat + 1),
                    sequences=8 * (repeat + 1),
                    microbatches=repeat + 1,
                    injected=rank == 1 and name == "forward-compute" and repeat == 2,
                )
            )
            t += dur_ns + 100_000
    out.append(
        Interval(
            name="optimizer",
            level=0,
            group="optimizer",
            step=step,
            repeat=0,
            host_start_ns=t,
            host_end_ns=t + 1_500_000,
            device_ms=1.2,
            degraded=None,
            tokens=4096 * MICROBATCHES,
            sequences=8 * MICROBATCHES,
            microbatches=MICROBATCHES,
            injected=False,
        )
    )
    return out


def stats_for(steps: int) -> dict[str, int | float]:
    return {
        "intervals": steps * (2 * MICROBATCHES + 1),
        "dropped_ring_full": 2,
        "degraded_sampled_out": steps,
        "barriers_skipped": 5,
        "faults": 1,
        "pool_high_water": 7,
        "readout_lag_ms": 1.5,
    }


def run_real_timers(args: dict[str, Any]) -> None:
    """Drive the real training-side Timers (host-only on CPU) with a Megatron-like step."""
    from otel_straggler.install import build_timers

    rank, world = args["rank"], args["world"]
    timers = build_timers(
        enabled=True,
        rank=rank,
        world_size=world,
        local_rank=rank,
        dp_rank=rank,
        dp_size=world,
        job_id=args["job_id"],
        export_mode=args["mode"],
        detail=args.get("detail", schema.DETAIL_STEP),
        readout_interval_ms=5,
    )
    assert timers is not None
    for step in range(args["steps"]):
        timers.set_step(step, 1024 * (rank + 1), 4, MICROBATCHES)
        timers("forward-backward", log_level=1).start()
        for _ in range(MICROBATCHES):
            timers("forward-compute", log_level=2).start()
            time.sleep(0.001)
            timers("forward-compute").stop()
            timers("backward-compute", log_level=2).start()
            time.sleep(0.002)
            timers("backward-compute").stop()
        timers("forward-backward").stop()
        timers("optimizer", log_level=1).start()
        timers("optimizer").stop()
    if args.get("sigterm"):  # the process ends through lifecycle's SIGTERM handler -> Timers.shutdown
        from otel_straggler import lifecycle

        lifecycle.register(timers, args.get("shutdown_timeout_s", 5.0))
        print(json.dumps({"ready": True, "child_pid": getattr(timers.sink, "child_pid", None)}), flush=True)
        time.sleep(60)
        return
    t0 = time.monotonic()
    timers.shutdown(5.0)
    print(json.dumps({"rank": rank, "shutdown_s": time.monotonic() - t0}), flush=True)


def main() -> None:
    args = json.loads(sys.argv[1])
    if args.get("scenario") == "timers":
        run_real_timers(args)
        return
    from otel_straggler.export import create_sink

    rank, world, job = args["rank"], args["world"], args["job_id"]
    cfg = EmitterConfig.from_env(
        {},
        export_mode=args["mode"],
        detail=args.get("detail", schema.DETAIL_STEP),
        shutdown_timeout_s=args.get("shutdown_timeout_s"),
        step_close_s=args.get("step_close_s"),
    )
    sink = create_sink(cfg, identity(rank, world, job))
    steps = args["steps"]
    scenario = args.get("scenario", "normal")
    result: dict[str, Any] = {"rank": rank}

    def feed(step_range: range) -> None:
        submit_s = []
        for step in step_range:
            ivs = make_intervals(rank, step)
            t0 = time.perf_counter()
            sink.submit(ivs)
            submit_s.append(time.perf_counter() - t0)
        result["max_submit_ms"] = max(submit_s) * 1000 if submit_s else 0.0
        sink.publish_stats(stats_for(step_range.stop))

    if scenario == "lifecycle":
        from otel_straggler import lifecycle

        class TimersLike:
            def shutdown(self, timeout_s: float) -> None:
                sink.shutdown(timeout_s)

        holder = TimersLike()
        lifecycle.register(holder, cfg.shutdown_timeout_s)

    readout = threading.Thread(target=feed, args=(range(steps),))
    readout.start()
    readout.join()

    if scenario == "fork":
        pid = os.fork()
        if pid == 0:  # a DataLoader-worker-like copy: must export nothing
            sink.submit(make_intervals(rank, steps))
            sink.submit(make_intervals(rank, steps + 1))
            sink.publish_stats(stats_for(steps + 2))
            sink.flush(2.0)
            sink.shutdown(2.0)
            os._exit(0)
        os.waitpid(pid, 0)

    child_pid = getattr(sink, "child_pid", None)
    if scenario in ("hang", "lifecycle"):
        print(json.dumps({"ready": True, "child_pid": child_pid}), flush=True)
        time.sleep(60)
        return
    t0 = time.monotonic()
    result["flush"] = sink.flush(args.get("flush_s", 10.0))
    result["flush_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    sink.shutdown(cfg.shutdown_timeout_s)
    result["shutdown_s"] = time.monotonic() - t0
    result["child_pid"] = child_pid
    result["counters"] = sink.counters.snapshot()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

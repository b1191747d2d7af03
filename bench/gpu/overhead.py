"""Step-time overhead of timing a real megatron-core GPT on one GPU, as a run pays it: mean step time.

Arms take turns in blocks inside one process: every round runs each arm (rotating order) for ``--warmup``
unmeasured steps then ``--steps`` measured ones (default 2 + 20). A block's value is the MEAN of its
steps, so every step counts, the heavy tail included (the readout drains, the export child, a step that
waited for either): ``sum(arm block means) / sum(off block means)`` over the rounds is what a run pays,
reported with a bootstrap 95 % interval over rounds; the median of the per-block ratios and the ratio of
per-step medians are printed beside it. On a host whose step time drifts over seconds (the lent H200 VM:
lag-1 autocorrelation of step times 0.86, 20-step block means +-12 %), block means of different arms differ
by the drift, not the arm: ``--steps 1 --warmup 0 --gate`` then interleaves the arms step by step (adjacent
steps share the drift) and still charges every shim its own background work: its readout thread wakes only
when the bench wakes it (its own timer is off), at the start of one of its own steps once per readout period
of its own step time, so a wake, its drain and the GIL hand-offs around it fall in the steps of the arm that
caused them, as often as in a run of that arm alone; the value is again the ratio of mean step times.
Unpinned by default (``--pin`` puts the training thread alone on one core and everything else on the others).
Model sizes (``otel_straggler_demo/megatron_gpt.py``): launch-bound (~30-50 ms steps: the host's launches are
the critical path), gpu-bound (>= 150 ms, but its forward pass is paced by its launches on a slow host) and
gpu-dense (GPU-bound in every stage); the last line's ``gpu_bound`` is gpu-dense's where it ran. Arms
(``--arms``):

  off      config.timers = None
  native   megatron.core.timers.Timers(2, "minmax")   (syncs the device at every start/stop)
  shim     otel_straggler with its defaults (``install_megatron``), exporting over OTLP/gRPC to a straggler
           collector on loopback through the export child; with blocks under 20 steps its N is what
           ``device_every=auto`` settles on when the shim runs alone (60 steps first), then kept
  every1   the same with device time on every step (``device_every=1``)
  host     the same never sampling the device (host timestamps only)
  every1-hold     ``every1`` with the driver calls made through ``ctypes.PyDLL`` (the GIL kept during each)
  every1-release  ``every1`` with the driver calls made through ``ctypes.CDLL`` (GIL released per call)
  every1-null     ``every1`` with the export side off (readout thread, no export child)
  every1-shared   ``every1`` with the export child on every core (no affinity away from training)
  every1-all      ``every1`` with every repeat (microbatch) of a timer on the device (``device_repeats=all``; the
                  default times the middle repeat of each timer per step on the device, the others on the host)
  every1-own      ``every1`` with every boundary recording its own event (``share_gap_us=0``: no reuse of the
                  previous boundary's event, ``otel_straggler/shared_event.py``)
  every1-norecord ``every1-own`` whose record calls no driver (a diagnostic: the timers' own work on a
                  device-sampled step; the readout reads the pool's stale, complete events)
  every1-clock    ``every1`` behind a proxy that sums, per step, the time spent inside the shim's Megatron calls
                  (``timers(name, level)``, ``start``, ``stop``; a diagnostic: what the calls themselves cost in
                  situ, cold caches included, against what the step pays; the proxy's own frames lie outside)
  every1-notiming ``every1-own`` recording events created without timing (``CU_EVENT_DISABLE_TIMING``: the same
                  driver call, no timestamp on the GPU; a diagnostic: every interval degrades to ``cuda_error``)

Before the arms, a boundary profile of the model: device-timed runs of ``--profile-steps`` steps through the
timers (no export) print the host gap before each start and stop (to the previous boundary of any timer) and the
records per step with the defaults, with every boundary of every repeat recording, and with the default
``share_gap_us`` and every repeat on the device.

Each step ends with torch.cuda.synchronize() in every arm (Megatron's loss reduction syncs each step too).
The collector runs on the same machine, niced (+10) as in the demo (runs 1-8 ran it at the bench's priority).
The shims' readout threads and export children stay alive during the other arms' blocks (idle there).

Profile, per measured step of every arm (the training thread's own /proc counters, read between steps):
CPU time, run-queue wait (runnable but another task on its core), voluntary context switches (it blocked:
the GIL, a lock) and involuntary ones (preempted), and the core it ran on; per shim, every readout drain
(start, end, intervals) and the export child's CPU time and core. Printed: the mean difference to ``off``
split into those parts, how much of it the slowest 5 % of steps carry, and the steps that overlap a
drain against those that do not.

Usage (on a GPU machine, from the checkout's root; wheels: scripts/gpu-wheels):
  python bench/gpu/overhead.py --sizes launch-bound --arms off,shim,every1 --seconds 300
  python bench/gpu/overhead.py --sizes launch-bound --arms off,shim,every1 --steps 1 --warmup 0 --gate
  python bench/gpu/overhead.py --analyse bench/results/gpu-h200/overhead-launch-10.json   (anywhere: a saved run)
Last line: launch_bound_mean_ratio=<shim/off> launch_bound_every_step_mean_ratio=<every1/off>
gpu_bound_mean_ratio=<shim/off> (each where measured).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from otel_straggler import hot_path  # noqa: E402
from otel_straggler.export.wire import RecordBatch  # noqa: E402
from otel_straggler_demo.run import free_port, yield_cpu  # noqa: E402

SHIM_ARMS = ("shim", "every1", "host", "every1-hold", "every1-release", "every1-null", "every1-shared", "every1-own",
             "every1-norecord", "every1-notiming", "every1-all", "every1-clock")


def start_collector(workdir: Path) -> tuple[subprocess.Popen, int, int]:
    import urllib.request

    import yaml

    from otel_straggler_demo.run import collector_config

    grpc_port, http_port, metrics_port, tap_port = (free_port() for _ in range(4))
    cfg = collector_config(grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port,
                           tap_port=tap_port, evidence=workdir / "verdicts.jsonl")
    # no trace backend in the benchmark: the processor runs, spans end in a one-line debug summary
    cfg["exporters"].pop("otlp_grpc/tap")
    cfg["exporters"]["debug"] = {"verbosity": "basic"}
    cfg["service"]["pipelines"]["traces"]["exporters"] = ["debug"]
    path = workdir / "collector.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = (workdir / "collector.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "collector_processor", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT)
    yield_cpu(proc.pid)  # beside a real job the collector has its own host; here it yields to training (+10)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.3)
    return proc, grpc_port, metrics_port


class ThreadProbe:
    """The calling thread's scheduler counters from /proc (read between steps, never inside one)."""

    def __init__(self) -> None:
        tid = threading.get_native_id()
        self._sched = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        self._status = os.open(f"/proc/self/task/{tid}/status", os.O_RDONLY)
        self._stat = os.open(f"/proc/self/task/{tid}/stat", os.O_RDONLY)

    def read(self) -> tuple[int, int, int, int, int]:
        """(cpu ns, run-queue wait ns, voluntary switches, involuntary switches, core)."""
        run, wait, _ = os.pread(self._sched, 256, 0).split()
        vol = invol = 0
        for line in os.pread(self._status, 4096, 0).splitlines():
            if line.startswith(b"voluntary_ctxt_switches"):
                vol = int(line.split()[1])
            elif line.startswith(b"nonvoluntary_ctxt_switches"):
                invol = int(line.split()[1])
        core = int(os.pread(self._stat, 1024, 0).rsplit(b")", 1)[1].split()[36])
        return int(run), int(wait), vol, invol, core


def proc_cpu(pid: int) -> tuple[int, int] | None:
    """(utime+stime ticks, last core) of a process, None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12]), int(fields[36])
    except (OSError, IndexError, ValueError):
        return None


def bootstrap(rounds: list[tuple[float, float]], stat: Any, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of ``stat(pairs)`` over resampled rounds (paired arm/off)."""
    rng = random.Random(seed)
    k = len(rounds)
    vals = sorted(stat(rng.choices(rounds, k=k)) for _ in range(n))
    return vals[int(0.025 * n)], vals[int(0.975 * n) - 1]


def ratio_of_sums(pairs: list[tuple[float, float]]) -> float:
    return sum(a for a, _ in pairs) / sum(b for _, b in pairs)


def median_of_ratios(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(a / b for a, b in pairs)


def _shim(name: str, every: int | None = None) -> Any:
    import otel_straggler

    opts: dict[str, Any] = {}
    if every is not None and name == "shim":
        opts["device_every"] = every
    if name == "every1" or name.startswith("every1-"):
        opts["device_every"] = 1
    if name == "host":
        opts["device_every"] = 1 << 40  # never a sampled step: host-only timing
    if name == "every1-null":
        opts["export_mode"] = "off"
    if name == "every1-shared":
        opts["export_affinity"] = "all"
    if name in ("every1-own", "every1-norecord", "every1-notiming"):
        opts["share_gap_us"] = 0.0
    if name == "every1-all":
        opts["device_repeats"] = "all"
    t = otel_straggler.install_megatron(enabled=True, set_global=False, **opts)
    if name == "every1-norecord" and t.pool.stream is not None:
        stream_of = t.pool.stream
        t.pool.record = lambda ev: stream_of()  # no timer exists yet: each takes the pool's record when made
    if name == "every1-notiming" and t.pool.record_api == "driver":
        import torch

        for i in range(t.pool.capacity):  # the same ids, events without timing in their place
            ev = torch.cuda.Event(enable_timing=False)
            ev.record()
            t.pool.events[i] = ev
            t.pool.table.handle[i] = ev.cuda_event
        torch.cuda.synchronize()
    if name in ("every1-hold", "every1-release") and t.pool.record_api == "driver":
        import torch

        from otel_straggler.event_pool import driver_elapsed, driver_recorder

        hold = name == "every1-hold"
        t.pool.record = driver_recorder(torch.cuda.current_device(), t.pool.events, t.pool.table.handle, hold_gil=hold)
        t.pool.elapsed = driver_elapsed(t.pool.table.handle, hold_gil=hold)
    if name == "every1-clock":
        return ClockedTimers(t)
    return t


class ClockedTimers:
    """``every1-clock``: the timers behind a proxy that sums perf_counter_ns around each of their Megatron calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ns = 0
        self.calls = 0
        self._wrapped: dict[str, ClockedTimer] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, name: str, log_level: int | None = None) -> Any:
        t0 = time.perf_counter_ns()
        timer = self.inner(name, log_level)
        self.ns += time.perf_counter_ns() - t0
        self.calls += 1
        w = self._wrapped.get(name)
        if w is None or w.timer is not timer:
            w = self._wrapped[name] = ClockedTimer(timer, self)
        return w


class ClockedTimer:
    __slots__ = ("owner", "timer")

    def __init__(self, timer: Any, owner: ClockedTimers) -> None:
        self.timer = timer
        self.owner = owner

    def start(self, barrier: bool = False) -> None:
        t0 = time.perf_counter_ns()
        self.timer.start(barrier)
        self.owner.ns += time.perf_counter_ns() - t0
        self.owner.calls += 1

    def stop(self, barrier: bool = False) -> None:
        t0 = time.perf_counter_ns()
        self.timer.stop(barrier)
        self.owner.ns += time.perf_counter_ns() - t0
        self.owner.calls += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.timer, name)


class DrainLog:
    """Wraps one readout's ``drain``: (start ns, end ns, intervals) of every drain, perf_counter_ns clock.
    ``gated``: the readout thread's own timer is off (an hour); the bench wakes it (``wake``) in its arm's
    steps, once per ``period_s`` (the configured readout period) of the arm's own step time."""

    def __init__(self, readout: Any, gated: bool = False) -> None:
        self.rows: list[tuple[int, int, int]] = []
        self.readout = readout
        self.period_s = readout.interval_s
        self.gated = gated
        if gated:
            readout.interval_s = 3600.0  # from its next wait on; the first (at install) ends within a period
        inner = readout.drain

        def drain(force: bool = False) -> int:
            t0 = time.perf_counter_ns()
            n = inner(force)
            t1 = time.perf_counter_ns()
            if n or t1 - t0 > 200_000:
                self.rows.append((t0, t1, n))
            return n

        readout.drain = drain

    def wake(self) -> None:
        """Wake the readout thread now (one wake: a drain, then the stats when due)."""
        self.readout._wake.set()


def boundary_profile(model: Any, steps: int) -> dict:
    """Host gaps between the model's timer boundaries and records per step with the defaults, without event reuse
    or repeat sampling, and with every repeat on the device (three runs of ``steps`` steps each; what reuse does
    to device times is checked on a fake clock in ``tests/emitter/test_shared_event.py``, where two runs can time
    the same work)."""
    from otel_straggler.config import DEFAULTS, EmitterConfig
    from otel_straggler.event_pool import EventPool
    from otel_straggler.interval import DecodingSink
    from otel_straggler.timers import Timers

    class Keep(DecodingSink):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[Any] = []

        def submit(self, intervals: Any) -> None:
            self.rows.extend(intervals)

    out: dict[str, Any] = {"share_gap_us": DEFAULTS.share_gap_us, "device_repeats": DEFAULTS.device_repeats}
    runs = {}
    # the defaults; every boundary of every repeat recording (the gaps below come from that run); every repeat
    gap1 = DEFAULTS.share_gap_us
    for gap, repeats in ((gap1, DEFAULTS.device_repeats), (0.0, "all"), (gap1, "all")):
        sink = Keep()
        cfg = EmitterConfig(enabled=True, device_every=1, share_gap_us=gap, device_repeats=repeats)
        t = Timers(2, "minmax", config=cfg, pool=EventPool(1024), sink=sink)
        model.set_timers(t)
        r0 = t.share.records
        for _ in range(steps):
            model.train_step()
            model.torch.cuda.synchronize()
            t.readout.drain(force=True)
        model.set_timers(None)
        runs[(gap, repeats)] = (sink.rows, (t.share.records - r0) / steps)
        t.shutdown(5.0)
    rows, per_step = runs[(DEFAULTS.share_gap_us, DEFAULTS.device_repeats)]
    rows0, per_step0 = runs[(0.0, "all")]
    out["records_per_step"] = per_step
    out["records_per_step_own"] = per_step0
    out["records_per_step_all_repeats"] = runs[(DEFAULTS.share_gap_us, "all")][1]
    out["intervals_per_step"] = len(rows) / steps
    # boundaries of each step in host order: the gap before each to the previous one
    by_step: dict[int, list[tuple[int, str]]] = {}
    for iv in rows0:
        by_step.setdefault(iv.step, []).extend(((iv.host_start_ns, "start"), (iv.host_end_ns, "stop")))
    gaps: dict[str, list[float]] = {"start": [], "stop": []}
    for marks in by_step.values():
        marks.sort()
        for (a, _), (b, kind) in itertools.pairwise(marks):
            gaps[kind].append((b - a) / 1000.0)
    for kind, g in gaps.items():
        if g:
            q = statistics.quantiles(g, n=20)
            out[f"gap_before_{kind}_us_p5_p50_p95"] = [round(q[0], 1), round(statistics.median(g), 1), round(q[-1], 1)]
            for lim in (20, 50, 100):
                out[f"gap_before_{kind}_under_{lim}us"] = sum(1 for x in g if x < lim) / len(g)
    return out


def run_size(size_name: str, arm_names: list[str], rounds: int, steps: int, warmup: int, seconds: float,
             train_cpu: int | None, gate: bool = False, profile_steps: int = 0) -> dict:
    from otel_straggler_demo.megatron_gpt import SIZES, MegatronGPT

    model = MegatronGPT(SIZES[size_name])
    torch = model.torch
    model.set_timers(None)
    for _ in range(10):  # compile/allocator warmup outside any arm
        model.train_step()
    torch.cuda.synchronize()
    profile = boundary_profile(model, profile_steps) if profile_steps else None
    if profile:
        print(f"  {size_name} boundaries: {json.dumps(profile)}", flush=True)
    every = None
    if steps < 20 and "shim" in arm_names:
        # short blocks: each arm's step periods include the other arms' steps, which the auto rule would take
        # for its own (3-4x too long): N is what auto settles on when the shim times every step alone
        auto = _shim("shim")
        model.set_timers(auto)
        for _ in range(60):
            model.train_step()
            torch.cuda.synchronize()
        every = auto.ctx.device_every
        model.set_timers(None)
        auto.shutdown(5.0)
        print(f"  {size_name}: device_every=auto settles on N={every} alone; the shim arm keeps it", flush=True)
    arms: dict[str, Any] = {}
    drains: dict[str, DrainLog] = {}
    for name in arm_names:
        if name == "off":
            arms[name] = None
        elif name == "native":
            from megatron.core.timers import Timers as NativeTimers

            arms[name] = NativeTimers(2, "minmax")
        else:
            arms[name] = _shim(name, every)
            if arms[name].readout is not None:
                drains[name] = DrainLog(arms[name].readout, gated=gate)
    if train_cpu is not None:  # the shims' threads and children started on the other cores
        os.sched_setaffinity(0, [train_cpu])
    probe = ThreadProbe()
    collector_pid = int(os.environ.get("BENCH_COLLECTOR_PID", "0"))
    fields = ("wall", "cpu", "rqwait", "vcsw", "ivcsw", "core", "t0", "sampled", "child_ticks", "child_core", "inside",
              "calls")
    steps_of: dict[str, dict[str, list]] = {n: {f: [] for f in fields} for n in arm_names}
    blocks: dict[str, list[float]] = {n: [] for n in arm_names}
    own_ns: dict[str, float] = dict.fromkeys(arm_names, 0.0)  # the arm's own step time since its last drain

    def child_pid(arm: str) -> int | None:
        sink = getattr(arms[arm], "sink", None)
        return getattr(sink, "child_pid", None)

    def block(arm: str, n: int, keep: bool) -> None:
        timers = arms[arm]
        ctx = getattr(timers, "ctx", None)
        rec = steps_of[arm]
        # gated: the arm's readout thread wakes only inside its own steps (woken after t0; a wake's drain takes a
        # few ms of a 30-40 ms step), and only once the arm's OWN time since its last wake reaches the readout
        # period: wakes as often and drains as large as in a run of this arm alone
        dlog = drains[arm] if arm in drains and drains[arm].gated else None
        walls = []
        for _ in range(n):
            cpid = child_pid(arm) if keep else None
            c0 = proc_cpu(cpid) if cpid else None
            i0, n0 = (timers.ns, timers.calls) if isinstance(timers, ClockedTimers) else (0, 0)
            p0 = probe.read()
            t0 = time.perf_counter_ns()
            if dlog is not None and own_ns[arm] >= dlog.period_s * 1e9:
                own_ns[arm] = 0
                dlog.wake()
            model.train_step()
            p1 = probe.read()
            torch.cuda.synchronize()
            t1 = time.perf_counter_ns()
            own_ns[arm] += t1 - t0
            if not keep:
                continue
            c1 = proc_cpu(cpid) if cpid else None
            wall = (t1 - t0) / 1e6
            walls.append(wall)
            rec["wall"].append(round(wall, 4))
            rec["cpu"].append(round((p1[0] - p0[0]) / 1e6, 4))
            rec["rqwait"].append(round((p1[1] - p0[1]) / 1e6, 4))
            rec["vcsw"].append(p1[2] - p0[2])
            rec["ivcsw"].append(p1[3] - p0[3])
            rec["core"].append(p1[4])
            rec["t0"].append(t0)
            rec["sampled"].append(bool(ctx is not None and ctx.device_on))
            rec["child_ticks"].append(c1[0] - c0[0] if (c0 and c1) else 0)
            rec["child_core"].append(c1[1] if c1 else -1)
            if isinstance(timers, ClockedTimers):
                rec["inside"].append(round((timers.ns - i0) / 1e6, 4))
                rec["calls"].append(timers.calls - n0)
        if keep:
            blocks[arm].append(statistics.fmean(walls))

    names = list(arm_names)
    t_end = time.monotonic() + seconds
    next_print = time.monotonic() + 15.0
    done = 0
    for r in range(rounds):
        if time.monotonic() > t_end:
            break
        order = names[r % len(names):] + names[: r % len(names)]
        for arm in order:
            model.set_timers(arms[arm])
            block(arm, warmup, False)
            block(arm, steps, True)
        done = r + 1
        if time.monotonic() >= next_print:
            next_print += 15.0
            print(f"  {size_name} round {done}: "
                  + " ".join(f"{a}={statistics.fmean(steps_of[a]['wall']):.2f}ms" for a in names), flush=True)
    model.set_timers(None)
    res: dict[str, Any] = {"size": size_name, "rounds": done, "steps_per_block": steps, "warmup_per_block": warmup,
                           "arms": names, "pinned": train_cpu is not None, "collector_pid": collector_pid,
                           "gated": gate, "boundaries": profile}
    for name, t in arms.items():
        if name in SHIM_ARMS:
            res[f"{name}_device_every"] = t.ctx.device_every
            res[f"{name}_record_api"] = t.pool.record_api
            res[f"{name}_hot_path"] = hot_path.NAME
            res[f"{name}_drain"] = "packed" if callable(getattr(t.readout.sink, "new_batch", None)) and \
                RecordBatch.packs else "objects"
            res[f"{name}_readout_period_s"] = drains[name].period_s if name in drains else t.readout.interval_s
            res[f"{name}_pool_size"] = t.pool.capacity
            res[f"{name}_counters"] = t.counters.snapshot()
            res[f"{name}_child_affinity"] = _affinity(child_pid(name))
    for name in arm_names:
        if name in SHIM_ARMS:
            arms[name].shutdown(5.0)
    for arm in names:
        res[f"{arm}_steps"] = steps_of[arm]
        res[f"{arm}_blocks"] = [round(x, 4) for x in blocks[arm]]
        if arm in drains:
            res[f"{arm}_drains"] = drains[arm].rows
    return res


def _affinity(pid: int | None) -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(pid)) if pid else None
    except OSError:
        return None


def analyse(res: dict) -> dict:
    """Ratios (mean per block, medians beside) and the profile of where the mean goes, per arm vs off."""
    out: dict[str, Any] = {"size": res["size"], "rounds": res["rounds"], "steps_per_block": res["steps_per_block"],
                           "gated": res.get("gated", False)}
    off = res["off_steps"]
    off_blocks = res["off_blocks"]
    p95 = statistics.quantiles(off["wall"], n=20)[-1]
    out["off_mean_ms"] = statistics.fmean(off["wall"])
    out["off_median_ms"] = statistics.median(off["wall"])
    out["off_p95_ms"] = p95
    for arm in res["arms"]:
        st = res[f"{arm}_steps"]
        a: dict[str, Any] = {
            "mean_ms": statistics.fmean(st["wall"]),
            "median_ms": statistics.median(st["wall"]),
            "p99_ms": statistics.quantiles(st["wall"], n=100)[-1],
            "max_ms": max(st["wall"]),
            "cpu_ms": statistics.fmean(st["cpu"]),
            "rqwait_ms": statistics.fmean(st["rqwait"]),
            "vcsw": statistics.fmean(st["vcsw"]),
            "ivcsw": statistics.fmean(st["ivcsw"]),
            "migrations": sum(1 for x, y in zip(st["core"], st["core"][1:]) if x != y) / max(1, len(st["core"]) - 1),
            "steps": len(st["wall"]),
        }
        a["other_wait_ms"] = a["mean_ms"] - a["cpu_ms"] - a["rqwait_ms"]
        if st.get("inside"):  # every1-clock: time inside the shim's calls
            a["inside_ms"] = statistics.fmean(st["inside"])
            a["calls_per_step"] = statistics.fmean(st["calls"])
        if arm != "off":
            pairs = list(zip(res[f"{arm}_blocks"], off_blocks))
            a["mean_ratio"] = ratio_of_sums(pairs)
            a["mean_ratio_ci95"] = bootstrap(pairs, ratio_of_sums)
            a["block_median_ratio"] = median_of_ratios(pairs)
            a["block_median_ratio_ci95"] = bootstrap(pairs, median_of_ratios)
            a["median_ratio"] = a["median_ms"] / out["off_median_ms"]
            # the tail: excess over off's 95th percentile, per step, against the whole mean difference
            a["tail_excess_ms"] = (sum(max(0.0, w - p95) for w in st["wall"]) / len(st["wall"])
                                   - sum(max(0.0, w - p95) for w in off["wall"]) / len(off["wall"]))
            a["share_over_off_p95"] = sum(1 for w in st["wall"] if w > p95) / len(st["wall"])
            sampled = [w for w, s in zip(st["wall"], st["sampled"]) if s]
            other = [w for w, s in zip(st["wall"], st["sampled"]) if not s]
            a["sampled_mean_ms"] = statistics.fmean(sampled) if sampled else None
            a["unsampled_mean_ms"] = statistics.fmean(other) if other else None
            cpu_on = [c for c, s in zip(st["cpu"], st["sampled"]) if s]
            a["sampled_cpu_ms"] = statistics.fmean(cpu_on) if cpu_on else None
        dr = res.get(f"{arm}_drains")
        if dr:
            # drains overlapping each measured step (perf_counter_ns clock on both sides)
            t0s, walls = st["t0"], st["wall"]
            over = []
            j = 0
            rows = sorted(dr)
            for t0, w in zip(t0s, walls):
                t1 = t0 + int(w * 1e6)
                ov = 0
                while j < len(rows) and rows[j][1] < t0:
                    j += 1
                k = j
                while k < len(rows) and rows[k][0] < t1:
                    ov += min(rows[k][1], t1) - max(rows[k][0], t0)
                    k += 1
                over.append(ov / 1e6)
            hit = [w for w, o in zip(walls, over) if o > 0]
            miss = [w for w, o in zip(walls, over) if o == 0]
            n_iv = sum(r[2] for r in dr)
            dur = [(r[1] - r[0]) / 1e6 for r in dr if r[2]]
            a["drains"] = len(dr)
            a["drain_ms_mean"] = statistics.fmean(dur) if dur else 0.0
            a["drain_ms_max"] = max(dur) if dur else 0.0
            a["drain_us_per_interval"] = 1e3 * sum(dur) / n_iv if n_iv else 0.0
            a["drain_ms_per_step"] = statistics.fmean(over)
            # drain time outside this arm's measured steps (gated: should be ~0; else it lands in other arms)
            a["drain_ms_outside_per_step"] = sum(dur) / len(walls) - a["drain_ms_per_step"]
            a["steps_with_drain"] = len(hit) / len(walls)
            a["mean_ms_with_drain"] = statistics.fmean(hit) if hit else None
            a["mean_ms_without_drain"] = statistics.fmean(miss) if miss else None
            if res["steps_per_block"] == 1 and len(walls) == len(off["wall"]):
                a["paired_split"] = paired_split(st, off, over)
        ticks = [t for t in st["child_ticks"]]
        if any(ticks):
            hz = os.sysconf("SC_CLK_TCK")
            a["child_cpu_ms_per_step"] = 1e3 * statistics.fmean(ticks) / hz
            a["child_same_core"] = statistics.fmean(
                1.0 if c == t else 0.0 for c, t in zip(st["child_core"], st["core"]))
        out[arm] = a
    return out


def paired_split(st: dict, off: dict, over: list[float]) -> dict[str, dict[str, float]]:
    """Per kind of step (device-sampled or host-only without a drain, any step with one), its share of the steps
    and its mean wall and CPU time over ``off``'s step of the same round (1-step blocks: adjacent steps share the
    host's drift)."""
    kinds = {"host_only": [], "sampled": [], "wake": []}
    for i, o in enumerate(over):
        kinds["wake" if o > 0 else "sampled" if st["sampled"][i] else "host_only"].append(i)
    out = {}
    for kind, idx in kinds.items():
        if idx:
            out[kind] = {"share": len(idx) / len(over),
                         "wall_ms": statistics.fmean(st["wall"][i] - off["wall"][i] for i in idx),
                         "cpu_ms": statistics.fmean(st["cpu"][i] - off["cpu"][i] for i in idx)}
    return out


def report(an: dict) -> None:
    print(f"\n== {an['size']}: {an['rounds']} rounds of {an['steps_per_block']}-step blocks"
          f"{' (drains gated to their arm)' if an['gated'] else ''}; off mean {an['off_mean_ms']:.2f} ms, median "
          f"{an['off_median_ms']:.2f}, p95 {an['off_p95_ms']:.2f}")
    print(f"{'arm':>15} {'mean ms':>8} {'mean ratio':>10} {'95% CI':>15} {'blk median':>10} {'step med':>8} "
          f"{'p99 ms':>7} {'cpu ms':>7} {'rq ms':>6} {'oth ms':>6} {'vcsw':>6} {'ivcsw':>6} {'migr':>5} "
          f"{'tail ms':>7}")
    for arm, a in an.items():
        if not isinstance(a, dict):
            continue
        if arm == "off":
            print(f"{arm:>15} {a['mean_ms']:8.2f} {'':>10} {'':>15} {'':>10} {'':>8} {a['p99_ms']:7.2f} "
                  f"{a['cpu_ms']:7.2f} {a['rqwait_ms']:6.3f} {a['other_wait_ms']:6.2f} {a['vcsw']:6.1f} "
                  f"{a['ivcsw']:6.2f} {a['migrations']:5.2f}")
            continue
        lo, hi = a["mean_ratio_ci95"]
        print(f"{arm:>15} {a['mean_ms']:8.2f} {a['mean_ratio']:10.4f} {lo:7.4f}-{hi:.4f} "
              f"{a['block_median_ratio']:10.4f} {a['median_ratio']:8.4f} {a['p99_ms']:7.2f} {a['cpu_ms']:7.2f} "
              f"{a['rqwait_ms']:6.3f} {a['other_wait_ms']:6.2f} {a['vcsw']:6.1f} {a['ivcsw']:6.2f} "
              f"{a['migrations']:5.2f} {a['tail_excess_ms']:7.3f}")
    for arm, a in an.items():
        if isinstance(a, dict) and "drains" in a:
            print(f"   {arm}: drains {a['drains']} (mean {a['drain_ms_mean']:.3f} ms, max {a['drain_ms_max']:.2f}, "
                  f"{a['drain_us_per_interval']:.2f} us/interval), {a['drain_ms_per_step']:.3f} ms of drain per "
                  f"step ({a['drain_ms_outside_per_step']:.3f} outside the arm's steps), "
                  f"{100 * a['steps_with_drain']:.0f} % of steps overlap one: mean "
                  f"{a['mean_ms_with_drain'] or 0:.2f} ms with vs {a['mean_ms_without_drain'] or 0:.2f} without; "
                  f"sampled steps {a['sampled_mean_ms'] or 0:.2f} ms (cpu {a['sampled_cpu_ms'] or 0:.2f}) vs "
                  f"others {a['unsampled_mean_ms'] or 0:.2f}; export child "
                  f"{a.get('child_cpu_ms_per_step', 0):.2f} ms cpu/step, on the training core "
                  f"{100 * a.get('child_same_core', 0):.1f} % of samples")
            if "inside_ms" in a:
                print(f"   {arm}: inside the shim's calls {a['inside_ms']:.3f} ms a step, {a['calls_per_step']:.1f} "
                      f"calls ({1000 * a['inside_ms'] / max(1.0, a['calls_per_step']):.2f} us each)")
            split = a.get("paired_split")
            if split:
                print(f"   {arm} over off's step of the same round: " + "; ".join(
                    f"{k.replace('_', '-')} steps ({100 * v['share']:.1f} %) wall {v['wall_ms']:+.3f} ms, "
                    f"cpu {v['cpu_ms']:+.3f}" for k, v in split.items()))


def _pin_others() -> int:
    """Move this thread (and so whatever it starts next) off one core; return that core for training."""
    cpus = sorted(os.sched_getaffinity(0))
    train = cpus[0]
    print(f"cpus {cpus}; training core {train}", flush=True)
    os.sched_setaffinity(0, [c for c in cpus if c != train])
    return train


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="launch-bound,gpu-bound")
    ap.add_argument("--arms", default="off,shim,every1", help=f"off, native and any of {SHIM_ARMS}")
    ap.add_argument("--rounds", type=int, default=10_000, help="most rounds per size")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per block")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps per block (after a switch)")
    ap.add_argument("--seconds", default="300", help="time budget per size, or one per size (comma-separated)")
    ap.add_argument("--pin", action="store_true", help="training thread alone on one core, the rest elsewhere")
    ap.add_argument("--gate", action="store_true",
                    help="a shim's readout thread wakes only inside its own arm's steps, once per readout period "
                         "of the arm's own time (for short blocks: each arm's wakes, and so their GIL time, land "
                         "in its own steps, as often as in a run of that arm alone)")
    ap.add_argument("--profile-steps", type=int, default=20,
                    help="steps of the boundary profile before the arms (0: none)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--analyse", metavar="JSON", default=None,
                    help="print the analysis of a saved --json-out file again (no GPU) and exit")
    args = ap.parse_args()
    if args.analyse:
        for res in json.loads(Path(args.analyse).read_text())["raw"]:
            report(analyse(res))
        return 0
    arm_names = args.arms.split(",")
    if arm_names[0] != "off":
        ap.error("the first arm must be off")
    sizes = args.sizes.split(",")
    secs = [float(x) for x in args.seconds.split(",")]
    secs = secs + [secs[-1]] * (len(sizes) - len(secs))

    import torch

    from otel_straggler_demo.megatron_gpt import init_single_process

    init_single_process(free_port())
    train_cpu = _pin_others() if args.pin else None
    work = Path(tempfile.mkdtemp(prefix="overhead-"))
    collector, grpc_port, metrics_port = start_collector(work)
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{grpc_port}",
                       "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_STRAGGLER_JOB_ID": "overhead-bench",
                       "BENCH_COLLECTOR_PID": str(collector.pid)})
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}, {os.cpu_count()} cpus, training "
          f"thread on cpu {train_cpu if train_cpu is not None else 'any'}; blocks of {args.warmup}+{args.steps} "
          f"steps", flush=True)
    results, analyses = [], []
    for name, s in zip(sizes, secs):
        res = run_size(name, arm_names, args.rounds, args.steps, args.warmup, s, train_cpu, args.gate,
                       args.profile_steps)
        an = analyse(res)
        report(an)
        results.append(res)
        analyses.append(an)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"analysis": analyses, "raw": results}))
    metrics = ""
    try:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
            metrics = r.read().decode()
    except OSError:
        pass
    collector.terminate()
    collector.wait(timeout=20)
    accepted = [ln for ln in metrics.splitlines() if ln.startswith("otel_straggler_collector_spans_accepted")]
    print("collector:", accepted[:1])
    for res in results:
        for arm in res["arms"]:
            if f"{arm}_counters" in res:
                c = res[f"{arm}_counters"]
                dropped = sum(v for k, v in c.items() if k.startswith("dropped"))
                print(f"  {res['size']} {arm}: N={res[f'{arm}_device_every']} record_api={res[f'{arm}_record_api']} "
                      f"hot_path={res.get(f'{arm}_hot_path')} drain={res.get(f'{arm}_drain')} "
                      f"readout={1000 * res[f'{arm}_readout_period_s']:.0f}ms pool={res[f'{arm}_pool_size']} "
                      f"intervals={c.get('intervals')} dropped={dropped} "
                      f"faults={c.get('faults')} child affinity={res.get(f'{arm}_child_affinity')}")
    by = {a["size"]: a for a in analyses}
    parts, cis = [], []
    gpu_bound = "gpu-dense" if "gpu-dense" in by else "gpu-bound"  # gpu-dense: GPU-bound in every stage
    for key, size, arm in (("launch_bound", "launch-bound", "shim"),
                           ("launch_bound_every_step", "launch-bound", "every1"),
                           ("gpu_bound", gpu_bound, "shim")):
        if size in by and arm in by[size]:
            lo, hi = by[size][arm]["mean_ratio_ci95"]
            parts.append(f"{key}_mean_ratio={by[size][arm]['mean_ratio']:.4f}")
            cis.append(f"{key}_mean_ci95={lo:.4f}-{hi:.4f}")
    print(" ".join(cis))
    print(" ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Memory limiter in the OTel Collector's manner: RSS is read every ``check_interval`` from /proc/self/statm.

Over ``limit_mib - spike_limit_mib`` (the soft limit) the pipelines that list it refuse new data (receivers answer
UNAVAILABLE / 503 with a retry delay), and memory is given back (a garbage collection, then glibc's
``malloc_trim``); so it is once a burst of large requests ended (``BURST_BYTES``). Allocations of 1 MiB or more are
mapped on their own (``allocator.MMAP_THRESHOLD``), so a burst's large blocks leave no freed memory in malloc's
arenas.

It is also the pipelines' ``Admission`` gate before decoding: a receiver reserves the memory a request may take
(its body, then the decoder's upper estimate, ``receiver.decode.decode_cost``) and is refused while the current
RSS plus what is reserved by requests being read or decoded plus the request would pass the soft limit. A request
that could not fit even alone (more than the soft limit minus the RSS at start) is refused for good (HTTP 413 /
RESOURCE_EXHAUSTED); any other refusal carries the retry delay. So a burst of bodies that inflate while decoding
waits its turn instead of passing the limit between two checks. The allocator's thresholds, the trim and the RSS
read are ``collector_processor.allocator``'s.
"""

from __future__ import annotations

import logging
import threading
import time

from pydantic import Field, model_validator

from collector_processor.allocator import rss_bytes, trim, tune
from collector_processor.component import Refusal
from collector_processor.config.model import MIB
from collector_processor.config.types import Duration, Strict
from collector_processor.registry import BuildContext, Factory
from collector_processor.telemetry import Telemetry

log = logging.getLogger(__name__)
MAX_LIMIT_MIB = 1024 * 1024  # 1 TiB


class Config(Strict):
    limit_mib: float = Field(1024, gt=0, le=MAX_LIMIT_MIB)
    spike_limit_mib: float | None = Field(None, ge=0, le=MAX_LIMIT_MIB)  # default: 20% of limit_mib
    # at least 10 ms: the check reads /proc and may collect garbage; shorter only burns CPU
    check_interval: Duration = Field(1.0, ge=0.01, le=60.0)

    @model_validator(mode="after")
    def _spike(self) -> Config:
        if self.spike_limit_mib is None:
            self.spike_limit_mib = 0.2 * self.limit_mib
        if self.spike_limit_mib >= self.limit_mib:
            raise ValueError("spike_limit_mib must be below limit_mib")
        if self.check_interval <= 0:
            raise ValueError("check_interval must be positive")
        return self


# A request reserving at least this much (its body or decoding) marks a burst: once nothing is reserved any more the
# next check returns the freed heap to the system (glibc keeps freed memory in its arenas otherwise: after a few
# bursts of decoding the RSS stayed over the soft limit and every request was refused for minutes).
BURST_BYTES = 32 * MIB


TRIM_EVERY_S = 10.0  # RSS over a quarter of the way to the soft limit: free arena pages returned this often
REFUSED_TRIM_EVERY_S = 1.0  # a reservation that RSS refuses trims first and looks again, at most this often


class MemoryLimiter:
    def __init__(self, cfg: Config, telemetry: Telemetry) -> None:
        self.cfg = cfg
        self.t = telemetry
        self.hard = int(cfg.limit_mib * MIB)
        self.soft = int((cfg.limit_mib - (cfg.spike_limit_mib or 0)) * MIB)
        self._over = False
        self._lock = threading.Lock()
        self._reserved = 0  # bytes reserved by requests being read or decoded
        self._burst = False  # a large reservation since the memory was last released
        self.releases = 0
        self._trimmed_s = 0.0
        self._refused_trim_s = -REFUSED_TRIM_EVERY_S
        tune()
        self.baseline = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-limiter", daemon=True)
        self.check()

    def refusal(self) -> Refusal | None:
        return Refusal("memory_limit", "memory limit reached") if self._over else None

    def reserve(self, nbytes: int) -> Refusal | None:
        refusal = self.refusal()
        if refusal is not None or nbytes <= 0:
            return refusal
        if nbytes > self.budget():
            return Refusal("memory_limit", f"decoding this request may take {nbytes / MIB:.0f} MiB, more than the "
                           f"memory limit leaves ({self.budget() / MIB:.0f} MiB): send smaller "
                           "requests or raise limit_mib", retry=False)
        for look in (1, 2):
            with self._lock:
                if rss_bytes() + self._reserved + nbytes <= self.soft:
                    self._reserved += nbytes
                    if nbytes >= BURST_BYTES:
                        self._burst = True
                    return None
            now = time.monotonic()
            if look == 2 or now - self._refused_trim_s < REFUSED_TRIM_EVERY_S:
                break
            # what RSS counts may be heap the allocator kept after earlier requests: return it and look again, so
            # an idle collector admits what its budget holds
            self._refused_trim_s = now
            trim(collect=False)  # no collection: this may run on a receiver's event loop
        return Refusal("memory_limit", f"memory limit: {self._reserved / MIB:.0f} MiB of requests being decoded")

    def budget(self) -> int:
        return max(0, self.soft - self.baseline)

    def hold(self, nbytes: int) -> None:
        if nbytes > 0:
            with self._lock:
                self._reserved += nbytes

    def release(self, nbytes: int) -> None:
        if nbytes > 0:
            with self._lock:
                self._reserved = max(0, self._reserved - nbytes)

    def check(self) -> None:
        rss = rss_bytes()
        if rss > self.soft or (self._burst and self._reserved == 0):
            # over the soft limit, or a burst of large requests just ended: give freed memory back now
            self._burst = False
            trim()
            self.releases += 1
            rss = rss_bytes()
        elif rss > self.baseline + (self.soft - self.baseline) // 4 and \
                time.monotonic() - self._trimmed_s >= TRIM_EVERY_S:
            # well above the start, not over the limit: what many small buffers (a flood of connections) left
            self._trimmed_s = time.monotonic()
            trim(collect=False)
            rss = rss_bytes()
        self.t.memory_bytes.set(rss)
        over = rss > self.soft
        if over != self._over:
            log.warning("memory limiter: RSS %.0f MiB %s the soft limit %.0f MiB; %s", rss / MIB,
                        "over" if over else "back under", self.soft / MIB,
                        "refusing data" if over else "accepting data again")
        self._over = over

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.check_interval):
            try:
                self.check()
            except Exception:
                log.exception("memory limiter check failed")

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def _create(ctx: BuildContext, cid: str, cfg: Config) -> MemoryLimiter:
    return MemoryLimiter(cfg, ctx.telemetry)


FACTORY = Factory("processor", "memory_limiter", Config, _create)

"""``nvml``: cause hints for the rank-step summary, sampled from NVML at a low rate, outside the hot path.

Off by default (``OTEL_STRAGGLER_NVML_INTERVAL_S`` = 0): this module is not even imported, no thread runs.
On (e.g. 2 s), the process that builds the rank's step summaries (the export child, or the in-process sink)
starts one daemon thread that every interval reads, for the rank's GPU: the SM clock and its maximum, the
clocks event (throttle) reasons, the GPU temperature, the power draw, the PCIe replay counter and the NVLink
error counters summed over the links. The latest sample is attached to every rank-step summary
(``schema.ATTR_GPU_*``); the collector turns it into a verdict's hint ("SM clock 1,410 MHz vs peers 1,980
(thermal slowdown)"). The training thread never calls NVML; each read is independent (a counter the GPU does not
support is left out). ``pynvml`` comes from the ``nvml`` extra (``nvidia-ml-py``); without it or without a GPU
the sampler says so once and stays off.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from otel_straggler import schema

_log = logging.getLogger(__name__)

# nvmlClocksEventReasons bits (nvml.h), as the names the rank-step carries
REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
_NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS on Hopper
_NVLINK_ERRORS = (0, 1, 2, 3)  # NVML_NVLINK_ERROR_DL_REPLAY, _DL_RECOVERY, _DL_CRC_FLIT, _DL_CRC_DATA


def reasons_of(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit]


class NvmlSampler:
    """Samples one GPU every ``interval_s`` on a daemon thread; ``latest()`` is the newest sample's rank-step
    attributes (an immutable mapping swapped in whole, read without a lock). ``device``: the GPU's UUID, else its
    index. ``module``: the NVML binding (default ``pynvml``, imported at ``start``)."""

    def __init__(self, interval_s: float, device: str | int, module: Any = None) -> None:
        self.interval_s = max(0.05, float(interval_s))
        self.device = device
        self._nvml = module
        self._handle: Any = None
        self._latest: Mapping[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0
        self.errors = 0  # reads that failed (unsupported counters are not counted)

    def start(self) -> bool:
        """Initialise NVML and start the thread; False (logged once) when NVML or the GPU is not there."""
        try:
            nvml = self._nvml if self._nvml is not None else importlib.import_module("pynvml")
            nvml.nvmlInit()
            if isinstance(self.device, str) and self.device.startswith("GPU-"):
                self._handle = nvml.nvmlDeviceGetHandleByUUID(self.device)
            else:
                self._handle = nvml.nvmlDeviceGetHandleByIndex(int(self.device))
        except Exception as exc:  # no binding, no driver, no such GPU: hints off, training unaffected
            _log.info("otel-straggler: NVML hints off (%s: %s)", type(exc).__name__, exc)
            return False
        self._nvml = nvml
        self.sample()
        self._thread = threading.Thread(target=self._run, name="otel-straggler-nvml", daemon=True)
        self._thread.start()
        return True

    def latest(self) -> Mapping[str, Any]:
        return self._latest

    def sample(self) -> Mapping[str, Any]:
        """One sample of every counter (each read on its own), swapped in as the latest."""
        nvml, h = self._nvml, self._handle
        out: dict[str, Any] = {}
        self._read(out, schema.ATTR_GPU_SM_CLOCK_MHZ, lambda: int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)))
        self._read(out, schema.ATTR_GPU_SM_CLOCK_MAX_MHZ,
                   lambda: int(nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM)))
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self._read(out, schema.ATTR_GPU_CLOCK_REASONS, lambda: reasons_of(int(reasons(h))))
        self._read(out, schema.ATTR_GPU_TEMPERATURE_C,
                   lambda: int(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)))
        self._read(out, schema.ATTR_GPU_POWER_W, lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
        self._read(out, schema.ATTR_GPU_PCIE_REPLAYS, lambda: int(nvml.nvmlDeviceGetPcieReplayCounter(h)))
        self._read(out, schema.ATTR_GPU_NVLINK_ERRORS, self._nvlink_errors)
        self._latest = out
        self.samples += 1
        return out

    def _nvlink_errors(self) -> int:
        nvml, h = self._nvml, self._handle
        total = 0
        for link in range(_NVLINK_MAX_LINKS):
            try:
                if not nvml.nvmlDeviceGetNvLinkState(h, link):
                    continue
            except Exception:
                break  # no NVLink, or no more links
            for counter in _NVLINK_ERRORS:
                try:
                    total += int(nvml.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
                except Exception:
                    continue
        return total

    def _read(self, out: dict[str, Any], key: str, read: Callable[[], Any]) -> None:
        try:
            out[key] = read()
        except Exception as exc:
            if "NotSupported" not in type(exc).__name__ and "Not Supported" not in str(exc):
                self.errors += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # never let a driver hiccup end the thread silently in a loop
                self.errors += 1
                time.sleep(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1.0)
        try:
            if self._nvml is not None and self._handle is not None:
                self._nvml.nvmlShutdown()
        except Exception:
            pass


def device_of(resource_attributes: Mapping[str, Any]) -> str | int:
    """The rank's GPU for NVML: its UUID where the identity has one, else its index (or local rank)."""
    uuid = resource_attributes.get(schema.RES_GPU_UUID)
    if isinstance(uuid, str) and uuid.startswith("GPU-"):
        return uuid
    for key in (schema.RES_GPU_INDEX, schema.RES_LOCAL_RANK):
        v = resource_attributes.get(key)
        if isinstance(v, int) and v >= 0:
            return v
    return 0

"""The collector's allocator settings and RSS read (``collector_processor/allocator.py``), each in a fresh process:
glibc's thresholds are process-wide and cannot be read back, so what is checked is their effect."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from collector_processor import allocator

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(allocator._MALLOPT is None, reason="not glibc: nothing is tuned")

# 300 requests' worth of buffers: a 960 KiB block (larger than any hole start-up leaves in the heap) taken from the
# heap's top and freed, as a request's bytes are. Counted: the frees after which the heap was smaller (glibc gave
# its top back with brk; the next block grows it again and its pages are faulted in and zeroed anew).
_CYCLES = r"""
import ctypes
from collector_processor import allocator
SETUP
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]
allocator._LIBC.mallinfo2.restype = Info
shrunk = 0
for _ in range(300):
    b = b"x" * (960 * 1024)
    held = allocator._LIBC.mallinfo2().arena
    del b
    shrunk += allocator._LIBC.mallinfo2().arena < held
print(shrunk)
"""


def _shrinks(setup: str) -> int:
    return int(_python(_CYCLES.replace("SETUP", setup)).split()[-1])


def _python(code: str) -> str:
    """``code`` run by a fresh interpreter with this checkout importable: its standard output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                          env=env).stdout


@pytest.mark.skipif(not hasattr(allocator._LIBC, "mallinfo2"), reason="glibc before 2.33: no mallinfo2")
def test_tune_keeps_the_heap_from_shrinking_and_regrowing_per_request() -> None:
    """Fixing only the mmap threshold (as the memory limiter once did) freezes glibc's trim threshold wherever
    start-up left it, at worst its 128 KiB default: then every freed request-sized block at the heap's top is
    given back and the next one grows the heap again (page faults and zeroing per request: a quarter of the
    throughput bench's decoding time). After ``tune`` the heap keeps it (up to ``TRIM_THRESHOLD``)."""
    frozen_low = _shrinks("allocator._MALLOPT(allocator._M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD); "
                          "allocator._MALLOPT(allocator._M_TRIM_THRESHOLD, 128 * 1024)")
    assert frozen_low >= 290
    assert _shrinks("assert allocator.tune()") == 0


def test_tune_still_maps_large_blocks_on_their_own() -> None:
    """A block of ``MMAP_THRESHOLD`` or more is mapped and unmapped by itself, so a burst of large requests
    leaves no freed memory in the heap: RSS is back within a few MiB once 64 such blocks are freed."""
    code = r"""
from collector_processor import allocator
assert allocator.tune()
before = allocator.rss_bytes()
blocks = [b"x" * (4 << 20) for _ in range(64)]
during = allocator.rss_bytes()
del blocks
print(during - before, allocator.rss_bytes() - before)
"""
    grown, left = (int(x) for x in _python(code).split())
    assert grown >= 200 << 20
    assert left < 8 << 20


def test_rss_bytes_reads_statm() -> None:
    with open("/proc/self/statm", "rb") as f:
        expect = int(f.read().split()[1]) * allocator._PAGE
    assert abs(allocator.rss_bytes() - expect) < 4 << 20


def test_rss_bytes_in_a_forked_child_is_the_childs() -> None:
    """The descriptor is opened on /proc/self of the process that opened it: a forked child opens its own, or it
    would report its parent's RSS."""
    code = r"""
import os
from collector_processor import allocator
parent = allocator.rss_bytes()  # the descriptor is open before the fork
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    block = b"x" * (96 << 20)
    os.write(w, str(allocator.rss_bytes() - parent).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(r, 64).decode())
"""
    assert int(_python(code).split()[-1]) >= 80 << 20

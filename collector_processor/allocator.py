"""The collector process's memory allocator (glibc malloc) and its resident size.

``tune`` fixes two of glibc's thresholds once per process (``cli`` at start, and the memory limiter):

* ``M_MMAP_THRESHOLD`` at 1 MiB: an allocation of at least that is mapped on its own and unmapped when freed, so
  a burst's large blocks (request bytes, the decoder's big blocks) never stay in a malloc arena. glibc otherwise
  raises this threshold to the largest block freed (up to 32 MiB), and after a few bursts of 4 MiB requests
  300 MiB stayed in its arenas that ``malloc_trim`` could not give back (``bench/results/hostile.md``).
* ``M_TRIM_THRESHOLD`` at 4 MiB: the free top of a malloc arena is given back to the system by ``free`` only
  beyond that. Fixing the mmap threshold also freezes this one where start-up left it (glibc's 128 KiB at worst),
  and then every request of a few hundred KiB shrank the heap when its buffers were freed and grew it (page faults
  on fresh pages) for the next: 26-44 page faults per request of the throughput bench and a fifth of its decoding
  time (``bench/results/processor-throughput.md``); from 1 MiB on none. Each arena (one per thread that
  allocates, at most 8 per core) keeps at most this much free at its top; the memory limiter returns everything
  free (``trim``) after a burst, over its soft limit and periodically when well above its start. At 32 MiB the
  arenas kept ~220 MiB after the hostile bench's attacks.

``rss_bytes`` reads ``/proc/self/statm`` through a descriptor kept open (one ``pread``, ~1.5 us against ~10 us
for open-read-close): the memory limiter asks it for every request it admits.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import threading

MMAP_THRESHOLD = 1 << 20
TRIM_THRESHOLD = 4 << 20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_STATM = "/proc/self/statm"


def _libc():  # type: ignore[no-untyped-def]
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune or trim with
        return None


_LIBC = _libc()
_MALLOC_TRIM = getattr(_LIBC, "malloc_trim", None)
if _MALLOC_TRIM is not None:
    _MALLOC_TRIM.argtypes = [ctypes.c_size_t]
    _MALLOC_TRIM.restype = ctypes.c_int
_MALLOPT = getattr(_LIBC, "mallopt", None)
if _MALLOPT is not None:
    _MALLOPT.argtypes = [ctypes.c_int, ctypes.c_int]
    _MALLOPT.restype = ctypes.c_int


def tune() -> bool:
    """Fix glibc's mmap and trim thresholds (``MMAP_THRESHOLD``, ``TRIM_THRESHOLD``); False where they cannot be
    set (not glibc). Idempotent."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(_MALLOPT(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def trim(collect: bool = True) -> None:
    """A full garbage collection (unless ``collect`` is False), then glibc's ``malloc_trim(0)``: free pages of every
    malloc arena go back to the system (a no-op where the C library is not glibc)."""
    if collect:
        gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


_statm_fd = -1
_statm_lock = threading.Lock()


def _forget_statm() -> None:
    """In a forked child the inherited descriptor would read the parent's statm (``/proc/self`` is resolved when
    opened): the child opens its own."""
    global _statm_fd
    if _statm_fd >= 0:
        try:
            os.close(_statm_fd)
        except OSError:
            pass
    _statm_fd = -1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_statm)


def _statm() -> int:
    global _statm_fd
    fd = _statm_fd
    if fd < 0:
        with _statm_lock:
            if _statm_fd < 0:
                _statm_fd = os.open(_STATM, os.O_RDONLY | os.O_CLOEXEC)
            fd = _statm_fd
    return fd


def rss_bytes() -> int:
    """The process's resident set size in bytes (its peak where ``/proc`` cannot be read)."""
    try:
        return int(os.pread(_statm(), 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, not current: best effort

"""Giving the C heap's free pages back to the kernel (glibc ``malloc_trim``).

An agent process allocates its sessions' CPU tensors, numpy buffers and large Python
containers through glibc malloc. malloc keeps what is freed in its arenas for reuse and
gives memory back by itself only from the top of a heap (above ``M_TRIM_THRESHOLD``). Busy
hours leave the heap at their peak size with live allocations scattered through it, so
the freed holes below them stay resident: the process's RSS does not come down after a
peak and creeps up with each busier one, although what is in use comes back down.
``malloc_trim(0)`` hands every whole free page inside the arenas back (``madvise``),
moving nothing; a page used again later is faulted back in, zeroed.

:class:`HeapTrimmer` does that at most once every ``interval_s``, when its owner asks at a
point where memory was just freed (``KVRouter.release``). Where there is no glibc (musl,
macOS) it does nothing. Thread-safe; one trim at a time.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvfs.heap")

#: seconds between two trims by default: a busy agent releases sessions several times a
#: second, and a trim walks every arena (milliseconds on a heap of a few hundred MiB)
DEFAULT_INTERVAL_S = 10.0

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        fn = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_malloc_trim = _load_malloc_trim()


def available() -> bool:
    """Whether this process's C library can trim its heap (glibc)."""
    return _malloc_trim is not None


def resident_bytes() -> int | None:
    """This process's resident set (``/proc/self/statm``); None where there is none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


class HeapTrimmer:
    """Trims the C heap at most once every ``interval_s`` (0 or less: never).

    ``trim`` and ``clock`` replace ``malloc_trim`` and ``time.monotonic`` (tests).
    """

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, *,
                 trim: Callable[[int], int] | None = _malloc_trim,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = float(interval_s)
        self._trim = trim
        self._clock = clock
        self._last: float | None = None
        self._lock = threading.Lock()
        # statistics
        self.trims = 0
        self.trim_s = 0.0
        self.max_trim_s = 0.0  # the longest: the pause of the thread that asked
        self.returned_bytes = 0  # RSS before minus after each trim (other threads blur it)

    @property
    def enabled(self) -> bool:
        return self._trim is not None and self.interval_s > 0

    def maybe_trim(self) -> bool:
        """Trim now unless the last trim was less than ``interval_s`` ago; whether it did."""
        if not self.enabled:
            return False
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            return False
        if not self._lock.acquire(blocking=False):  # another thread is trimming
            return False
        try:
            self._last = now
            self._run()
        finally:
            self._lock.release()
        return True

    def _run(self) -> None:
        assert self._trim is not None
        before = resident_bytes()
        t0 = time.perf_counter()
        self._trim(0)
        took = time.perf_counter() - t0
        after = resident_bytes()
        returned = max(0, before - after) if before is not None and after is not None else 0
        self.trims += 1
        self.trim_s += took
        self.max_trim_s = max(self.max_trim_s, took)
        self.returned_bytes += returned
        log.debug("heap trimmed in %.2f ms: %d KiB returned", took * 1e3, returned >> 10)

    def stats(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "enabled": self.enabled, "trims": self.trims,
                "trim_ms_total": round(self.trim_s * 1e3, 3), "trim_ms_max": round(self.max_trim_s * 1e3, 3),
                "returned_bytes": self.returned_bytes}

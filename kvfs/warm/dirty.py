"""Sessions with changes their cold copy lacks: since when, and how many bytes.

Write-behind (writeback.py) writes them within ``writebehind_s`` of their first change,
or sooner once ``writebehind_bytes`` are waiting (``wake`` is set then). Thread-safe.
"""

from __future__ import annotations

import threading
import time


class DirtySet:
    def __init__(self, every_s: float, max_bytes: int, on: bool) -> None:
        self.every_s, self.max_bytes, self.on = float(every_s), int(max_bytes), on
        self._d: dict[str, list] = {}  # sid -> [monotonic time of first change, bytes]
        self.bytes = 0
        self.wake = threading.Event()
        self._lock = threading.Lock()

    def mark(self, sid: str, n: int) -> None:
        with self._lock:
            d = self._d.get(sid)
            if d is None:
                self._d[sid] = [time.monotonic(), n]
            else:
                d[1] += n
            self.bytes += n
            wake = self.bytes >= self.max_bytes
        if wake and self.on:
            self.wake.set()

    def drop(self, sid: str) -> float | None:
        """Forget that ``sid`` is dirty; returns when it became dirty."""
        with self._lock:
            d = self._d.pop(sid, None)
            if d is None:
                return None
            self.bytes -= d[1]
            return d[0]

    def since(self, sid: str) -> tuple[float, int] | None:
        """(time of its first change, bytes) of a dirty session."""
        with self._lock:
            d = self._d.get(sid)
            return (d[0], d[1]) if d is not None else None

    def written(self, sid: str, n: int) -> None:
        """``n`` bytes were written (not made durable): they no longer count towards the
        byte threshold; the session stays dirty."""
        with self._lock:
            d = self._d.get(sid)
            if d is not None:
                k = min(d[1], n)
                d[1] -= k
                self.bytes -= k

    def names(self) -> list[str]:
        with self._lock:
            return list(self._d)

    def due(self, now: float) -> tuple[float, bool]:
        """When the next background pass is due (inf: none), and whether it is the one of
        the time lag (write and make durable) rather than of the byte threshold (write)."""
        with self._lock:
            if not self._d:
                return float("inf"), True
            at = min(d[0] for d in self._d.values()) + self.every_s
            full = at <= now or self.bytes < self.max_bytes
            return (at if full else now), full

    def __contains__(self, sid: object) -> bool:
        return sid in self._d

    def __len__(self) -> int:
        return len(self._d)

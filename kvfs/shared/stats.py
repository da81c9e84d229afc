"""Counters and latency samples of one ``SharedTier`` (plain numbers; exporting them is
the metrics layer's business)."""

from __future__ import annotations

import threading
from collections import deque

COUNTERS = ("hits", "misses", "bytes_in", "bytes_out", "appends", "reads", "syncs",
            "sync_unreplicated", "corrupt", "refetches", "unavailable", "lease_takeovers",
            "lease_lost", "evicted_sessions", "compactions", "forged_leases")
LATENCIES = ("read", "append", "sync")


class Stats:
    """Thread-safe counters (``COUNTERS``) and the last ``window`` latencies per operation."""

    def __init__(self, window: int = 4096) -> None:
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.samples: dict[str, deque[float]] = {op: deque(maxlen=window) for op in LATENCIES}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def time(self, op: str, ms: float) -> None:
        with self._lock:
            self.samples[op].append(ms)

    def quantile(self, op: str, q: float) -> float:
        with self._lock:
            s = sorted(self.samples[op])
        return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self.counts)
        for op in LATENCIES:
            out[f"{op}_ms_p50"] = self.quantile(op, 0.50)
            out[f"{op}_ms_p99"] = self.quantile(op, 0.99)
        return out

"""The bytes the warm tier holds in RAM and the cap they may reach.

The cap is at most what the RAM filesystem can hold (``os.statvfs``: free space plus what
the tier holds, less a margin of min(8 MiB, 5 %), at least 64 KiB), refreshed as other
processes fill or empty it; migration starts past ``migrate_at`` of it. Publishes the
tier's gauges. Thread-safe.
"""

from __future__ import annotations

import os
import threading

from kvfs.ops import metrics

from .rootdir import RootDir
from .space import PAGE

MARGIN_MAX = 8 << 20  # room left free on the RAM filesystem: at most 8 MiB, at most 5%


class Budget:
    def __init__(self, rootdir: RootDir, cap_bytes: int, migrate_at: float) -> None:
        self.rootdir = rootdir
        self.cap_bytes = int(cap_bytes)  # as configured
        self.cap = self.cap_bytes  # what the RAM filesystem allows now
        self.migrate_at = float(migrate_at)
        self.bytes = 0
        self.warned_full = False  # "over the threshold and no cold tier" logged
        self._lock = threading.Lock()

    def add(self, delta: int) -> None:
        with self._lock:
            self.bytes += delta

    def refresh(self) -> None:
        try:
            st = os.fstatvfs(self.rootdir.fd)
        except OSError:
            return
        total = st.f_blocks * st.f_frsize
        room = st.f_bavail * st.f_frsize + self.bytes - max(64 << 10, min(MARGIN_MAX, total // 20))
        self.cap = max(PAGE, min(self.cap_bytes, room))

    @property
    def limit(self) -> float:
        """Bytes past which a group is migrated."""
        return self.migrate_at * self.cap

    @property
    def ratio(self) -> float:
        return self.bytes / self.cap

    def gauges(self, sessions: int) -> None:
        metrics.warm_bytes.set(self.bytes)
        metrics.warm_sessions.set(sessions)
        metrics.warm_usage_ratio.set(self.bytes / self.cap)

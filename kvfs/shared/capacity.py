"""The cluster's bound on session bytes (``max_bytes``): bookkeeping and eviction.

Each write also updates the capacity slot ``kvfs:{/capacity}:`` (last write time and bytes
per session, and their total); when the total passes the bound, the least recently written
sessions that nobody holds a lease on are deleted until it is under (``evicted_sessions``).
The total is bookkeeping beside the data (not atomic with it) and ages out sessions that
expired on their own; Redis's own ``maxmemory`` stays the hard limit. Expiring or evicting a
session here never removes it from the volumes that hold it.
"""

from __future__ import annotations

import logging
from typing import Any

from .chunks import CAP_TAG, SessionKeys
from .client import ClusterClient
from .errors import SharedUnavailable
from .lease import Leases
from .scripts import DELETE, FORGET, NOTE_WRITE, status
from .stats import Stats

log = logging.getLogger(__name__)
KEYS = [CAP_TAG + "lru", CAP_TAG + "bytes", CAP_TAG + "total"]


class Capacity:
    """The bound of one tier; does nothing when ``max_bytes`` is None."""

    def __init__(self, client: ClusterClient, leases: Leases, max_bytes: int | None,
                 retention_ms: int, chunk_bytes: int, stats: Stats) -> None:
        self._c, self._leases, self.max_bytes = client, leases, max_bytes
        self.retention_ms, self.chunk_bytes, self._stats = retention_ms, chunk_bytes, stats

    def _cap(self, script: str, args: list[Any]) -> int | None:
        try:
            return int(self._c.eval("capacity", script, KEYS, args))
        except SharedUnavailable as e:     # bookkeeping only: the write itself succeeded
            log.warning("capacity bookkeeping skipped: %s", e)
            return None

    def wrote(self, session: str, delta: int) -> None:
        """``session`` grew (or shrank) by ``delta`` bytes; evict if over the bound."""
        if self.max_bytes is None:
            return
        total = self._cap(NOTE_WRITE, [session, delta, self.retention_ms])
        if total is not None and total > self.max_bytes:
            self._evict(total, protect=session)

    def forget(self, session: str) -> None:
        if self.max_bytes is not None:
            self._cap(FORGET, [session])

    def _evict(self, total: int, protect: str) -> None:
        """Drop least recently written sessions (none leased) until under ``max_bytes``."""
        lru = CAP_TAG + "lru"
        names = self._c.guard(lru, "evict", lambda: self._c.rc.zrange(lru, 0, 31))
        for raw in names:
            s = raw.decode() if isinstance(raw, bytes) else str(raw)
            if s == protect or s in self._leases:
                continue
            k = SessionKeys(s)
            res = self._c.eval(f"evict {s}", DELETE,
                               [k.files, k.lease, k.meta, k.holder, k.sync, k.owner, k.vers],
                               [self._leases.value(s), self.chunk_bytes, k.prefix, "evict"])
            if status(res) != "OK":
                continue
            self._stats.add("evicted_sessions")
            log.info("shared tier over %d bytes: dropped session %s (least recently written)",
                     self.max_bytes, s)
            t = self._cap(FORGET, [s])
            total = total if t is None else t
            if total <= (self.max_bytes or 0):
                return
        log.warning("shared tier holds %d bytes over its bound of %d: every old session is leased",
                    total, self.max_bytes)

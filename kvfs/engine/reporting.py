"""What a ``Store`` reports about itself: usage and the stats of ``/.kvfs/stats`` (a mixin
of ``Store``, which owns every attribute read here). Read-only: nothing here changes the
volume or the index."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from .types import Usage

if TYPE_CHECKING:
    from .btree import BTree
    from .failsafe import FsckMark
    from .format import Superblock
    from .index import Index
    from .quota import Ledger
    from .ring import Ring, ScanReport
    from .volume import VolumeFile


class Reporting:
    """Store's reporting methods; the attributes below are the store's."""

    _lock: threading.RLock
    ring: Ring
    vol: VolumeFile
    idx: Index
    sb: Superblock
    counters: dict[str, int]
    last_ckpt: float
    open_report: ScanReport | None
    fsck_mark: FsckMark
    needs_fsck: bool
    tree: BTree
    quota: Ledger
    ring_only: bool

    def usage(self) -> Usage:
        with self._lock:
            return self._usage()

    def _usage(self) -> Usage:
        return Usage(self.ring.size, self.ring.used(), self.idx.n_sessions, self.ring.head,
                     self.ring.tail, self.sb.ckpt_pos, time.monotonic() - self.last_ckpt,
                     self.counters["raw_written"], self.counters["stored_written"])

    @property
    def volume_id(self) -> str:
        """The volume's uuid (hex): stable for its life, distinct between volumes."""
        return self.sb.uuid.hex()

    def stats(self) -> dict:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        u = self._usage()
        raw, st = self.counters["raw_written"], self.counters["stored_written"]
        rep = self.open_report
        return {
            "volume": {"path": self.vol.path, "uuid": self.volume_id, "size": self.sb.volume_size,
                       "capacity": u.capacity,
                       "used": u.used, "used_ratio": u.used / u.capacity, "sessions": u.sessions,
                       "head": u.head, "tail": u.tail, "checkpoint_pos": u.checkpoint_pos,
                       "checkpoint_age_s": round(u.checkpoint_age_s, 3),
                       "needs_fsck": self.needs_fsck, "needs_fsck_reason": self.fsck_mark.reason},
            "index": {"hot_sessions": len(self.idx.hot), "pinned_sessions": len(self.idx.pinned),
                      "tree": self.tree.stats(), "ring_only": self.ring_only},
            "quota": self.quota.stats(),
            "counters": dict(self.counters),
            "compression_ratio": round(raw / st, 4) if st else 1.0,
            "recovery": None if rep is None else {
                "entries_replayed": rep.entries, "corrupt_regions": len(rep.corrupt or []),
                "torn_tail": rep.torn_tail},
        }

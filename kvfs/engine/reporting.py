"""What a ``Store`` reports about itself: usage and the stats of ``/.kvfs/stats``, read
from its ``StoreState`` under the store's state lock. Read-only: nothing here changes the
volume or the index."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .types import Usage

if TYPE_CHECKING:
    from .state import StoreState


def usage_of(store: StoreState) -> Usage:
    """Under the state lock."""
    return Usage(store.ring.size, store.ring.used(), store.idx.n_sessions, store.ring.head,
                 store.ring.tail, store.sb.ckpt_pos, time.monotonic() - store.last_ckpt,
                 store.counters["raw_written"], store.counters["stored_written"])


def stats_of(store: StoreState) -> dict:
    """Under the state lock: the JSON-able counters of ``/.kvfs/stats``."""
    u = usage_of(store)
    raw, st = store.counters["raw_written"], store.counters["stored_written"]
    rep = store.open_report
    return {
        "volume": {"path": store.vol.path, "uuid": store.sb.uuid.hex(), "size": store.sb.volume_size,
                   "capacity": u.capacity,
                   "used": u.used, "used_ratio": u.used / u.capacity, "sessions": u.sessions,
                   "head": u.head, "tail": u.tail, "checkpoint_pos": u.checkpoint_pos,
                   "checkpoint_age_s": round(u.checkpoint_age_s, 3),
                   "needs_fsck": store.needs_fsck, "needs_fsck_reason": store.fsck_mark.reason},
        "index": {"hot_sessions": len(store.idx.hot), "pinned_sessions": len(store.idx.pinned),
                  "tree": store.tree.stats(), "ring_only": store.ring_only},
        "quota": store.quota.stats(),
        "catalog": None if store.catalog is None else {
            "sessions": len(store.catalog), **store.catalog.counts},
        "counters": dict(store.counters),
        "compression_ratio": round(raw / st, 4) if st else 1.0,
        "recovery": None if rep is None else {
            "entries_replayed": rep.entries, "corrupt_regions": len(rep.corrupt or []),
            "torn_tail": rep.torn_tail},
    }

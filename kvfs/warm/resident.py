"""The RAM copies of sessions: what the warm tier's parts share, with named seams.

A ``Resident`` is composed of the shard files (``ShardStore``), the order sessions leave RAM
in (``EvictionPolicy``), the bytes they hold (``Budget``), which ones have changes their
cold copy lacks (``DirtySet``), the sessions this process holds (``HeldSessions``) and the
cold tier (``ColdBackend``). It adds what they do together: a session's warm record (made
on first write, whole before it is published: a cold copy's meta and summaries loaded
into it), use, accounting, marking dirty, and dropping a RAM copy. The parts above it --
reads, write-behind, migration, validation, the tier's API -- use only this and those
seams.

State of a session, per layer: the warm shard holds bytes [base, size) and the cold copy
holds at least [0, base). The cold copy is always a *prefix* of the true content:
migration appends only the missing tail, truncate cuts cold before warm. So a session in
both tiers reads correctly from either side, and after a crash "the cold copy is
complete" is just "its sizes match".

Locks, in this order only: a session's cold-I/O lock (``io_lock``, striped; held from
reading a session's tail to recording what reached cold), its shard's lock
(``locked``). The parts' own locks are taken briefly and never while waiting for another.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Literal, overload

import numpy as np

from kvfs.ops import metrics
from kvfs.session import files
from kvfs.session.backend import ColdBackend
from kvfs.session.formats import parse_meta

from .budget import Budget
from .dirty import DirtySet
from .held import HeldSessions
from .kvmap_format import FLAG_CLEAN, FLAG_ON_COLD, K_SUMMARY
from .policy import EvictionPolicy
from .shard import ShardFile
from .shard_index import WarmSession
from .shards import ShardStore, Slot

IO_STRIPES = 64
POOL_THREADS = 8


def new_incarnation() -> int:
    return int.from_bytes(os.urandom(8), "little") or 1


class Resident:
    def __init__(self, shards: ShardStore, policy: EvictionPolicy, budget: Budget,
                 dirty: DirtySet, held: HeldSessions, cold: ColdBackend | None,
                 clock: Callable[[], float], dim: int) -> None:
        self.shards, self.policy, self.budget = shards, policy, budget
        self.dirty, self.held, self.cold = dirty, held, cold
        self.clock, self.row = clock, 4 * dim  # bytes of one round summary
        self.stats = {"migrations": 0, "promotions": 0, "hits": 0, "misses": 0, "groups": 0}
        self._stats_lock = threading.Lock()
        self._io = [threading.RLock() for _ in range(IO_STRIPES)]
        self._pool: ThreadPoolExecutor | None = None

    @property
    def _cold(self) -> ColdBackend:
        """The cold tier, where a caller runs only with one."""
        assert self.cold is not None
        return self.cold


    # ---- locks ------------------------------------------------------------------------
    def io_lock(self, sid: str) -> threading.RLock:
        return self._io[hash(sid) % IO_STRIPES]

    def locked(self, sid: str) -> AbstractContextManager[Slot]:
        return self.shards.locked(sid)

    def pool(self) -> ThreadPoolExecutor:
        """Threads for work that need not hold up the caller (unmapping dropped files)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="kvfs-warm-pool")
        return self._pool

    def close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    # ---- a session's record ------------------------------------------------------------
    @overload
    def warm(self, slot: Slot, sid: str, create: Literal[True]) -> tuple[ShardFile, WarmSession]: ...
    @overload
    def warm(self, slot: Slot, sid: str, create: bool = False
             ) -> tuple[ShardFile | None, WarmSession | None]: ...

    def warm(self, slot: Slot, sid: str, create: bool = False
             ) -> tuple[ShardFile | None, WarmSession | None]:
        """The shard file and warm record of ``sid`` (shard lock held); with ``create``,
        make them, loading meta and summaries of a cold copy so the record is whole."""
        f = slot.file
        s = f.sessions.get(sid) if f is not None else None
        if s is not None or not create:
            return f, s
        if f is None:
            f = self.shards.new_file(slot)
        cs = self._cold.state(sid) if self.cold else None
        cold, inc = cs if cs is not None else (None, None)
        assert cold is None or self.cold is not None
        s = f.new_session(sid, self.clock(), live=cold is None, inc=inc or new_incarnation())
        s.cold, held = cold, 0
        if cold is not None:  # the warm record must be whole before it is published
            try:
                raw = files.read_meta_bytes(self._cold, sid)
                if raw and parse_meta(raw, sid) is not None:
                    held += f.put_meta(s, raw)
                summ = files.read_summaries(self._cold, sid)
                n = len(summ) // self.row * self.row
                if n:
                    held += f.write(s, K_SUMMARY, 0, 0, np.frombuffer(summ, np.uint8, n))
                s.cmeta, s.csumm = raw or None, summ
                if inc is not None and n == len(summ):  # what cold has, and its id
                    f.set_flags(s, FLAG_ON_COLD | FLAG_CLEAN)
            except BaseException:
                f.drop(s)
                raise
            f.publish_session(s)
        self.policy.touch(sid)
        self.budget.add(held)
        return f, s

    def touch(self, f: ShardFile, s: WarmSession) -> None:
        f.set_last_used(s, self.clock())
        self.policy.touch(s.name)

    @staticmethod
    def span(s: WarmSession, layer: int) -> tuple[int, int]:
        """(base, size) of a layer of a warm session: bytes below base are on cold."""
        st = s.layers.get(layer)
        if st is not None and st.segs:
            return st.base, st.end
        c = (s.cold or {}).get(layer, 0)
        return c, c

    def summary_bytes(self, f: ShardFile, s: WarmSession) -> bytes:
        out = np.empty(s.summary.end, np.uint8)
        f.read_into(s, s.summary, 0, s.summary.end, out, "summaries")
        return out.tobytes()

    # ---- accounting -------------------------------------------------------------------
    def account(self, delta: int) -> None:
        self.budget.add(delta)
        self.gauges()

    def gauges(self) -> None:
        self.budget.gauges(len(self.policy))

    def bump(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[name] += n

    def count(self, hit: bool) -> None:
        self.bump("hits" if hit else "misses")
        (metrics.warm_hits if hit else metrics.warm_misses).inc()

    def mark_dirty(self, f: ShardFile, s: WarmSession, n: int) -> None:
        """Before a change of ``s`` (shard lock held): not clean any more -- the flag goes
        first, so that after a crash a clean flag never covers bytes cold lacks."""
        if s.flags & FLAG_CLEAN:
            f.set_flags(s, s.flags & ~FLAG_CLEAN)
        self.dirty.mark(s.name, n)

    def drop(self, slot: Slot, f: ShardFile, s: WarmSession) -> int:
        """Remove a session's RAM copy (shard lock held); returns the bytes freed."""
        sid = s.name
        freed = f.drop(s)
        if not f.sessions:
            self.shards.remove_file(slot, self.pool())
        self.dirty.drop(sid)
        self.policy.remove(sid)
        self.budget.add(-freed)
        self.held.see(sid, False)
        self.gauges()
        return freed

    def sessions(self) -> Iterator[str]:
        return iter(self.policy.names())

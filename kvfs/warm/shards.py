"""The shard files of one process's RAM tier: one lock per shard, mappings bounded.

``locked(sid)`` is how every access to a session's bytes starts: the session id checked,
its shard's slot (made on first use, forgotten once idle without a file) held locked, and
the least recently used shards beyond ``max_open`` unmapped on the way (skipping any that
are busy), so a process serving many sessions keeps a bounded number of mappings. ``load`` opens the files a
process left at start-up (files of a dead process's making or dropping removed; older
versions discarded: the tier is a cache; damaged files set aside). Owns no session state
beyond what the files hold.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Executor

from .ids import WarmError, check_sid, shard_file_name, shard_of
from .rootdir import RootDir
from .shard import ShardFile
from .shard_index import ShardCorrupt
from .shardload import ShardOutdated, load_shard

log = logging.getLogger("kvfs.warm")


class Slot:
    """One shard number in a WarmTier: its lock, its open file (None: no file) and how
    many callers hold it (counted under the store's lock: a slot without a file and
    without users is forgotten, so a process that touched 65,536 shards once does not
    keep 65,536 locks)."""

    __slots__ = ("shard", "lock", "file", "users")

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.lock = threading.RLock()
        self.file: ShardFile | None = None
        self.users = 0


class ShardStore:
    def __init__(self, rootdir: RootDir, root: str, shards: int, key: int, dim: int,
                 clock: Callable[[], float], max_open: int) -> None:
        self.rootdir, self.root = rootdir, root
        self.shards, self.key, self.dim, self.clock, self.max_open = shards, key, dim, clock, max_open
        self.closed = False
        self._slots: dict[int, Slot] = {}
        self._mapped: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()

    # ---- access -----------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self, sid: str) -> Iterator[Slot]:
        """Hold ``sid``'s shard locked (see the module doc); WarmError once closed. An
        OSError inside becomes a WarmError naming the path."""
        check_sid(sid)
        shard = shard_of(sid, self.shards, self.key)
        with self._lock:
            if self.closed:
                raise WarmError("warm tier is closed")
            slot = self._slots.get(shard)
            if slot is None:
                slot = self._slots[shard] = Slot(shard)
            slot.users += 1
            self._mapped[shard] = None
            self._mapped.move_to_end(shard)
            over = list(itertools.islice(self._mapped, max(0, len(self._mapped) - self.max_open)))
        try:
            with slot.lock:
                for k in over:
                    self._try_unmap(k)
                try:
                    yield slot
                except OSError as e:  # every failure of the tier is a WarmError
                    where = e.filename if e.filename else f"warm tier {self.root}"
                    raise WarmError(f"{where!r}: {e.strerror or e}") from e
        finally:
            self._let_go(slot)

    def _let_go(self, slot: Slot) -> None:
        """One user of ``slot`` is done; an idle slot without a file is forgotten (no
        thread holds or waits for its lock: each would have counted itself first)."""
        with self._lock:
            slot.users -= 1
            if slot.users == 0 and slot.file is None and self._slots.get(slot.shard) is slot:
                del self._slots[slot.shard]
                self._mapped.pop(slot.shard, None)

    def _try_unmap(self, shard: int) -> None:
        slot = self._slots.get(shard)
        if slot is None or not slot.lock.acquire(blocking=False):
            return
        try:
            if slot.file is not None:
                slot.file.unmap()
            with self._lock:
                if self._slots.get(shard) is slot:
                    self._mapped.pop(shard, None)
        finally:
            slot.lock.release()

    def slots(self) -> list[Slot]:
        """The slots known now (those with a file, and those in use)."""
        with self._lock:
            return list(self._slots.values())

    def file(self, shard: int) -> ShardFile | None:
        """The open file of shard ``shard`` (tests and tools look inside)."""
        slot = self._slots.get(shard)
        return slot.file if slot is not None else None

    def count_files(self) -> int:
        return sum(1 for s in self.slots() if s.file is not None)

    # ---- files ------------------------------------------------------------------------
    def new_file(self, slot: Slot) -> ShardFile:
        f = slot.file = ShardFile.create(self.rootdir, shard_file_name(slot.shard, self.shards),
                                         slot.shard, self.shards, self.key, self.dim, self.clock())
        return f

    def remove_file(self, slot: Slot, pool: Executor | None = None) -> None:
        """Remove a shard file without sessions (slot locked). With ``pool``: renamed out
        of the way now, unmapped and unlinked there (freeing a big tmpfs file's pages takes
        milliseconds)."""
        f, slot.file = slot.file, None
        if f is None:
            return
        if pool is None:
            f.unmap(flush=False)
            self.rootdir.unlink(f.name)
            return
        with self._lock:
            slot.users += 1  # the slot (its lock) outlives the caller until the unlink
        pool.submit(self._discard, slot, f)

    def _discard(self, slot: Slot, f: ShardFile) -> None:
        try:
            f.discard()  # unmapping a big mapping takes milliseconds too
            with slot.lock, contextlib.suppress(OSError, WarmError):
                if slot.file is None and self.rootdir.lstat(f.name).st_ino == f.ino:
                    self.rootdir.unlink(f.name)  # not a new file of this shard made meanwhile
        finally:
            self._let_go(slot)

    def load(self) -> list[tuple[Slot, ShardFile]]:
        """Open the shard files found at start-up (module doc); WarmError when one was
        made with other settings (shards, shard key, summary size)."""
        out = []
        for name in sorted(self.rootdir.listdir()):
            path = self.rootdir.join(name)
            if ".kvmap.tmp." in name or ".kvmap.drop." in name:  # made or dropped by a dead process
                self.rootdir.unlink(name)
                continue
            if not name.endswith(".kvmap"):
                continue
            try:
                f = load_shard(self.rootdir, name)
                if name != shard_file_name(f.shard, f.shards):
                    raise ShardCorrupt(f"header says shard {f.shard}")
            except ShardOutdated as e:
                log.warning("warm shard %s: %s; discarded (a cache: sessions are served from "
                            "their cold copies)", path, e)
                self.rootdir.unlink(name)
                continue
            except (ShardCorrupt, WarmError, OSError) as e:
                aside = f"{name}.corrupt.{int(time.time())}"
                log.error("warm shard %s: %s; its sessions are treated as missing (kept as %s)",
                          path, e, aside)
                with contextlib.suppress(WarmError):
                    self.rootdir.rename(name, aside)
                continue
            if (f.shards, f.key, f.dim) != (self.shards, self.key, self.dim):
                f.unmap()
                raise WarmError(
                    f"warm root {self.root!r} was made with shards={f.shards}, "
                    f"shard_key={'device' if f.key else 'session'}, summary_dim={f.dim}")
            slot = self._slots[f.shard] = Slot(f.shard)
            slot.file = f
            out.append((slot, f))
        return out

    def flush(self) -> None:
        """msync every mapped shard."""
        for slot in self.slots():
            with slot.lock:
                if slot.file is not None:
                    slot.file.flush()

    def close(self) -> None:
        """No access from now on; every shard unmapped."""
        with self._lock:
            self.closed = True
        for slot in self.slots():
            with slot.lock:
                if slot.file is not None:
                    slot.file.unmap()

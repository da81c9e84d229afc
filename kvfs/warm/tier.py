"""WarmTier: sessions in RAM shards, a global LRU, the locks and the writes. Its reads
(reads.py), write-behind to cold (writeback.py, validate.py), migration to and promotion
from cold (migrate.py) and housekeeping (lifecycle.py) are mixins of it.

State of a session, per layer: the warm shard holds bytes [base, size) and the cold copy
(``cold_root/sessions/<sid>/layer_<n>``) holds at least [0, base). The cold copy is always
a *prefix* of the true content: migration appends only the missing tail, truncate cuts
cold before warm. So a session in both tiers reads correctly from either side, and after
a crash "the cold copy is complete" is just "its sizes match" (``_cold_complete``).

Locks: one lock per shard, held around every file and memmap access of that shard
(cold reads included; a migration's cold writes too, not write-behind's); a session's
cold-I/O lock taken before it (writeback.py); one global lock for the LRU, the byte
count and the shard table, only ever taken briefly and never while waiting for a shard
lock; one migration lock, so that a single thread migrates at a time (the appending
thread that crossed the threshold, or ``migrate``). Migrations start only after the
caller's shard lock is released. Contract: one writer per session, any number of
readers; one process at a time per session (owners.py).

Room: the cap is at most what the RAM filesystem can hold (``os.statvfs``: free space
plus what the tier holds, less a margin), and every range is reserved before it is
written through a mapping (space.py): a full tmpfs means eviction to the mount, or a
WarmError, never a SIGBUS.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np

from kvfs.ops import metrics

from .cold import META, SUMMARIES, ColdStore, layer_name, side_stream
from .format import FLAG_CLEAN, FLAG_ON_COLD, K_LAYER, K_SUMMARY, KEY_DEVICE, KEY_SESSION
from .ids import (
    WarmError,
    WarmFull,
    as_u8,
    check_layer,
    check_shards,
    check_sid,
    shard_file_name,
    shard_of,
)
from .lifecycle import Lifecycle
from .migrate import Mover
from .owners import SessionLocks, adopt_dead, check_volume_id, claim_dir
from .reads import Reads
from .records import Slot, WarmSession
from .rootdir import RootDir
from .shard import ShardFile
from .space import PAGE
from .validate import Validator
from .writeback import WriteBehind, new_incarnation

T = TypeVar("T")
MARGIN_MAX = 8 << 20  # room left free on the RAM filesystem: at most 8 MiB, at most 5%


class WarmTier(Reads, Mover, WriteBehind, Validator, Lifecycle):
    """The warm tier. See ``docs/contracts/warm-api.md`` and the package docstring."""

    def __init__(self, cold_root: str | None, root: str = "/dev/shm/kvfs-warm", *,
                 cap_bytes: int = 16 << 30, migrate_at: float = 0.85, group: int = 10,
                 shards: int = 65536, shard_key: str = "session", summary_dim: int = 128,
                 clock: Callable[[], float] = time.time, max_open_shards: int = 512,
                 retry_s: float = 1.0, retry_max_s: float = 300.0, writebehind: bool = True,
                 writebehind_s: float = 2.0, writebehind_bytes: int = 64 << 20,
                 volume_id: str | None = None) -> None:
        if shard_key not in ("session", "device"):
            raise WarmError(f"shard_key must be 'session' or 'device', got {shard_key!r}")
        self.key = KEY_SESSION if shard_key == "session" else KEY_DEVICE
        check_shards(shards, self.key)
        if cap_bytes <= 0 or not 0 < migrate_at <= 1 or group < 1 or summary_dim < 1 or max_open_shards < 1:
            raise WarmError("cap_bytes, group, summary_dim, max_open_shards must be > 0 and 0 < migrate_at <= 1")
        if not 0 < retry_s <= retry_max_s:
            raise WarmError("retry_s must be > 0 and at most retry_max_s")
        self.volume_id = check_volume_id(volume_id) if volume_id is not None else None
        self.cold = ColdStore(cold_root) if cold_root is not None else None  # WarmError if absent
        self.root, self.cap, self.migrate_at, self.group = root, int(cap_bytes), float(migrate_at), int(group)
        self.cap_bytes = self.cap  # the configured cap; ``cap`` is what the RAM filesystem allows
        self.shards, self.dim, self.clock, self.max_open = shards, int(summary_dim), clock, max_open_shards
        self._row = 4 * self.dim  # bytes of one round summary
        self._dirs: list[RootDir] = []
        try:  # each a WarmError if it is not safely ours
            top = self._keep(RootDir(root))
            base = self._keep(top.sub(self.volume_id)) if self.volume_id is not None else top
            self.locks = SessionLocks(self._keep(base.sub("locks")))
            self.rootdir = self._keep(claim_dir(base))  # this process's shards (flock'ed)
            adopt_dead(base, self.rootdir, legacy=self.volume_id is None)
        except BaseException:
            self._close_dirs()
            raise
        self.retry_s, self.retry_max_s = float(retry_s), float(retry_max_s)
        self._backoff = 0.0  # current retry interval after failed migrations; 0: healthy
        self._retry_at = 0.0  # time.monotonic() before which no migration is tried
        self._cold_error: str | None = None  # why the last migration failed
        self._lock = threading.RLock()
        self._mig_lock = threading.Lock()
        self._slots: dict[int, Slot] = {}
        self._mapped: OrderedDict[int, None] = OrderedDict()
        self._lru: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._closed = False
        self._warned_full = False
        self.stats = {"migrations": 0, "promotions": 0, "hits": 0, "misses": 0, "groups": 0}
        try:
            self._init_writebehind(writebehind, writebehind_s, writebehind_bytes)
            self._scan()
        except BaseException:
            self._close_dirs()
            raise
        self._refresh_cap()
        self._gauges()
        self._start_writer()

    def _keep(self, d: RootDir) -> RootDir:
        self._dirs.append(d)
        return d

    def _close_dirs(self) -> None:
        for d in reversed(self._dirs):  # the process directory's flock goes with its fd
            d.close()

    def _refresh_cap(self) -> None:
        """Cap at what the RAM filesystem can hold: free space plus what we hold, less a
        margin (min(8 MiB, 5%) of it, at least 64 KiB)."""
        try:
            st = os.fstatvfs(self.rootdir.fd)
        except OSError:
            return
        total = st.f_blocks * st.f_frsize
        room = st.f_bavail * st.f_frsize + self._bytes - max(64 << 10, min(MARGIN_MAX, total // 20))
        self.cap = max(PAGE, min(self.cap_bytes, room))

    # ---- plumbing -------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, sid: str, own: bool = True) -> Iterator[Slot]:
        """Validate ``sid``, take it for this process (``own``; internal passes do not),
        and hold its shard's lock; unmaps the least recently used shards beyond
        ``max_open_shards`` on the way (skipping any that are busy)."""
        check_sid(sid)
        if own:
            self._own(sid)
        shard = shard_of(sid, self.shards, self.key)
        with self._lock:
            if self._closed:
                raise WarmError("warm tier is closed")
            slot = self._slots.get(shard)
            if slot is None:
                slot = self._slots[shard] = Slot(shard)
            self._mapped[shard] = None
            self._mapped.move_to_end(shard)
            over = list(itertools.islice(self._mapped, max(0, len(self._mapped) - self.max_open)))
        with slot.lock:
            for k in over:
                self._try_unmap(k)
            try:
                yield slot
            except OSError as e:  # every failure of the tier is a WarmError
                where = e.filename if e.filename else f"warm tier {self.root}"
                raise WarmError(f"{where!r}: {e.strerror or e}") from e

    def _try_unmap(self, shard: int) -> None:
        slot = self._slots.get(shard)
        if slot is None or not slot.lock.acquire(blocking=False):
            return
        try:
            if slot.file is not None:
                slot.file.unmap()
            with self._lock:
                self._mapped.pop(shard, None)
        finally:
            slot.lock.release()

    def _remove_file(self, slot: Slot, later: bool = False) -> None:
        """Remove a shard file without sessions. ``later``: renamed out of the way now,
        unlinked by a pool thread (freeing a big tmpfs file's pages takes milliseconds)."""
        f, slot.file = slot.file, None
        if not later:
            f.unmap(flush=False)
            self.rootdir.unlink(f.name)
            return
        self._fsync_pool().submit(self._discard, slot, f)

    def _discard(self, slot: Slot, f: ShardFile) -> None:
        f.discard()  # unmapping a big mapping takes milliseconds too
        with slot.lock, contextlib.suppress(OSError, WarmError):
            if slot.file is None and self.rootdir.lstat(f.name).st_ino == f.ino:
                self.rootdir.unlink(f.name)  # not a new file of this shard made meanwhile

    def _warm(self, slot: Slot, sid: str, create: bool = False) -> tuple[ShardFile | None, WarmSession | None]:
        """The shard file and warm record of ``sid``; with ``create``, make them, loading
        meta and summaries of a cold copy so the warm record is whole for them."""
        f = slot.file
        s = f.sessions.get(sid) if f is not None else None
        if s is not None or not create:
            return f, s
        if f is None:
            name = shard_file_name(slot.shard, self.shards)
            f = slot.file = ShardFile.create(self.rootdir, name, slot.shard, self.shards,
                                             self.key, self.dim, self.clock())
        cs = self.cold.state(sid) if self.cold else None
        cold, inc = cs if cs is not None else (None, None)
        s = f.new_session(sid, self.clock(), live=cold is None, inc=inc or new_incarnation())
        s.cold, held = cold, 0
        if cold is not None:  # the warm record must be whole before it is published
            try:
                raw = self.cold.read_small(sid, META)
                if raw and self.cold.read_meta(sid) is not None:
                    held += f.put_meta(s, raw)
                summ = self.cold.read_small(sid, SUMMARIES) or b""
                n = len(summ) // self._row * self._row
                if n:
                    held += f.write(s, K_SUMMARY, 0, 0, np.frombuffer(summ, np.uint8, n))
                s.cmeta, s.csumm = raw or None, summ
                if inc is not None and n == len(summ):  # what cold has, and its id
                    f.set_flags(s, FLAG_ON_COLD | FLAG_CLEAN)
            except BaseException:
                f.drop(s)
                raise
            f.publish_session(s)
        with self._lock:
            self._lru[sid] = None
            self._bytes += held
        return f, s

    def _touch(self, f: ShardFile, s: WarmSession) -> None:
        f.set_last_used(s, self.clock())
        with self._lock:
            self._lru[s.name] = None
            self._lru.move_to_end(s.name)

    def _account(self, delta: int) -> None:
        with self._lock:
            self._bytes += delta
        self._gauges()

    def _gauges(self) -> None:
        metrics.warm_bytes.set(self._bytes)
        metrics.warm_sessions.set(len(self._lru))
        metrics.warm_usage_ratio.set(self._bytes / self.cap)

    def _summary_bytes(self, f: ShardFile, s: WarmSession) -> bytes:
        out = np.empty(s.summary.end, np.uint8)
        f.read_into(s, s.summary, 0, s.summary.end, out, "summaries")
        return out.tobytes()

    @staticmethod
    def _span(s: WarmSession, layer: int) -> tuple[int, int]:
        """(base, size) of a layer of a warm session: bytes below base are on cold."""
        st = s.layers.get(layer)
        if st is not None and st.segs:
            return st.base, st.end
        c = (s.cold or {}).get(layer, 0)
        return c, c

    # ---- bytes ----------------------------------------------------------------------
    def append(self, sid: str, layer: int, data: bytes | memoryview | np.ndarray) -> int:
        """Append token-major bytes to a layer; returns its new size. May then migrate the
        least recently used group to cold if usage passed the threshold."""
        return self._append(sid, check_layer(layer), data)

    def side_append(self, sid: str, name: str, data: bytes | memoryview | np.ndarray) -> int:
        """Append to the session's side stream ``name`` (``key_bounds``: the hot tier's
        per-block key bounds, cold file ``sessions/<sid>/key_bounds``); returns its new
        size. Stored, checksummed, written behind, migrated and deleted like a layer."""
        return self._append(sid, side_stream(name), data)

    def side_truncate(self, sid: str, name: str, length: int) -> None:
        """Shorten side stream ``name`` (see ``truncate``)."""
        self._truncate(sid, side_stream(name), length)

    def _append(self, sid: str, layer: int, data: bytes | memoryview | np.ndarray) -> int:
        buf = as_u8(data)
        self._admit(len(buf))

        def write() -> int:
            with self._locked(sid) as slot:
                f, s = self._warm(slot, sid, create=True)
                base, size = self._span(s, layer)
                if len(buf):
                    self._mark_dirty(f, s, len(buf))
                    self._account(f.write(s, K_LAYER, layer, size, buf, base=base))
                self._touch(f, s)
                return size + len(buf)

        new = self._with_room(sid, write)
        self._maybe_migrate()
        return new

    def _with_room(self, sid: str, fn: Callable[[], T]) -> T:
        """Run a write; when the RAM filesystem is full (nothing changed), evict a group
        to the cold tier and try once more, else a WarmError that says so."""
        try:
            return fn()
        except WarmFull as e:
            self._refresh_cap()
            if self.cold is None:
                raise WarmError(f"{e}; no cold tier to evict to") from e
            with self._mig_lock:
                freed = (self._evict_group if self.wb_on else self._migrate_group)(self.group, {sid}, True)
            if not freed:
                raise WarmError(f"{e}; nothing could be evicted to the cold tier"
                                + (f" ({self._cold_error})" if self._cold_error else "")) from e
        try:
            return fn()
        except WarmFull as e:
            raise WarmError(f"{e} (after evicting a group to the cold tier)") from e

    def truncate(self, sid: str, layer: int, length: int) -> None:
        """Shorten a layer (an agent retrying a turn). Cold is cut first, then warm, so
        cold stays a prefix of the content whatever the moment of a crash."""
        self._truncate(sid, check_layer(layer), length)

    def _truncate(self, sid: str, layer: int, length: int) -> None:
        self._own(sid)
        with self._io_lock(sid), self._locked(sid, own=False) as slot:
            f, s = self._warm(slot, sid)
            if s is not None:
                size, cold_size = self._span(s, layer)[1], (s.cold or {}).get(layer, 0)
            else:
                size = cold_size = self.cold.size(sid, layer) if self.cold else 0
            if not 0 <= length <= size:
                raise ValueError(f"truncate to {length}: only shortening (size {size})")
            if length == size:
                return
            if cold_size > length:
                self.cold.truncate(sid, layer_name(layer), length)
                if s is not None:
                    s.cold[layer] = length
            if s is not None:
                self._account(-f.truncate(s, K_LAYER, layer, length))
                self._touch(f, s)

    # ---- meta and summaries ---------------------------------------------------------
    def put_meta(self, sid: str, meta: dict) -> None:
        if not isinstance(meta, dict):
            raise TypeError("meta must be a dict")
        raw = json.dumps(meta, separators=(",", ":")).encode()
        self._admit(len(raw))

        def write() -> None:
            with self._locked(sid) as slot:
                f, s = self._warm(slot, sid, create=True)
                self._mark_dirty(f, s, len(raw))
                self._account(f.put_meta(s, raw))
                self._touch(f, s)

        self._with_room(sid, write)
        self._maybe_migrate()

    def get_meta(self, sid: str) -> dict | None:
        with self._locked(sid) as slot:
            f, s = self._warm(slot, sid)
            if s is None:
                return self.cold.read_meta(sid) if self.cold else None
            raw = f.meta_bytes(s)
            self._touch(f, s)
            return json.loads(raw) if raw is not None else None

    def put_summary(self, sid: str, round_idx: int, vec: np.ndarray) -> None:
        """Set round ``round_idx``'s summary; rounds skipped over read as zero vectors."""
        v = np.asarray(vec, dtype=np.float32).reshape(-1)
        if v.size != self.dim:
            raise ValueError(f"summary must have {self.dim} floats, got {v.size}")
        if isinstance(round_idx, bool) or not isinstance(round_idx, (int, np.integer)) or round_idx < 0:
            raise ValueError(f"bad round index {round_idx!r}")
        self._admit(self._row)

        def write() -> None:
            with self._locked(sid) as slot:
                f, s = self._warm(slot, sid, create=True)
                have = s.summary.end
                pos = int(round_idx) * self._row
                buf = v.view(np.uint8)
                if pos > have:
                    buf = np.concatenate([np.zeros(pos - have, np.uint8), buf])
                    pos = have
                self._mark_dirty(f, s, len(buf))
                self._account(f.write(s, K_SUMMARY, 0, pos, buf))
                self._touch(f, s)

        self._with_room(sid, write)
        self._maybe_migrate()

    def summaries(self, sid: str) -> np.ndarray:
        """float32 [rounds, summary_dim] (a copy; empty when none)."""
        with self._locked(sid) as slot:
            f, s = self._warm(slot, sid)
            if s is not None:
                raw = self._summary_bytes(f, s)
                self._touch(f, s)
            else:
                raw = (self.cold.read_small(sid, SUMMARIES) if self.cold else None) or b""
        n = len(raw) // self._row
        return np.frombuffer(raw, np.float32, n * self.dim).reshape(n, self.dim).copy()

    def truncate_summaries(self, sid: str, rounds: int) -> None:
        """Keep the first ``rounds`` summaries (addition: pairs with truncate)."""
        with self._locked(sid) as slot:
            f, s = self._warm(slot, sid)
            if s is None and self.cold is not None and self.cold.exists(sid):
                f, s = self._warm(slot, sid, create=True)  # the cold file is cut at migration
            if s is not None and rounds * self._row < s.summary.end:
                self._mark_dirty(f, s, 0)
                self._account(-f.truncate(s, K_SUMMARY, 0, rounds * self._row))

    def __enter__(self) -> WarmTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

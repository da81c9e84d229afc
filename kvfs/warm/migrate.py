"""Moving sessions between the tiers: group migration to cold (``writebehind=False``;
with write-behind, eviction is a drop of clean sessions, writeback.py), promotion back,
and the start-up reconciliation of a migration that a crash interrupted.

The rule that makes a crash harmless: a session leaves RAM only after its cold copy is
complete and fsynced (layer files, summaries.f32, meta.json, its directory). A group
moves in three steps: (1) per session, under its shard lock, append what cold lacks and
mark the session FLAG_MIGRATING; (2) fsync every file and directory written, from a
small thread pool, so the filesystem commits them together; (3) per session, under its
shard lock again, drop it from RAM -- unless it changed since step 1 (its ``gen``), in
which case it stays warm with cold as a valid prefix. On restart a session still marked
FLAG_MIGRATING is checked: cold complete (sizes match, summaries and meta equal) -> the
migration is finished by dropping the warm copy; otherwise the warm copy is kept and the
next migration appends only what cold lacks. Cold files are only appended to or cut
shorter, never rewritten (the mount refuses writes anywhere but at the end).

A cold tier that refuses a migration (full, I/O errors, a session directory that is not
ours) is not retried on every append: the tier backs off (``retry_s``, doubling up to
``retry_max_s``), counts kv_warm_migration_failures and logs one line per back-off
period; while it backs off, a write that would pass the byte cap is refused with a
WarmError instead of growing RAM without bound. An explicit ``migrate`` always tries and
raises the failure when nothing could move.

A mixin of WarmTier (tier.py owns the locks and the LRU). Never imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from kvfs.ops import metrics

from .cold import (
    INCARNATION,
    META,
    SUMMARIES,
    Changes,
    ColdBackend,
    Written,
    incarnation_bytes,
    layer_name,
)
from .format import FLAG_CLEAN, FLAG_MIGRATING, K_LAYER
from .ids import WarmCorrupt, WarmError, WarmFull, shard_file_name
from .records import ShardCorrupt, Slot, WarmSession
from .rootdir import RootDir
from .shard import ShardFile
from .shardload import ShardOutdated, load_shard

log = logging.getLogger("kvfs.warm")
PAUSE_ENV = "KVFS_WARM_TEST_PAUSE"  # test hook: a crash point name (see _pause)
PAUSE_FILE_ENV = "KVFS_WARM_TEST_PAUSE_FILE"


_pause_hits: dict[str, int] = {}


def _pause(point: str) -> None:
    """Test hook for crash tests: at the n-th pass through ``point`` (env value
    ``point`` or ``point#n``) create a marker file and stop forever, so the test can
    SIGKILL the process exactly there. Inert unless the env var is set."""
    want = os.environ.get(PAUSE_ENV)
    if not want or want.partition("#")[0] != point:
        return
    _pause_hits[point] = _pause_hits.get(point, 0) + 1
    if str(_pause_hits[point]) == (want.partition("#")[2] or "1"):
        with open(os.environ.get(PAUSE_FILE_ENV, os.devnull), "w") as f:
            f.write(point)
        while True:
            time.sleep(3600)


FSYNC_THREADS = 8


class _Staged:
    """A session written to cold, waiting for its durability point and then its drop."""

    __slots__ = ("sid", "session", "gen", "written")

    def __init__(self, sid: str, session: WarmSession) -> None:
        self.sid, self.session, self.gen = sid, session, session.gen
        self.written: list[Written] = []

    @property
    def error(self) -> BaseException | None:
        return next((w.error for w in self.written if w.error is not None), None)


class Mover:
    """Migration and promotion; mixed into WarmTier, whose state and helpers it uses."""

    # owned by WarmTier (tier.py); listed here for readers of this module
    root: str
    rootdir: RootDir
    shards: int
    key: int
    dim: int
    cold: ColdBackend | None
    group: int
    migrate_at: float
    cap: int
    stats: dict[str, int]
    _lock: threading.RLock
    _mig_lock: threading.Lock
    _lru: OrderedDict[str, None]
    _slots: dict[int, Slot]
    _bytes: int
    _closed: bool
    _warned_full: bool
    retry_s: float
    retry_max_s: float
    _backoff: float
    _retry_at: float
    _cold_error: str | None
    _pool: ThreadPoolExecutor | None = None  # fsync workers, made on first migration

    def _scan(self) -> None:
        """Load every shard file, reconcile sessions caught mid-migration, rebuild the LRU
        from the recorded last-use times."""
        found: list[tuple[float, str]] = []
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
            for s in list(f.sessions.values()):
                try:
                    s.cold = self.cold.layer_sizes(s.name) if self.cold else None
                    if not self.wb_on:
                        self._reconcile(f, s)
                    elif not s.flags & FLAG_CLEAN:  # checked and written by the first pass
                        self._dirty[s.name] = [time.monotonic(), 0]
                except WarmCorrupt as e:
                    log.error("%s; its warm copy is dropped", e)
                    f.drop(s)
                except (WarmError, OSError) as e:  # kept warm; migration reports it again
                    log.error("warm session %r: cold copy unusable: %s", s.name, e)
                    s.cold = None
                if s.name in f.sessions:
                    found.append((s.last_used, s.name))
            self._bytes += f.total_bytes
            if not f.sessions:
                self._remove_file(slot)
            else:
                f.unmap()  # remapped on first use; keeps start-up within max_open_shards
        for _, sid in sorted(found):
            self._lru[sid] = None
        if found:
            log.info("warm tier %s: %d session(s), %d bytes", self.root, len(found), self._bytes)

    def _reconcile(self, f: ShardFile, s: WarmSession) -> None:
        if s.cold is None:
            if any(st.base for st in s.layers.values()):
                log.error("warm session %r: cold copy missing; bytes below the warm part are lost", s.name)
            if s.flags:
                f.set_flags(s, 0)
            return
        for layer, st in list(s.layers.items()):
            c = s.cold.get(layer, 0)
            if st.base > c:  # a truncate cut cold and died before cutting warm: finish it
                log.warning("warm session %r layer %d: finishing an interrupted truncate", s.name, layer)
                f.truncate(s, K_LAYER, layer, 0)
            elif c > st.end:  # never written by us; restore "cold is a prefix"
                log.warning("warm session %r layer %d: cold copy longer than warm; cut", s.name, layer)
                self.cold.truncate(s.name, layer_name(layer), st.end)
                s.cold[layer] = st.end
        if s.flags & FLAG_MIGRATING:
            if self._cold_complete(f, s):
                log.info("warm session %r: interrupted migration was complete on cold; dropped from warm", s.name)
                f.drop(s)
            else:
                log.info("warm session %r: interrupted migration incomplete; warm copy kept", s.name)
                f.set_flags(s, 0)

    def _cold_complete(self, f: ShardFile, s: WarmSession) -> bool:
        if any((s.cold or {}).get(layer, 0) != st.end for layer, st in s.layers.items()):
            return False
        if (self.cold.read_small(s.name, SUMMARIES) or b"") != self._summary_bytes(f, s):
            return False
        meta = f.meta_bytes(s)
        return meta is None or self.cold.read_small(s.name, META) == meta

    def migrate(self, n: int | None = None) -> list[str]:
        """Move the ``n`` (default: group) least recently used sessions to cold now (also
        while backing off); WarmError when the cold tier refused and nothing moved."""
        if self.cold is None:
            raise WarmError("no cold tier")
        with self._mig_lock:
            move = self._evict_group if self.wb_on else self._migrate_group
            done = move(n or self.group, set(), True)
        if not done and self._cold_error is not None:
            raise WarmError(f"migration to cold tier {self.cold.root!r} failed: {self._cold_error}")
        return done

    def _maybe_migrate(self, exclude: set[str] | frozenset = frozenset()) -> None:
        limit = self.migrate_at * self.cap
        if self._bytes <= limit:
            self._warned_full = False
            return
        if self.cold is None:
            if not self._warned_full:
                log.warning("warm tier over %.0f%% of its cap and no cold tier to migrate to",
                            100 * self.migrate_at)
                self._warned_full = True
            return
        if time.monotonic() < self._retry_at or not self._mig_lock.acquire(blocking=False):
            return  # backing off, or another thread is migrating already
        try:
            move = self._evict_group if self.wb_on else self._migrate_group
            while self._bytes > limit and not self._closed and time.monotonic() >= self._retry_at:
                if not move(self.group, exclude):
                    break
        finally:
            self._mig_lock.release()

    def _admit(self, n: int) -> None:
        """Refuse a write of ``n`` bytes that would pass the cap while the cold tier refuses
        migrations (after one more try once the back-off has passed)."""
        self._refresh_cap()
        if self.cold is None or self._bytes + n <= self.cap:
            return
        self._maybe_migrate()
        if self._cold_error is not None and self._bytes + n > self.cap:
            wait = max(0.0, self._retry_at - time.monotonic())
            raise WarmError(
                f"warm tier {self.root!r} is full ({self._bytes} of {self.cap} bytes) and "
                f"migration to cold tier {self.cold.root!r} fails ({self._cold_error}); "
                f"next try in {wait:.0f} s")

    def _cold_failed(self, reason: str, sessions: int) -> None:
        """Start a back-off period: one metric increment and one log line per period."""
        self._backoff = min(self.retry_max_s, 2 * self._backoff) if self._backoff else self.retry_s
        self._retry_at = time.monotonic() + self._backoff
        self._cold_error = reason
        metrics.warm_migration_failures.inc()
        log.error("writing %d session(s) to cold tier %s failed: %s; they stay in warm, "
                  "next try in %.1f s (warm at %.0f%% of its cap)", sessions, self.cold.root,
                  reason, self._backoff, 100 * self._bytes / self.cap)

    def _drop_damaged(self, sid: str, err: WarmCorrupt) -> None:
        """A warm copy that fails its checksums cannot be migrated: drop it (the cold copy,
        written from checked bytes only, stays a prefix of the content)."""
        log.error("%s; its warm copy is dropped, the cold copy kept", err)
        with self._io_lock(sid), self._locked(sid, own=False) as slot:
            f, s = self._warm(slot, sid)
            if s is not None:
                self._drop_session(slot, f, s)

    def _fsync_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix="kvfs-warm-fsync")
        return self._pool

    def _migrate_group(self, n: int, exclude: set[str] | frozenset, explicit: bool = False) -> list[str]:
        """Move the ``n`` least recently used sessions in three steps: write each one's
        missing tail to cold (under its shard lock, no fsync yet), fsync every file and
        directory written (concurrently: the filesystem commits them together, as fast
        as one big file), then drop from RAM each session that did not change meanwhile.
        The whole move is timed into kv_warm_evict_latency_ms."""
        with self._lock:
            victims = [sid for sid in self._lru if sid not in exclude][:n]
        if not victims:
            return []
        t0 = time.perf_counter()
        staged: list[_Staged] = []
        errors: list[str] = []
        for sid in victims:
            try:
                st = self._stage(sid)
            except WarmCorrupt as e:
                self._drop_damaged(sid, e)
                continue
            except (OSError, WarmError) as e:
                errors.append(f"{sid!r}: {e}")
                continue
            if st is not None:
                staged.append(st)
        # the durability point only once every session is written: an fsync that runs
        # while others are still being written finds new bytes each time, and on the
        # mount each such fsync is a device flush (one flush covers all files of a volume)
        self.cold.sync([w for st in staged for w in st.written])
        done, moved = [], 0
        for st in staged:
            freed = self._commit(st)
            if freed is not None:
                done.append(st.sid)
                moved += freed
            elif st.error is not None:
                errors.append(f"{st.sid!r}: {st.error}")
        if errors:
            self._cold_failed(errors[0] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""),
                              len(errors))
        elif self._cold_error is not None:
            log.info("migration to cold tier %s works again", self.cold.root)
            self._backoff, self._cold_error = 0.0, None
        ms = (time.perf_counter() - t0) * 1000
        metrics.warm_evict_latency.observe(ms)
        metrics.warm_migrations.inc(len(done))
        with self._lock:
            self.stats["migrations"] += len(done)
            self.stats["groups"] += 1
        self._gauges()
        if done:
            log.info("migrated %d session(s), %d bytes, to cold in %.1f ms", len(done), moved, ms)
        return done

    def _stage(self, sid: str) -> _Staged | None:
        """Append what cold lacks of one session (no durability point yet). None if it is
        gone. The first layer goes on its own, so a crash test can stop right after it."""
        with self._io_lock(sid), self._locked(sid, own=False) as slot:
            f, s = self._warm(slot, sid)
            if s is None:
                return None
            f.set_flags(s, s.flags | FLAG_MIGRATING)  # for a restart: see _reconcile
            st = _Staged(sid, s)
            try:
                made = self.cold.ensure_dir(sid)
                self._hold_made(sid)
                ch = Changes()
                if self.cold.read_incarnation(sid) is None:  # deletion wins: writeback.py
                    ch.replace(INCARNATION, incarnation_bytes(s.inc or 1))
                s.cold = s.cold if s.cold is not None else {}
                # the files, not the cache: a failed try may have grown them (one listing)
                sizes = self.cold.layer_sizes(sid) or {}
                done: dict[int, int] = {}  # layer sizes once ``ch`` is written
                for k, (layer, stream) in enumerate(sorted(s.layers.items())):
                    name = layer_name(layer)
                    c = sizes.get(layer, 0)
                    if c < stream.base:
                        raise WarmError(f"cold {name} has {c} bytes, warm starts at {stream.base}")
                    if c > stream.end:
                        self.cold.truncate(sid, name, stream.end)
                        s.cold[layer] = c = stream.end
                    if c < stream.end or layer not in s.cold:
                        ch.append(name, c, f.segments(s, stream, c, stream.end, f"layer {layer}"))
                    done[layer] = stream.end
                    if k == 0 and ch:
                        st.written.append(self.cold.write(sid, ch))
                        s.cold.update(done)
                        ch, done = Changes(), {}
                        _pause("cold_partial")
                ch.rewrite(SUMMARIES, self._summary_bytes(f, s),
                           self.cold.read_small(sid, SUMMARIES) or b"")
                meta = f.meta_bytes(s)
                if meta is not None and self.cold.read_small(sid, META) != meta:
                    ch.replace(META, meta)
                if ch:
                    st.written.append(self.cold.write(sid, ch))
                s.cold.update(done)
                if not st.written:
                    st.written.append(Written(sid))
                st.written[0].made_dir = made
            except BaseException:
                f.set_flags(s, s.flags & ~FLAG_MIGRATING)
                for w in st.written:  # descriptors kept for a sync that will not run
                    self.cold.forget(w)
                raise
            return st

    def _commit(self, st: _Staged) -> int | None:
        """Drop a staged session from RAM if its cold copy is durable and it did not change
        since it was written; returns the bytes freed, else None (it stays in warm)."""
        with self._io_lock(st.sid), self._locked(st.sid, own=False) as slot:
            f, s = self._warm(slot, st.sid)
            if s is not st.session:
                return None  # deleted (and maybe re-created) meanwhile
            if st.error is not None or s.gen != st.gen:
                f.set_flags(s, s.flags & ~FLAG_MIGRATING)
                return None
            _pause("cold_written")
            # the cold copy is complete and durable: now RAM may go
            return self._drop_session(slot, f, s)

    def promote(self, sid: str) -> None:
        """Bring a session's cold bytes back into warm (the cold copy stays as a prefix, so
        a later migration appends only what was added meanwhile)."""
        with self._locked(sid) as slot:
            changed = self._promote_locked(slot, sid)
        if changed:
            self._maybe_migrate(exclude={sid})

    def _promote_locked(self, slot: Slot, sid: str, soft: bool = False) -> bool:
        """Promote under the shard lock. While migrations fail, a promotion that would pass
        the cap is skipped (``soft``: the read is served from cold) or refused."""
        f, s = self._warm(slot, sid)
        if s is None:
            if self.cold is None or not self.cold.exists(sid):
                raise WarmError(f"no session {sid!r}")
            f, s = self._warm(slot, sid, create=True)
        if s.cold is None:
            return False
        s.cold = self.cold.layer_sizes(sid) or {}
        need = sum(self._span(s, layer)[0] for layer in s.cold)
        if self._cold_error is not None and self._bytes + need > self.cap:
            if soft:
                return False
            raise WarmError(f"warm tier {self.root!r} is full and migration to cold fails "
                            f"({self._cold_error}): {sid!r} not promoted")
        changed = False
        for layer, c in sorted(s.cold.items()):
            base = self._span(s, layer)[0]
            if base == 0:
                continue
            if base > c:
                raise WarmError(f"{sid}/layer_{layer}: cold copy has {c} bytes, warm starts at {base}")
            try:
                pieces = f.prepend(s, layer, base)
            except WarmFull:
                if soft:  # no room: the read is served from cold
                    return changed
                raise
            try:
                for g, view in pieces:
                    self.cold.read_into(sid, layer, g.start, view)
            except BaseException:
                f.abandon(pieces)
                raise
            f.publish(s, layer, pieces)
            self._account(base)
            changed = True
        self._touch(f, s)
        if changed:
            with self._lock:
                self.stats["promotions"] += 1
            metrics.warm_promotions.inc()
        return changed

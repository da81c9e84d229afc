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

``Mover`` migrates and promotes; ``Evictor`` decides when a group leaves RAM and how
(``move``: the mover's migration, or write-behind's drop of clean sessions), refuses
writes over the cap while the cold tier refuses them, and makes room when the RAM
filesystem is full. Both work on the RAM copies (``resident.Resident``) and the cold tier
(``ColdBackend``) only. Never imports torch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Container
from typing import TypeVar

import numpy as np

from kvfs.ops import metrics
from kvfs.session import files
from kvfs.session.backend import ColdBackend, Written
from kvfs.session.commit import RoundWrite
from kvfs.session.names import layer_name

from .health import ColdHealth
from .held import HeldSessions
from .ids import WarmCorrupt, WarmError, WarmFull
from .kvmap_format import FLAG_CLEAN, FLAG_MIGRATING, K_LAYER
from .resident import Resident
from .shard import ShardFile
from .shard_index import Seg, WarmSession
from .shards import Slot

log = logging.getLogger("kvfs.warm")
T = TypeVar("T")
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
    """Migration, promotion and the start-up reconciliation (module doc)."""

    def __init__(self, res: Resident, health: ColdHealth, cold: ColdBackend | None,
                 held: HeldSessions, own: Callable[[str], None], root: str) -> None:
        self.res, self.health, self.cold, self.held, self.own = res, health, cold, held, own
        self.root = root
        self.after_promote: Callable[[str], None] = lambda sid: None  # the evictor's, set later

    @property
    def _cold(self) -> ColdBackend:
        """The cold tier, where a caller runs only with one."""
        assert self.cold is not None
        return self.cold


    def scan(self, writebehind: bool) -> None:
        """Load every shard file; reconcile sessions caught mid-migration (no write-behind)
        or leave the unclean ones dirty for the first pass; the LRU order from the
        recorded last-use times."""
        res = self.res
        found: list[tuple[float, str]] = []
        for slot, f in res.shards.load():
            for s in list(f.sessions.values()):
                try:
                    s.cold = files.layer_sizes(self._cold, s.name) if self.cold else None
                    if not writebehind:
                        self._reconcile(f, s)
                    elif not s.flags & FLAG_CLEAN:  # checked and written by the first pass
                        res.dirty.mark(s.name, 0)
                except WarmCorrupt as e:
                    log.error("%s; its warm copy is dropped", e)
                    f.drop(s)
                except (WarmError, OSError) as e:  # kept warm; migration reports it again
                    log.error("warm session %r: cold copy unusable: %s", s.name, e)
                    s.cold = None
                if s.name in f.sessions:
                    found.append((s.last_used, s.name))
            res.budget.add(f.total_bytes)
            if not f.sessions:
                res.shards.remove_file(slot)
            else:
                f.unmap()  # remapped on first use; keeps start-up within max_open_shards
        for _, sid in sorted(found):
            res.policy.touch(sid)
        if found:
            log.info("warm tier %s: %d session(s), %d bytes", self.root, len(found), res.budget.bytes)

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
                files.truncate_stream(self._cold, s.name, layer, st.end)
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
        if files.read_summaries(self._cold, s.name) != self.res.summary_bytes(f, s):
            return False
        meta = f.meta_bytes(s)
        return meta is None or files.read_meta_bytes(self._cold, s.name) == meta

    def drop_damaged(self, sid: str, err: WarmCorrupt) -> None:
        """A warm copy that fails its checksums cannot be migrated: drop it (the cold copy,
        written from checked bytes only, stays a prefix of the content)."""
        log.error("%s; its warm copy is dropped, the cold copy kept", err)
        with self.res.io_lock(sid), self.res.locked(sid) as slot:
            f, s = self.res.warm(slot, sid)
            if s is not None:
                assert f is not None  # a warm record lives in a shard file
                self.res.drop(slot, f, s)

    def migrate_group(self, n: int, exclude: Container[str], explicit: bool = False) -> list[str]:
        """Move the ``n`` least recently used sessions in three steps: write each one's
        missing tail to cold (under its shard lock, no fsync yet), fsync every file and
        directory written (concurrently: the filesystem commits them together, as fast
        as one big file), then drop from RAM each session that did not change meanwhile.
        The whole move is timed into kv_warm_evict_latency_ms."""
        victims = self.res.policy.victims(n, exclude)
        if not victims:
            return []
        t0 = time.perf_counter()
        staged: list[_Staged] = []
        errors: list[tuple[str, str]] = []
        for sid in victims:
            try:
                st = self._stage(sid)
            except WarmCorrupt as e:
                self.drop_damaged(sid, e)
                continue
            except (OSError, WarmError) as e:
                errors.append((sid, str(e)))
                continue
            if st is not None:
                staged.append(st)
        # the durability point only once every session is written: an fsync that runs
        # while others are still being written finds new bytes each time, and on the
        # mount each such fsync is a device flush (one flush covers all files of a volume)
        self._cold.sync([w for st in staged for w in st.written])
        done, moved = [], 0
        for st in staged:
            freed = self._commit(st)
            if freed is not None:
                done.append(st.sid)
                moved += freed
            elif st.error is not None:
                errors.append((st.sid, str(st.error)))
        if errors:
            self.health.failed(errors, self._cold.root, self.res.budget.ratio)
        else:
            self.health.ok("migration to", self._cold.root)
        ms = (time.perf_counter() - t0) * 1000
        metrics.warm_evict_latency.observe(ms)
        metrics.warm_migrations.inc(len(done))
        self.res.bump("migrations", len(done))
        self.res.bump("groups")
        self.res.gauges()
        if done:
            log.info("migrated %d session(s), %d bytes, to cold in %.1f ms", len(done), moved, ms)
        return done

    def _stage(self, sid: str) -> _Staged | None:
        """Append what cold lacks of one session (no durability point yet). None if it is
        gone. The first layer goes on its own, so a crash test can stop right after it."""
        with self.res.io_lock(sid), self.res.locked(sid) as slot:
            f, s = self.res.warm(slot, sid)
            if s is None:
                return None
            assert f is not None  # a warm record lives in a shard file
            f.set_flags(s, s.flags | FLAG_MIGRATING)  # for a restart: see _reconcile
            st = _Staged(sid, s)
            try:
                made = files.ensure_dir(self._cold, sid)
                self.held.hold_made(sid)
                plan = RoundWrite(sid)
                if files.read_incarnation(self._cold, sid) is None:  # deletion wins: writeback.py
                    plan.incarnation = s.inc or 1
                s.cold = s.cold if s.cold is not None else {}
                # the files, not the cache: a failed try may have grown them (one listing)
                sizes = files.layer_sizes(self._cold, sid) or {}
                done: dict[int, int] = {}  # layer sizes once ``ch`` is written
                for k, (layer, stream) in enumerate(sorted(s.layers.items())):
                    name = layer_name(layer)
                    c = sizes.get(layer, 0)
                    if c < stream.base:
                        raise WarmError(f"cold {name} has {c} bytes, warm starts at {stream.base}")
                    if c > stream.end:
                        files.truncate_stream(self._cold, sid, layer, stream.end)
                        s.cold[layer] = c = stream.end
                    if c < stream.end or layer not in s.cold:
                        plan.stream(layer, c, f.segments(s, stream, c, stream.end, f"layer {layer}"))
                    done[layer] = stream.end
                    if k == 0 and (ch := plan.changes()):
                        st.written.append(self._cold.write(sid, ch))
                        s.cold.update(done)
                        plan, done = RoundWrite(sid), {}
                        _pause("cold_partial")
                plan.summaries = (self.res.summary_bytes(f, s), files.read_summaries(self._cold, sid))
                meta = f.meta_bytes(s)
                if meta is not None and files.read_meta_bytes(self._cold, sid) != meta:
                    plan.meta = meta
                if ch := plan.changes():
                    st.written.append(self._cold.write(sid, ch))
                s.cold.update(done)
                if not st.written:
                    st.written.append(Written(sid))
                st.written[0].made_dir = made
            except BaseException:
                f.set_flags(s, s.flags & ~FLAG_MIGRATING)
                for w in st.written:  # descriptors kept for a sync that will not run
                    w.forget()
                raise
            return st

    def _commit(self, st: _Staged) -> int | None:
        """Drop a staged session from RAM if its cold copy is durable and it did not change
        since it was written; returns the bytes freed, else None (it stays in warm)."""
        with self.res.io_lock(st.sid), self.res.locked(st.sid) as slot:
            f, s = self.res.warm(slot, st.sid)
            if s is not st.session:
                return None  # deleted (and maybe re-created) meanwhile
            assert f is not None  # a warm record lives in a shard file
            if st.error is not None or s.gen != st.gen:
                f.set_flags(s, s.flags & ~FLAG_MIGRATING)
                return None
            _pause("cold_written")
            # the cold copy is complete and durable: now RAM may go
            return self.res.drop(slot, f, s)

    def promote(self, sid: str) -> None:
        """Bring a session's cold bytes back into warm (the cold copy stays as a prefix, so
        a later migration appends only what was added meanwhile)."""
        self.own(sid)
        with self.res.locked(sid) as slot:
            changed = self.promote_locked(slot, sid)
        if changed:
            self.after_promote(sid)

    def promote_locked(self, slot: Slot, sid: str, soft: bool = False) -> bool:
        """Promote under the shard lock. While migrations fail, a promotion that would pass
        the cap is skipped (``soft``: the read is served from cold) or refused."""
        res = self.res
        f, s = res.warm(slot, sid)
        if s is None:
            if self.cold is None or not self._cold.exists(sid):
                raise WarmError(f"no session {sid!r}")
            f, s = res.warm(slot, sid, create=True)
        assert f is not None  # a warm record lives in a shard file
        if s.cold is None:
            return False
        s.cold = files.layer_sizes(self._cold, sid) or {}
        need = sum(res.span(s, layer)[0] for layer in s.cold)
        if self.health.error is not None and res.budget.bytes + need > res.budget.cap:
            if soft:
                return False
            raise WarmError(f"warm tier {self.root!r} is full and migration to cold fails "
                            f"({self.health.reason(sid)}): {sid!r} not promoted")
        changed = False
        reads: list[tuple[int, list[tuple[Seg, np.ndarray]]]] = []  # every layer's cold part in one batch
        for layer, c in sorted(s.cold.items()):
            base = res.span(s, layer)[0]
            if base == 0:
                continue
            if base > c:
                raise WarmError(f"{sid}/{layer_name(layer)}: cold copy has {c} bytes, warm starts at {base}")
            try:
                pieces = f.prepend(s, layer, base)
            except WarmFull:
                if not soft:
                    for _, pc in reads:
                        f.abandon(pc)
                    raise
                break  # no room: the rest is served from cold
            reads.append((layer, pieces))
        try:
            self._cold.read_ranges(sid, [(layer, g.start, view) for layer, pc in reads for g, view in pc])
        except BaseException:
            for _, pc in reads:
                f.abandon(pc)
            raise
        for layer, pieces in reads:
            f.publish(s, layer, pieces)
            res.account(sum(len(v) for _, v in pieces))  # bytes [0, base) now in RAM
            changed = True
        res.touch(f, s)
        if changed:
            res.bump("promotions")
            metrics.warm_promotions.inc()
        return changed


class Evictor:
    """When a group leaves RAM, and what a write that does not fit meets (module doc).
    ``move(n, exclude, explicit)`` moves up to ``n`` sessions out and returns those moved."""

    def __init__(self, res: Resident, health: ColdHealth, cold: ColdBackend | None,
                 group: int, root: str) -> None:
        self.res, self.health, self.cold, self.group, self.root = res, health, cold, group, root
        self.move: Callable[[int, Container[str], bool], list[str]] = lambda n, ex, explicit: []
        self.lock = threading.Lock()  # one migration at a time

    @property
    def _cold(self) -> ColdBackend:
        """The cold tier, where a caller runs only with one."""
        assert self.cold is not None
        return self.cold


    def migrate(self, n: int | None = None) -> list[str]:
        """Move the ``n`` (default: group) least recently used sessions to cold now (also
        while backing off); WarmError when the cold tier refused and nothing moved."""
        if self.cold is None:
            raise WarmError("no cold tier")
        with self.lock:
            done = self.move(n or self.group, set(), True)
        if not done and self.health.error is not None:
            raise WarmError(f"migration to cold tier {self._cold.root!r} failed: {self.health.error}")
        return done

    def maybe_migrate(self, exclude: Container[str] = frozenset()) -> None:
        b = self.res.budget
        if b.bytes <= b.limit:
            b.warned_full = False
            return
        if self.cold is None:
            if not b.warned_full:
                log.warning("warm tier over %.0f%% of its cap and no cold tier to migrate to",
                            100 * b.migrate_at)
                b.warned_full = True
            return
        if not self.health.due() or not self.lock.acquire(blocking=False):
            return  # backing off, or another thread is migrating already
        try:
            while (b.bytes > b.limit and not self.res.shards.closed and self.health.due()):
                if not self.move(self.group, exclude, False):
                    break
        finally:
            self.lock.release()

    def after_promote(self, sid: str) -> None:
        self.maybe_migrate(exclude={sid})

    def admit(self, n: int, sid: str | None = None) -> None:
        """Refuse a write of ``n`` bytes (of session ``sid``) that would pass the cap while
        the cold tier refuses migrations (after one more try once the back-off has passed);
        the refusal quotes ``sid``'s own cold error only (``ColdHealth.reason``)."""
        b = self.res.budget
        b.refresh()
        if self.cold is None or b.bytes + n <= b.cap:
            return
        self.maybe_migrate()
        if self.health.error is not None and b.bytes + n > b.cap:
            raise WarmError(
                f"warm tier {self.root!r} is full ({b.bytes} of {b.cap} bytes) and "
                f"migration to cold tier {self._cold.root!r} fails ({self.health.reason(sid)}); "
                f"next try in {self.health.wait_s():.0f} s")

    def with_room(self, sid: str, fn: Callable[[], T]) -> T:
        """Run a write; when the RAM filesystem is full (nothing changed), evict a group
        to the cold tier and try once more, else a WarmError that says so."""
        try:
            return fn()
        except WarmFull as e:
            self.res.budget.refresh()
            if self.cold is None:
                raise WarmError(f"{e}; no cold tier to evict to") from e
            with self.lock:
                freed = self.move(self.group, {sid}, True)
            if not freed:
                raise WarmError(f"{e}; nothing could be evicted to the cold tier"
                                + (f" ({self.health.reason(sid)})" if self.health.error else "")) from e
        try:
            return fn()
        except WarmFull as e:
            raise WarmError(f"{e} (after evicting a group to the cold tier)") from e

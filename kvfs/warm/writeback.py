"""Write-behind: every byte the warm tier takes also goes to the mount, soon.

A background thread appends what the cold copy (``cold_root/sessions/<sid>/``) lacks of
each changed ("dirty") session -- layer tails, summaries.f32, meta.json -- and fsyncs the
files it wrote, at the latest ``writebehind_s`` after the first unwritten change or once
``writebehind_bytes`` are waiting, whichever comes first. The RAM copy stays; a session
whose cold copy holds every byte, fsynced, is *clean* (``FLAG_CLEAN`` in its shard). At
the cap the tier drops the least recently used clean sessions without copying anything;
dirty ones are written first. ``sync`` does a pass now and raises when the mount cannot
take it; ``writebehind=False`` leaves only the group migration of ``migrate.py`` (then
a reboot loses every session not migrated yet).

Deletion wins: each session has an incarnation id (``new_incarnation``), and a RAM copy
the mount no longer agrees with is dropped, not written; validate.py holds those checks
and the ownership of sessions.

Locks, in this order only: a pass (``_pass_lock``), the session-ownership lock, a
session's cold-I/O lock (striped; held from reading a session's tail to recording what
reached cold, so the extents read cannot be freed by a truncate, delete or drop), its
shard lock. Cold writes run outside the shard lock: the agent keeps appending meanwhile.

A mixin of WarmTier (tier.py), like validate.py. Never imports torch.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kvfs.ops import metrics

from .cold import INCARNATION, META, SUMMARIES, Changes, Written, incarnation_bytes, layer_name
from .format import FLAG_CLEAN, FLAG_MIGRATING, FLAG_ON_COLD
from .ids import WarmCorrupt, WarmError
from .owners import write_stats
from .records import WarmSession
from .shard import ShardFile

log = logging.getLogger("kvfs.warm")
IO_STRIPES = 64
STATS_EVERY_S = 1.0


def new_incarnation() -> int:
    return int.from_bytes(os.urandom(8), "little") or 1


class _Pass:
    """A session whose tail a pass wrote, waiting for its durability point."""

    __slots__ = ("sid", "session", "gen", "since", "bytes", "written")

    def __init__(self, sid: str, session: WarmSession, gen: int, d: list | None) -> None:
        self.sid, self.session, self.gen = sid, session, gen
        self.since, self.bytes = (d[0], d[1]) if d else (time.monotonic(), 0)
        self.written = Written(sid)  # what the cold tier did; its names: all to make durable

    @property
    def error(self) -> BaseException | None:
        return self.written.error


class WriteBehind:
    """Dirty tracking, the writer thread, passes, eviction; see module doc."""

    def _init_writebehind(self, on: bool, every_s: float, max_bytes: int) -> None:
        if every_s <= 0 or max_bytes <= 0:
            raise WarmError("writebehind_s and writebehind_bytes must be > 0")
        self.wb_on = bool(on) and self.cold is not None
        self.wb_s, self.wb_bytes = float(every_s), int(max_bytes)
        self._dirty: dict[str, list] = {}  # sid -> [monotonic time of first change, bytes]
        self._dirty_bytes = 0
        self._init_owners()
        self._io = [threading.RLock() for _ in range(IO_STRIPES)]
        self._pass_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._wb_lag = 0.0
        self._thread: threading.Thread | None = None

    def _start_writer(self) -> None:
        self._thread = threading.Thread(target=self._writer, name="kvfs-warm-writer", daemon=True)
        self._thread.start()

    def _io_lock(self, sid: str) -> threading.RLock:
        return self._io[hash(sid) % IO_STRIPES]

    # ---- dirty sessions -------------------------------------------------------------
    def _mark_dirty(self, f: ShardFile, s: WarmSession, n: int) -> None:
        """Before a change of ``s`` (under its shard lock): not clean any more -- the flag
        goes first, so that after a crash a clean flag never covers bytes cold lacks."""
        if s.flags & FLAG_CLEAN:
            f.set_flags(s, s.flags & ~FLAG_CLEAN)
        with self._lock:
            d = self._dirty.get(s.name)
            if d is None:
                self._dirty[s.name] = [time.monotonic(), n]
            else:
                d[1] += n
            self._dirty_bytes += n
            wake = self._dirty_bytes >= self.wb_bytes
        if wake and self.wb_on:
            self._wake.set()

    def _undirty(self, sid: str) -> float | None:
        """Forget that ``sid`` is dirty; returns when it became dirty."""
        with self._lock:
            d = self._dirty.pop(sid, None)
            if d is None:
                return None
            self._dirty_bytes -= d[1]
            return d[0]

    # ---- passes -----------------------------------------------------------------------
    def _pass(self, sids: list[str] | None, explicit: bool, fsync: bool = True) -> list[str]:
        """Write the tails of ``sids`` (default: every dirty session) to cold and fsync
        them; returns the errors. A background pass waits out the back-off. ``fsync=False``
        (a pass for the byte threshold): write only; the sessions stay dirty until a pass
        fsyncs the files written (at the time lag, or ``sync``)."""
        if self.cold is None:
            return []
        with self._pass_lock:
            if not explicit and time.monotonic() < self._retry_at:
                return []
            if sids is None:
                with self._lock:
                    sids = list(self._dirty)
            staged: list[_Pass] = []
            errors: list[str] = []
            temps: list[str] = []
            try:
                for sid in sids:
                    if not self._pass_owner(sid, temps):
                        continue
                    try:
                        st = self._stage_tail(sid)
                    except WarmCorrupt as e:
                        self._drop_damaged(sid, e)
                        continue
                    except (OSError, WarmError) as e:
                        errors.append(f"{sid!r}: {e}")
                        continue
                    if st is not None:
                        staged.append(st)
                if not fsync:
                    self._written(staged)
                    for st in staged:
                        self.cold.forget(st.written)
                    staged = []
                if staged:  # one durability point for every session written
                    self.cold.sync([st.written for st in staged])
                lag = 0.0
                for st in staged:
                    done = self._commit_tail(st)
                    if st.error is not None:
                        errors.append(f"{st.sid!r}: {st.error}")
                    elif done is not None:
                        lag = max(lag, done)
            finally:
                for st in staged:
                    self.cold.forget(st.written)  # none left unless something failed midway
                for sid in temps:
                    self._release_temp(sid)
            if staged and not errors:
                self._wb_lag = lag
            if errors:
                self._cold_failed(errors[0] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""),
                                  len(errors))
            elif staged and self._cold_error is not None:
                log.info("writing to cold tier %s works again", self.cold.root)
                self._backoff, self._cold_error = 0.0, None
            return errors

    def _stage_tail(self, sid: str) -> _Pass | None:
        """Check one session against the mount and append what cold lacks (no fsync)."""
        with self._io_lock(sid):
            cs = self.cold.state(sid)
            with self._locked(sid, own=False) as slot:
                f, s = self._warm(slot, sid)
                if s is None:
                    self._undirty(sid)
                    return None
                stale = self._stale_reason(s, cs)
                if stale is not None:
                    self._forget_locked(slot, f, s, *stale)
                    return None
                if s.flags & FLAG_MIGRATING:
                    f.set_flags(s, s.flags & ~FLAG_MIGRATING)
                if not s.inc:  # a RAM copy of an older version: take the mount's id
                    s.inc = (cs[1] if cs else None) or new_incarnation()
                sizes = dict(cs[0]) if cs else {}
                tails = []
                for layer, stream in sorted(s.layers.items()):
                    c = sizes.get(layer, 0)
                    if c < stream.end or layer not in sizes:
                        tails.append((layer, c, list(f.segments(s, stream, c, stream.end, f"layer {layer}"))))
                summ, meta = self._summary_bytes(f, s), f.meta_bytes(s)
                old_summ, old_meta = s.csumm, s.cmeta
                with self._lock:
                    d = self._dirty.get(sid)
                    st = _Pass(sid, s, s.gen, d)
            # the tail's extents stay (io lock): write them without blocking the agent
            ch = Changes()
            w = st.written  # names as they are tried (synced later even if this fails)
            summ_changed = meta_changed = True  # until known: then what cold holds is known
            try:
                if cs is None:
                    w.made_dir = self.cold.ensure_dir(sid)
                    self._hold_made(sid)
                if cs is None or cs[1] is None:
                    ch.replace(INCARNATION, incarnation_bytes(s.inc))
                for layer, c, pieces in tails:
                    ch.append(layer_name(layer), c, pieces)
                if old_summ is None:
                    old_summ = self.cold.read_small(sid, SUMMARIES) or b""
                summ_changed = ch.rewrite(SUMMARIES, summ, old_summ)
                meta_changed = meta is not None and meta != old_meta and (
                    old_meta is not None or self.cold.read_small(sid, META) != meta)
                if meta_changed:
                    ch.replace(META, meta)
                if ch:
                    self.cold.write(sid, ch, w)
            finally:
                for layer, _, _ in tails:
                    if layer_name(layer) in w.sizes:
                        sizes[layer] = w.sizes[layer_name(layer)]
                if not summ_changed or w.sizes.get(SUMMARIES) == len(summ):
                    old_summ = summ
                if meta is not None and (not meta_changed or w.sizes.get(META) == len(meta)):
                    old_meta = meta
                written = set(w.names)
                with self._locked(sid, own=False) as slot:
                    f2, s2 = self._warm(slot, sid)
                    if s2 is s:
                        s.cold, s.csumm, s.cmeta = sizes, old_summ, old_meta
                        s.unsynced |= written
                        st.written.names = set(s.unsynced)
                        if INCARNATION in written and not s.flags & FLAG_ON_COLD:
                            f2.set_flags(s, s.flags | FLAG_ON_COLD)  # a removal from now on is one
        return st

    def _written(self, staged: list[_Pass]) -> None:
        """Bytes written (not fsynced yet) no longer count towards the byte threshold."""
        with self._lock:
            for st in staged:
                d = self._dirty.get(st.sid)
                if d is not None:
                    n = min(d[1], st.bytes)
                    d[1] -= n
                    self._dirty_bytes -= n

    def _commit_tail(self, st: _Pass) -> float | None:
        """Record a durable tail; clean if nothing changed since. Returns the lag."""
        with self._locked(st.sid, own=False) as slot:
            f, s = self._warm(slot, st.sid)
            if s is not st.session:
                st.error = None  # deleted or dropped meanwhile: nothing to report
                return None
            if st.error is not None:
                return None
            s.unsynced -= st.written.names
            flags = s.flags | FLAG_ON_COLD
            own = self._owned.get(st.sid)
            if own is not None:
                own.seen = True
            clean = s.gen == st.gen and not s.unsynced
            if clean:
                flags |= FLAG_CLEAN
                self._undirty(st.sid)
            f.set_flags(s, flags)
        return time.monotonic() - st.since if clean else None

    # ---- the writer thread --------------------------------------------------------------
    def _due(self, now: float) -> tuple[float, bool]:
        """When the next background pass is due (inf: none), and whether it is the one of
        the time lag (write and fsync) rather than of the byte threshold (write only)."""
        with self._lock:
            if not self._dirty:
                return float("inf"), True
            at = min(d[0] for d in self._dirty.values()) + self.wb_s
            full = at <= now or self._dirty_bytes < self.wb_bytes
            at = at if full else now
        return max(at, self._retry_at), full

    def _writer(self) -> None:
        next_stats = 0.0
        while not self._stop:
            now = time.monotonic()
            if now >= next_stats:
                self._refresh_cap()  # other processes fill or empty the RAM filesystem too
                self._write_stats()
                next_stats = now + STATS_EVERY_S
            due, full = self._due(now) if self.wb_on else (float("inf"), True)
            if due <= now:
                try:
                    self._pass(None, explicit=False, fsync=full)
                except Exception:  # noqa: BLE001 - the thread must live; the next pass retries
                    log.exception("warm write-behind pass failed")
                    time.sleep(min(self.retry_s, 1.0))
                continue
            self._wake.wait(max(0.0, min(due, next_stats) - now))
            self._wake.clear()

    def _write_stats(self) -> None:
        u = self.usage()
        doc = {k: u[k] for k in ("bytes", "sessions", "cap", "cap_bytes", "hits", "misses",
                                 "dirty_bytes", "dirty_sessions", "writebehind_lag_s",
                                 "cold_error", "volume_id")}
        doc.update(pid=os.getpid(), time=time.time())
        extra = getattr(self, "stats_extra", None)  # the hot tier's figures, from its router
        if extra is not None:
            try:
                doc.update(extra())
            except Exception:  # a figure is never worth a failed pass
                log.debug("hot-tier figures not published", exc_info=True)
        try:
            write_stats(self.rootdir, doc)
        except WarmError as e:
            log.debug("warm stats not written: %s", e)

    # ---- eviction ---------------------------------------------------------------------
    def _evict_group(self, n: int, exclude: set[str] | frozenset, explicit: bool = False) -> list[str]:
        """Drop the ``n`` least recently used sessions from RAM: clean ones at once (their
        cold copy is complete), dirty ones after a pass wrote them. Timed into
        kv_warm_evict_latency_ms."""
        with self._lock:
            victims = [sid for sid in self._lru if sid not in exclude][:n]
            dirty = [sid for sid in victims if sid in self._dirty]
        if not victims:
            return []
        t0 = time.perf_counter()
        if dirty:
            self._pass(dirty, explicit)
        done, freed = [], 0
        for sid in victims:
            with self._io_lock(sid), self._locked(sid, own=False) as slot:
                f, s = self._warm(slot, sid)
                if s is None or sid in self._dirty:
                    continue
                freed += self._drop_session(slot, f, s)
                done.append(sid)
        ms = (time.perf_counter() - t0) * 1000
        metrics.warm_evict_latency.observe(ms)
        metrics.warm_migrations.inc(len(done))
        with self._lock:
            self.stats["migrations"] += len(done)
            self.stats["groups"] += 1
        if done:
            log.info("dropped %d clean session(s), %d bytes, from RAM in %.2f ms", len(done), freed, ms)
        return done

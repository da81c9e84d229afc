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

``WriteBehind`` works on the RAM copies (``resident.Resident``), the cold tier
(``ColdBackend``), their validation (``validate.Validator``) and the shared back-off
(``ColdHealth``). Never imports torch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Container

from kvfs.ops import metrics
from kvfs.session import files
from kvfs.session.backend import ColdBackend, Written
from kvfs.session.commit import RoundWrite
from kvfs.session.names import INCARNATION, META, SUMMARIES, layer_name

from .health import ColdHealth
from .ids import WarmCorrupt, WarmError
from .kvmap_format import FLAG_CLEAN, FLAG_MIGRATING, FLAG_ON_COLD
from .owners import write_stats
from .resident import Resident, new_incarnation
from .rootdir import RootDir
from .shard_index import WarmSession
from .validate import Validator

log = logging.getLogger("kvfs.warm")
STATS_EVERY_S = 1.0


class _Pass:
    """A session whose tail a pass wrote, waiting for its durability point."""

    __slots__ = ("sid", "session", "gen", "since", "bytes", "written")

    def __init__(self, sid: str, session: WarmSession, gen: int, d: tuple[float, int] | None) -> None:
        self.sid, self.session, self.gen = sid, session, gen
        self.since, self.bytes = d if d else (time.monotonic(), 0)
        self.written = Written(sid)  # what the cold tier did; its names: all to make durable

    @property
    def error(self) -> BaseException | None:
        return self.written.error


class WriteBehind:
    """The writer thread, passes and the eviction of clean sessions; see the module doc.
    ``drop_damaged(sid, err)`` drops a RAM copy that fails its checks (the mover's);
    ``usage()`` and ``extra()`` give the figures published in the process's stats.json."""

    def __init__(self, res: Resident, cold: ColdBackend | None, valid: Validator,
                 health: ColdHealth, rootdir: RootDir, on: bool,
                 drop_damaged: Callable[[str, WarmCorrupt], None],
                 usage: Callable[[], dict], extra: Callable[[], Callable[[], dict] | None]) -> None:
        self.res, self.cold, self.valid, self.health = res, cold, valid, health
        self.rootdir, self.drop_damaged, self.usage, self.extra = rootdir, drop_damaged, usage, extra
        self.on = bool(on) and cold is not None
        self.lag = 0.0  # seconds from a session's first change to its durable copy, last pass
        self.failed: dict[str, str] = {}  # the last explicit pass: session -> its error
        self.written = 0  # sessions the last explicit pass made durable
        self._pass_lock = threading.Lock()
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def _cold(self) -> ColdBackend:
        """The cold tier, where a caller runs only with one."""
        assert self.cold is not None
        return self.cold


    def start(self) -> None:
        self._thread = threading.Thread(target=self._writer, name="kvfs-warm-writer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self.res.dirty.wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # ---- passes -----------------------------------------------------------------------
    def run(self, sids: list[str] | None, explicit: bool, fsync: bool = True) -> list[str]:
        """Write the tails of ``sids`` (default: every dirty session) to cold and fsync
        them; returns the errors. A background pass waits out the back-off. ``fsync=False``
        (a pass for the byte threshold): write only; the sessions stay dirty until a pass
        fsyncs the files written (at the time lag, or ``sync``)."""
        if self.cold is None:
            return []
        res = self.res
        with self._pass_lock:
            if not explicit and not self.health.due():
                return []
            if sids is None:
                sids = res.dirty.names()
            staged: list[_Pass] = []
            errors: list[str] = []
            failed: dict[str, str] = {}
            temps: list[str] = []
            try:
                for sid in sids:
                    if not self.valid.pass_owner(sid, temps):
                        continue
                    try:
                        st = self._stage_tail(sid)
                    except WarmCorrupt as e:
                        self.drop_damaged(sid, e)
                        continue
                    except (OSError, WarmError) as e:
                        errors.append(f"{sid!r}: {e}")
                        failed[sid] = str(e)
                        continue
                    if st is not None:
                        staged.append(st)
                if not fsync:
                    for st in staged:  # written, not durable: no longer towards the threshold
                        res.dirty.written(st.sid, st.bytes)
                    for st in staged:
                        st.written.forget()
                    staged = []
                if staged:  # one durability point for every session written
                    self._cold.sync([st.written for st in staged])
                lag = 0.0
                for st in staged:
                    done = self._commit_tail(st)
                    if st.error is not None:
                        errors.append(f"{st.sid!r}: {st.error}")
                        failed[st.sid] = str(st.error)
                    elif done is not None:
                        lag = max(lag, done)
            finally:
                for st in staged:
                    st.written.forget()  # none left unless something failed midway
                for sid in temps:
                    res.held.release_temp(sid)
            if explicit:
                self.failed, self.written = failed, len(staged) - sum(
                    1 for st in staged if st.sid in failed)
            if staged and not errors:
                self.lag = lag
            if errors:
                self.health.failed(list(failed.items()), self._cold.root, res.budget.ratio)
            elif staged:
                self.health.ok("writing to", self._cold.root)
            return errors

    def _stage_tail(self, sid: str) -> _Pass | None:
        """Check one session against the mount and append what cold lacks (no fsync)."""
        res = self.res
        with res.io_lock(sid):
            cs = self._cold.state(sid)
            mount_meta = self.valid.mount_meta(sid, cs)
            with res.locked(sid) as slot:
                f, s = res.warm(slot, sid)
                if s is None:
                    res.dirty.drop(sid)
                    return None
                assert f is not None  # a warm record lives in a shard file
                stale = self.valid.stale_reason(s, cs, mount_meta)
                if stale is not None:
                    self.valid.forget_locked(slot, f, s, *stale)
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
                summ, meta = res.summary_bytes(f, s), f.meta_bytes(s)
                old_summ, old_meta = s.csumm, s.cmeta
                st = _Pass(sid, s, s.gen, res.dirty.since(sid))
            # the tail's extents stay (io lock): write them without blocking the agent
            plan = RoundWrite(sid)
            w = st.written  # names as they are tried (synced later even if this fails)
            summ_changed = meta_changed = True  # until known: then what cold holds is known
            try:
                if cs is None:
                    w.made_dir = files.ensure_dir(self._cold, sid)
                    res.held.hold_made(sid)
                if cs is None or cs[1] is None:
                    plan.incarnation = s.inc
                for layer, c, pieces in tails:
                    plan.stream(layer, c, pieces)
                if old_summ is None:
                    old_summ = files.read_summaries(self._cold, sid)
                summ_changed = summ != old_summ
                plan.summaries = (summ, old_summ)
                meta_changed = meta is not None and meta != old_meta and (
                    old_meta is not None or files.read_meta_bytes(self._cold, sid) != meta)
                if meta_changed:
                    plan.meta = meta
                if ch := plan.changes():
                    self._cold.write(sid, ch, w)
            finally:
                for layer, _, _ in tails:
                    if layer_name(layer) in w.sizes:
                        sizes[layer] = w.sizes[layer_name(layer)]
                if not summ_changed or w.sizes.get(SUMMARIES) == len(summ):
                    old_summ = summ
                if meta is not None and (not meta_changed or w.sizes.get(META) == len(meta)):
                    old_meta = meta
                written = set(w.names)
                with res.locked(sid) as slot:
                    f2, s2 = res.warm(slot, sid)
                    if s2 is s:
                        s.cold, s.csumm, s.cmeta = sizes, old_summ, old_meta
                        s.unsynced |= written
                        st.written.names = set(s.unsynced)
                        if INCARNATION in written and not s.flags & FLAG_ON_COLD:
                            assert f2 is not None  # a warm record lives in a shard file
                            f2.set_flags(s, s.flags | FLAG_ON_COLD)  # a removal from now on is one
        return st

    def _commit_tail(self, st: _Pass) -> float | None:
        """Record a durable tail; clean if nothing changed since. Returns the lag."""
        res = self.res
        with res.locked(st.sid) as slot:
            f, s = res.warm(slot, st.sid)
            if s is not st.session:
                st.written.error = None  # deleted or dropped meanwhile: nothing to report
                return None
            if st.error is not None:
                return None
            assert f is not None  # a warm record lives in a shard file
            s.unsynced -= st.written.names
            flags = s.flags | FLAG_ON_COLD
            res.held.see(st.sid)
            clean = s.gen == st.gen and not s.unsynced
            if clean:
                flags |= FLAG_CLEAN
                res.dirty.drop(st.sid)
            f.set_flags(s, flags)
        return time.monotonic() - st.since if clean else None

    # ---- the writer thread --------------------------------------------------------------
    def _due(self, now: float) -> tuple[float, bool]:
        at, full = self.res.dirty.due(now)
        return max(at, self.health.retry_at), full

    def _writer(self) -> None:
        next_stats = 0.0
        while not self._stop:
            now = time.monotonic()
            if now >= next_stats:
                self.res.budget.refresh()  # other processes fill or empty the RAM filesystem too
                self._write_stats()
                next_stats = now + STATS_EVERY_S
            due, full = self._due(now) if self.on else (float("inf"), True)
            if due <= now:
                try:
                    self.run(None, explicit=False, fsync=full)
                except Exception:  # noqa: BLE001 - the thread must live; the next pass retries
                    log.exception("warm write-behind pass failed")
                    time.sleep(min(self.health.retry_s, 1.0))
                continue
            wake = self.res.dirty.wake
            wake.wait(max(0.0, min(due, next_stats) - now))
            wake.clear()

    def _write_stats(self) -> None:
        u = self.usage()
        doc = {k: u[k] for k in ("bytes", "sessions", "cap", "cap_bytes", "hits", "misses",
                                 "dirty_bytes", "dirty_sessions", "writebehind_lag_s",
                                 "cold_error", "volume_id")}
        doc.update(pid=os.getpid(), time=time.time())
        extra = self.extra()  # the hot tier's figures, from its router
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
    def evict_group(self, n: int, exclude: Container[str], explicit: bool = False) -> list[str]:
        """Drop the ``n`` least recently used sessions from RAM: clean ones at once (their
        cold copy is complete), dirty ones after a pass wrote them. Timed into
        kv_warm_evict_latency_ms."""
        res = self.res
        victims = res.policy.victims(n, exclude)
        dirty = [sid for sid in victims if sid in res.dirty]
        if not victims:
            return []
        t0 = time.perf_counter()
        if dirty:
            self.run(dirty, explicit)
        done, freed = [], 0
        for sid in victims:
            with res.io_lock(sid), res.locked(sid) as slot:
                f, s = res.warm(slot, sid)
                if s is None or sid in res.dirty:
                    continue
                assert f is not None  # a warm record lives in a shard file
                freed += res.drop(slot, f, s)
                done.append(sid)
        ms = (time.perf_counter() - t0) * 1000
        metrics.warm_evict_latency.observe(ms)
        metrics.warm_migrations.inc(len(done))
        res.bump("migrations", len(done))
        res.bump("groups")
        if done:
            log.info("dropped %d clean session(s), %d bytes, from RAM in %.2f ms", len(done), freed, ms)
        return done

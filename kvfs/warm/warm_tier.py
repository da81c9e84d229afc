"""WarmTier: the RAM tier's API, built from parts with named seams.

The parts, bottom up: the shard files (``shards.ShardStore``), the order sessions leave
RAM in (``policy.EvictionPolicy``, LRU groups by default), the bytes held and the cap
(``budget.Budget``), the sessions with changes cold lacks (``dirty.DirtySet``), the
sessions this process holds (``held.HeldSessions``) and the cold tier
(``cold.ColdBackend``: the mount's files or its native channel). ``resident.Resident``
composes them into the RAM copies of sessions; above it ``validate.Validator`` checks a
copy against the mount, ``reads.Reader`` reads, ``migrate.Mover`` migrates and promotes,
``migrate.Evictor`` decides when a group leaves RAM, ``writeback.WriteBehind`` writes
behind. This class builds them and owns the writes (append, truncate, meta, summaries)
and the session calls (sessions, where, delete, sync, release, flush, usage, close).

Contract: one writer per session, any number of readers; one process at a time per
session (owners.py). ``sync`` is the durable point (every byte on the mount, fsynced, or
a WarmError); ``flush`` only msyncs the RAM shards; ``close`` runs a last write-behind
pass, so a closed tier leaves complete sessions on the mount (raising, after closing
everything, when the mount refused them: their RAM copies then stay for the next start-up
to write). Room: every range is reserved before it is written through a mapping (a full
tmpfs means eviction to the mount, or a WarmError, never a SIGBUS).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvfs.session import files
from kvfs.session import fork as fork_stored
from kvfs.session.backend import ColdBackend
from kvfs.session.names import SIDE_STREAMS, side_stream

from .budget import Budget
from .coldopen import open_cold
from .dirty import DirtySet
from .health import ColdHealth
from .held import HeldSessions
from .ids import WarmError, as_u8, check_layer, check_shards, check_sid
from .kvmap_format import K_LAYER, K_SUMMARY, KEY_DEVICE, KEY_SESSION
from .migrate import Evictor, Mover
from .owners import SessionLocks, adopt_dead, check_volume_id, claim_dir
from .policy import EvictionPolicy, LRUGroups
from .reader import Reader
from .resident import Resident
from .rootdir import DEFAULT_ROOT, RootDir, open_root
from .shards import ShardStore, Slot
from .validate import Validator
from .writeback import WriteBehind

log = logging.getLogger("kvfs.warm")


class WarmTier:
    """The warm tier. See ``docs/contracts/warm-api.md`` and the module docstring."""

    def __init__(self, cold_root: str | None, root: str = DEFAULT_ROOT, *,
                 cap_bytes: int = 16 << 30, migrate_at: float = 0.85, group: int = 10,
                 shards: int = 65536, shard_key: str = "session", summary_dim: int = 128,
                 clock: Callable[[], float] = time.time, max_open_shards: int = 512,
                 retry_s: float = 1.0, retry_max_s: float = 300.0, writebehind: bool = True,
                 writebehind_s: float = 2.0, writebehind_bytes: int = 64 << 20,
                 volume_id: str | None = None, native: bool | None = None,
                 policy: EvictionPolicy | None = None) -> None:
        if shard_key not in ("session", "device"):
            raise WarmError(f"shard_key must be 'session' or 'device', got {shard_key!r}")
        key = KEY_SESSION if shard_key == "session" else KEY_DEVICE
        check_shards(shards, key)
        if cap_bytes <= 0 or not 0 < migrate_at <= 1 or group < 1 or summary_dim < 1 or max_open_shards < 1:
            raise WarmError("cap_bytes, group, summary_dim, max_open_shards must be > 0 and 0 < migrate_at <= 1")
        if not 0 < retry_s <= retry_max_s:
            raise WarmError("retry_s must be > 0 and at most retry_max_s")
        if writebehind_s <= 0 or writebehind_bytes <= 0:
            raise WarmError("writebehind_s and writebehind_bytes must be > 0")
        self.volume_id = check_volume_id(volume_id) if volume_id is not None else None
        self.root, self.dim = root, int(summary_dim)
        self.stats_extra: Callable[[], dict] | None = None  # the hot tier's figures (its router)
        self._dirs: list[RootDir] = []
        self.cold: ColdBackend | None = None
        try:  # each a WarmError if it is not safely ours
            top = self._keep(open_root(root))
            self.root_path = root = top.path  # a private fallback when the name was squatted
            base = self._keep(top.sub(self.volume_id)) if self.volume_id is not None else top
            locks = SessionLocks(self._keep(base.sub("locks")))
            self.rootdir = self._keep(claim_dir(base))  # this process's shards (flock'ed)
            adopt_dead(base, self.rootdir, legacy=self.volume_id is None)
            # the mount's native channel when it serves one this process may use (``native``
            # None), never (False), or required (True); WarmError if the mount is absent
            self.cold = open_cold(cold_root, native) if cold_root is not None else None
            self.health = ColdHealth(retry_s, retry_max_s)
            self.budget = Budget(self.rootdir, cap_bytes, migrate_at)
            held = self.held = HeldSessions(locks, self.cold, self.rootdir.path)
            dirty = DirtySet(writebehind_s, writebehind_bytes, bool(writebehind) and self.cold is not None)
            store = ShardStore(self.rootdir, root, shards, key, self.dim, clock, max_open_shards)
            self.res = res = Resident(store, policy or LRUGroups(), self.budget, dirty, held,
                                      self.cold, clock, self.dim)
            self.valid = Validator(res, held, self.cold)
            self.mover = Mover(res, self.health, self.cold, held, self.valid.own, root)
            self.evictor = Evictor(res, self.health, self.cold, int(group), root)
            self.mover.after_promote = self.evictor.after_promote
            self.reader = Reader(res, self.cold, self.valid.own, self.mover.promote_locked,
                                 self.evictor.after_promote)
            self.wb = WriteBehind(res, self.cold, self.valid, self.health, self.rootdir,
                                  writebehind, self.mover.drop_damaged, self.usage,
                                  lambda: self.stats_extra)
            self.evictor.move = self.wb.evict_group if self.wb.on else self.mover.migrate_group
            self.mover.scan(self.wb.on)
        except BaseException:
            if self.cold is not None:
                self._cold.close()
            self._close_dirs()
            raise
        self.budget.refresh()
        res.gauges()
        self.wb.start()

    @property
    def _cold(self) -> ColdBackend:
        """The cold tier, where a caller runs only with one."""
        assert self.cold is not None
        return self.cold


    def _keep(self, d: RootDir) -> RootDir:
        self._dirs.append(d)
        return d

    def _close_dirs(self) -> None:
        for d in reversed(self._dirs):  # the process directory's flock goes with its fd
            d.close()

    # ---- settings others read or change ---------------------------------------------------
    @property
    def migrate_at(self) -> float:
        return self.budget.migrate_at

    @migrate_at.setter
    def migrate_at(self, v: float) -> None:
        self.budget.migrate_at = float(v)

    @property
    def cap(self) -> int:
        return self.budget.cap

    @property
    def store(self) -> ShardStore:
        """The shard files (tests and tools look inside: ``store.file(shard)``)."""
        return self.res.shards

    @property
    def stats(self) -> dict[str, int]:
        return self.res.stats

    def _locked(self, sid: str) -> contextlib.AbstractContextManager[Slot]:
        self.valid.own(sid)
        return self.res.locked(sid)

    # ---- bytes ----------------------------------------------------------------------------
    def append(self, sid: str, layer: int, data: bytes | memoryview | np.ndarray) -> int:
        """Append token-major bytes to a layer; returns its new size. May then migrate the
        least recently used group to cold if usage passed the threshold."""
        return self._append(sid, check_layer(layer), data)

    def side_append(self, sid: str, name: str, data: bytes | memoryview | np.ndarray) -> int:
        """Append to the session's side stream ``name`` (``key_centroids``: the hot tier's
        per-block key centroids, cold file ``sessions/<sid>/key_centroids``); returns its new
        size. Stored, checksummed, written behind, migrated and deleted like a layer."""
        return self._append(sid, side_stream(name), data)

    def side_truncate(self, sid: str, name: str, length: int) -> None:
        """Shorten side stream ``name`` (see ``truncate``)."""
        self._truncate(sid, side_stream(name), length)

    def _append(self, sid: str, layer: int, data: bytes | memoryview | np.ndarray) -> int:
        buf = as_u8(data)
        self.held.check_lost(sid)
        self.evictor.admit(len(buf), sid)
        res = self.res

        def write() -> int:
            with self._locked(sid) as slot:
                f, s = res.warm(slot, sid, create=True)
                base, size = res.span(s, layer)
                if len(buf):
                    res.mark_dirty(f, s, len(buf))
                    res.account(f.write(s, K_LAYER, layer, size, buf, base=base))
                res.touch(f, s)
                return size + len(buf)

        new = self.evictor.with_room(sid, write)
        self.evictor.maybe_migrate()
        return new

    def truncate(self, sid: str, layer: int, length: int) -> None:
        """Shorten a layer (an agent retrying a turn). Cold is cut first, then warm, so
        cold stays a prefix of the content whatever the moment of a crash."""
        self._truncate(sid, check_layer(layer), length)

    def _truncate(self, sid: str, layer: int, length: int) -> None:
        self.valid.own(sid)
        self.held.check_lost(sid)
        res = self.res
        with res.io_lock(sid), res.locked(sid) as slot:
            f, s = res.warm(slot, sid)
            if s is not None:
                assert f is not None  # a warm record lives in a shard file
                size, cold_size = res.span(s, layer)[1], (s.cold or {}).get(layer, 0)
            else:
                size = cold_size = files.stream_size(self._cold, sid, layer) if self.cold else 0
            if not 0 <= length <= size:
                raise ValueError(f"truncate to {length}: only shortening (size {size})")
            if length == size:
                return
            if cold_size > length:
                files.truncate_stream(self._cold, sid, layer, length)
                if s is not None and s.cold is not None:
                    s.cold[layer] = length
            if s is not None:
                assert f is not None  # a warm record lives in a shard file
                res.account(-f.truncate(s, K_LAYER, layer, length))
                res.touch(f, s)

    # ---- meta and summaries ---------------------------------------------------------------
    def put_meta(self, sid: str, meta: dict) -> None:
        if not isinstance(meta, dict):
            raise TypeError("meta must be a dict")
        raw = json.dumps(meta, separators=(",", ":")).encode()
        self.held.check_lost(sid)
        self.evictor.admit(len(raw), sid)
        res = self.res

        def write() -> None:
            with self._locked(sid) as slot:
                f, s = res.warm(slot, sid, create=True)
                res.mark_dirty(f, s, len(raw))
                res.account(f.put_meta(s, raw))
                res.touch(f, s)

        self.evictor.with_room(sid, write)
        self.evictor.maybe_migrate()

    def get_meta(self, sid: str) -> dict | None:
        with self._locked(sid) as slot:
            f, s = self.res.warm(slot, sid)
            if s is None:
                return files.read_meta(self._cold, sid) if self.cold else None
            assert f is not None  # a warm record lives in a shard file
            raw = f.meta_bytes(s)
            self.res.touch(f, s)
            return json.loads(raw) if raw is not None else None

    def put_summary(self, sid: str, round_idx: int, vec: np.ndarray) -> None:
        """Set round ``round_idx``'s summary; rounds skipped over read as zero vectors."""
        v = np.asarray(vec, dtype=np.float32).reshape(-1)
        if v.size != self.dim:
            raise ValueError(f"summary must have {self.dim} floats, got {v.size}")
        if isinstance(round_idx, bool) or not isinstance(round_idx, (int, np.integer)) or round_idx < 0:
            raise ValueError(f"bad round index {round_idx!r}")
        self.held.check_lost(sid)
        row = self.res.row
        self.evictor.admit(row, sid)
        res = self.res

        def write() -> None:
            with self._locked(sid) as slot:
                f, s = res.warm(slot, sid, create=True)
                have = s.summary.end
                pos = int(round_idx) * row
                buf = v.view(np.uint8)
                if pos > have:
                    buf = np.concatenate([np.zeros(pos - have, np.uint8), buf])
                    pos = have
                res.mark_dirty(f, s, len(buf))
                res.account(f.write(s, K_SUMMARY, 0, pos, buf))
                res.touch(f, s)

        self.evictor.with_room(sid, write)
        self.evictor.maybe_migrate()

    def summaries(self, sid: str) -> np.ndarray:
        """float32 [rounds, summary_dim] (a copy; empty when none)."""
        with self._locked(sid) as slot:
            f, s = self.res.warm(slot, sid)
            if s is not None:
                assert f is not None  # a warm record lives in a shard file
                raw = self.res.summary_bytes(f, s)
                self.res.touch(f, s)
            else:
                raw = files.read_summaries(self._cold, sid) if self.cold else b""
        n = len(raw) // self.res.row
        return np.frombuffer(raw, np.float32, n * self.dim).reshape(n, self.dim).copy()

    def truncate_summaries(self, sid: str, rounds: int) -> None:
        """Keep the first ``rounds`` summaries (addition: pairs with truncate)."""
        res = self.res
        with self._locked(sid) as slot:
            f, s = res.warm(slot, sid)
            if s is None and self.cold is not None and self._cold.exists(sid):
                f, s = res.warm(slot, sid, create=True)  # the cold file is cut at migration
            if s is not None and rounds * res.row < s.summary.end:
                assert f is not None  # a warm record lives in a shard file
                res.mark_dirty(f, s, 0)
                res.account(-f.truncate(s, K_SUMMARY, 0, rounds * res.row))

    # ---- reads (reader.py) ------------------------------------------------------------------
    def size(self, sid: str, layer: int) -> int:
        return self.reader.size(sid, layer)

    def layer_sizes(self, sid: str) -> dict[int, int]:
        return self.reader.layer_sizes(sid)

    def layers(self, sid: str) -> list[int]:
        return self.reader.layers(sid)

    def read(self, sid: str, layer: int, start: int, end: int, *,
             promote: bool | None = None) -> np.ndarray:
        return self.reader.read(sid, layer, start, end, promote=promote)

    def read_into(self, sid: str, layer: int, start: int, end: int, out: np.ndarray, *,
                  promote: bool | None = None) -> None:
        self.reader.read_into(sid, layer, start, end, out, promote=promote)

    def read_many(self, sid: str, ranges: list[tuple[int, int, int, np.ndarray]], *,
                  promote: bool | None = False) -> None:
        self.reader.read_many(sid, ranges, promote=promote)

    def read_layers(self, sid: str, layers: list[int] | range, start: int, end: int, *,
                    promote: bool = False) -> np.ndarray:
        return self.reader.read_layers(sid, layers, start, end, promote=promote)

    def prefetch(self, sid: str, layers: list[int] | range, start: int, end: int) -> int:
        return self.reader.prefetch(sid, layers, start, end)

    def in_ram(self, sid: str, layer: int, start: int, end: int) -> bool:
        return self.reader.in_ram(sid, layer, start, end)

    def side_size(self, sid: str, name: str) -> int:
        return self.reader.side_size(sid, name)

    def side_read(self, sid: str, name: str, start: int, end: int) -> np.ndarray:
        return self.reader.side_read(sid, name, start, end)

    # ---- moves ---------------------------------------------------------------------------
    def migrate(self, n: int | None = None) -> list[str]:
        """Move the ``n`` (default: group) least recently used sessions to cold now (also
        while backing off); WarmError when the cold tier refused and nothing moved."""
        return self.evictor.migrate(n)

    def promote(self, sid: str) -> None:
        """Bring a session's cold bytes back into warm (the cold copy stays as a prefix)."""
        self.mover.promote(sid)

    # ---- sessions ------------------------------------------------------------------------
    def sessions(self) -> list[str]:
        names = set(self.res.policy.names())
        if self.cold is not None:
            for n in self._cold.list():
                with contextlib.suppress(WarmError):
                    names.add(check_sid(n))
        return sorted(names)

    def where(self, sid: str) -> str | None:
        with self._locked(sid) as slot:
            _, s = self.res.warm(slot, sid)
            on_cold = (s.cold is not None) if s is not None else bool(self.cold and self._cold.exists(sid))
        if s is not None:
            return "both" if on_cold else "warm"
        return "cold" if on_cold else None

    def delete(self, sid: str) -> None:
        """Remove a session from both tiers (warm first: a crash in between leaves the
        cold prefix, a consistent older state)."""
        self.valid.own(sid)
        res = self.res
        with res.io_lock(sid), res.locked(sid) as slot:
            f, s = res.warm(slot, sid)
            if s is not None:
                assert f is not None  # a warm record lives in a shard file
                res.drop(slot, f, s)
            if self.cold is not None:
                self._cold.delete(sid)
        self.held.clear_lost(sid)

    def fork(self, src: str, dst: str) -> None:
        """Make the new session ``dst`` a copy of session ``src`` as it stands now.

        With a mount, ``src`` is synced and copied there in the session's commit order
        (``kvfs.session.fork``: a crash leaves ``dst`` absent or whole), then read from
        the mount like any stored session; a failed copy is deleted. Without one, it is
        copied in RAM, meta.json last. FileExistsError when ``dst`` exists in either
        tier; KeyError when ``src`` has no meta.json in any.
        """
        check_sid(src)
        if dst == src or self.where(dst) is not None:  # ``where`` takes dst: no one else makes it
            raise FileExistsError(f"session {dst!r} exists: a fork makes a new session")
        meta = self.get_meta(src)
        if meta is None:
            raise KeyError(f"session {src!r} has no meta.json in any tier")
        try:
            if self.cold is None:
                self._copy_in_ram(src, dst, meta)
            else:
                self.sync(src)
                done = fork_stored(self._cold, src, dst)
                if done is None:
                    raise KeyError(f"session {src!r} left the mount while being forked")
                if done.error is not None:
                    raise WarmError(f"fork {src!r} -> {dst!r}: {done.error}") from done.error
        except BaseException:
            if self.where(dst) is not None:
                self.delete(dst)  # no half copy left behind
            raise
        log.info("forked session %r -> %r", src, dst)

    def _copy_in_ram(self, src: str, dst: str, meta: dict) -> None:
        step = 8 << 20
        for layer, size in self.layer_sizes(src).items():
            for a in range(0, size, step):
                self.append(dst, layer, self.read(src, layer, a, min(size, a + step), promote=False))
        for name in SIDE_STREAMS:
            size = self.side_size(src, name)
            for a in range(0, size, step):
                self.side_append(dst, name, self.side_read(src, name, a, min(size, a + step)))
        for i, vec in enumerate(self.summaries(src)):
            self.put_summary(dst, i, vec)
        self.put_meta(dst, meta)  # last: it claims the bytes

    def sync(self, sid: str | None = None) -> None:
        """Return once every byte of ``sid`` (default: of every session) is on the mount and
        fsynced; WarmError when the mount cannot be reached or refuses the bytes. A lost
        session (``WarmLost``), or one whose bytes the mount refused while it took others',
        is raised by a sync of that session only: a sync of every session logs it and syncs
        the others (it is that session's error, not theirs; ``unsynced`` names them)."""
        if self.cold is None:
            raise WarmError("no cold tier to sync to")
        if sid is not None:
            self.valid.own(sid)
        self._raise_lost(sid)
        self._cold.reachable()
        errors = self.wb.run([sid] if sid is not None else None, explicit=True)
        self._raise_lost(sid)  # the pass found the mount's copy changed under ours
        if errors and sid is None and self.wb.written:
            # others were written: each failure is its session's, raised by its own sync
            for s, e in self.wb.failed.items():
                log.warning("warm session %r: not synced to the cold tier (%s); left to that "
                            "session's own calls, the others are synced", s, e)
            return
        if errors:
            raise WarmError(f"sync to cold tier {self._cold.root!r} failed: {errors[0]}"
                            + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))

    def unsynced(self) -> dict[str, WarmError]:
        """The sessions the last sync could not write, each with its error (their own
        ``sync`` raises it)."""
        return {s: WarmError(e) for s, e in self.wb.failed.items()}

    def _raise_lost(self, sid: str | None) -> None:
        if sid is not None:
            self.held.check_lost(sid)
            return
        for lost in self.held.lost():
            log.warning("warm session %r: its RAM copy was lost (the mount's copy is newer); "
                        "not synced, left to that session's own calls", lost)

    def release(self, sid: str) -> None:
        """Sync ``sid`` (when there is a cold tier) and give up its lock and hold, so that
        another process or node may open it. The RAM copy stays, checked against the mount
        on next use. A lost session (``WarmLost``) is let go without a sync."""
        h = self.held.get(sid)
        lost = self.held.clear_lost(sid)
        if h is None:
            return
        if self.cold is not None and lost is None:
            self.sync(sid)
        with self.held.taking:
            h = self.held.pop(sid)
        if h is not None:
            self.held.let_go(sid, h)

    def lost(self) -> list[str]:
        """The sessions whose RAM copy was dropped because someone else wrote them."""
        return self.held.lost()

    def clear_lost(self, sid: str) -> None:
        """The agent let go of a lost session, or resumes it from the mount's copy: a RAM
        copy older than the mount's (even one held and checked before) is dropped now, so
        what follows reads the mount's session, not the stale copy."""
        if self.cold is not None and self.held.get(check_sid(sid)) is not None:
            try:
                self.valid.validate(sid)
            except WarmError as e:  # the mount is away: checked again on the next pass
                log.warning("warm session %r: cannot check it against the mount: %s", sid, e)
        self.held.clear_lost(sid)

    def owned(self) -> list[str]:
        """The sessions this tier holds open (their locks)."""
        return self.held.owned()

    def flush(self, sid: str | None = None) -> None:
        """msync the shard of ``sid`` (or of every mapped shard). Not a durable point: see
        ``sync``."""
        if sid is None:
            self.res.shards.flush()
            return
        with self._locked(sid) as slot:
            if slot.file is not None:
                slot.file.flush()

    def usage(self) -> dict[str, Any]:
        """Bytes, the effective cap (what the RAM filesystem allows, at most ``cap_bytes``),
        sessions, dirty bytes and sessions, the last write-behind lag, counters."""
        b, d = self.budget, self.res.dirty
        return {"bytes": b.bytes, "cap": b.cap, "cap_bytes": b.cap_bytes, "ratio": b.ratio,
                "threshold": b.migrate_at, "sessions": len(self.res.policy),
                "cold_error": self.health.error, "shard_files": self.res.shards.count_files(),
                "dirty_bytes": d.bytes, "dirty_sessions": len(d), "writebehind": self.wb.on,
                "writebehind_lag_s": round(self.wb.lag, 3), "owned": self.held.count(),
                "volume_id": self.volume_id, "dir": self.rootdir.path,
                "cold": self._cold.kind if self.cold is not None else None, **self.res.stats}

    def close(self) -> None:
        if self.res.shards.closed:
            return
        self.wb.stop()
        failed = None
        if self.wb.on:
            try:
                errors = self.wb.run(None, explicit=True)
            except WarmError as e:
                errors = [str(e)]
            if errors:
                failed = errors[0]
        with self.evictor.lock:
            self.res.shards.close()
            self.res.close_pool()
            if self.cold is not None:
                self._cold.close()
        self.held.release_all()
        self._close_dirs()
        if failed is not None:
            raise WarmError(f"closed, but the last write-behind to cold tier {self._cold.root!r} "
                            f"failed: {failed}; the RAM copies stay for the next start-up")

    def __enter__(self) -> WarmTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

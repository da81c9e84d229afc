"""The warm tier's session and housekeeping calls: sessions, where, delete, sync,
release, flush, usage, close.

``sync`` is the durable point (every byte on the mount, fsynced, or a WarmError);
``flush`` only msyncs the RAM shards. ``close`` runs a last write-behind pass, so a
closed tier leaves complete sessions on the mount (raising, after closing everything,
when the mount refused them: their RAM copies then stay for the next start-up to write).

A mixin of WarmTier (tier.py owns the state; writeback.py the passes). Never imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from .ids import WarmError, check_sid

log = logging.getLogger("kvfs.warm")


class Lifecycle:
    """sessions / where / delete / sync / release / flush / usage / close; see the module doc."""

    def sessions(self) -> list[str]:
        with self._lock:
            names = set(self._lru)
        if self.cold is not None:
            for n in self.cold.list():
                with contextlib.suppress(WarmError):
                    names.add(check_sid(n))
        return sorted(names)

    def where(self, sid: str) -> str | None:
        with self._locked(sid) as slot:
            _, s = self._warm(slot, sid)
            on_cold = (s.cold is not None) if s is not None else bool(self.cold and self.cold.exists(sid))
        if s is not None:
            return "both" if on_cold else "warm"
        return "cold" if on_cold else None

    def delete(self, sid: str) -> None:
        """Remove a session from both tiers (warm first: a crash in between leaves the
        cold prefix, a consistent older state)."""
        self._own(sid)
        with self._io_lock(sid), self._locked(sid, own=False) as slot:
            f, s = self._warm(slot, sid)
            if s is not None:
                self._drop_session(slot, f, s)
            if self.cold is not None:
                self.cold.delete(sid)
        self.clear_lost(sid)

    # ---- housekeeping ---------------------------------------------------------------

    def sync(self, sid: str | None = None) -> None:
        """Return once every byte of ``sid`` (default: of every session) is on the mount and
        fsynced; WarmError when the mount cannot be reached or refuses the bytes."""
        if self.cold is None:
            raise WarmError("no cold tier to sync to")
        if sid is not None:
            self._own(sid)
        self._raise_lost(sid)
        self.cold.reachable()
        errors = self._pass([sid] if sid is not None else None, explicit=True)
        self._raise_lost(sid)  # the pass found the mount's copy changed under ours
        if errors:
            raise WarmError(f"sync to cold tier {self.cold.root!r} failed: {errors[0]}"
                            + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))

    def _raise_lost(self, sid: str | None) -> None:
        for lost in [sid] if sid is not None else list(self._lost):
            self._check_lost(lost)

    def release(self, sid: str) -> None:
        """Sync ``sid`` (when there is a cold tier) and give up its lock and hold, so that
        another process or node may open it. The RAM copy stays, checked against the mount
        on next use. A lost session (``WarmLost``) is let go without a sync."""
        with self._lock:
            own = self._owned.get(sid)
            lost = self._lost.pop(sid, None)
        if own is None:
            return
        if self.cold is not None and lost is None:
            self.sync(sid)
        with self._own_lock, self._lock:
            own = self._owned.pop(sid, None)
        if own is not None:
            self._let_go(sid, own)

    def _let_go(self, sid: str, own: Any) -> None:
        if self.cold is not None:
            self.cold.unhold(own.hold)  # the mount hands the lease back once it pushed all
        self.locks.drop(sid, own.fd)

    def owned(self) -> list[str]:
        """The sessions this tier holds open (their locks)."""
        with self._lock:
            return sorted(sid for sid, own in self._owned.items() if not own.temp)

    def _release_all(self) -> None:
        with self._own_lock, self._lock:
            owned, self._owned = self._owned, {}
        for sid, own in owned.items():
            self._let_go(sid, own)

    def _stop_writer(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def flush(self, sid: str | None = None) -> None:
        """msync the shard of ``sid`` (or of every mapped shard). Not a durable point: see
        ``sync``."""
        if sid is not None:
            with self._locked(sid) as slot:
                if slot.file is not None:
                    slot.file.flush()
            return
        with self._lock:
            slots = list(self._slots.values())
        for slot in slots:
            with slot.lock:
                if slot.file is not None:
                    slot.file.flush()

    def usage(self) -> dict:
        """Bytes, the effective cap (what the RAM filesystem allows, at most ``cap_bytes``),
        sessions, dirty bytes and sessions, the last write-behind lag, counters."""
        with self._lock:
            return {"bytes": self._bytes, "cap": self.cap, "cap_bytes": self.cap_bytes,
                    "ratio": self._bytes / self.cap, "threshold": self.migrate_at,
                    "sessions": len(self._lru), "cold_error": self._cold_error,
                    "shard_files": sum(1 for s in self._slots.values() if s.file is not None),
                    "dirty_bytes": self._dirty_bytes, "dirty_sessions": len(self._dirty),
                    "writebehind": self.wb_on, "writebehind_lag_s": round(self._wb_lag, 3),
                    "owned": sum(1 for o in self._owned.values() if not o.temp),
                    "volume_id": self.volume_id, "dir": self.rootdir.path, **self.stats}

    def close(self) -> None:
        if self._closed:
            return
        self._stop_writer()
        failed = None
        if self.wb_on:
            try:
                errors = self._pass(None, explicit=True)
            except WarmError as e:
                errors = [str(e)]
            if errors:
                failed = errors[0]
        with self._mig_lock:
            with self._lock:
                self._closed = True
                slots = list(self._slots.values())
            for slot in slots:
                with slot.lock:
                    if slot.file is not None:
                        slot.file.unmap()
            if self._pool is not None:
                self._pool.shutdown()
            if self.cold is not None:
                self.cold.close()
        self._release_all()
        self._close_dirs()
        if failed is not None:
            raise WarmError(f"closed, but the last write-behind to cold tier {self.cold.root!r} "
                            f"failed: {failed}; the RAM copies stay for the next start-up")

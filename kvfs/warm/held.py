"""The sessions this process holds, and those whose RAM copy it lost while holding them.

A session is taken on its first use here: a flock on its lock file (``owners.SessionLocks``,
so one process at a time serves it) and, on a mount with a shared tier, its hold
(``ColdBackend.hold``: the lease stays with this node until the session is released,
another node's agent gets ``WarmBusy``), or the hold once its directory is made
(``hold_made``). A write-behind pass takes the sessions nobody here holds for that pass
only (``temp``). A RAM copy dropped while this process serves the session is *lost*
work: writes and syncs raise ``WarmLost`` until it is released or resumed. Thread-safe;
knows nothing of shards.
"""

from __future__ import annotations

import threading

from kvfs.session.backend import ColdBackend, Hold

from .ids import WarmLost
from .owners import SessionLocks


class Held:
    """A session this process holds: its flock'ed lock file. ``temp``: taken by a pass for
    a session nobody has open here (released after the pass); ``seen``: its cold
    directory is known to exist (then every use checks that it still does); ``hold``: what
    keeps its lease on a shared mount (None: none taken)."""

    __slots__ = ("fd", "temp", "seen", "hold")

    def __init__(self, fd: int, temp: bool = False) -> None:
        self.fd, self.temp, self.seen = fd, temp, False
        self.hold: Hold | None = None


class HeldSessions:
    def __init__(self, locks: SessionLocks, cold: ColdBackend | None, where: str) -> None:
        self.locks, self.cold, self.where = locks, cold, where
        self.taking = threading.Lock()  # one take at a time (a take may wait for a hold)
        self._held: dict[str, Held] = {}
        self._lost: dict[str, str] = {}  # sid -> why its RAM copy was dropped while held
        self._lock = threading.Lock()

    def get(self, sid: str) -> Held | None:
        return self._held.get(sid)

    def owned(self) -> list[str]:
        with self._lock:
            return sorted(sid for sid, h in self._held.items() if not h.temp)

    def count(self) -> int:
        with self._lock:
            return sum(1 for h in self._held.values() if not h.temp)

    # ---- taking and letting go (callers hold ``taking``) ------------------------------
    def take(self, sid: str) -> Held:
        """Take ``sid`` for this process (WarmError naming the holder; WarmBusy when another
        node holds its lease); a pass's temporary hold becomes ours."""
        h = self._held.get(sid)
        if h is None:
            h = Held(self.locks.take(sid, self.where))
            try:
                h.hold = self.cold.hold(sid) if self.cold is not None else None
            except BaseException:
                self.locks.drop(sid, h.fd)  # another node serves it: not ours at all
                raise
            with self._lock:
                self._held[sid] = h
            return h
        if h.hold is None and self.cold is not None:
            h.hold = self.cold.hold(sid)
        h.temp = False
        return h

    def take_temp(self, sid: str) -> bool:
        """Hold ``sid`` for one pass: ours already, or free to take now."""
        if sid in self._held:
            return True
        fd = self.locks.try_take(sid)
        if fd is None:
            return False
        with self._lock:
            self._held[sid] = Held(fd, temp=True)
        return True

    def release_temp(self, sid: str) -> None:
        with self._lock:
            h = self._held.get(sid)
            if h is None or not h.temp:
                return
            del self._held[sid]
        self.locks.drop(sid, h.fd)

    def hold_made(self, sid: str) -> None:
        """``sid``'s directory was just made: take its hold if this process serves it."""
        h = self._held.get(sid)
        if h is not None and not h.temp and h.hold is None and self.cold is not None:
            h.hold = self.cold.hold(sid)

    def pop(self, sid: str) -> Held | None:
        with self._lock:
            return self._held.pop(sid, None)

    def let_go(self, sid: str, h: Held) -> None:
        if h.hold is not None:
            h.hold.release()  # the mount hands the lease back once it pushed all
        self.locks.drop(sid, h.fd)

    def release_all(self) -> None:
        with self.taking, self._lock:
            held, self._held = self._held, {}
        for sid, h in held.items():
            self.let_go(sid, h)

    def holder(self, sid: str) -> str:
        return self.locks.holder(sid)

    # ---- seen and lost ------------------------------------------------------------------
    def see(self, sid: str, seen: bool = True) -> None:
        h = self._held.get(sid)
        if h is not None:
            h.seen = seen

    def lose(self, sid: str, why: str) -> None:
        """``sid``'s RAM copy was dropped because someone else wrote the session: lost work
        if this process serves it."""
        with self._lock:
            h = self._held.get(sid)
            if h is not None and not h.temp:
                self._lost[sid] = why

    def check_lost(self, sid: str) -> None:
        why = self._lost.get(sid)
        if why is not None:
            raise WarmLost(f"session {sid!r}: its RAM copy was dropped because {why}; what this "
                           "process wrote since is not on the mount. Release it (release(id, "
                           "flush=False)) and resume it to continue from the mount's copy")

    def lost(self) -> list[str]:
        with self._lock:
            return list(self._lost)

    def clear_lost(self, sid: str) -> str | None:
        with self._lock:
            return self._lost.pop(sid, None)

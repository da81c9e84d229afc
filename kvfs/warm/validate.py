"""Sessions this process holds, and whether their RAM copies are still the mount's.

Deletion wins: each session has an incarnation id (random, 64 bits, made with the
session), written to ``sessions/<sid>/.incarnation`` with its first bytes. Before a RAM
copy is used -- the first use in a process, every pass -- it is checked against the
mount: a copy removed there (while we had written it), made anew (another incarnation),
cut shorter than what we wrote, or grown by someone else means the RAM copy is dropped
(one log line) and the mount's copy is the session. Every use of a session checks that its
directory still exists (one lstat), so ``rm -r`` on the mount is seen at once.

A session is taken (a flock on its lock file, owners.py) on its first use here; a
write-behind pass takes the sessions nobody here has open for that pass only, and drops
its RAM copy of one that another process has open. On a mount with a shared tier, taking a
session also takes its hold (``ColdBackend.hold``: the lease stays with this node until the
session is released; another node's agent gets ``WarmBusy``), or, for a session not on the
mount yet, once its directory is made (``_hold_made``).

A RAM copy dropped while this process serves the session is *lost* work: writes and syncs
of the session raise ``WarmLost`` until it is released or resumed (``clear_lost``), so an
agent's flush never returns normally over bytes the mount does not have. Separate from writeback.py, which
writes the tails these checks clear: every call of the tier goes through ``_own`` first.

A mixin of WarmTier (tier.py owns the shard locks, writeback.py the cold-I/O locks).
Never imports torch.
"""

from __future__ import annotations

import logging
import threading

from .cold import ColdBackend
from .format import FLAG_CLEAN, FLAG_ON_COLD
from .ids import WarmError, WarmLost, check_sid
from .owners import SessionLocks
from .records import Slot, WarmSession
from .shard import ShardFile

log = logging.getLogger("kvfs.warm")


class _Own:
    """A session this process holds: its flock'ed lock file. ``temp``: taken by a pass
    for a session nobody has open here (released after the pass); ``seen``: its cold
    directory is known to exist (then every use checks that it still does); ``hold``: the
    descriptor that keeps its lease on a shared mount (None: none taken)."""

    __slots__ = ("fd", "temp", "seen", "hold")

    def __init__(self, fd: int, temp: bool = False) -> None:
        self.fd, self.temp, self.seen = fd, temp, False
        self.hold: int | None = None


class Validator:
    """Session ownership, validation against the mount, dropping a RAM copy; see module doc."""

    cold: ColdBackend | None
    locks: SessionLocks

    def _init_owners(self) -> None:
        self._owned: dict[str, _Own] = {}
        self._own_lock = threading.Lock()
        self._lost: dict[str, str] = {}  # sid -> why its RAM copy was dropped while served

    def _check_lost(self, sid: str) -> None:
        why = self._lost.get(sid)
        if why is not None:
            raise WarmLost(f"session {sid!r}: its RAM copy was dropped because {why}; what this "
                           "process wrote since is not on the mount. Release it (release(id, "
                           "flush=False)) and resume it to continue from the mount's copy")

    def clear_lost(self, sid: str) -> None:
        """The agent let go of a lost session, or resumes it from the mount's copy."""
        with self._lock:
            self._lost.pop(sid, None)

    def _hold_made(self, sid: str) -> None:
        """The session's directory was just made: take its hold if this process serves it."""
        own = self._owned.get(sid)
        if own is not None and not own.temp and own.hold is None and self.cold is not None:
            own.hold = self.cold.hold(sid)

    def _own(self, sid: str) -> None:
        """Take the session's lock on its first use here (WarmError naming the holder),
        and check a RAM copy made earlier against the mount before it is used."""
        own = self._owned.get(check_sid(sid))
        if own is not None and not own.temp:
            if own.seen and self.cold is not None:
                try:
                    gone = not self.cold.exists(sid)
                except WarmError:  # the mount is away: the RAM copy serves; checked later
                    gone = False
                if gone:
                    self._forget(sid, "its directory was removed through the mount")
            return
        with self._own_lock:
            with self._lock:
                if self._closed:
                    raise WarmError("warm tier is closed")
                own = self._owned.get(sid)
            if own is None:
                own = _Own(self.locks.take(sid, self.rootdir.path))
                try:
                    own.hold = self.cold.hold(sid) if self.cold is not None else None
                except BaseException:
                    self.locks.drop(sid, own.fd)  # another node serves it: not ours at all
                    raise
                with self._lock:
                    self._owned[sid] = own
            else:  # a pass held it: ours now (once held), checked below anyway
                if own.hold is None and self.cold is not None:
                    own.hold = self.cold.hold(sid)
                own.temp = False
            if self.cold is not None and sid in self._lru:
                try:
                    self._validate(sid)
                except WarmError as e:  # the mount is away: the RAM copy serves; checked later
                    log.warning("warm session %r: cannot check it against the mount: %s", sid, e)

    def _validate(self, sid: str) -> None:
        with self._io_lock(sid):
            cs = self.cold.state(sid)
            with self._locked(sid, own=False) as slot:
                f, s = self._warm(slot, sid)
                if s is None:
                    return
                stale = self._stale_reason(s, cs)
                if stale is not None:
                    self._forget_locked(slot, f, s, *stale)
                elif cs is not None and s.flags & FLAG_ON_COLD:
                    self._owned[sid].seen = True

    def _stale_reason(self, s: WarmSession,
                      cs: tuple[dict[int, int], int | None] | None) -> tuple[str, bool] | None:
        """Why the RAM copy ``s`` is not the mount's session any more, and whether it is
        because someone else wrote the session (rather than cut or removed it: a user's
        ``rm -r`` or truncate wins quietly); None: it is the mount's session."""
        on_cold = bool(s.flags & FLAG_ON_COLD)
        if cs is None:
            return ("it was removed through the mount", False) if on_cold else None
        sizes, inc = cs
        if inc is not None and s.inc and inc != s.inc:
            return f"the mount holds another incarnation ({inc:016x}, ours {s.inc:016x})", True
        if inc is None and on_cold:
            return "its .incarnation file was removed through the mount", False
        known = s.cold or {}
        for layer in sorted(set(sizes) | set(known) | set(s.layers)):
            c = sizes.get(layer, 0)
            st = s.layers.get(layer)
            end = self._span(s, layer)[1]
            floor = max(known.get(layer, 0), end if s.flags & FLAG_CLEAN else 0,
                        st.base if st is not None and st.segs else 0)
            if c < floor:
                return f"layer_{layer} was cut to {c} bytes through the mount (we wrote {floor})", False
            if c > end:
                return f"layer_{layer} grew to {c} bytes on the mount (ours has {end})", True
        return None

    def _forget(self, sid: str, reason: str) -> None:
        with self._io_lock(sid), self._locked(sid, own=False) as slot:
            f, s = self._warm(slot, sid)
            if s is not None:
                self._forget_locked(slot, f, s, reason)

    def _forget_locked(self, slot: Slot, f: ShardFile, s: WarmSession, reason: str,
                       elsewhere: bool = False) -> None:
        """Drop a stale RAM copy; ``elsewhere``: someone else wrote the session, so the work
        of this process, if it serves the session, is lost (``WarmLost``)."""
        log.warning("warm session %r: %s; its RAM copy is dropped, the mount's copy is the "
                    "session", s.name, reason)
        with self._lock:
            own = self._owned.get(s.name)
            if elsewhere and own is not None and not own.temp:
                self._lost[s.name] = reason
        self._drop_session(slot, f, s)

    def _drop_session(self, slot: Slot, f: ShardFile, s: WarmSession) -> int:
        """Remove a session's RAM copy (shard lock held); returns the bytes freed."""
        sid = s.name
        freed = f.drop(s)
        if not f.sessions:
            self._remove_file(slot, later=True)
        self._undirty(sid)
        with self._lock:
            self._lru.pop(sid, None)
            self._bytes -= freed
            own = self._owned.get(sid)
            if own is not None:
                own.seen = False
        self._gauges()
        return freed

    def _pass_owner(self, sid: str, temps: list[str]) -> bool:
        """Hold ``sid`` for a pass: ours already, or taken for the pass. A session another
        process has open now is its business: our RAM copy of it is older, dropped."""
        with self._own_lock:
            if sid in self._owned:
                return True
            fd = self.locks.try_take(sid)
            if fd is not None:
                with self._lock:
                    self._owned[sid] = _Own(fd, temp=True)
                temps.append(sid)
                return True
        self._forget(sid, f"process {self.locks.holder(sid)} has the session open")
        return False

    def _release_temp(self, sid: str) -> None:
        with self._own_lock, self._lock:
            own = self._owned.get(sid)
            if own is None or not own.temp:
                return
            del self._owned[sid]
        self.locks.drop(sid, own.fd)

"""Whether a RAM copy is still the mount's session: checks on first use and every pass.

Deletion wins: each session has an incarnation id (random, 64 bits, made with the
session), written to ``sessions/<sid>/.incarnation`` with its first bytes. Before a RAM
copy is used -- the first use in a process, every pass -- it is checked against the
mount: a copy removed there (while we had written it), made anew (another incarnation),
cut shorter than what we wrote, grown by someone else, or holding another ``meta.json``
than the one we last wrote or read there (a session written on elsewhere to the same
sizes: sizes alone cannot tell) means the RAM copy is dropped
(one log line) and the mount's copy is the session. Every use of a session checks that its
directory still exists (one lstat), so ``rm -r`` on the mount is seen at once.

``own`` is where every call of the tier on a session starts: the session taken for this
process on its first use (``HeldSessions``), its RAM copy checked. A copy dropped because
someone else wrote the session is lost work (``HeldSessions.lose``). A pass takes the
sessions nobody here holds for itself (``pass_owner``) and drops its RAM copy of one that
another process has open.
"""

from __future__ import annotations

import logging

from kvfs.session import files
from kvfs.session.backend import ColdBackend
from kvfs.session.names import META, layer_name

from .held import HeldSessions
from .ids import WarmError, check_sid
from .kvmap_format import FLAG_CLEAN, FLAG_ON_COLD
from .resident import Resident
from .shard import ShardFile
from .shard_index import WarmSession
from .shards import Slot

log = logging.getLogger("kvfs.warm")


class Validator:
    def __init__(self, res: Resident, held: HeldSessions, cold: ColdBackend | None) -> None:
        self.res, self.held, self.cold = res, held, cold

    @property
    def _cold(self) -> ColdBackend:
        """The cold tier, where a caller runs only with one."""
        assert self.cold is not None
        return self.cold


    def own(self, sid: str) -> None:
        """Take the session on its first use here (WarmError naming the holder), and check
        a RAM copy made earlier against the mount before it is used."""
        h = self.held.get(check_sid(sid))
        if h is not None and not h.temp:
            if h.seen and self.cold is not None:
                try:
                    gone = not self._cold.exists(sid)
                except WarmError:  # the mount is away: the RAM copy serves; checked later
                    gone = False
                if gone:
                    self.forget(sid, "its directory was removed through the mount")
            return
        with self.held.taking:
            if self.res.shards.closed:
                raise WarmError("warm tier is closed")
            self.held.take(sid)
            if self.cold is not None and sid in self.res.policy:
                try:
                    self.validate(sid)
                except WarmError as e:  # the mount is away: the RAM copy serves; checked later
                    log.warning("warm session %r: cannot check it against the mount: %s", sid, e)

    def mount_meta(self, sid: str, cs: object) -> bytes | None:
        """The mount's meta.json of ``sid`` (None when it has no copy): the session's
        content version, compared with the one this copy last wrote or read."""
        return files.read_meta_bytes(self._cold, sid) if cs is not None and self.cold else None

    def validate(self, sid: str) -> None:
        with self.res.io_lock(sid):
            cs = self._cold.state(sid)
            meta = self.mount_meta(sid, cs)
            with self.res.locked(sid) as slot:
                f, s = self.res.warm(slot, sid)
                if s is None:
                    return
                assert f is not None  # a warm record lives in a shard file
                stale = self.stale_reason(s, cs, meta)
                if stale is not None:
                    self.forget_locked(slot, f, s, *stale)
                elif cs is not None and s.flags & FLAG_ON_COLD:
                    self.held.see(sid)

    def stale_reason(self, s: WarmSession, cs: tuple[dict[int, int], int | None] | None,
                     meta: bytes | None = None) -> tuple[str, bool] | None:
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
            end = self.res.span(s, layer)[1]
            floor = max(known.get(layer, 0), end if s.flags & FLAG_CLEAN else 0,
                        st.base if st is not None and st.segs else 0)
            if c < floor:
                return f"{layer_name(layer)} was cut to {c} bytes through the mount (we wrote {floor})", False
            if c > end:
                return f"{layer_name(layer)} grew to {c} bytes on the mount (ours has {end})", True
        if meta is not None and s.cmeta is not None and meta != s.cmeta:
            return f"its {META} on the mount is not the one this copy wrote or read", True
        return None

    def forget(self, sid: str, reason: str) -> None:
        with self.res.io_lock(sid), self.res.locked(sid) as slot:
            f, s = self.res.warm(slot, sid)
            if s is not None:
                assert f is not None  # a warm record lives in a shard file
                self.forget_locked(slot, f, s, reason)

    def forget_locked(self, slot: Slot, f: ShardFile, s: WarmSession, reason: str,
                      elsewhere: bool = False) -> None:
        """Drop a stale RAM copy; ``elsewhere``: someone else wrote the session, so the work
        of this process, if it serves the session, is lost (``WarmLost``)."""
        log.warning("warm session %r: %s; its RAM copy is dropped, the mount's copy is the "
                    "session", s.name, reason)
        if elsewhere:
            self.held.lose(s.name, reason)
        self.res.drop(slot, f, s)

    def pass_owner(self, sid: str, temps: list[str]) -> bool:
        """Hold ``sid`` for a pass: ours already, or taken for the pass. A session another
        process has open now is its business: our RAM copy of it is older, dropped."""
        with self.held.taking:
            if self.held.take_temp(sid):
                h = self.held.get(sid)
                if h is not None and h.temp and sid not in temps:
                    temps.append(sid)
                return True
        self.forget(sid, f"process {self.held.holder(sid)} has the session open")
        return False

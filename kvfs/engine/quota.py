"""Who uses what on a volume: per-uid usage, the quotas on it, and the index budget.

Usage is kept per uid (the owner of a session is charged for all of it): sessions, files,
data bytes (the files' sizes) and index bytes (the size of the session's checkpoint record,
``records.Session.encode``). It changes with every change of a session and is persisted
with the checkpoint under tree keys ``"U"`` (the totals; its presence says usage is tracked)
and ``"U" + uid`` (4 bytes, big-endian), each four little-endian u64 in the order above, so
a mount knows every uid's usage without reading every session record.

Two limits guard a volume that other users write (``--allow-other``):

* quotas, per uid other than root: sessions, data bytes, and a share of the index budget
  (``QuotaExceeded``, EDQUOT). They keep one user from taking what the others need.
* the index budget, for everyone: the checkpoint must fit one half of the B+ tree region
  with room left for the copy-on-write commits after a compaction (``docs/format.md``), so
  creating sessions and files, and appends (an extent each), stop with ``IndexFull``
  (ENOSPC) once the index would pass ``index_fill`` of a half. Deleting, reading,
  truncating, unmounting and remounting never need index room.

If a volume's index does not fit its region anyway (written before the budget existed),
the store keeps the index in the ring only (``store.Store.checkpoint``): never a volume that
cannot be mounted. Pure bookkeeping: no I/O, never imports pyfuse3 or torch.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from .btree_page import HDR as PAGE_HDR
from .errors import Corrupt, IndexFull, QuotaExceeded, RecordFull
from .format import PAGE
from .records import _EXT, _FILE, _SESS, CHUNK, FileRec, Session

_USE = struct.Struct("<QQQQ")  # sessions, files, bytes, index bytes
SESSIONS, FILES, BYTES, INDEX = range(4)
Use = tuple[int, int, int, int]
NONE: Use = (0, 0, 0, 0)
EXTENT_BYTES = _EXT.size  # index bytes one more extent (one appended entry) costs
KEY_BYTES = 19 + 3  # a session record chunk's key and its leaf entry header
BITMAP_BYTES = 5 + 3 + 1000  # one bitmap chunk: key, entry header, value
USE_BYTES = 5 + 3 + _USE.size  # one "U" key
AUTO = -1  # a quota value: decided by the mount (none on a private one)


def _nb(name: str) -> int:
    return len(name.encode("utf-8", "surrogateescape"))


def session_base(name: str) -> int:
    """Index bytes of a session record without its files."""
    return _SESS.size + 2 + _nb(name)


def file_base(name: str) -> int:
    """Index bytes a file adds to its session's record before its extents."""
    return _FILE.size + 2 + _nb(name)


def file_use(f: FileRec) -> Use:
    return 0, 1, f.size, file_base(f.name) + EXTENT_BYTES * len(f.ext)


def session_use(s: Session) -> Use:
    files = [file_use(f) for f in s.files.values()]
    return (1, len(files), sum(u[BYTES] for u in files),
            session_base(s.name) + sum(u[INDEX] for u in files))


def tree_bytes(index: int, sessions: int) -> int:
    """Leaf bytes, about, that records of ``index`` bytes over ``sessions`` take in the
    tree: the records cut into chunks, each under its own key."""
    return index + KEY_BYTES * (sessions + index // CHUNK)


@dataclass(frozen=True)
class Limits:
    """Resolved limits (0: none). ``budget``: index bytes for the whole volume."""

    sessions: int = 0
    bytes: int = 0
    index: int = 0
    budget: int = 0
    capacity: int = 0  # leaf bytes of one tree half: what a checkpoint can hold at all

    @classmethod
    def resolve(cls, quota_sessions: int, quota_bytes: int, quota_index_share: float,
                shared: bool, index_fill: float, half_pages: int, ring_size: int) -> Limits:
        """Limits from the store's configuration. ``AUTO`` values are none on a private
        mount; on a shared one (``shared``, ``--allow-other``) a uid may hold a quarter of
        the ring's bytes, a quarter of the index budget, and as many sessions as that
        quarter holds at 1 KiB of index each (at least 16)."""
        capacity = half_pages * (PAGE - PAGE_HDR.size)
        budget = int(capacity * index_fill)
        share = quota_index_share if quota_index_share >= 0 else (0.25 if shared else 0.0)
        index = int(budget * share) if 0 < share < 1 else 0
        auto_sessions = max(16, (index or budget // 4) // 1024) if shared else 0
        return cls(sessions=auto_sessions if quota_sessions == AUTO else quota_sessions,
                   bytes=(ring_size // 4 if shared else 0) if quota_bytes == AUTO else quota_bytes,
                   index=index, budget=budget, capacity=capacity)


class Ledger:
    """Usage per uid, what the checkpoint has not recorded yet, and admission checks."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.use: dict[int, list[int]] = {}
        self.dirty: set[int] = set()
        self.tracked = False  # the checkpoint holds the "U" mark (else: rebuilt by a scan)
        self.bitmap_chunks = 0  # set by the store: bitmap chunks the tree holds

    # ------------------------------------------------------------------ changes
    def add(self, uid: int, d: Use, sign: int = 1) -> None:
        if d == NONE:
            return
        u = self.use.setdefault(uid, [0, 0, 0, 0])
        for k in range(4):
            u[k] += sign * d[k]
        self.dirty.add(uid)
        if not any(u):
            del self.use[uid]

    def sub(self, uid: int, d: Use) -> None:
        self.add(uid, d, -1)

    def move(self, old: int, new: int, d: Use) -> None:
        if old != new:
            self.sub(old, d)
            self.add(new, d)

    def of(self, uid: int) -> Use:
        u = self.use.get(uid)
        return (u[0], u[1], u[2], u[3]) if u else NONE

    def totals(self) -> Use:
        t = [0, 0, 0, 0]
        for u in self.use.values():
            for k in range(4):
                t[k] += u[k]
        return t[0], t[1], t[2], t[3]

    def estimate(self) -> int:
        """Leaf bytes the checkpoint of this usage takes, about (records, keys, bitmap,
        usage keys)."""
        t = self.totals()
        return (tree_bytes(t[INDEX], t[SESSIONS]) + BITMAP_BYTES * self.bitmap_chunks
                + USE_BYTES * (len(self.use) + 1))

    def fits(self) -> bool:
        """Whether the index fits a tree half at all."""
        return not self.limits.capacity or self.estimate() <= self.limits.capacity

    # ------------------------------------------------------------------ admission
    def admit(self, uid: int, sessions: int = 0, files: int = 0, nbytes: int = 0,
              index: int = 0) -> None:
        """Raise unless ``uid`` may add this much: QuotaExceeded for its own limits,
        IndexFull for the volume's index budget. Root (uid 0) has no quota."""
        lim = self.limits
        if uid != 0 and (lim.sessions or lim.bytes or lim.index):
            u = self.of(uid)
            if sessions and lim.sessions and u[SESSIONS] + sessions > lim.sessions:
                raise QuotaExceeded(f"uid {uid} holds {u[SESSIONS]} sessions, its quota is "
                                    f"{lim.sessions}")
            if nbytes and lim.bytes and u[BYTES] + nbytes > lim.bytes:
                raise QuotaExceeded(f"uid {uid} holds {u[BYTES]} bytes, {nbytes} more pass its "
                                    f"quota of {lim.bytes}")
            if index and lim.index and tree_bytes(u[INDEX] + index, u[SESSIONS] + sessions) > lim.index:
                raise QuotaExceeded(f"uid {uid} uses {u[INDEX]} bytes of the index, its share "
                                    f"is {lim.index}")
        if index and lim.budget:
            est = self.estimate() + tree_bytes(index, sessions)
            if est > lim.budget:
                raise IndexFull(f"index region full: {est} of {lim.budget} bytes of its budget "
                                "(delete sessions or files to make room)")

    def admit_change(self, uid: int, session: Session | None, max_record: int,
                     **more: int) -> None:
        """``admit``; a change to ``session`` must also leave its index record encodable
        (at most ``max_record`` bytes), or every later checkpoint would fail: RecordFull."""
        self.admit(uid, **more)
        add = more.get("index", 0)
        # the owner's index bytes bound each of its records: counted only past the limit
        if session is not None and self.of(uid)[INDEX] + add > max_record:
            have = session_use(session)[INDEX]
            if have + add > max_record:
                raise RecordFull(f"session {session.name!r}: its index record would pass "
                                 f"{max_record} bytes ({have} now): start another session")

    def room(self, uid: int) -> int | None:
        """Data bytes ``uid`` may still add under its quota (None: no byte quota)."""
        if uid == 0 or not self.limits.bytes:
            return None
        return max(0, self.limits.bytes - self.of(uid)[BYTES])

    # ------------------------------------------------------------------ checkpoint
    def load(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        """The usage recorded by a checkpoint (its ``"U"`` keys); Corrupt for a bad one."""
        self.use, self.dirty, self.tracked = {}, set(), False
        total = NONE
        for key, val in items:
            if len(val) != _USE.size or len(key) not in (1, 5):
                raise Corrupt(f"usage record {key!r} of {len(val)} bytes")
            u = _USE.unpack(val)
            if len(key) == 1:
                self.tracked, total = True, u
            elif any(u):
                self.use[int.from_bytes(key[1:], "big")] = list(u)
        if self.tracked and self.totals() != total:
            raise Corrupt(f"usage records sum to {self.totals()}, their total says {total}")

    def rebuild(self, sessions: Iterable[Session]) -> None:
        """Usage counted from the sessions themselves; every uid (and the mark) rewritten at
        the next checkpoint, the uids no session has any more removed."""
        fresh = Ledger(self.limits)
        for s in sessions:
            fresh.add(s.uid, session_use(s))
        self.replace(fresh)

    def replace(self, other: Ledger) -> None:
        """Take ``other``'s usage (counted afresh: fsck --repair); all of it rewritten."""
        self.dirty = set(self.use) | set(other.use)
        self.use = {uid: list(u) for uid, u in other.use.items()}
        self.tracked = False

    def changes(self) -> dict[bytes, bytes | None]:
        if not self.dirty and (self.tracked or not self.use):  # nothing new; or no usage yet
            return {}
        out: dict[bytes, bytes | None] = {
            b"U" + uid.to_bytes(4, "big"): _USE.pack(*self.use[uid]) if uid in self.use else None
            for uid in self.dirty}
        out[b"U"] = _USE.pack(*self.totals())
        return out

    def committed(self) -> None:
        self.dirty.clear()
        self.tracked = True

    def stats(self) -> dict:
        lim = self.limits
        return {"limits": {"sessions": lim.sessions, "bytes": lim.bytes, "index": lim.index,
                           "index_budget": lim.budget, "index_capacity": lim.capacity},
                "index_estimate": self.estimate(),
                "uids": {str(uid): dict(zip(("sessions", "files", "bytes", "index"), u, strict=True))
                         for uid, u in sorted(self.use.items())}}

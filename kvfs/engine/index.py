"""The session index: live-session bitmap, hot LRU of decoded sessions, checkpoint tree.

Owns which sessions exist (bit ``sno`` of the bitmap), which are decoded in memory (at
most ``hot_cap`` clean ones, LRU; sessions changed since the checkpoint are pinned until
it), and turning that state into one B+ tree commit. Lookups of a session not in memory
read only the tree pages on its key's path, so memory and open time do not grow with the
number of sessions. Never writes the ring; never imports pyfuse3 or torch.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict

from .btree import BTree
from .errors import Corrupt, IndexCorrupt
from .records import Session, chunk0_name, chunk_key, name_hash, session_prefix, split_chunks

BITMAP_CHUNK = 1000  # bytes of the bitmap per tree value (8000 sessions)


def _checkpoint_reader(fn):  # noqa: ANN001, ANN202
    """A bad tree page or session record becomes IndexCorrupt: the store then rebuilds the
    index from the ring (the checkpoint is a shortcut, never the only truth)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        try:
            return fn(*a, **kw)
        except IndexCorrupt:
            raise
        except Corrupt as e:
            raise IndexCorrupt(f"checkpoint unreadable: {e}") from e

    return wrapper


class Index:
    def __init__(self, tree: BTree, hot_cap: int) -> None:
        self.tree = tree
        self.hot_cap = hot_cap
        self.bitmap = bytearray()
        self.bitmap_dirty: set[int] = set()
        self.n_sessions = 0
        self.hot: OrderedDict[int, Session] = OrderedDict()  # clean sessions, LRU order
        self.pinned: dict[int, Session] = {}  # changed since the checkpoint: never evicted
        self.names: dict[str, int] = {}  # name -> sno for sessions in hot or pinned
        self.purge: dict[int, int] = {}  # deleted sno -> name hash: tree keys to drop
        self.atime_dirty: set[int] = set()  # read since the checkpoint (atime only)
        # Every decoded session still referenced anywhere (e.g. by the engine call that is
        # appending to it while reclaim runs): one object per session, never a second copy.
        self.alive: weakref.WeakValueDictionary[int, Session] = weakref.WeakValueDictionary()

    # ---------------------------------------------------------------- bitmap
    def load_bitmap(self) -> None:
        bm = bytearray()
        for key, val in self.tree.scan(b"B"):
            i = int.from_bytes(key[1:5], "big") * BITMAP_CHUNK
            if len(bm) < i + len(val):
                bm.extend(bytes(i + len(val) - len(bm)))
            bm[i: i + len(val)] = val
        self.bitmap = bm
        self.n_sessions = int.from_bytes(bm, "little").bit_count()

    def live(self, sno: int) -> bool:
        i = sno >> 3
        return i < len(self.bitmap) and bool(self.bitmap[i] & (1 << (sno & 7)))

    def set_live(self, sno: int, live: bool) -> None:
        i = sno >> 3
        if i >= len(self.bitmap):
            self.bitmap.extend(bytes(i + 1 - len(self.bitmap)))
        was = self.live(sno)
        if live:
            self.bitmap[i] |= 1 << (sno & 7)
        else:
            self.bitmap[i] &= ~(1 << (sno & 7)) & 0xFF
        self.n_sessions += int(live) - int(was)
        self.bitmap_dirty.add(i // BITMAP_CHUNK)

    # --------------------------------------------------------------- memory
    def cached(self, sno: int) -> Session | None:
        s = self.pinned.get(sno)
        if s is None:
            s = self.hot.get(sno)
            if s is not None:
                self.hot.move_to_end(sno)
        return s

    def remember(self, s: Session) -> None:
        self.names[s.name] = s.sno
        self.alive[s.sno] = s
        if s.dirty:
            self.hot.pop(s.sno, None)
            self.pinned[s.sno] = s
            return
        self.hot[s.sno] = s
        self.hot.move_to_end(s.sno)
        while len(self.hot) > self.hot_cap:
            _, old = self.hot.popitem(last=False)
            if self.names.get(old.name) == old.sno:
                del self.names[old.name]
            if old.sno in self.atime_dirty:  # keep its read time: pin it till the checkpoint
                old.dirty = True
                self.pinned[old.sno] = old
                self.names[old.name] = old.sno

    def dirty(self, s: Session) -> None:
        if not s.dirty:
            s.dirty = True
            self.remember(s)

    def touched(self, s: Session) -> None:
        """Read (atime) without a change: persisted at the checkpoint, best effort."""
        if not s.dirty:
            self.atime_dirty.add(s.sno)

    def drop(self, s: Session) -> None:
        """Forget a session whose tombstone is written: bitmap now, tree keys at checkpoint."""
        self.set_live(s.sno, False)
        self.purge[s.sno] = s.name_hash
        self.pinned.pop(s.sno, None)
        self.hot.pop(s.sno, None)
        self.atime_dirty.discard(s.sno)
        if self.names.get(s.name) == s.sno:
            del self.names[s.name]

    def reset(self, tree: BTree) -> None:
        self.__init__(tree, self.hot_cap)

    # --------------------------------------------------------------- lookup
    @_checkpoint_reader
    def load(self, nh: int, sno: int) -> Session | None:
        """The live session ``sno`` (hash ``nh``) from memory or the checkpoint tree."""
        if not self.live(sno):
            return None
        s = self.cached(sno)
        if s is not None:
            return s
        s = self.alive.get(sno)
        if s is not None:  # evicted from the LRU but still in use: the same object
            self.remember(s)
            return s
        parts = [v for _, v in self.tree.scan(session_prefix(nh, sno))]
        if not parts:
            return None
        s = Session.decode(b"".join(parts))
        self.remember(s)
        return s

    @_checkpoint_reader
    def find(self, name: str) -> Session | None:
        sno = self.names.get(name)
        if sno is not None:
            s = self.cached(sno)
            if s is not None and self.live(sno):
                return s
        nh = name_hash(name)
        for key, val in self.tree.scan(session_prefix(nh)):
            sno = int.from_bytes(key[9:17], "big")
            if key[17:19] == b"\0\0" and self.live(sno) and chunk0_name(val) == name:
                return self.load(nh, sno)
        return None

    @_checkpoint_reader
    def list_names(self) -> list[str]:
        names: dict[int, str] = {}
        for key, val in self.tree.scan(b"S"):
            sno = int.from_bytes(key[9:17], "big")
            if key[17:19] == b"\0\0" and self.live(sno):
                names[sno] = chunk0_name(val)
        for d in (self.hot, self.pinned):
            for sno, s in d.items():
                if self.live(sno):
                    names[sno] = s.name
        return sorted(names.values())

    # ----------------------------------------------------------- checkpoint
    def has_changes(self) -> bool:
        return bool(self.pinned or self.purge or self.bitmap_dirty or self.atime_dirty)

    @_checkpoint_reader
    def changes(self) -> dict[bytes, bytes | None]:
        """One tree commit: purged sessions' keys, dirty sessions' chunks, bitmap chunks."""
        out: dict[bytes, bytes | None] = {}
        for sno, nh in self.purge.items():
            for key, _ in self.tree.scan(session_prefix(nh, sno)):
                out[key] = None
        for s in list(self.pinned.values()) + [self.hot[n] for n in self.atime_dirty if n in self.hot]:
            old = [k for k, _ in self.tree.scan(session_prefix(s.name_hash, s.sno))]
            chunks = split_chunks(s.encode())
            for k in old[len(chunks):]:
                out[k] = None
            for i, c in enumerate(chunks):
                out[chunk_key(s.name_hash, s.sno, i)] = c
        for c in self.bitmap_dirty:
            out[b"B" + c.to_bytes(4, "big")] = bytes(self.bitmap[c * BITMAP_CHUNK: (c + 1) * BITMAP_CHUNK])
        return out

    def committed(self) -> None:
        """The commit built by ``changes`` is durable: unpin, forget what it recorded."""
        pinned = list(self.pinned.values())
        self.purge.clear()
        self.bitmap_dirty.clear()
        self.atime_dirty.clear()
        self.pinned.clear()
        for s in pinned:
            s.dirty = False
            self.remember(s)

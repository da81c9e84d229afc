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
from collections.abc import Callable

from .btree import BTree
from .errors import Corrupt, IndexCorrupt
from .records import (
    Session,
    chunk0_name,
    chunk_key,
    name_hash,
    session_key_sno,
    session_prefix,
    split_chunks,
)

BITMAP_CHUNK = 1000  # bytes of the bitmap per tree value (8000 sessions)
BITS = 8 * BITMAP_CHUNK


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
        self.hot_cap = hot_cap
        # told the name of every session changed or dropped (under the state lock; must
        # not wait): what the store publishes for other processes follows it
        self.on_change: Callable[[str], None] | None = None
        self._clear(tree)

    def _clear(self, tree: BTree) -> None:
        self.tree = tree
        # the bitmap in chunks of BITMAP_CHUNK bytes, only those holding a set bit: memory
        # and the index budget follow the live sessions, whatever a crafted chunk index
        # says or however many session numbers creating and deleting used up
        self.chunks: dict[int, bytearray] = {}
        self.empty_loaded = 0  # chunks without a set bit the checkpoint held (dropped)
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
    def load_bitmap(self, next_sno: int) -> None:
        """The live-session bitmap from the checkpoint; IndexCorrupt for a chunk that is
        not one (a key of the wrong length, a value over a chunk, a bit at or past
        ``next_sno``, the superblock's next session number). A chunk without a set bit
        (older kvfs kept them) is left out and deleted by the next checkpoint."""
        chunks: dict[int, bytearray] = {}
        empty: set[int] = set()
        for key, val in self.tree.scan(b"B"):
            if len(key) != 5 or len(val) > BITMAP_CHUNK:
                raise IndexCorrupt(f"bitmap chunk key {key!r} with {len(val)} bytes")
            i = int.from_bytes(key[1:5], "big")
            c = bytearray(val.ljust(BITMAP_CHUNK, b"\0"))
            top = int.from_bytes(c, "little").bit_length()  # highest set bit + 1
            if top and i * BITS + top > next_sno:
                raise IndexCorrupt(f"bitmap chunk {i} marks session {i * BITS + top - 1} live, "
                                   f"past the next session number {next_sno}")
            if top:
                chunks[i] = c
            else:
                empty.add(i)
        self.chunks = chunks
        self.empty_loaded = len(empty)
        self.bitmap_dirty |= empty
        self.n_sessions = sum(int.from_bytes(c, "little").bit_count() for c in chunks.values())

    def live(self, sno: int) -> bool:
        c = self.chunks.get(sno // BITS)
        b = sno % BITS
        return c is not None and bool(c[b >> 3] & (1 << (b & 7)))

    def set_live(self, sno: int, live: bool) -> None:
        i, b = divmod(sno, BITS)
        c = self.chunks.get(i)
        if c is None:
            if not live:
                return
            c = self.chunks[i] = bytearray(BITMAP_CHUNK)
        was = bool(c[b >> 3] & (1 << (b & 7)))
        if live:
            c[b >> 3] |= 1 << (b & 7)
        else:
            c[b >> 3] &= ~(1 << (b & 7)) & 0xFF
        self.n_sessions += int(live) - int(was)
        self.bitmap_dirty.add(i)
        if not live and not any(c):  # its tree key goes at the checkpoint: no budget held
            del self.chunks[i]

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
        if self.on_change is not None:
            self.on_change(s.name)
        if not s.dirty:
            s.dirty = True
            self.remember(s)

    def touched(self, s: Session) -> None:
        """Read (atime) without a change: persisted at the checkpoint, best effort."""
        if not s.dirty:
            self.atime_dirty.add(s.sno)

    def drop(self, s: Session) -> None:
        """Forget a session whose tombstone is written: bitmap now, tree keys at checkpoint."""
        if self.on_change is not None:
            self.on_change(s.name)
        self.set_live(s.sno, False)
        self.purge[s.sno] = s.name_hash
        self.pinned.pop(s.sno, None)
        self.hot.pop(s.sno, None)
        self.atime_dirty.discard(s.sno)
        if self.names.get(s.name) == s.sno:
            del self.names[s.name]

    def reset(self, tree: BTree) -> None:
        self._clear(tree)

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
        parts = []
        for i, (key, v) in enumerate(self.tree.scan(session_prefix(nh, sno))):
            if key != chunk_key(nh, sno, i):
                raise IndexCorrupt(f"session record {sno}: chunk key {key!r} out of sequence")
            parts.append(v)
        if not parts:
            return None
        s = Session.decode(b"".join(parts))
        if (s.sno, s.name_hash) != (sno, nh):
            raise IndexCorrupt(f"session record under ({nh:x}, {sno}) says ({s.name_hash:x}, {s.sno})")
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
            sno = session_key_sno(key)
            if key[17:19] == b"\0\0" and self.live(sno) and chunk0_name(val) == name:
                return self.load(nh, sno)
        return None

    @_checkpoint_reader
    def list_names(self) -> list[str]:
        names: dict[int, str] = {}
        for key, val in self.tree.scan(b"S"):
            sno = session_key_sno(key)
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
        for i in self.bitmap_dirty:
            bits = self.chunks.get(i)
            out[b"B" + i.to_bytes(4, "big")] = None if bits is None else bytes(bits)
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

"""The catalog: where every published session's files lie, for readers in other processes.

A mount's own clients read the volume themselves (``direct.DirectReader``); what they
need first is a file's extents. Asking the mount costs a round trip through its socket
and its Python server, most of a small read's time. So the mount also publishes, in a
second block of shared memory beside ``published.Published``, each session it holds in
memory: its attributes and, per file, its attributes and extents. A client resolves
(session, file, range) -> extents here and issues one ``preadv``; it asks the mount only
for what the catalog does not hold (a session not published yet, a range past what was
published, a record a writer is rewriting).

What makes a record safe to use is what makes any fetched extents safe
(``published``): it was built under the store's state lock with the session's count of
cuts at that moment, appends only add extents, and the reader checks the durable tail
and the cut count after reading. So a record may lag behind the session (it is rebuilt a
few milliseconds after each change): a lagging record still describes the bytes it
covers, and a read past them goes to the mount. Only extents already written to the
volume are published.

Layout (native byte order, 8-byte words)::

    words 0..511      header: magic "KVFSCAT1", version, slots, arena bytes, open flag
    then              slots x 4 words: seq, key, blob offset, blob bytes
    then              the arena: blobs, written as a ring (oldest dropped first)

A slot is keyed by ``name_hash(session)`` (0: empty) and placed by linear probing from
``key % slots``; a removal shifts the entries after it back (no tombstones). Each slot is
guarded by its sequence number (a seqlock): the writer makes it odd, writes the slot, and
makes it even; a reader copies the slot and the blob, reads the number again, and uses the
copy only if it was even and unchanged. A record that still fits its blob's room (rounded
up to a power of two, so a growing session is rewritten in place most times) is rewritten
there, inside the odd window; arena space of other records is reused only after the slot
that pointed at it was rewritten, so a reader of an old blob always sees its slot's number
change. Readers rely on stores becoming visible in program order (x86's TSO), so a
reader elsewhere refuses the catalog (``CatalogView`` raises) and asks the mount.

A blob, in 8-byte words: magic, words, sno, cuts, mode, uid, gid, files, name bytes,
the name (padded to 8); per file: name bytes, fno, mode, uid, gid, extents, the name,
``off[n]``, then ``(pos, skip, length, esize)`` per extent.

The store is the only writer (under its state lock); readers map it read-only. Never
imports anything above the engine.
"""

from __future__ import annotations

import collections
import itertools
import mmap
import os
import platform
import struct
from array import array
from collections.abc import Collection, Iterable

from .direct import FileExtents
from .published import sealed_block
from .records import name_hash

MAGIC = struct.unpack("=Q", b"KVFSCAT1")[0]
VERSION = 1
BLOB_MAGIC = 0x4B564253  # "KVBS"
HEADER_WORDS = 512
SLOT_WORDS = 4
SLOTS = 1 << 16  # sessions published at most: half of the slots (2 MiB of slots)
ARENA = 32 << 20  # bytes of blobs (pages are touched only as they are used)
MAX_PROBE = 64  # a reader gives up (asks the mount) after this many slots
_H_MAGIC, _H_VER, _H_SLOTS, _H_ARENA, _H_OPEN = range(5)
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _key(session: str) -> int:
    return name_hash(session) or 1  # 0 marks an empty slot


def _name_words(b: bytes) -> list[int]:
    return list(array("q", b + bytes(-len(b) % 8)))


def encode(name: str, sno: int, cuts: int, attrs: tuple[int, int, int],
           files: Iterable[tuple[str, int, tuple[int, int, int], list[int],
                                 list[tuple[int, int, int, int]]]]) -> bytes:
    """One session's blob: ``files`` are (name, fno, (mode, uid, gid), off, ext)."""
    nb = name.encode("utf-8", "surrogateescape")
    words = array("q", [BLOB_MAGIC, 0, sno, cuts, *attrs, 0, len(nb)])
    words.extend(_name_words(nb))
    n = 0
    for fname, fno, (mode, uid, gid), off, ext in files:
        fb = fname.encode("utf-8", "surrogateescape")
        words.extend((len(fb), fno, mode, uid, gid, len(ext)))
        words.extend(_name_words(fb))
        words.extend(off)
        words.extend(itertools.chain.from_iterable(ext))
        n += 1
    words[1], words[7] = len(words), n
    return words.tobytes()


_BLOB = struct.Struct("=9q")  # magic, words, sno, cuts, mode, uid, gid, files, name bytes
_FILE = struct.Struct("=6q")  # name bytes, fno, mode, uid, gid, extents


def decode(blob: bytes, session: str, file: str) -> tuple[
        tuple[int, int, int], FileExtents | None] | None:
    """From a blob: the session's (mode, uid, gid) and ``file``'s extents (None: the session
    has no such file); None when the blob is not ``session``'s or does not parse."""
    got = decode_files(blob, session, (file,))
    return None if got is None else (got[0], got[1][file])


def decode_files(blob: bytes, session: str, files: Collection[str]) -> tuple[
        tuple[int, int, int], dict[str, FileExtents | None]] | None:
    """``decode`` of several files in one pass over the blob: each of ``files`` -> its
    extents, or None where the session has no such file."""
    size = len(blob)
    try:
        magic, words, sno, cuts, mode, uid, gid, nfiles, nlen = _BLOB.unpack_from(blob, 0)
        sb = session.encode("utf-8", "surrogateescape")
        if magic != BLOB_MAGIC or words * 8 != size or nlen != len(sb) or not blob.startswith(sb, 72):
            return None
        attrs = (mode, uid, gid)
        want = {f.encode("utf-8", "surrogateescape"): f for f in files}
        out: dict[str, FileExtents | None] = dict.fromkeys(files)
        left = len(want)
        i = 72 + -(-nlen // 8) * 8
        for _ in range(nfiles):
            if not left:
                break
            flen, fno, fmode, fuid, fgid, n = _FILE.unpack_from(blob, i)
            j = i + 48 + -(-flen // 8) * 8
            if not (0 <= flen and 0 <= n and j + 40 * n <= size):
                return None
            name = want.get(blob[i + 48:i + 48 + flen])
            if name is not None:
                off = list(struct.unpack_from(f"={n}q", blob, j))
                flat = iter(struct.unpack_from(f"={4 * n}q", blob, j + 8 * n))
                ext = list(zip(flat, flat, flat, flat, strict=True))
                fe = FileExtents(sno, fno, 0, cuts, 0, 0, off, ext, fmode, fuid, fgid)
                if n:
                    fe.lo, fe.hi = off[0], off[-1] + ext[-1][2]
                    fe.size = fe.hi
                out[name] = fe
                left -= 1
            i = j + 40 * n
        return attrs, out
    except struct.error:
        return None


class Catalog:
    """The writer's side (module doc): a memfd (``fd``) mapped read-write here. Not
    thread-safe: the store calls it under its state lock."""

    def __init__(self, slots: int = SLOTS, arena: int = ARENA) -> None:
        if slots & (slots - 1) or slots < 4:
            raise ValueError("slots must be a power of two")
        self.nslots, self.arena = slots, arena
        self.base = (HEADER_WORDS + SLOT_WORDS * slots) * 8  # the arena's first byte
        size = self.base + arena
        self.fd, self._map = sealed_block("kvfs-catalog", size)
        self.words = memoryview(self._map).cast("Q")
        self.bytes = memoryview(self._map)
        self._names: list[str | None] = [None] * slots  # the session in each slot
        self._slot: dict[str, int] = {}  # session -> its slot
        self._blob: dict[str, tuple[int, int]] = {}  # session -> its blob's (start, room)
        self._fifo: collections.deque[tuple[int, str]] = collections.deque()  # (start, session)
        self._head = 0  # arena bytes ever handed out: a blob at h lies at h % arena
        self.counts = {"published": 0, "withdrawn": 0, "dropped": 0, "too_big": 0}
        w = self.words
        w[_H_VER], w[_H_SLOTS], w[_H_ARENA] = VERSION, slots, arena
        w[_H_OPEN] = 1
        w[_H_MAGIC] = MAGIC

    def __contains__(self, session: str) -> bool:
        return session in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def reader_fd(self) -> int:
        """A new read-only descriptor of the block, to hand to a reader (the caller closes it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    # ------------------------------------------------------------------ writes
    def put(self, session: str, blob: bytes) -> bool:
        """Publish (or replace) ``session``'s record; False when it cannot be held (too
        big, or no slot near its place): then readers ask the mount for it."""
        key, i, cur = _key(session), self._slot.get(session), self._blob.get(session)
        if i is not None and cur is not None and len(blob) <= cur[1]:  # over its old blob
            at = self.base + cur[0] % self.arena
            b = HEADER_WORDS + SLOT_WORDS * i
            self.words[b] += 1  # odd first: a reader copying the old bytes sees it change
            self.bytes[at:at + len(blob)] = blob
            self.words[b + 3] = len(blob)
            self.words[b] += 1
            self.counts["published"] += 1
            return True
        cap = 64
        while cap < len(blob):  # room to grow in place as the session's extents do
            cap *= 2
        if cap > self.arena // 4:
            self.withdraw(session)
            self.counts["too_big"] += 1
            return False
        start = self._head
        if start % self.arena + cap > self.arena:  # no wrap inside a blob
            start += self.arena - start % self.arena
        self._make_room(start + cap)
        self._head = start + cap
        if session not in self._slot:  # it may have been dropped to make room
            while len(self._slot) >= self.nslots // 2 and self._fifo:  # load factor <= 1/2
                self._drop_oldest()
            i = self._place(key)
            if i is None:
                self.counts["dropped"] += 1
                return False
            self._names[i] = session
            self._slot[session] = i
        i = self._slot[session]
        at = self.base + start % self.arena
        self.bytes[at:at + len(blob)] = blob  # space no slot names now
        self._write_slot(i, key, at, len(blob))
        self._blob[session] = (start, cap)
        self._fifo.append((start, session))
        self.counts["published"] += 1
        return True

    def withdraw(self, session: str) -> None:
        """Readers find ``session`` here no more (they ask the mount)."""
        i = self._slot.pop(session, None)
        self._blob.pop(session, None)
        if i is not None:
            self._remove_at(i)
            self.counts["withdrawn"] += 1

    def close(self) -> None:
        if self.fd >= 0:
            self.words[_H_OPEN] = 0  # a reader still mapping it finds nothing here
            self.words.release()
            self.bytes.release()
            self._map.close()
            os.close(self.fd)
            self.fd = -1

    # ------------------------------------------------------------------ the arena
    def _make_room(self, end: int) -> None:
        """Drop every record whose blob may lie where ``[.., end)`` is written: those that
        start before ``end - arena`` (the blobs are in the FIFO in order of their start)."""
        while self._fifo and self._fifo[0][0] < end - self.arena:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        start, name = self._fifo.popleft()
        cur = self._blob.get(name)
        if cur is not None and cur[0] == start:  # still its current record
            self.withdraw(name)
            self.counts["dropped"] += 1

    # ------------------------------------------------------------------ the slots
    def _slot_key(self, i: int) -> int:
        return self.words[HEADER_WORDS + SLOT_WORDS * i + 1]

    def _write_slot(self, i: int, key: int, off: int, n: int) -> None:
        w, b = self.words, HEADER_WORDS + SLOT_WORDS * i
        w[b] += 1  # odd: being written
        w[b + 1], w[b + 2], w[b + 3] = key, off, n
        w[b] += 1

    def _place(self, key: int) -> int | None:
        mask = self.nslots - 1
        for k in range(MAX_PROBE):
            i = (key + k) & mask
            if self._names[i] is None:
                return i
        return None

    def _remove_at(self, i: int) -> None:
        """Empty slot ``i``, shifting back the entries after it that probed past it."""
        mask = self.nslots - 1
        j = i
        while True:
            j = (j + 1) & mask
            name = self._names[j]
            if name is None:
                break
            home = self._slot_key(j) & mask
            if (i < j and (home <= i or home > j)) or (j < i and i >= home > j):
                b = HEADER_WORDS + SLOT_WORDS * j
                self._write_slot(i, *self.words[b + 1:b + 4])
                self._names[i], self._slot[name] = name, i
                i = j
        self._write_slot(i, 0, 0, 0)
        self._names[i] = None


class CatalogView:
    """A reader's side: the block mapped read-only from a descriptor ``Catalog`` gave.
    ValueError when it is not one, or when this machine may reorder stores (module doc)."""

    def __init__(self, fd: int) -> None:
        if not ORDERED_STORES:
            raise ValueError(f"the catalog needs ordered stores ({platform.machine()} may reorder)")
        size = os.fstat(fd).st_size
        if size < HEADER_WORDS * 8:
            raise ValueError("catalog block too small")
        self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        self.words = memoryview(self._map).cast("Q")
        self.bytes = memoryview(self._map)
        w = self.words
        self.nslots, self.arena = w[_H_SLOTS], w[_H_ARENA]
        if (w[_H_MAGIC] != MAGIC or w[_H_VER] != VERSION or self.nslots & (self.nslots - 1)
                or (HEADER_WORDS + SLOT_WORDS * self.nslots) * 8 + self.arena != size):
            self.close()
            raise ValueError("not a kvfs catalog of this version")
        self.base = (HEADER_WORDS + SLOT_WORDS * self.nslots) * 8

    def lookup(self, session: str, file: str) -> tuple[tuple[int, int, int], FileExtents | None] | None:
        """``session``'s (mode, uid, gid) and ``file``'s extents as published (None for the
        extents: no such file in the record); None when the catalog does not hold the
        session now (ask the mount)."""
        got = self.lookup_files(session, (file,))
        return None if got is None else (got[0], got[1][file])

    def lookup_files(self, session: str, files: Collection[str]) -> tuple[
            tuple[int, int, int], dict[str, FileExtents | None]] | None:
        """``lookup`` of several files of a session: its record found, copied and decoded
        once."""
        w = self.words
        if not w[_H_OPEN]:
            return None
        key, mask = _key(session), self.nslots - 1
        for k in range(MAX_PROBE):
            b = HEADER_WORDS + SLOT_WORDS * ((key + k) & mask)
            seq = w[b]
            skey, off, n = w[b + 1], w[b + 2], w[b + 3]
            if skey == 0:
                return None
            if skey != key:
                continue
            if seq & 1 or not self.base <= off <= off + n <= len(self.bytes):
                return None  # being written: ask the mount rather than wait
            blob = bytes(self.bytes[off:off + n])
            if w[b] != seq:
                return None
            got = decode_files(blob, session, files)
            if got is not None:
                return got
        return None

    def close(self) -> None:
        self.words.release()
        self.bytes.release()
        self._map.close()

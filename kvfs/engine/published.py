"""What a store publishes for readers in other processes: one small block of shared memory.

A mount's own clients read the volume themselves (``direct.DirectReader``, served its
extents by the mount). What they must know on every read, without asking the mount, the
store writes here as it changes:

- the ring's geometry and a generation (random per open of the volume);
- the durable tail. The head writes over an entry's space only once the durable tail has
  passed the entry (``Ring.room``), so a read of the entry at ``pos`` that finished while
  the published tail was still ``<= pos`` read that entry's bytes, whatever reclaim did
  meanwhile (it copies live entries forward first: the old copy stays right until then);
- per bucket of session numbers, a count of *cuts*: truncates, deletions of files and
  sessions, sessions dropped by reclaim or cleanup. A file's extents fetched while its
  bucket counted ``c`` still describe the file while the count is ``c`` (appends only add
  extents; a copy forward leaves the old copy readable until the tail check above fails).

Layout (native byte order, 8-byte aligned words, so each store and load is one access)::

    word 0   magic "KVFSPUB1"        word 4   ring_size
    word 1   version | buckets << 32  word 5   durable_tail
    word 2   generation             words 6..511 reserved (zero)
    word 3   ring_offset            words 512.. cut counters, one per bucket

The store is the only writer (under its state lock); readers map it read-only. Never
imports anything above the engine.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct

MAGIC = struct.unpack("=Q", b"KVFSPUB1")[0]
VERSION = 1
F_SEAL_FUTURE_WRITE = 0x10  # Linux 5.1: no new writable mapping or write(), ours stays
BUCKETS = 4096  # cut counters: sessions share a bucket by sno % BUCKETS (a cut of one
# invalidates the cached extents of the others in it: correct, a little less cached)
_W_MAGIC, _W_VER, _W_GEN, _W_ROFF, _W_RSIZE, _W_TAIL = range(6)
_CUTS = 512
SIZE = (_CUTS + BUCKETS) * 8


def sealed_block(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A memfd of ``size`` bytes and its read-write mapping here, sealed: a reader can
    neither reopen it writable (/proc/PID/fd) to forge what it says, nor shrink it under a
    mapping; only this mapping writes. Readers get ``reader_fd`` descriptors of it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd, m


class Published:
    """The writer's side: a memfd holding the block (``fd``), mapped read-write here."""

    def __init__(self, ring_offset: int, ring_size: int, durable_tail: int) -> None:
        self.fd, self._map = sealed_block("kvfs-published", SIZE)  # nobody forges the tail or cuts
        self.words = memoryview(self._map).cast("Q")
        w = self.words
        w[_W_VER] = VERSION | BUCKETS << 32
        w[_W_GEN] = int.from_bytes(os.urandom(8), "little")
        w[_W_ROFF], w[_W_RSIZE], w[_W_TAIL] = ring_offset, ring_size, durable_tail
        w[_W_MAGIC] = MAGIC  # last: a reader that sees the magic sees the rest

    @property
    def generation(self) -> int:
        return self.words[_W_GEN]

    def set_tail(self, durable_tail: int) -> None:
        self.words[_W_TAIL] = durable_tail

    def cut(self, sno: int) -> None:
        """A cut in session ``sno``: extents fetched before it are not to be used."""
        i = _CUTS + sno % BUCKETS
        self.words[i] = self.words[i] + 1

    def cuts(self, sno: int) -> int:
        return self.words[_CUTS + sno % BUCKETS]

    def reader_fd(self) -> int:
        """A new read-only descriptor of the block, to hand to a reader (the caller closes it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            # ended: a reader still mapping it (a client of a mount that stopped) finds no
            # entry it holds readable (``holds``), so it asks the mount -- the next one --
            # for extents again instead of trusting ones a new mount may have cut
            self.words[_W_TAIL] = (1 << 64) - 1
            self.words.release()
            self._map.close()
            os.close(self.fd)
            self.fd = -1


class PublishedView:
    """A reader's side: the block mapped read-only from a descriptor ``Published`` gave."""

    def __init__(self, fd: int) -> None:
        if os.fstat(fd).st_size < SIZE:
            raise ValueError("published block too small")
        self._map = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        self.words = memoryview(self._map).cast("Q")
        w = self.words
        if w[_W_MAGIC] != MAGIC or w[_W_VER] & 0xFFFFFFFF != VERSION or w[_W_VER] >> 32 != BUCKETS:
            self.close()
            raise ValueError("not a kvfs published block of this version")
        self.generation = w[_W_GEN]
        self.ring_offset, self.ring_size = w[_W_ROFF], w[_W_RSIZE]

    def tail(self) -> int:
        return self.words[_W_TAIL]

    def cuts(self, sno: int) -> int:
        return self.words[_CUTS + sno % BUCKETS]

    def holds(self, pos: int, sno: int, cuts: int) -> bool:
        """Whether the entry at ``pos`` was not written over and session ``sno`` not cut
        since its count of cuts was ``cuts`` (one call on the read path)."""
        w = self.words
        return w[_W_TAIL] <= pos and w[_CUTS + sno % BUCKETS] == cuts

    def close(self) -> None:
        self.words.release()
        self._map.close()

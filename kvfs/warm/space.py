"""Space inside a ``.kvmap`` file and room on the RAM filesystem under it.

Extents are allocated first fit in freed gaps, else at the end; the file grows sparse.
A sparse page of a tmpfs file gets its memory when it is first written -- through our
shared mapping that is a page fault, and on a full tmpfs the kernel answers it with
SIGBUS, which kills the process. So every range is *reserved* (``posix_fallocate``)
before it is written through the mapping: a full RAM filesystem is then an ENOSPC here,
raised as ``WarmFull`` before anything changed, and the tier evicts to the cold tier or
reports a WarmError. Freed pages are handed back to tmpfs (``MADV_REMOVE``).

A mixin of ShardFile (shard.py owns the file and the mapping).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import mmap
import os

import numpy as np

from .ids import WarmError, WarmFull
from .kvmap_format import ALIGN, MAX_GROW

log = logging.getLogger("kvfs.warm")
PAGE = mmap.PAGESIZE
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def reserve_fd(fd: int, off: int, n: int, path: str) -> bool:
    """Give the range [off, off + n) of an open file its pages now. WarmFull when the
    filesystem is full; False when it cannot reserve (not tmpfs-like: nothing to fear)."""
    if n <= 0:
        return True
    try:
        os.posix_fallocate(fd, off, n)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise WarmFull(f"warm file {path!r}: no room for {n} more bytes on its RAM "
                           f"filesystem (full)") from e
        if e.errno in _NO_FALLOCATE:
            return False
        raise WarmError(f"warm file {path!r}: cannot reserve space: {e.strerror}") from e
    return True


class Space:
    """Free list, end of the allocated area and reservations of one shard file."""

    # owned by ShardFile (shard.py)
    path: str
    free: list[tuple[int, int]]
    end: int
    fsize: int
    _mm: mmap.mmap | None
    _buf: np.ndarray | None
    _tbl: np.ndarray | None
    can_reserve: bool = True

    def open_fd(self) -> int:  # shard.py
        raise NotImplementedError

    def map(self) -> np.ndarray:  # shard.py
        raise NotImplementedError

    def reserve(self, off: int, n: int) -> None:
        """Reserve [off, off + n) before writing it through the mapping (module doc)."""
        if n <= 0 or not self.can_reserve:
            return
        fd = self.open_fd()
        try:
            if not reserve_fd(fd, off, n, self.path):
                self.can_reserve = False
                log.info("warm file %s: its filesystem cannot reserve space (not a RAM "
                         "filesystem?); writing without reservations", self.path)
        finally:
            os.close(fd)

    def _alloc(self, size: int) -> int:
        """A free range of ``size`` bytes (not yet reserved: the caller reserves what it
        writes, and gives the range back with ``add_free`` if that fails)."""
        align = PAGE if size >= PAGE else ALIGN
        for k, (off, n) in enumerate(self.free):
            a = round_up(off, align)
            if a + size <= off + n:
                del self.free[k]
                if a > off:
                    self.add_free(off, a - off, advise=False)
                if off + n > a + size:
                    self.add_free(a + size, off + n - a - size, advise=False)
                return a
        a = round_up(self.end, align)
        if a + size > self.fsize:  # grow first: a failure leaves the allocation untouched
            new = round_up(max(a + size, min(self.fsize * 2, self.fsize + MAX_GROW)), PAGE)
            fd = self.open_fd()
            try:
                os.ftruncate(fd, new)  # sparse growth; remapped on next access
            except OSError as e:
                raise WarmError(f"warm file {self.path!r}: cannot grow: {e.strerror}") from e
            finally:
                os.close(fd)
            self.fsize = new
            self._mm = self._buf = self._tbl = None
        if a > self.end:
            self.add_free(self.end, a - self.end, advise=False)
        self.end = a + size
        return a

    def add_free(self, off: int, n: int, advise: bool = True) -> None:
        if n <= 0:
            return
        if advise:
            # give the pages back to tmpfs now (page-aligned interior only); other
            # filesystems may refuse, then the pages are simply reused later
            a, b = round_up(off, PAGE), (off + n) // PAGE * PAGE
            if b > a:
                self.map()
                with contextlib.suppress(AttributeError, OSError, ValueError):
                    assert self._mm is not None
                    self._mm.madvise(mmap.MADV_REMOVE, a, b - a)
        k = bisect.bisect_left(self.free, (off, n))
        if k < len(self.free) and self.free[k][0] == off + n:  # merge with the next gap
            n += self.free.pop(k)[1]
        if k > 0 and self.free[k - 1][0] + self.free[k - 1][1] == off:  # and the previous
            off, n0 = self.free.pop(k - 1)
            n += n0
            k -= 1
        if off + n == self.end:
            self.end = off  # the tail is simply unallocated again
            return
        self.free.insert(k, (off, n))

    def alloc_reserved(self, size: int, ranges: list[tuple[int, int]]) -> int:
        """Allocate ``size`` bytes and reserve ``ranges`` (offsets relative to the new
        extent); all or nothing."""
        off = self._alloc(size)
        try:
            for a, n in ranges:
                self.reserve(off + a, n)
        except BaseException:
            self.add_free(off, size)
            raise
        return off

"""Direct reads of a volume by the mount's own clients: extents in, checked bytes out.

The mount stays the only authority on names and extents (``Store.extents``); a client
holding a file's extents reads the entries from the volume itself (a read-only
descriptor), with the checks the engine's own reads make: each entry's header (its ring
position, the lap stamp: a header of another lap names another position; its size,
session and file numbers and file offset), its block table's CRC, each block's CRC and
exact decoded length. Then the published block (``published.PublishedView``) must still
say that nothing can have written over what was read (the durable tail has not passed
the entries) and that the file was not cut since its extents were fetched (its bucket's
count of cuts): otherwise ``Stale``, and the caller fetches the extents again. So a range
reclaim overwrote or a truncate cut is never returned.

One ``read`` serves many files (a resume asks for every layer at once): every entry it
needs is planned first, entries that lie close on disk are read together by one
``preadv``, and several such runs go on a few threads, each checking and copying out
what it read. Reads bypass the page cache (``O_DIRECT``: entries are 512-byte aligned, so
are the reads, into page-aligned scratch buffers): a cold read costs the disk and one
copy, and KV read once does not fill the page cache, which is what the engine's own
``POSIX_FADV_DONTNEED`` after reads is for. (The kernel writes the mount's dirty pages of
a range out before reading it directly, so both see the same bytes.) Where the volume
takes no direct I/O the same reads go through the page cache.

An entry's block table is guessed from its extent (blocks are appended raw, ``BLOCK``
bytes each) so the first read takes header, table and blocks at once; a wrong guess (a
block compressed when reclaim copied it) costs one more read, with the table then known.
Tables once read are kept (by ring position, which is never reused).
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import crc32c

from .blocks import Table, parse_table
from .codec import decode
from .errors import Corrupt
from .format import ALIGN, BLOCK, BLOCK_ENTRY, HDR_SIZE, T_DATA, Header, unpack_header
from .published import PublishedView

INLINE_SKIP = 64 << 10  # a range this far into an entry still reads from its start
MERGE_GAP = 64 << 10  # entries this close on disk are read by one preadv
MERGE_MAX = 4 << 20  # ... of at most this many bytes (several of them run in parallel)
TABLES = 8192  # block tables kept


@dataclass(slots=True)
class FileExtents:
    """A file as the mount described it: where its bytes ``[lo, hi)`` lie on the ring.

    ``off[i]`` is the file offset of ``ext[i] = (pos, skip, length, esize)``: bytes
    ``[off, off + length)`` are raw bytes ``[skip, skip + length)`` of the entry at ``pos``.
    ``cuts`` is the session's bucket's count of cuts when they were fetched."""

    sno: int
    fno: int
    size: int
    cuts: int
    lo: int = 0
    hi: int = 0
    off: list[int] = field(default_factory=list)
    ext: list[tuple[int, int, int, int]] = field(default_factory=list)
    mode: int = 0
    uid: int = 0
    gid: int = 0

    def covers(self, a: int, b: int) -> bool:
        return self.lo <= a and b <= self.hi


class Stale(Exception):
    """What was read may not be the file's bytes any more: fetch the extents again."""


class _Piece:
    """Raw bytes [a, b) of the entry at ``pos`` into ``out``. ``spans`` are the entry
    ranges read for it, ``have`` the memory holding each once read."""

    __slots__ = ("fe", "pos", "phys", "esize", "a", "b", "out", "hint", "file_off", "known",
                 "nb", "spans", "have")

    def __init__(self, fe: FileExtents, pos: int, phys: int, esize: int, a: int, b: int,
                 out: memoryview, hint: int, file_off: int) -> None:
        self.fe, self.pos, self.phys, self.esize = fe, pos, phys, esize
        self.a, self.b, self.out = a, b, out
        self.hint = hint  # the entry holds at least this many raw bytes
        self.file_off = file_off  # the file offset of the entry's first raw byte
        self.known: tuple[Header, Table] | None = None
        self.nb = 0  # blocks the table was guessed to hold
        self.spans: list[tuple[int, int]] = []  # entry ranges to read
        self.have: list[memoryview] = []  # their bytes, in the same order


class _Run:
    """One preadv of ``[off, off + n)`` (aligned) into a scratch buffer, serving spans."""

    __slots__ = ("off", "n", "spans", "buf")

    def __init__(self, off: int) -> None:
        self.off, self.n = off, 0
        self.spans: list[tuple[_Piece, int, int, int]] = []  # piece, index, start, end (volume)
        self.buf: memoryview | None = None


class _Scratch:
    """Page-aligned buffers (mmap) for direct reads, kept for reuse by size."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> mmap.mmap:
        with self._lock:
            for i, m in enumerate(self._free):
                if len(m) >= n:
                    return self._free.pop(i)
        return mmap.mmap(-1, max(-(-n // mmap.PAGESIZE) * mmap.PAGESIZE, 1 << 17))

    def give(self, m: mmap.mmap) -> None:
        """Back for reuse (what is not kept is unmapped once its last view is gone)."""
        with self._lock:
            if len(self._free) < 16 and len(m) <= 2 * MERGE_MAX:
                self._free.append(m)


class DirectReader:
    """Checked reads of a volume from outside the mount (see the module doc). ``path``:
    the volume, opened here read-only (and for direct I/O when it takes it)."""

    def __init__(self, path: str, view: PublishedView, threads: int = 4) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.dfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError:  # a filesystem without direct I/O (tmpfs): the page cache then
            self.dfd = -1
        self.view = view
        self.roff, self.rsize = view.ring_offset, view.ring_size
        self._tables: OrderedDict[int, tuple[Header, Table]] = OrderedDict()
        self._raw: set[int] = set()  # positions of kept tables whose blocks are all raw
        self._tlock = threading.Lock()
        self._scratch = _Scratch()
        self._local = threading.local()  # each thread's own buffer for ``_one``
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvfs-direct")
        self.stats = {"reads": 0, "preadv": 0, "bytes": 0, "guess_missed": 0, "stale": 0}

    def close(self) -> None:
        self._pool.shutdown()
        for fd in (self.fd, self.dfd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.dfd = -1

    # ------------------------------------------------------------------ the read
    def read(self, jobs: list[tuple[FileExtents, int, memoryview]]) -> None:
        """Fill each ``out`` with bytes ``[off, off + len(out))`` of its file. Raises
        ``Stale`` (fetch the extents again and retry), ``Corrupt`` (an entry fails its
        checks while the published state says it is intact) or ``ValueError`` (a range the
        extents do not cover)."""
        if len(jobs) == 1 and self._one(*jobs[0]):
            return
        pieces: list[_Piece] = []
        for fe, off, out in jobs:
            pieces += self._pieces(fe, off, out)
        if not pieces:
            return
        try:
            again = self._round([p for p in pieces if self._plan(p)])
            if again:  # tables guessed wrong: the blocks again, with the tables known
                self.stats["guess_missed"] += len(again)
                for p in again:
                    self._plan(p)
                if self._round(again):
                    raise Corrupt(f"entry at ring position {again[0].pos}: blocks not where "
                                  "its table says")
        except Corrupt:
            self._still_valid(pieces, jobs)  # overwritten meanwhile: Stale, not damage
            raise
        self._still_valid(pieces, jobs)
        self.stats["reads"] += 1

    def _one(self, fe: FileExtents, off: int, out: memoryview) -> bool:
        """The common read, in few steps: one range inside one entry whose blocks there
        are raw, its table known or read along with them (the range lies near the entry's
        start). False (nothing done) for any other: ``read``'s general path serves it."""
        end = off + len(out)
        i = bisect.bisect_right(fe.off, off) - 1
        if i < 0 or not fe.lo <= off < end <= fe.hi or end > fe.size:
            return False
        pos, skip, n, esize = fe.ext[i]
        o = fe.off[i]
        if end > o + n:
            return False
        a = off - o + skip
        b = a + len(out)
        phys = self.roff + pos % self.rsize
        known = self._tables.get(pos) if pos in self._raw else None
        if known is not None:
            t = known[1]
            r = t.blocks(a, b)
            st, ro = t.st_off, t.raw_off
            s1 = st[r[-1] + 1]
            a0 = phys + st[r[0]] - (phys + st[r[0]]) % ALIGN
        else:  # guess: raw blocks, a table for what the entry holds at least
            tend = HDR_SIZE + BLOCK_ENTRY.size * -(-(skip + n) // BLOCK)
            s1 = tend + min(-(-b // BLOCK) * BLOCK, esize - tend)
            if a > INLINE_SKIP or s1 > esize or s1 < tend + b:
                return False
            a0 = phys
        need = -(-(phys + s1 - a0) // ALIGN) * ALIGN
        m = getattr(self._local, "buf", None)
        if m is None or len(m) < need:
            m = self._local.buf = mmap.mmap(-1, max(-(-need // mmap.PAGESIZE) * mmap.PAGESIZE, 1 << 18))
        buf = memoryview(m)[:need]
        got = self._pread(buf, a0)
        if got < phys + s1 - a0:
            raise Corrupt(f"entry at ring position {pos} lies past the volume's end")
        base = phys - a0  # buf offset of the entry's byte 0
        try:
            if known is None:
                h = self._entry_header(buf, pos, esize, fe, o - skip)
                if BLOCK_ENTRY.size * h.nblocks > got - HDR_SIZE:
                    return False  # a table longer than guessed: the general path
                t = parse_table(h, buf[HDR_SIZE:])
                self._keep(pos, (h, t))
                if not 0 <= a < b <= h.raw_len:
                    raise Corrupt(f"entry at {pos} holds {h.raw_len} bytes, extent wants {a}..{b}")
                r = t.blocks(a, b)
                st, ro = t.st_off, t.raw_off
                if (st[r[-1] + 1] > s1 or any(t.flags[j] for j in r)
                        or st[r[-1] + 1] - st[r[0]] != ro[r[-1] + 1] - ro[r[0]]):
                    return False  # compressed, or elsewhere: the general path
            crcs = t.crc
            for j in r:
                if crc32c.crc32c(buf[base + st[j]:base + st[j + 1]]) != crcs[j]:
                    raise Corrupt(f"block {j} checksum mismatch in entry at ring position {pos}")
        except Corrupt:
            self._check_valid([pos], fe)
            raise
        k = base + st[r[0]] + a - ro[r[0]]
        out[:] = buf[k:k + len(out)]
        buf.release()
        if not self.view.holds(pos, fe.sno, fe.cuts):
            self.stats["stale"] += 1
            raise Stale("the ring's tail passed the entry read, or the file was cut")
        self.stats["reads"] += 1
        return True

    def _pread(self, buf: memoryview, off: int) -> int:
        fd = self.dfd if self.dfd >= 0 else self.fd
        try:
            n = os.preadv(fd, [buf], off)
        except OSError as e:
            if fd == self.fd or e.errno != 22:
                raise
            n = os.preadv(self.fd, [buf], off)  # EINVAL: a device wants other alignment
        while 0 < n < len(buf):  # short: only at the volume's end, or a signal
            k = os.preadv(self.fd, [buf[n:]], off + n)
            if k <= 0:
                break
            n += k
        self.stats["preadv"] += 1
        self.stats["bytes"] += n
        return n

    def _check_valid(self, positions: list[int], fe: FileExtents) -> None:
        view = self.view
        if view.tail() > min(positions) or view.cuts(fe.sno) != fe.cuts:
            self.stats["stale"] += 1
            raise Stale("the ring's tail passed an entry read, or the file was cut")

    def _still_valid(self, pieces: list[_Piece], jobs: list[tuple[FileExtents, int, memoryview]]) -> None:
        view = self.view
        if view.tail() > min(p.pos for p in pieces) or any(view.cuts(fe.sno) != fe.cuts for fe, _, _ in jobs):
            self.stats["stale"] += 1
            raise Stale("the ring's tail passed an entry read, or the file was cut")

    def _pieces(self, fe: FileExtents, off: int, out: memoryview) -> list[_Piece]:
        end = off + len(out)
        if off < 0 or end > fe.size or not fe.covers(off, end):
            raise ValueError(f"range [{off}, {end}) is not within the extents "
                             f"[{fe.lo}, {min(fe.hi, fe.size)}) of a {fe.size}-byte file")
        ps = []
        i = max(bisect.bisect_right(fe.off, off) - 1, 0)
        k = 0
        while off < end:
            if i >= len(fe.off) or fe.off[i] > off:
                raise ValueError(f"no extent holds file byte {off}")
            pos, skip, n, esize = fe.ext[i]
            o = fe.off[i]
            a, b = off - o + skip, min(end, o + n) - o + skip
            ps.append(_Piece(fe, pos, self.roff + pos % self.rsize, esize, a, b,
                             out[k:k + b - a], skip + n, o - skip))
            k += b - a
            off += b - a
            i += 1
        return ps

    def _plan(self, p: _Piece) -> bool:
        """The entry ranges ``p`` needs read (``p.spans``); False if none (never)."""
        if p.known is None:
            with self._tlock:
                p.known = self._tables.get(p.pos)
                if p.known is not None:
                    self._tables.move_to_end(p.pos)
        p.have = []
        if p.known is not None:
            t = p.known[1]
            r = t.blocks(p.a, p.b)
            p.spans = [(t.st_off[r[0]], t.st_off[r[-1] + 1])]
            return True
        # guess: raw blocks of BLOCK bytes, the table sized by what the entry holds at least
        p.nb = -(-p.hint // BLOCK)
        tend = HDR_SIZE + BLOCK_ENTRY.size * p.nb
        ba = p.a - p.a % BLOCK
        bb = min(-(-p.b // BLOCK) * BLOCK, p.esize - tend)
        if bb < p.b:  # raw blocks would not fit the entry: header and table first
            p.spans = [(0, min(tend, p.esize))]
        elif ba <= INLINE_SKIP:  # one read from the entry's start
            p.spans = [(0, tend + bb)]
        else:  # two at once: header and table, and where the raw blocks would be
            p.spans = [(0, tend), (tend + ba, tend + bb)]
        return True

    def _round(self, pieces: list[_Piece]) -> list[_Piece]:
        """Read every span of ``pieces`` (runs merged, in parallel when several), check
        each piece and copy its bytes out; returns the pieces whose table was guessed
        wrong (their ``known`` now set)."""
        reads = sorted(((p.phys + s0, p.phys + s1, p, k) for p in pieces
                        for k, (s0, s1) in enumerate(p.spans)), key=lambda x: x[0])
        runs: list[_Run] = []
        cur: _Run | None = None
        for a, b, p, k in reads:
            a0, b0 = a - a % ALIGN, -(-b // ALIGN) * ALIGN
            if cur is None or a0 - (cur.off + cur.n) > MERGE_GAP or b0 - cur.off > MERGE_MAX:
                cur = _Run(a0)
                runs.append(cur)
            cur.n = max(cur.n, b0 - cur.off)
            cur.spans.append((p, k, a, b))
        for p in pieces:
            p.have = [memoryview(b"")] * len(p.spans)
        bufs: list[mmap.mmap] = []
        try:
            if len(runs) == 1:
                bufs.append(self._read_run(runs[0]))
                return [p for p in pieces if not self._check(p)]
            # each run's own pieces checked on its thread; a piece over two runs after
            futs = [self._pool.submit(self._run_and_check, r) for r in runs]
            bad: list[_Piece] = []
            split: list[_Piece] = []
            for f in futs:
                m, wrong, rest = f.result()
                bufs.append(m)
                bad += wrong
                split += rest
            return bad + [p for p in dict.fromkeys(split) if not self._check(p)]
        finally:
            for p in pieces:
                p.have = []
            for m in bufs:
                self._scratch.give(m)

    def _run_and_check(self, r: _Run) -> tuple[mmap.mmap, list[_Piece], list[_Piece]]:
        m = self._read_run(r)
        mine = [p for p, k, _, _ in r.spans if len(p.spans) == 1]
        split = [p for p, k, _, _ in r.spans if len(p.spans) > 1]
        return m, [p for p in dict.fromkeys(mine) if not self._check(p)], split

    def _read_run(self, r: _Run) -> mmap.mmap:
        m = self._scratch.take(r.n)
        buf = memoryview(m)[:r.n]
        n = self._pread(buf, r.off)
        for p, k, a, b in r.spans:
            if b - r.off > n:
                raise Corrupt(f"entry at ring position {p.pos} lies past the volume's end")
            p.have[k] = buf[a - r.off:b - r.off]
        return m

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _entry_header(raw: memoryview, pos: int, esize: int, fe: FileExtents, file_off: int) -> Header:
        """The header at the start of ``raw``: the lap stamp and what the extents say."""
        h = unpack_header(raw)
        if h is None or h.pos != pos:
            raise Corrupt(f"bad entry header at ring position {pos}")
        if (h.type != T_DATA or h.size != esize or h.sno != fe.sno or h.fno != fe.fno
                or h.file_off != file_off):
            raise Corrupt(f"entry at ring position {pos} is not the data of file "
                          f"{fe.sno}/{fe.fno} the extents name")
        return h

    def _check(self, p: _Piece) -> bool:
        """Check what was read for ``p`` and copy (decode) its bytes into ``p.out``;
        False when its table was guessed wrong (``p.known`` is then set)."""
        if p.known is not None and p.spans[0][0] != 0:  # blocks of a known table
            h, t = p.known
            return self._copy(p, t, p.have[0], p.spans[0][0])
        have = p.have[0]
        h = self._entry_header(have, p.pos, p.esize, p.fe, p.file_off)
        tlen = BLOCK_ENTRY.size * h.nblocks
        if len(have) - HDR_SIZE < tlen:
            t = self._read_table(p, h)
        else:
            t = parse_table(h, have[HDR_SIZE:])
        self._keep(p.pos, (h, t))
        if not 0 <= p.a < p.b <= h.raw_len:
            raise Corrupt(f"entry at {p.pos} holds {h.raw_len} bytes, extent wants {p.a}..{p.b}")
        r = t.blocks(p.a, p.b)
        s0, s1 = t.st_off[r[0]], t.st_off[r[-1] + 1]
        for k, (e0, e1) in enumerate(p.spans):
            if e0 <= s0 and s1 <= e1:
                return self._copy(p, t, p.have[k], e0)
        p.known = (h, t)
        return False

    def _copy(self, p: _Piece, t: Table, have: memoryview, base: int) -> bool:
        """Blocks of ``p`` from ``have`` (entry bytes from ``base`` on): each checked,
        decoded if compressed, its part of [a, b) copied into ``p.out``."""
        a, b, out = p.a, p.b, p.out
        st, ro, crcs, flags = t.st_off, t.raw_off, t.crc, t.flags
        for i in t.blocks(a, b):
            stored = have[st[i] - base:st[i + 1] - base]
            if crc32c.crc32c(stored) != crcs[i]:
                raise Corrupt(f"block {i} checksum mismatch in entry at ring position {p.pos}")
            r0, r1 = ro[i], ro[i + 1]
            raw = stored if not flags[i] and len(stored) == r1 - r0 else decode(flags[i], stored, r1 - r0)
            x0, x1 = max(a, r0), min(b, r1)
            out[x0 - a:x1 - a] = raw[x0 - r0:x1 - r0]
        return True

    def _read_table(self, p: _Piece, h: Header) -> Table:
        """The table of an entry whose block count was guessed low (one more read)."""
        n = BLOCK_ENTRY.size * h.nblocks
        raw = os.pread(self.fd, n, p.phys + HDR_SIZE)
        if len(raw) != n:
            raise Corrupt(f"entry at ring position {p.pos}: its table is cut short")
        return parse_table(h, raw)

    def _keep(self, pos: int, known: tuple[Header, Table]) -> None:
        with self._tlock:
            self._tables[pos] = known
            if not any(known[1].flags):
                self._raw.add(pos)
            while len(self._tables) > TABLES:
                self._raw.discard(self._tables.popitem(last=False)[0])

    def forget_tables(self) -> None:
        with self._tlock:
            self._tables.clear()
            self._raw.clear()

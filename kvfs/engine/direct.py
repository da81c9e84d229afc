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
needs is planned first, entries that lie next to each other on disk are read by one
``preadv`` scattered straight into the callers' buffers (the header and block table into
a small buffer, raw blocks into place: no copy), and the reads run on a few threads.
Blocks are appended raw (``compress_on_copy``) and only compressed when reclaim copies
them; a compressed block is read into a scratch buffer and decoded. An entry's block
table is guessed from its extent (raw blocks of ``BLOCK`` bytes) so the first read takes
header, table and blocks at once; a wrong guess costs one more read, with the table then
known. Tables once read are kept (by ring position, which is never reused).
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import crc32c

from .blocks import Table, parse_table
from .codec import decode
from .errors import Corrupt
from .format import BLOCK, BLOCK_ENTRY, HDR_SIZE, T_DATA, Header, unpack_header
from .published import PublishedView

INLINE_SKIP = 64 << 10  # a range this far into an entry still reads from its start
MERGE_GAP = 64 << 10  # entries this close on disk are read by one preadv
MERGE_MAX = 4 << 20  # ... of at most this many bytes (several of them run in parallel)
IOV_MAX = 1000  # buffers per preadv (the kernel takes 1024)
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
    """Raw bytes [a, b) of the entry at ``pos`` into ``out``."""

    __slots__ = ("fe", "pos", "esize", "a", "b", "out", "hint", "file_off", "hdr", "blocks",
                 "prefix", "tail", "known", "nb", "base", "scratch")

    def __init__(self, fe: FileExtents, pos: int, esize: int, a: int, b: int,
                 out: memoryview, hint: int, file_off: int) -> None:
        self.fe, self.pos, self.esize, self.a, self.b, self.out = fe, pos, esize, a, b, out
        self.hint = hint  # the entry holds at least this many raw bytes
        self.file_off = file_off  # the file offset of the entry's first raw byte
        self.hdr: bytearray | None = None  # header + table (+ raw bytes before ``a``)
        self.prefix: bytearray | None = None  # raw bytes of the first block before ``a``
        self.tail: bytearray | None = None  # raw bytes of the last block after ``b``
        self.scratch: bytearray | None = None  # stored blocks, to check and decode
        self.known: tuple[Header, Table] | None = None
        self.nb = 0  # blocks the table was guessed to hold
        self.base = 0  # entry offset of the first stored byte read (raw layout guess)
        self.blocks = (0, 0)  # raw [start, end) of the blocks read (guess)


class _Run:
    """One preadv: buffers filling ``[off, off + n)`` of the volume."""

    __slots__ = ("off", "bufs", "n")

    def __init__(self, off: int) -> None:
        self.off, self.bufs, self.n = off, [], 0

    def add(self, buf: memoryview | bytearray) -> None:
        self.bufs.append(buf)
        self.n += len(buf)


class DirectReader:
    """Checked reads of a volume from outside the mount (see the module doc)."""

    def __init__(self, fd: int, view: PublishedView, threads: int = 4) -> None:
        self.fd, self.view = fd, view
        self.roff, self.rsize = view.ring_offset, view.ring_size
        self._tables: OrderedDict[int, tuple[Header, Table]] = OrderedDict()
        self._tlock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvfs-direct")
        self.stats = {"reads": 0, "preadv": 0, "bytes": 0, "guess_missed": 0, "stale": 0}

    def close(self) -> None:
        self._pool.shutdown()

    # ------------------------------------------------------------------ planning
    def read(self, jobs: list[tuple[FileExtents, int, memoryview]]) -> None:
        """Fill each ``out`` with bytes ``[off, off + len(out))`` of its file. Raises
        ``Stale`` (fetch the extents again and retry), ``Corrupt`` (an entry fails its
        checks while the published state says it is intact) or ``ValueError`` (a range the
        extents do not cover)."""
        pieces: list[_Piece] = []
        for fe, off, out in jobs:
            pieces += self._pieces(fe, off, out)
        if not pieces:
            return
        cuts = {fe.sno: fe.cuts for fe, _, _ in jobs}
        try:
            self._run_all([r for p in pieces for r in self._plan(p)])
            second = [p for p in pieces if not self._check(p)]
            if second:  # a table guessed wrong: read the blocks again with it known
                self.stats["guess_missed"] += len(second)
                self._run_all([r for p in second for r in self._plan(p)])
                for p in second:
                    if not self._check(p):
                        raise Corrupt(f"entry at ring position {p.pos}: blocks not where its "
                                      "table says")
        except Corrupt:
            self._still_valid(pieces, cuts)  # overwritten meanwhile: Stale, not damage
            raise
        self._still_valid(pieces, cuts)
        self.stats["reads"] += 1

    def _still_valid(self, pieces: list[_Piece], cuts: dict[int, int]) -> None:
        if self.view.tail() > min(p.pos for p in pieces) or any(
                self.view.cuts(sno) != c for sno, c in cuts.items()):
            self.stats["stale"] += 1
            raise Stale("the ring's tail passed an entry read, or the file was cut")

    @staticmethod
    def _pieces(fe: FileExtents, off: int, out: memoryview) -> list[_Piece]:
        end = off + len(out)
        if off < 0 or end > fe.size or not fe.covers(off, end):
            raise ValueError(f"range [{off}, {end}) is not within the extents "
                             f"[{fe.lo}, {min(fe.hi, fe.size)}) of a {fe.size}-byte file")
        out_pieces = []
        i = max(bisect.bisect_right(fe.off, off) - 1, 0)
        while off < end:
            if i >= len(fe.off) or fe.off[i] > off:
                raise ValueError(f"no extent holds file byte {off}")
            pos, skip, n, esize = fe.ext[i]
            o = fe.off[i]
            a, b = off - o + skip, min(end, o + n) - o + skip
            k = off - (end - len(out))
            out_pieces.append(_Piece(fe, pos, esize, a, b, out[k:k + b - a], skip + n, o - skip))
            off += b - a
            i += 1
        return out_pieces

    def _plan(self, p: _Piece) -> list[tuple[int, list, _Piece]]:
        """The reads of one piece: (volume offset, buffers, piece)."""
        phys = self.roff + p.pos % self.rsize
        with self._tlock:
            known = self._tables.get(p.pos)
            if known is not None:
                self._tables.move_to_end(p.pos)
        p.known = known
        if known is not None:
            _, t = known
            r = t.blocks(p.a, p.b)
            s0, s1 = t.st_off[r[0]], t.st_off[r[-1] + 1]
            if all(t.flags[i] == 0 and t.st_off[i + 1] - t.st_off[i] == t.raw_off[i + 1] - t.raw_off[i]
                   for i in r) and p.a == t.raw_off[r[0]] and p.b == t.raw_off[r[-1] + 1]:
                p.scratch = None
                return [(phys + s0, [p.out], p)]
            p.scratch = bytearray(s1 - s0)
            return [(phys + s0, [p.scratch], p)]
        # guess: raw blocks of BLOCK bytes, the table sized by what the entry holds at least
        p.nb = -(-p.hint // BLOCK)
        table_end = HDR_SIZE + BLOCK_ENTRY.size * p.nb
        ba = p.a - p.a % BLOCK
        bb = min(-(-p.b // BLOCK) * BLOCK, p.esize - table_end)
        if bb < p.b:  # raw blocks would not fit the entry: header and table first
            p.blocks, p.base = (0, 0), table_end
            p.hdr = bytearray(min(table_end, p.esize))
            return [(phys, [p.hdr], p)]
        p.blocks, p.base = (ba, bb), table_end
        p.tail = bytearray(bb - p.b) if bb > p.b else None
        tail = [p.tail] if p.tail is not None else []
        if ba <= INLINE_SKIP:  # one read from the entry's start
            p.hdr, p.prefix = bytearray(table_end + p.a), None
            return [(phys, [p.hdr, p.out, *tail], p)]
        p.hdr = bytearray(table_end)
        p.prefix = bytearray(p.a - ba) if p.a > ba else None
        pre = [p.prefix] if p.prefix is not None else []
        return [(phys, [p.hdr], p), (phys + table_end + ba, [*pre, p.out, *tail], p)]

    # ------------------------------------------------------------------ reading
    def _run_all(self, reads: list[tuple[int, list, _Piece]]) -> None:
        """Merge reads that lie next to each other on disk, then run them (in parallel
        when there are several)."""
        reads.sort(key=lambda r: r[0])
        runs: list[_Run] = []
        cur: _Run | None = None
        for off, bufs, _ in reads:
            size = sum(len(b) for b in bufs)
            if (cur is not None and 0 <= off - (cur.off + cur.n) <= MERGE_GAP
                    and cur.n + size <= MERGE_MAX and len(cur.bufs) + len(bufs) < IOV_MAX):
                gap = off - (cur.off + cur.n)
                if gap:
                    cur.add(bytearray(gap))
            else:
                cur = _Run(off)
                runs.append(cur)
            for b in bufs:
                cur.add(b)
        if len(runs) == 1:
            self._preadv(runs[0])
        else:
            for f in [self._pool.submit(self._preadv, r) for r in runs]:
                f.result()

    def _preadv(self, r: _Run) -> None:
        bufs, off = list(r.bufs), r.off
        n = os.preadv(self.fd, bufs, off)
        self.stats["preadv"] += 1
        self.stats["bytes"] += n
        while n < r.n:  # short: the rest, buffer by buffer (only at a volume's end)
            got = n
            rest: list = []
            for b in bufs:
                if got >= len(b):
                    got -= len(b)
                    continue
                rest.append(memoryview(b)[got:])
                got = 0
            m = os.preadv(self.fd, rest, off + n)
            if m <= 0:
                raise OSError(5, f"short read of the volume at {off + n}")
            n += m

    # ------------------------------------------------------------------ checking
    def _check(self, p: _Piece) -> bool:
        """Check (and decode into place) what was read for ``p``; False when the table
        was guessed wrong (``p`` is then planned again with it known)."""
        if p.known is None:
            h = self._header(p)
            have = len(p.hdr) - HDR_SIZE >= BLOCK_ENTRY.size * h.nblocks
            t = parse_table(h, memoryview(p.hdr)[HDR_SIZE:]) if h.nblocks == p.nb and have else None
            if t is None:
                t = self._read_table(p, h)
            self._keep(p.pos, (h, t))
            if not 0 <= p.a < p.b <= h.raw_len:
                raise Corrupt(f"entry at {p.pos} holds {h.raw_len} bytes, extent wants {p.a}..{p.b}")
            r = t.blocks(p.a, p.b)
            if (h.nblocks != p.nb or t.raw_off[r[0]] < p.blocks[0] or t.raw_off[r[-1] + 1] > p.blocks[1]
                    or any(t.flags[i] or t.st_off[i] != p.base + t.raw_off[i] for i in r)
                    or t.st_off[r[-1] + 1] != p.base + t.raw_off[r[-1] + 1]):
                p.known = (h, t)
                return False
            for i in r:
                _check_crc(t, i, self._raw_views(p, t.raw_off[i], t.raw_off[i + 1]), p.pos)
            return True
        h, t = p.known
        if not 0 <= p.a < p.b <= h.raw_len:
            raise Corrupt(f"entry at {p.pos} holds {h.raw_len} bytes, extent wants {p.a}..{p.b}")
        r = t.blocks(p.a, p.b)
        s0 = t.st_off[r[0]]
        if p.scratch is None:  # raw blocks read into place
            for i in r:
                r0 = t.raw_off[i] - p.a
                _check_crc(t, i, [p.out[r0:t.raw_off[i + 1] - p.a]], p.pos)
            return True
        sv = memoryview(p.scratch)
        for i in r:
            stored = sv[t.st_off[i] - s0:t.st_off[i + 1] - s0]
            _check_crc(t, i, [stored], p.pos)
            r0, r1 = t.raw_off[i], t.raw_off[i + 1]
            raw = stored if not t.flags[i] and len(stored) == r1 - r0 else decode(t.flags[i], stored, r1 - r0)
            x0, x1 = max(p.a, r0), min(p.b, r1)
            p.out[x0 - p.a:x1 - p.a] = memoryview(raw)[x0 - r0:x1 - r0]
        return True

    def _header(self, p: _Piece) -> Header:
        h = unpack_header(p.hdr)
        fe = p.fe
        if h is None or h.pos != p.pos:
            raise Corrupt(f"bad entry header at ring position {p.pos}")
        if (h.type != T_DATA or h.size != p.esize or h.sno != fe.sno or h.fno != fe.fno
                or h.file_off != p.file_off):
            raise Corrupt(f"entry at ring position {p.pos} is not the data of file "
                          f"{fe.sno}/{fe.fno} the extents name")
        return h

    def _read_table(self, p: _Piece, h: Header) -> Table:
        """The table of an entry whose block count was guessed wrong (one more read)."""
        n = BLOCK_ENTRY.size * h.nblocks
        raw = bytearray(n)
        got = os.preadv(self.fd, [raw], self.roff + p.pos % self.rsize + HDR_SIZE)
        if got != n:
            raise Corrupt(f"entry at ring position {p.pos}: its table is cut short")
        return parse_table(h, raw)

    def _raw_views(self, p: _Piece, x0: int, x1: int) -> list[memoryview]:
        """Memory holding raw bytes [x0, x1) of the entry as read by the guessed plan:
        prefix (or the header buffer), then ``out``, then the tail buffer."""
        views = []
        segs: list[tuple[int, memoryview]] = []  # (raw start, view)
        if p.prefix is not None:
            segs.append((p.blocks[0], memoryview(p.prefix)))
        elif p.hdr is not None and len(p.hdr) > p.base:
            segs.append((0, memoryview(p.hdr)[p.base:]))
        segs.append((p.a, p.out))
        if p.tail is not None:
            segs.append((p.b, memoryview(p.tail)))
        for s0, v in segs:
            a, b = max(x0, s0), min(x1, s0 + len(v))
            if a < b:
                views.append(v[a - s0:b - s0])
        if sum(len(v) for v in views) != x1 - x0:
            raise Corrupt(f"entry at ring position {p.pos}: block {x0}..{x1} not read whole")
        return views

    def _keep(self, pos: int, known: tuple[Header, Table]) -> None:
        with self._tlock:
            self._tables[pos] = known
            while len(self._tables) > TABLES:
                self._tables.popitem(last=False)

    def forget_tables(self) -> None:
        with self._tlock:
            self._tables.clear()


def _check_crc(t: Table, i: int, views: list[memoryview], pos: int) -> None:
    crc = 0
    for v in views:
        crc = crc32c.crc32c(v, crc)
    if crc != t.crc[i]:
        raise Corrupt(f"block {i} checksum mismatch in entry at ring position {pos}")


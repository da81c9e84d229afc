"""The ring: append entries at the head, read them back by position, scan for recovery.

Positions are 64-bit logical byte offsets that only grow; the physical offset is
``pos % ring_size``, so the lap is implicit and every header records its own ``pos``. A
header found at a physical offset whose ``pos`` is not the one expected there belongs to
another lap and reads as "no entry": old laps reject themselves (RocksDB's kOldRecord).

Owns the write buffer and ``durable_tail``: the head never writes over space behind the
tail recorded in the newest superblock (jbd2's rule). Moving the tail is the engine's job.
Never fsyncs on its own except through ``sync``; interprets payloads only as far as the
block table of data entries (``blocks``), to check them and read a range.

Every write that ends inside a page carries zeros on to the page's end, when that space is
free (behind the durable tail, one lap back): the kernel then takes the page whole instead
of reading it from the disk first to merge the write in. On the disk that space holds an
older lap's bytes (or a filled volume's zeros), so without the zeros each write ending
mid-page would wait for a read; the next write starts in that page, still in the cache.

Threads: the store calls the writing methods and ``locate`` under its lock; ``read_data``
runs outside it (it only reads the volume), so its caller must check afterwards that the
tail did not pass the entry while it read (``tail`` only grows, and the head writes over
an entry's space only after the tail has passed it).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import crc32c

from .blocks import Encoded, Table, check_payload, parse_table, read_range
from .errors import Corrupt
from .format import (
    ALIGN,
    BLOCK,
    BLOCK_ENTRY,
    ENTRY_MAGIC,
    HDR_SIZE,
    MAX_ENTRY_RAW,
    PAGE,
    T_DATA,
    T_PAD,
    Header,
    align,
    entry_size,
    unpack_header,
)
from .volume import VolumeFile, now_ns

log = logging.getLogger(__name__)

_MAGIC = struct.pack("<I", ENTRY_MAGIC)
MAX_ENTRY = entry_size(MAX_ENTRY_RAW + (MAX_ENTRY_RAW >> 6) + 64)  # worst-case zstd expansion
SCAN_WINDOW = 8 << 20
DIRECT_WRITE = 64 << 10  # payloads this large are written without the buffer copy
INLINE_SKIP = 64 << 10  # a range read this far into an entry still reads from its start
PAGE_IO = 4096  # reads end on a page boundary: the rest of the page costs nothing


class RingFull(Exception):
    """No room between head and the durable tail; the engine must reclaim first."""


@dataclass
class ScanItem:
    hdr: Header
    payload: bytes | None  # None when the payload failed its checksum (header still valid)


@dataclass
class ScanReport:
    end: int = 0  # position after the last entry found: the head
    entries: int = 0
    corrupt: list[tuple[int, int]] | None = None  # (pos, bytes skipped) of bad regions mid-log
    torn_tail: bool = False


class Ring:
    def __init__(self, vol: VolumeFile, offset: int, size: int, head: int, tail: int,
                 write_buffer: int = 4 << 20) -> None:
        self.vol, self.offset, self.size = vol, offset, size
        self.head = head
        self.tail = tail  # in memory: may run ahead of durable_tail during reclaim
        self.durable_tail = tail
        self.write_buffer = write_buffer
        self._buf = bytearray()
        self._buf_pos = head  # logical position of _buf[0]

    # ------------------------------------------------------------------ sizes
    # The lap arithmetic lives here only: a position's byte in the file, and how far its
    # lap runs on (entries never cross a lap end).
    def phys(self, pos: int) -> int:
        return self.offset + pos % self.size

    def lap_left(self, pos: int) -> int:
        """Bytes from ``pos`` to the physical end of the ring (the end of its lap)."""
        return self.size - pos % self.size

    def used(self) -> int:
        return self.head - self.tail

    def room(self) -> int:
        """Bytes the head may still write without passing the durable tail."""
        return self.size - (self.head - self.durable_tail)

    def cost(self, stored_len: int) -> int:
        """Ring bytes an entry would take now, including padding to the lap end."""
        esize = entry_size(stored_len)
        lap_left = self.lap_left(self.head)
        return esize if esize <= lap_left else lap_left + esize

    # ------------------------------------------------------------------ write
    def append(self, type_: int, flags: int, name_hash: int, sno: int, fno: int, file_off: int,
               raw_len: int, payload: bytes | memoryview = b"", ts_ns: int | None = None) -> tuple[int, int]:
        """Buffer one entry at the head; returns (pos, entry size). RingFull if no room."""
        pos, esize, _ = self.put(type_, flags, name_hash, sno, fno, file_off, raw_len,
                                 [payload] if payload else [], crc32c.crc32c(payload), 0, ts_ns)
        return pos, esize

    def append_data(self, flags: int, name_hash: int, sno: int, fno: int, file_off: int,
                    enc: Encoded, defer: bool = False) -> tuple[int, int, tuple | None]:
        """Append a data entry (block table + blocks). With ``defer`` a large entry is only
        reserved: (pos, esize, (bufs, offset)) and the caller writes it with ``write_reserved``
        (outside the store's lock) or gives the space back with ``cancel``."""
        return self.put(T_DATA, flags, name_hash, sno, fno, file_off, enc.raw_len, enc.parts,
                        enc.table_crc, enc.nblocks, None, defer, enc.stored_len)

    def put(self, type_: int, flags: int, name_hash: int, sno: int, fno: int, file_off: int,
            raw_len: int, parts: list[bytes | memoryview], payload_crc: int, nblocks: int = 0,
            ts_ns: int | None = None, defer: bool = False,
            stored: int = -1) -> tuple[int, int, tuple | None]:
        if stored < 0:
            stored = sum(len(p) for p in parts)
        esize = entry_size(stored)
        if esize > self.size // 4:
            raise ValueError(f"entry of {esize} bytes is too large for a ring of {self.size}")
        if self.cost(stored) > self.room():
            raise RingFull(f"need {self.cost(stored)} bytes, {self.room()} free")
        lap_left = self.lap_left(self.head)
        if esize > lap_left:
            # Entries never straddle the physical end: a PAD header sends readers to the next lap.
            pad = Header(T_PAD, 0, self.head, 0, 0, lap_left, 0, 0, 0, crc32c.crc32c(b""), now_ns())
            self._buf += pad.pack()
            self.head += lap_left
            self.flush()
        pos = self.head
        h = Header(type_, flags, pos, name_hash, sno, file_off, fno, stored, raw_len,
                   payload_crc, ts_ns if ts_ns is not None else now_ns(), nblocks)
        if stored >= DIRECT_WRITE:
            # Large payloads skip the buffer: one gathered write instead of a copy.
            self.flush()
            tail = esize - HDR_SIZE - stored + self._page_rest(pos + esize)
            job = ([h.pack(), *parts, bytes(tail)], self.phys(pos))
            self.head += esize
            self._buf_pos = self.head
            if defer:
                return pos, esize, job
            try:
                self.vol.pwritev(*job)
            except BaseException:
                self.cancel(pos)
                raise
            return pos, esize, None
        self._buf += h.pack()
        for p in parts:
            self._buf += p
        self._buf += bytes(esize - HDR_SIZE - stored)
        self.head += esize
        if len(self._buf) >= self.write_buffer or self.head % self.size == 0:
            self.flush()
        return pos, esize, None

    def write_reserved(self, job: tuple) -> None:
        """Write an entry reserved by ``put(defer=True)``; needs no lock (nothing reads or
        writes that space until the caller publishes it)."""
        self.vol.pwritev(*job)

    def cancel(self, pos: int) -> None:
        """Give back a reserved entry at ``pos`` whose write failed: the head returns there."""
        self.head = self._buf_pos = pos
        self._buf = bytearray()

    def _page_rest(self, end: int) -> int:
        """Bytes from ``end`` to its page's end when they are free to write over (see the
        module's doc), else 0."""
        n = -self.phys(end) % PAGE
        return n if n <= self.size - (end - self.durable_tail) else 0

    def flush(self) -> None:
        """Write the buffered entries (one pwrite; they never cross the lap end)."""
        if self._buf:
            rest = self._page_rest(self.head)
            off = self.phys(self._buf_pos)
            if rest:
                self.vol.pwritev([self._buf, bytes(rest)], off)
            else:
                self.vol.pwrite(self._buf, off)
            self._buf = bytearray()
        self._buf_pos = self.head

    @property
    def unwritten(self) -> int:
        """Bytes of entries still in the write buffer (not yet given to the volume)."""
        return len(self._buf)

    def sync(self) -> None:
        """Flush and fsync; no fsync when nothing was written since the last one."""
        self.flush()
        self.vol.sync_written()

    # ------------------------------------------------------------------- read
    def on_disk(self, pos: int) -> bool:
        """Whether ``pos`` was written to the volume (not still in the write buffer)."""
        return pos < self._buf_pos

    def buffered(self, pos: int, n: int) -> bytes | None:
        """A copy of up to ``n`` bytes at ``pos`` from the write buffer; None if not there.

        A copy: a view would pin the buffer (it must stay resizable) and see it change."""
        o = pos - self._buf_pos
        if not 0 <= o < len(self._buf):
            return None
        return bytes(self._buf[o: o + n])

    def live(self, pos: int, esize: int) -> None:
        if not (self.tail <= pos and pos + esize <= self.head):
            raise Corrupt(f"entry at {pos} is outside the live ring [{self.tail}, {self.head})")

    def locate(self, pos: int, esize: int) -> bytes | None:
        """Under the store's lock, before ``read_data``: Corrupt unless the entry is in the
        live ring; its bytes if they are still in the write buffer, else None."""
        self.live(pos, esize)
        return None if pos < self._buf_pos else self.buffered(pos, esize)

    def _check_header(self, raw: bytes | memoryview, pos: int, esize: int) -> Header:
        h = unpack_header(raw)
        if h is None or h.pos != pos:
            raise Corrupt(f"bad entry header at ring position {pos}")
        if h.size != esize:
            raise Corrupt(f"entry at {pos} has size {h.size}, index says {esize}")
        return h

    def read_entry(self, pos: int, esize: int) -> tuple[Header, memoryview]:
        """Header and payload of the entry at ``pos``; Corrupt unless both check out (for a
        data entry: its block table and every block)."""
        self.live(pos, esize)
        got = self.buffered(pos, esize)
        if got is not None:
            raw = memoryview(got)
        else:
            off = self.phys(pos)
            raw = memoryview(self.vol.pread(esize, off))
            self.vol.dontneed(off, esize)
        h = self._check_header(raw, pos, esize)
        payload = raw[HDR_SIZE: HDR_SIZE + h.stored_len]
        if not check_payload(h, payload):
            raise Corrupt(f"payload checksum mismatch in entry at ring position {pos}")
        return h, payload

    @staticmethod
    def second_read(a: int) -> bool:
        """Whether raw bytes from ``a`` on, in an entry whose table is not known, are read
        apart from its header and table (they lie too far into it to read along)."""
        return a - a % BLOCK > INLINE_SKIP

    def _first_read(self, phys: int, esize: int, a: int, b: int, raw_hint: int) -> tuple[int, int, int]:
        """For an entry whose table is not known: the bytes of its first read (header,
        table and, when they lie close, the blocks from the start up to ``b``), and the
        entry range [start, end) raw blocks [a, b) would span if they need a read of their
        own (else 0, 0)."""
        end = HDR_SIZE + BLOCK_ENTRY.size * -(-max(b, raw_hint) // BLOCK)
        blocks_end = min(esize, end + -(-b // BLOCK) * BLOCK)
        rest = (end + a - a % BLOCK, blocks_end) if self.second_read(a) else (0, 0)
        if not rest[1]:
            end = blocks_end
        return min(esize, -(-(phys + end) // PAGE_IO) * PAGE_IO - phys), *rest

    def read_plan(self, pos: int, esize: int, a: int, b: int, known: tuple[Header, Table] | None,
                  raw_hint: int = 0) -> list[tuple[int, int]]:
        """The volume ranges ``read_data`` reads for these arguments: exact for a known
        table, else where raw blocks would lie (appends store raw). For advice only."""
        phys = self.offset + pos % self.size
        if known is not None:
            st, r = known[1].st_off, known[1].blocks(a, b)
            return [(phys + st[r[0]], st[r[-1] + 1] - st[r[0]])]
        n, r0, r1 = self._first_read(phys, esize, a, b, raw_hint)
        # compressed blocks lie nearer than raw ones would: past the entry's end, no guess
        return [(phys, n), (phys + r0, r1 - r0)] if r1 > r0 else [(phys, n)]

    def read_data(self, pos: int, esize: int, a: int, b: int, src: bytes | None,
                  known: tuple[Header, Table] | None, raw_hint: int = 0
                  ) -> tuple[list[bytes | memoryview], dict[int, bytes | memoryview], tuple[Header, Table]]:
        """Raw bytes [a, b) of the data entry at ``pos`` (pieces), the blocks decoded on the
        way, and its header and table (``known``: from an earlier read). Reads, checks and
        decodes only the blocks the range touches: the header and table come with the
        first blocks in one read when they lie close, else in a read of their own.
        ``src``: the entry's bytes from the write buffer (``locate``); ``raw_hint``: the
        entry's raw length as far as the index knows (sizes the table). No lock needed."""
        phys = self.offset + pos % self.size

        def fetch(o: int, n: int) -> bytes | memoryview:
            if src is not None:
                return memoryview(src)[o: o + n]
            out = self.vol.pread(n, phys + o)
            self.vol.dontneed(phys + o, n)
            return out

        if known is None:
            n, _, _ = self._first_read(phys, esize, a, b, raw_hint)
            have = memoryview(fetch(0, n))
            h = self._check_header(have, pos, esize)
            if h.type != T_DATA:
                raise Corrupt(f"entry at {pos} is not a data entry")
            tend = HDR_SIZE + BLOCK_ENTRY.size * h.nblocks
            if tend > len(have) and tend <= esize:
                have = memoryview(bytes(have) + bytes(fetch(len(have), tend - len(have))))
            known = (h, parse_table(h, have[HDR_SIZE:]))
        else:
            have = memoryview(b"")
        h, t = known
        if not 0 <= a < b <= h.raw_len:
            raise Corrupt(f"entry at {pos} holds {h.raw_len} bytes, index wants {a}..{b}")
        pieces, decoded = read_range(h, t, a, b, have, 0, fetch)
        return pieces, decoded, known

    # ------------------------------------------------------------------- scan
    def scan(self, start: int, limit: int, report: ScanReport) -> Iterator[ScanItem]:
        """Entries from ``start`` up to the first position with no valid entry.

        ``limit`` bounds the scan (tail + ring size). A bad entry followed, within the
        largest entry size, by a valid entry of this lap is corruption: it is reported and
        skipped. A bad entry with nothing valid after it is the torn end of the log.
        """
        reader = _Window(self)
        pos = start
        report.corrupt = report.corrupt or []
        while pos < limit:
            h = reader.header(pos)
            if h is not None and h.type == T_PAD:
                if self.lap_left(pos) <= MAX_ENTRY:
                    pos += self.lap_left(pos)
                    continue
                # a pad stands only where the next entry did not fit the lap: one further
                # from the lap's end is not the engine's (read as no entry)
                h = None
            if h is not None and pos + h.size <= limit and h.size <= MAX_ENTRY:
                payload = reader.read(pos + HDR_SIZE, h.stored_len)
                ok = check_payload(h, payload)
                if ok or self._resync(reader, pos + h.size, limit) is not None:
                    report.entries += 1
                    if not ok:
                        report.corrupt.append((pos, h.size))
                        log.error("ring entry at %d: payload checksum mismatch", pos)
                    yield ScanItem(h, payload if ok else None)
                    pos += h.size
                    continue
                report.torn_tail = True
                break
            nxt = self._resync(reader, pos + ALIGN, limit)
            if nxt is None:
                # Zeros or an intact entry of an older lap end the log cleanly; anything
                # else there is a write of this lap that did not finish.
                report.torn_tail = h is not None or not reader.clean_end(pos)
                break
            log.error("ring corruption: skipped %d bytes at position %d", nxt - pos, pos)
            report.corrupt.append((pos, nxt - pos))
            pos = nxt
        report.end = pos

    def _resync(self, reader: _Window, frm: int, limit: int) -> int | None:
        """Position of the next valid entry of this lap within MAX_ENTRY of ``frm``."""
        stop = min(limit, frm + MAX_ENTRY)
        pos = align(frm)
        while pos < stop:
            lap_left = self.lap_left(pos)
            chunk = reader.read(pos, min(stop - pos, lap_left, SCAN_WINDOW))
            i = 0
            while True:
                i = chunk.find(_MAGIC, i)
                if i < 0:
                    break
                if i % ALIGN == 0:
                    h = unpack_header(chunk[i: i + HDR_SIZE]) if i + HDR_SIZE <= len(chunk) else reader.header(pos + i)
                    if h is not None and h.pos == pos + i:
                        return pos + i
                i += 1
            pos += len(chunk) if chunk else lap_left
        return None


class _Window:
    """Sequential reads of the ring through a large buffer (scan is sequential)."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.start = -1
        self.data = b""

    def read(self, pos: int, n: int) -> bytes:
        r = self.ring
        got = r.buffered(pos, n)
        if got is not None:
            return got
        lap_left = r.lap_left(pos)
        n = min(n, lap_left)
        if not (self.start <= pos and pos + n <= self.start + len(self.data)):
            want = min(max(n, SCAN_WINDOW), lap_left)
            self.data = r.vol.pread(want, r.phys(pos))
            self.start = pos
        o = pos - self.start
        return self.data[o: o + n]

    def header(self, pos: int) -> Header | None:
        h = unpack_header(self.read(pos, HDR_SIZE))
        return h if h is not None and h.pos == pos else None

    def clean_end(self, pos: int) -> bool:
        """Zeros, or the valid header of another lap (a stale entry), at ``pos``."""
        raw = self.read(pos, HDR_SIZE)
        h = unpack_header(raw)
        return not any(raw) or (h is not None and h.pos != pos)

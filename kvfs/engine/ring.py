"""The ring: append entries at the head, read them back by position, scan for recovery.

Positions are 64-bit logical byte offsets that only grow; the physical offset is
``pos % ring_size``, so the lap is implicit and every header records its own ``pos``. A
header found at a physical offset whose ``pos`` is not the one expected there belongs to
another lap and reads as "no entry": old laps reject themselves (RocksDB's kOldRecord).

Owns the write buffer and ``durable_tail``: the head never writes over space behind the
tail recorded in the newest superblock (jbd2's rule). Moving the tail is the engine's job.
Never fsyncs on its own except through ``sync``; never interprets payloads.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import crc32c

from .errors import Corrupt
from .format import (
    ALIGN,
    ENTRY_MAGIC,
    HDR_SIZE,
    MAX_ENTRY_RAW,
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
        stored = len(payload)
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
                   crc32c.crc32c(payload), ts_ns if ts_ns is not None else now_ns())
        if stored >= DIRECT_WRITE:
            # Large payloads skip the buffer: one gathered write instead of a copy.
            self.flush()
            self.vol.pwritev([h.pack(), payload, bytes(esize - HDR_SIZE - stored)], self.phys(pos))
            self.head += esize
            self._buf_pos = self.head
            return pos, esize
        self._buf += h.pack()
        self._buf += payload
        self._buf += bytes(esize - HDR_SIZE - stored)
        self.head += esize
        if len(self._buf) >= self.write_buffer or self.head % self.size == 0:
            self.flush()
        return pos, esize

    def flush(self) -> None:
        """Write the buffered entries (one pwrite; they never cross the lap end)."""
        if self._buf:
            self.vol.pwrite(self._buf, self.phys(self._buf_pos))
            self._buf = bytearray()
        self._buf_pos = self.head

    def sync(self) -> None:
        self.flush()
        self.vol.sync()

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

    def read_entry(self, pos: int, esize: int) -> tuple[Header, memoryview]:
        """Header and payload of the entry at ``pos``; Corrupt unless both check out."""
        if not (self.tail <= pos and pos + esize <= self.head):
            raise Corrupt(f"entry at {pos} is outside the live ring [{self.tail}, {self.head})")
        got = self.buffered(pos, esize)
        if got is not None:
            raw = memoryview(got)
        else:
            off = self.phys(pos)
            raw = memoryview(self.vol.pread(esize, off))
            self.vol.dontneed(off, esize)
        h = unpack_header(raw)
        if h is None or h.pos != pos:
            raise Corrupt(f"bad entry header at ring position {pos}")
        if h.size != esize:
            raise Corrupt(f"entry at {pos} has size {h.size}, index says {esize}")
        payload = raw[HDR_SIZE: HDR_SIZE + h.stored_len]
        if crc32c.crc32c(payload) != h.payload_crc:
            raise Corrupt(f"payload checksum mismatch in entry at ring position {pos}")
        return h, payload

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
                pos += self.lap_left(pos)
                continue
            if h is not None and pos + h.size <= limit:
                payload = reader.read(pos + HDR_SIZE, h.stored_len)
                ok = crc32c.crc32c(payload) == h.payload_crc
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

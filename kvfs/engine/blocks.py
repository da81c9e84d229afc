"""Blocks inside data entries: encode an entry's bytes as checked blocks, read a range back.

A data entry's payload is a block table, then the blocks (layout in format.py). Each block
of at most BLOCK raw bytes is compressed on its own and has its own CRC-32C in the table;
the table's CRC is the header's ``payload_crc``. So a range read reads, checks and decodes
only the blocks it touches (LevelDB's blocks, zstd's seekable format), and a damaged block
costs only the reads that touch it.

Blocks of one write are compressed on a small thread pool (zstd, crc32c and numpy release
the GIL), so a large append is not held up by one core. Never touches the volume itself:
the ring passes its reads in.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import crc32c

from .codec import Codec, decode
from .errors import Corrupt
from .format import BLOCK, BLOCK_ENTRY, HDR_SIZE, MAX_ENTRY_RAW, T_DATA, Header

POOL_WORKERS = max(1, min(4, (os.cpu_count() or 1) - 1))  # a core left for the caller:
# on two busy cores the hand-offs cost more than they gain (measured 15 % slower)
POOL_JOB = 256 << 10  # raw bytes per pool job: smaller jobs cost more in hand-offs than they gain
MAX_BLOCKS = -(-MAX_ENTRY_RAW // BLOCK) * 4  # a table claiming more is damaged
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(POOL_WORKERS, thread_name_prefix="kvfs-codec")
        return _pool


@dataclass
class Encoded:
    """One data entry's payload, ready to write: table first, then the blocks."""

    parts: list[bytes | memoryview]  # table, block 0, block 1, ...
    table_crc: int
    nblocks: int
    raw_len: int
    stored_len: int = -1  # bytes of all parts (computed when not given)

    def __post_init__(self) -> None:
        if self.stored_len < 0:
            self.stored_len = sum(len(p) for p in self.parts)


def _blocks(codec: Codec, data: memoryview, jobs: list[tuple[int, int, bool]]
            ) -> list[tuple[int, bytes | memoryview, int]]:
    out = []
    for a, b, tried in jobs:
        flags, stored = codec.compress(data[a:b]) if tried else (0, data[a:b])
        out.append((flags, stored, crc32c.crc32c(stored)))
    return out


def encode_entries(codec: Codec, data: memoryview, entry_raw: int, key: object = None) -> list[Encoded]:
    """``data`` cut into entries of at most ``entry_raw`` bytes, each into blocks. A large
    write's blocks are compressed on the pool, POOL_JOB bytes per job; the codec's
    back-off for stream ``key`` sees them in order."""
    jobs: list[tuple[int, int, bool]] = []
    for e0 in range(0, len(data), entry_raw):
        e1 = min(len(data), e0 + entry_raw)
        for b0 in range(e0, e1, BLOCK):
            b1 = min(e1, b0 + BLOCK)
            jobs.append((b0, b1, codec.plan(b1 - b0, key)))
    per = max(1, POOL_JOB // BLOCK)
    tried = sum(t for _, _, t in jobs)
    if POOL_WORKERS > 1 and tried > per:
        futs = [_get_pool().submit(_blocks, codec, data, jobs[i:i + per])
                for i in range(0, len(jobs), per)]
        done = [x for f in futs for x in f.result()]
    else:
        done = _blocks(codec, data, jobs)
    out: list[Encoded] = []
    k = 0
    for e0 in range(0, len(data), entry_raw):
        e1 = min(len(data), e0 + entry_raw)
        table, n = bytearray(), 0
        parts: list[bytes | memoryview] = [b""]
        for b0 in range(e0, e1, BLOCK):
            flags, stored, crc = done[k]
            codec.result(jobs[k][2], flags, key)
            k += 1
            table += BLOCK_ENTRY.pack(len(stored), min(e1, b0 + BLOCK) - b0, crc, flags)
            parts.append(stored)
            n += len(stored)
        parts[0] = bytes(table)
        out.append(Encoded(parts, crc32c.crc32c(table), len(parts) - 1, e1 - e0, n + len(table)))
    return out


class Table:
    """A data entry's parsed block table. Offsets are into the entry (header included)."""

    __slots__ = ("nblocks", "raw_off", "st_off", "crc", "flags")

    def __init__(self, raw_off: list[int], st_off: list[int], crc: list[int], flags: list[int]) -> None:
        self.nblocks = len(crc)
        self.raw_off = raw_off  # nblocks + 1: block i holds raw bytes [raw_off[i], raw_off[i+1])
        self.st_off = st_off  # nblocks + 1: block i is entry bytes [st_off[i], st_off[i+1])
        self.crc, self.flags = crc, flags

    def blocks(self, a: int, b: int) -> range:
        """Indexes of the blocks holding raw bytes [a, b)."""
        i = bisect.bisect_right(self.raw_off, a) - 1
        j = bisect.bisect_left(self.raw_off, b)
        return range(max(i, 0), min(j, self.nblocks))


def parse_table(h: Header, raw: bytes | memoryview) -> Table:
    """The table of data entry ``h`` from ``raw`` (its bytes from HDR_SIZE on); Corrupt
    unless its CRC and every length agree with the header."""
    n = h.nblocks
    tlen = n * BLOCK_ENTRY.size
    if h.type != T_DATA or not 0 < n <= MAX_BLOCKS or tlen > h.stored_len or len(raw) < tlen:
        raise Corrupt(f"entry at ring position {h.pos}: bad block count {n}")
    tab = raw[:tlen]
    if crc32c.crc32c(tab) != h.payload_crc:
        raise Corrupt(f"block table checksum mismatch in entry at ring position {h.pos}")
    raw_off, st_off, crcs, flags = [0], [HDR_SIZE + tlen], [], []
    ro, so = 0, HDR_SIZE + tlen
    for stored, rlen, crc, fl in BLOCK_ENTRY.iter_unpack(tab):
        if rlen == 0 or rlen > 4 * BLOCK or stored > rlen + (rlen >> 6) + 64:
            raise Corrupt(f"entry at ring position {h.pos}: bad block lengths")
        ro += rlen
        so += stored
        raw_off.append(ro)
        st_off.append(so)
        crcs.append(crc)
        flags.append(fl)
    if ro != h.raw_len or so != HDR_SIZE + h.stored_len:
        raise Corrupt(f"entry at ring position {h.pos}: block table disagrees with the header")
    return Table(raw_off, st_off, crcs, flags)


def decode_block(h: Header, t: Table, i: int, stored: bytes | memoryview) -> bytes | memoryview:
    """Raw bytes of block ``i`` from its stored bytes; Corrupt unless they check out."""
    if crc32c.crc32c(stored) != t.crc[i]:
        raise Corrupt(f"block {i} checksum mismatch in entry at ring position {h.pos}")
    n = t.raw_off[i + 1] - t.raw_off[i]
    if not t.flags[i] and len(stored) == n:
        return stored  # stored raw: the checked bytes are the data
    return decode(t.flags[i], stored, n)


def check_payload(h: Header, payload: bytes | memoryview) -> bool:
    """Whether a whole payload checks out (table and every block, or the plain CRC)."""
    if h.type != T_DATA:
        return crc32c.crc32c(payload) == h.payload_crc
    try:
        t = parse_table(h, payload)
    except Corrupt:
        return False
    return all(crc32c.crc32c(payload[t.st_off[i] - HDR_SIZE: t.st_off[i + 1] - HDR_SIZE]) == t.crc[i]
               for i in range(t.nblocks))


def decode_payload(h: Header, payload: bytes | memoryview) -> bytes:
    """All raw bytes of a data entry's checked payload (copy forward, fsck)."""
    t = parse_table(h, payload)
    return b"".join(decode_block(h, t, i, payload[t.st_off[i] - HDR_SIZE: t.st_off[i + 1] - HDR_SIZE])
                    for i in range(t.nblocks))


Fetch = Callable[[int, int], bytes | memoryview]  # (offset in the entry, n) -> bytes


def read_range(h: Header, t: Table, a: int, b: int, have: memoryview, have_off: int,
               fetch: Fetch) -> tuple[list[bytes | memoryview], dict[int, bytes | memoryview]]:
    """Raw bytes [a, b) of the entry as pieces, and the last block if the range ends inside
    it (a sequential reader wants the rest next: worth keeping decoded).

    ``have`` holds entry bytes from ``have_off`` on (what a first read already got);
    ``fetch`` reads the rest in one more read."""
    st, ro, crcs, flags = t.st_off, t.raw_off, t.crc, t.flags
    i0 = max(bisect.bisect_right(ro, a) - 1, 0)
    i1 = min(bisect.bisect_left(ro, b), t.nblocks)
    s0, s1 = st[i0], st[i1]
    if not (have_off <= s0 and s1 <= have_off + len(have)):
        have, have_off = memoryview(fetch(s0, s1 - s0)), s0
    pieces = []
    raw: bytes | memoryview = b""
    for i in range(i0, i1):  # decode_block, inlined: this loop is every cold read
        stored = have[st[i] - have_off: st[i + 1] - have_off]
        if crc32c.crc32c(stored) != crcs[i]:
            raise Corrupt(f"block {i} checksum mismatch in entry at ring position {h.pos}")
        r0, r1 = ro[i], ro[i + 1]
        raw = stored if not flags[i] and len(stored) == r1 - r0 else decode(flags[i], stored, r1 - r0)
        pieces.append(raw[max(a, r0) - r0: min(b, r1) - r0] if a > r0 or b < r1 else raw)
    return pieces, ({i1 - 1: raw} if b < ro[i1] else {})

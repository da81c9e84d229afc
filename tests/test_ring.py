"""The ring's reader, LevelDB log_test style: hand-made buffers, exact assertions on what a
scan reports (entries, bytes skipped, torn tail) and on what ``read_entry`` and
``read_data`` (a range of a data entry's blocks) refuse."""

from __future__ import annotations

import crc32c
import pytest

from kvfs.engine.blocks import decode_payload, encode_entries
from kvfs.engine.codec import Codec
from kvfs.engine.errors import Corrupt
from kvfs.engine.format import (
    ALIGN,
    BLOCK,
    BLOCK_ENTRY,
    HDR_SIZE,
    PAGE,
    T_DATA,
    T_PAD,
    T_TRUNC,
    Header,
    entry_size,
)
from kvfs.engine.ring import DIRECT_WRITE, Ring, RingFull, ScanReport

SIZE = 16 * ALIGN  # a ring of 16 sectors: laps are cheap to reach


class MemVolume:
    """The volume calls the ring makes, over a bytearray (no file, no fsync)."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.writes: list[tuple[int, int]] = []
        self.reads: list[tuple[int, int]] = []
        self.dirty = False

    def pread(self, n: int, off: int) -> bytes:
        assert 0 <= off and off + n <= len(self.buf), "read outside the volume"
        self.reads.append((off, n))
        return bytes(self.buf[off:off + n])

    def pwrite(self, data: bytes | memoryview, off: int) -> None:
        assert off + len(data) <= len(self.buf), "write outside the volume"
        self.buf[off:off + len(data)] = data
        self.writes.append((off, len(data)))
        self.dirty = True

    def pwritev(self, bufs: list, off: int) -> None:
        self.pwrite(b"".join(bytes(b) for b in bufs), off)

    def dontneed(self, off: int, n: int) -> None:
        pass

    def willneed(self, off: int, n: int) -> None:
        pass

    def sync(self) -> None:
        self.dirty = False

    def sync_written(self) -> bool:
        if not self.dirty:
            return False
        self.sync()
        return True


TAB = BLOCK_ENTRY.size  # one block's table entry


def encoded(raw: bytes):
    """A data entry's payload for ``raw`` (blocks stored raw, one table in front)."""
    return encode_entries(Codec("none"), memoryview(raw), max(len(raw), 1))[0]


def entry(pos: int, raw: bytes = b"", type_: int = T_DATA, file_off: int = 0,
          crc: int | None = None, stored_len: int | None = None) -> bytes:
    """The bytes of one entry as the writer lays them out (header, payload, zero pad); a
    data entry's payload is its block table and blocks."""
    if type_ == T_DATA and raw:
        enc = encoded(raw)
        payload, pcrc, nblocks = b"".join(bytes(p) for p in enc.parts), enc.table_crc, enc.nblocks
    else:
        payload, pcrc, nblocks = raw, crc32c.crc32c(raw), 0
    n = len(payload) if stored_len is None else stored_len
    h = Header(type_, 0, pos, 7, 1, file_off, 1, n, len(raw), pcrc if crc is None else crc, 0, nblocks)
    return (h.pack() + payload).ljust(entry_size(len(payload)), b"\0")


def raw_of(item) -> bytes:
    return decode_payload(item.hdr, item.payload) if item.hdr.type == T_DATA else bytes(item.payload)


def ring_with(*pieces: tuple[int, bytes], head: int = 0, tail: int = 0) -> Ring:
    """A ring whose bytes at logical position ``pos`` (any lap) are the given ones."""
    vol = MemVolume(SIZE)
    for pos, raw in pieces:
        vol.buf[pos % SIZE: pos % SIZE + len(raw)] = raw
    return Ring(vol, 0, SIZE, head, tail)


def scan(r: Ring, start: int = 0, limit: int | None = None) -> tuple[list, ScanReport]:
    rep = ScanReport()
    items = list(r.scan(start, start + SIZE if limit is None else limit, rep))
    return items, rep


def positions(items: list) -> list[int]:
    return [it.hdr.pos for it in items]


# ---------------------------------------------------------------- clean logs
def test_empty_ring():
    items, rep = scan(ring_with())
    assert items == [] and rep.end == 0 and rep.entries == 0
    assert rep.corrupt == [] and not rep.torn_tail


def test_entries_in_order_with_their_payloads():
    a, b = entry(0, b"first"), entry(512, b"x" * 600)
    c = entry(512 + len(b), b"", type_=T_TRUNC, file_off=3)
    items, rep = scan(ring_with((0, a), (512, b), (512 + len(b), c)))
    assert positions(items) == [0, 512, 1536] and rep.entries == 3
    assert [raw_of(it) for it in items] == [b"first", b"x" * 600, b""]
    assert items[2].hdr.type == T_TRUNC and items[2].hdr.file_off == 3
    assert rep.end == 2048 and rep.corrupt == [] and not rep.torn_tail


def test_entry_ending_exactly_at_the_ring_end_then_wrap():
    last = SIZE - 1024
    big = entry(last, b"y" * (1024 - HDR_SIZE - TAB))  # fills the lap to its last byte
    assert len(big) == 1024
    nxt = entry(SIZE, b"next lap")  # physical offset 0 again
    items, rep = scan(ring_with((last, big), (SIZE, nxt)), start=last)
    assert positions(items) == [last, SIZE]
    assert rep.end == SIZE + 512 and not rep.torn_tail


def test_pad_sends_the_reader_to_the_next_lap():
    pad = entry(SIZE - 1536, type_=T_PAD, file_off=1536)
    items, rep = scan(ring_with((SIZE - 1536, pad), (SIZE, entry(SIZE, b"after pad"))),
                      start=SIZE - 1536)
    assert positions(items) == [SIZE] and rep.entries == 1  # pads are not entries
    assert rep.end == SIZE + 512


def test_scan_stops_at_limit():
    r = ring_with((0, entry(0, b"a")), (512, entry(512, b"b")))
    items, rep = scan(r, limit=512)
    assert positions(items) == [0] and rep.end == 512 and not rep.torn_tail


# ---------------------------------------------------------------- the end of the log
def test_short_header_at_the_end_is_a_torn_tail():
    torn = entry(512, b"never finished")[:40]
    items, rep = scan(ring_with((0, entry(0, b"ok")), (512, torn)))
    assert positions(items) == [0] and rep.end == 512
    assert rep.torn_tail and rep.corrupt == []


def test_torn_payload_at_the_end_is_a_torn_tail():
    whole = entry(512, b"p" * 300)
    items, rep = scan(ring_with((0, entry(0, b"ok")), (512, whole[:HDR_SIZE + 100])))
    assert positions(items) == [0] and rep.end == 512 and rep.torn_tail
    assert rep.corrupt == []


def test_bad_length_at_the_end_is_a_torn_tail():
    # a valid header whose entry would run past the end of the scan
    liar = entry(SIZE - 512, b"z", stored_len=2000)
    items, rep = scan(ring_with((0, entry(0, b"ok")), (SIZE - 512, liar)), limit=SIZE)
    assert positions(items) == [0] and rep.end == SIZE - 512 and rep.torn_tail


def test_bad_length_in_the_middle_is_skipped_and_reported():
    bad = bytearray(entry(512, b"m" * 100))
    bad[44:48] = (5000).to_bytes(4, "little")  # stored_len: the header checksum now fails
    items, rep = scan(ring_with((0, entry(0, b"a")), (512, bytes(bad)), (1024, entry(1024, b"c"))))
    assert positions(items) == [0, 1024] and rep.entries == 2
    assert rep.corrupt == [(512, 512)] and not rep.torn_tail and rep.end == 1536


def test_checksum_mismatch_in_the_middle_is_reported_and_payload_withheld():
    bad = entry(512, b"good bytes", crc=crc32c.crc32c(b"other bytes"))
    items, rep = scan(ring_with((0, entry(0, b"a")), (512, bad), (1024, entry(1024, b"c"))))
    assert positions(items) == [0, 512, 1024] and rep.entries == 3
    assert items[1].payload is None  # the header is still known: the index can skip it
    assert rep.corrupt == [(512, 512)] and not rep.torn_tail and rep.end == 1536


def test_checksum_mismatch_at_the_end_is_a_torn_tail():
    bad = entry(512, b"good bytes", crc=crc32c.crc32c(b"other bytes"))
    items, rep = scan(ring_with((0, entry(0, b"a")), (512, bad)))
    assert positions(items) == [0] and rep.end == 512 and rep.torn_tail


def test_unknown_type_reads_as_no_entry():
    weird = entry(512, b"?", type_=9)
    items, rep = scan(ring_with((0, entry(0, b"a")), (512, weird), (1024, entry(1024, b"c"))))
    assert positions(items) == [0, 1024] and rep.corrupt == [(512, 512)]
    items, rep = scan(ring_with((0, entry(0, b"a")), (512, weird)))
    assert positions(items) == [0] and rep.end == 512 and rep.torn_tail


def test_garbage_region_in_the_middle_reports_the_bytes_skipped():
    junk = b"\xab" * 1536
    items, rep = scan(ring_with((0, entry(0, b"a")), (512, junk), (2048, entry(2048, b"d"))))
    assert positions(items) == [0, 2048] and rep.corrupt == [(512, 1536)] and rep.end == 2560


def test_old_lap_reads_as_a_clean_end_of_log():
    # Lap 1 wrote two entries; past them lie lap 0's entries, intact but stale.
    r = ring_with((0, entry(0, b"lap0-a")), (512, entry(512, b"lap0-b")),
                  (1024, entry(1024, b"lap0-c")))
    r.vol.buf[0:1024] = entry(SIZE, b"lap1-a") + entry(SIZE + 512, b"lap1-b")
    items, rep = scan(r, start=SIZE)
    assert positions(items) == [SIZE, SIZE + 512] and rep.end == SIZE + 1024
    assert not rep.torn_tail and rep.corrupt == []


def test_entry_of_a_later_lap_is_not_this_lap():
    r = ring_with((SIZE + 512, entry(SIZE + 512, b"future")))
    items, rep = scan(r, start=0)
    assert items == [] and rep.end == 0 and not rep.torn_tail


# ---------------------------------------------------------------- writer and read_entry
def put(r: Ring, file_off: int, raw: bytes) -> tuple[int, int]:
    pos, esize, _ = r.append_data(0, 7, 1, 1, file_off, encoded(raw))
    return pos, esize


def test_append_pads_at_the_lap_end_and_reads_back():
    r = Ring(MemVolume(SIZE), 0, SIZE, head=SIZE - 1024, tail=SIZE - 1024)
    p1, s1 = put(r, 0, b"hello")
    assert (p1, s1) == (SIZE - 1024, 512)
    p2, s2 = put(r, 5, b"w" * 700)  # 1024 bytes: not in the 512 left
    assert p2 == SIZE and s2 == 1024 and r.head == SIZE + 1024
    assert decode_payload(*r.read_entry(p2, s2)) == b"w" * 700  # still in the write buffer
    r.flush()
    assert decode_payload(*r.read_entry(p1, s1)) == b"hello"
    assert decode_payload(*r.read_entry(p2, s2)) == b"w" * 700  # from the volume
    items, rep = scan(r, start=SIZE - 1024, limit=r.head)
    assert positions(items) == [p1, p2] and rep.end == r.head


def test_read_entry_refuses_what_is_not_there():
    r = Ring(MemVolume(SIZE), 0, SIZE, 0, 0)
    pos, esize = put(r, 0, b"abc")
    put(r, 3, b"def")
    r.flush()
    assert (pos, esize, r.head) == (0, 512, 1024)
    with pytest.raises(Corrupt, match="outside the live ring"):
        r.read_entry(pos + SIZE, esize)
    with pytest.raises(Corrupt, match="has size 512, index says 1024"):
        r.read_entry(pos, 1024)
    r.vol.buf[HDR_SIZE + TAB] ^= 1  # first payload byte after the table
    with pytest.raises(Corrupt, match="checksum"):
        r.read_entry(pos, esize)
    r.vol.buf[HDR_SIZE + TAB] ^= 1
    r.vol.buf[HDR_SIZE] ^= 1  # the table itself
    with pytest.raises(Corrupt, match="checksum"):
        r.read_entry(pos, esize)
    r.head = 2 * SIZE  # pretend a lap passed: the same place now holds a stale entry
    with pytest.raises(Corrupt, match="bad entry header"):
        r.read_entry(SIZE, esize)


def test_the_head_never_passes_the_durable_tail():
    r = Ring(MemVolume(SIZE), 0, SIZE, 0, 0)
    for _ in range(16):
        put(r, 0, b"x")
    assert r.room() == 0
    with pytest.raises(RingFull):
        put(r, 0, b"x")


def test_sync_skips_the_fsync_when_nothing_was_written():
    r = Ring(MemVolume(SIZE), 0, SIZE, 0, 0)
    synced = []
    r.vol.sync = lambda: (synced.append(1), setattr(r.vol, "dirty", False))
    put(r, 0, b"x")
    r.sync()
    r.sync()
    assert synced == [1]
    put(r, 1, b"y")
    r.sync()
    assert synced == [1, 1]


def test_writes_end_on_a_page_with_zeros_only_over_free_space():
    """A write that ends mid-page carries zeros to the page's end (the kernel then need not
    read the page first), but never over the space of an entry the durable tail keeps."""
    big = 128 * PAGE
    r = Ring(MemVolume(big), 0, big, 0, 0)
    r.vol.buf[:] = b"\xee" * big  # an older lap's bytes
    put(r, 0, b"a" * 100)  # 512 bytes, buffered
    r.flush()
    assert r.vol.writes == [(0, PAGE)] and r.vol.buf[512:PAGE] == bytes(PAGE - 512)
    pos, esize, _ = r.append_data(0, 7, 1, 1, 100, encoded(b"b" * (DIRECT_WRITE + 1000)))
    assert r.vol.writes[-1] == (pos, -(-(pos + esize) // PAGE) * PAGE - pos)  # written directly
    assert decode_payload(*r.read_entry(pos, esize)) == b"b" * (DIRECT_WRITE + 1000)
    # One lap on, with the tail kept at a live entry just past the head's page end: the
    # zeros stop where that entry's space begins.
    big = 4 * PAGE
    r = Ring(MemVolume(big), 0, big, big + 512, PAGE + 512)
    r.vol.buf[:] = b"\xee" * big
    assert r.room() == PAGE
    put(r, 0, b"c" * 100)
    r.flush()
    assert r.vol.writes == [(512, PAGE - 512)]  # to the page's end: free
    r = Ring(MemVolume(big), 0, big, big + 512, 1024)
    r.vol.buf[:] = b"\xee" * big
    assert r.room() == 512
    put(r, 0, b"c" * 100)
    r.flush()
    assert r.vol.writes == [(512, 512)] and r.vol.buf[1024:] == b"\xee" * (big - 1024)


# ---------------------------------------------------------------- blocks inside data entries
BIG = 64 * BLOCK  # a ring where entries of several blocks fit


def block_ring(raw: bytes, head: int = 0) -> tuple[Ring, int, int]:
    """A ring holding one data entry of ``raw`` at ``head``, on the volume."""
    r = Ring(MemVolume(BIG), 0, BIG, head, head)
    pos, esize = put(r, 0, raw)
    r.flush()
    r.vol.reads.clear()
    return r, pos, esize


def pattern(n: int) -> bytes:
    return bytes(i * 7 % 251 for i in range(n))


def read(r: Ring, pos: int, esize: int, a: int, b: int, known=None) -> tuple[bytes, tuple]:
    pieces, decoded, known = r.read_data(pos, esize, a, b, None, known, esize)
    return b"".join(bytes(p) for p in pieces), known


def test_range_read_reads_and_decodes_only_its_blocks():
    raw = pattern(10 * BLOCK + 123)
    r, pos, esize = block_ring(raw)
    got, known = read(r, pos, esize, 100, 200)
    assert got == raw[100:200]
    assert len(r.vol.reads) == 1 and r.vol.reads[0][1] <= HDR_SIZE + 11 * TAB + BLOCK + 4096
    r.vol.reads.clear()
    a, b = 7 * BLOCK - 10, 8 * BLOCK + 10  # far into the entry: table first, then 3 blocks
    got, _ = read(r, pos, esize, a, b)
    assert got == raw[a:b]
    assert len(r.vol.reads) == 2 and r.vol.reads[1][1] == 3 * BLOCK
    r.vol.reads.clear()
    got, _ = read(r, pos, esize, a, b, known)  # table known: one read of the blocks only
    assert got == raw[a:b] and r.vol.reads == [(pos + HDR_SIZE + 11 * TAB + 6 * BLOCK, 3 * BLOCK)]
    for a, b in ((0, len(raw)), (10 * BLOCK, len(raw)), (BLOCK - 1, BLOCK + 1), (5, 6)):
        assert read(r, pos, esize, a, b)[0] == raw[a:b]
    with pytest.raises(Corrupt, match="holds"):
        read(r, pos, esize, 0, len(raw) + 1)  # the index asks for more than the entry holds


def test_bit_flip_in_one_block_fails_only_that_block():
    raw = pattern(4 * BLOCK)
    r, pos, esize = block_ring(raw)
    blk2 = pos + HDR_SIZE + 4 * TAB + 2 * BLOCK
    r.vol.buf[blk2 + 1000] ^= 0x10
    with pytest.raises(Corrupt, match="block 2 checksum"):
        read(r, pos, esize, 2 * BLOCK + 5, 2 * BLOCK + 6)
    with pytest.raises(Corrupt, match="block 2 checksum"):
        read(r, pos, esize, 0, len(raw))
    for a, b in ((0, 2 * BLOCK), (3 * BLOCK, 4 * BLOCK), (BLOCK, 2 * BLOCK)):
        assert read(r, pos, esize, a, b)[0] == raw[a:b]
    with pytest.raises(Corrupt):
        r.read_entry(pos, esize)  # the whole entry does not check out
    # Mid-log, the scan reports the entry as corrupt (header still known); at the end of
    # the log it is a torn tail.
    items, rep = scan(r, start=pos, limit=r.head)
    assert items == [] and rep.torn_tail
    put(r, len(raw), b"after")
    r.flush()
    items, rep = scan(r, start=pos, limit=r.head)
    assert positions(items) == [pos, pos + esize] and items[0].payload is None
    assert rep.corrupt == [(pos, esize)]


def test_torn_tail_inside_the_block_table():
    raw = pattern(6 * BLOCK)
    enc = encoded(raw)
    whole = entry(512, raw)
    for cut in (HDR_SIZE + 1, HDR_SIZE + TAB - 1, HDR_SIZE + 3 * TAB + 7, HDR_SIZE + 6 * TAB):
        r = Ring(MemVolume(BIG), 0, BIG, 0, 0)
        r.vol.buf[0:512] = entry(0, b"ok")
        r.vol.buf[512:512 + cut] = whole[:cut]
        items, rep = scan(r, limit=BIG)
        assert positions(items) == [0] and rep.end == 512 and rep.torn_tail, cut
    # A table that checks out but disagrees with the header is refused on read.
    r = Ring(MemVolume(BIG), 0, BIG, 0, 0)
    bad = bytearray(enc.parts[0])
    bad[4:8] = (BLOCK - 1).to_bytes(4, "little")  # block 0's raw length
    h = Header(T_DATA, 0, 0, 7, 1, 0, 1, enc.stored_len, len(raw), crc32c.crc32c(bad), 0, 6)
    r.vol.buf[0:HDR_SIZE + enc.stored_len] = h.pack() + bytes(bad) + b"".join(enc.parts[1:])
    r.head = entry_size(enc.stored_len)
    with pytest.raises(Corrupt, match="disagrees"):
        read(r, 0, r.head, 0, 10)
    for n in (0, 10**6):  # a block count the entry cannot hold
        h = Header(T_DATA, 0, 0, 7, 1, 0, 1, enc.stored_len, len(raw), enc.table_crc, 0, n)
        r.vol.buf[0:HDR_SIZE] = h.pack()
        with pytest.raises(Corrupt, match="block count"):
            read(r, 0, r.head, 0, 10)


def test_stale_lap_is_never_read_as_this_entry():
    raw = pattern(3 * BLOCK)
    r, pos, esize = block_ring(raw, head=BIG - 4 * BLOCK)
    _, known = read(r, pos, esize, 0, 10)
    # A lap later the same bytes sit at pos + BIG: the header names pos, not pos + BIG.
    r.head, r.tail = pos + BIG + esize, pos + BIG
    with pytest.raises(Corrupt, match="bad entry header"):
        read(r, pos + BIG, esize, 0, 10)
    # A newer entry written over the old one's blocks fails the old (cached) table's checks.
    first = r.phys(pos) + HDR_SIZE + 3 * TAB
    r.vol.buf[first:first + 3 * BLOCK] = pattern(3 * BLOCK)[::-1]
    assert len(r.vol.buf) == BIG
    with pytest.raises(Corrupt, match="checksum"):
        read(r, pos, esize, 0, 10, known)

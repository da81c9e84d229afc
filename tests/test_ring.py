"""The ring's reader, LevelDB log_test style: hand-made buffers, exact assertions on what a
scan reports (entries, bytes skipped, torn tail) and on what ``read_entry`` refuses."""

from __future__ import annotations

import crc32c
import pytest

from kvfs.engine.errors import Corrupt
from kvfs.engine.format import ALIGN, HDR_SIZE, T_DATA, T_PAD, T_TRUNC, Header, entry_size
from kvfs.engine.ring import Ring, RingFull, ScanReport

SIZE = 16 * ALIGN  # a ring of 16 sectors: laps are cheap to reach


class MemVolume:
    """The volume calls the ring makes, over a bytearray (no file, no fsync)."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.writes: list[tuple[int, int]] = []

    def pread(self, n: int, off: int) -> bytes:
        assert 0 <= off and off + n <= len(self.buf), "read outside the volume"
        return bytes(self.buf[off:off + n])

    def pwrite(self, data: bytes | memoryview, off: int) -> None:
        assert off + len(data) <= len(self.buf), "write outside the volume"
        self.buf[off:off + len(data)] = data
        self.writes.append((off, len(data)))

    def pwritev(self, bufs: list, off: int) -> None:
        self.pwrite(b"".join(bytes(b) for b in bufs), off)

    def dontneed(self, off: int, n: int) -> None:
        pass

    def willneed(self, off: int, n: int) -> None:
        pass

    def sync(self) -> None:
        pass


def entry(pos: int, payload: bytes = b"", type_: int = T_DATA, file_off: int = 0,
          crc: int | None = None, stored_len: int | None = None) -> bytes:
    """The bytes of one entry as the writer lays them out (header, payload, zero pad)."""
    n = len(payload) if stored_len is None else stored_len
    h = Header(type_, 0, pos, 7, 1, file_off, 1, n, len(payload),
               crc32c.crc32c(payload) if crc is None else crc, 0)
    return (h.pack() + payload).ljust(entry_size(len(payload)), b"\0")


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
    assert [bytes(it.payload) for it in items] == [b"first", b"x" * 600, b""]
    assert items[2].hdr.type == T_TRUNC and items[2].hdr.file_off == 3
    assert rep.end == 2048 and rep.corrupt == [] and not rep.torn_tail


def test_entry_ending_exactly_at_the_ring_end_then_wrap():
    last = SIZE - 1024
    big = entry(last, b"y" * (1024 - HDR_SIZE))  # fills the lap to its last byte
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
def test_append_pads_at_the_lap_end_and_reads_back():
    r = Ring(MemVolume(SIZE), 0, SIZE, head=SIZE - 1024, tail=SIZE - 1024)
    p1, s1 = r.append(T_DATA, 0, 7, 1, 1, 0, 5, b"hello")
    assert (p1, s1) == (SIZE - 1024, 512)
    p2, s2 = r.append(T_DATA, 0, 7, 1, 1, 5, 700, b"w" * 700)  # 1024 bytes: not in 512 left
    assert p2 == SIZE and s2 == 1024 and r.head == SIZE + 1024
    assert bytes(r.read_entry(p2, s2)[1]) == b"w" * 700  # still in the write buffer
    r.flush()
    assert bytes(r.read_entry(p1, s1)[1]) == b"hello"
    assert bytes(r.read_entry(p2, s2)[1]) == b"w" * 700  # from the volume
    items, rep = scan(r, start=SIZE - 1024, limit=r.head)
    assert positions(items) == [p1, p2] and rep.end == r.head


def test_read_entry_refuses_what_is_not_there():
    r = Ring(MemVolume(SIZE), 0, SIZE, 0, 0)
    pos, esize = r.append(T_DATA, 0, 7, 1, 1, 0, 3, b"abc")
    r.append(T_DATA, 0, 7, 1, 1, 3, 3, b"def")
    r.flush()
    assert (pos, esize, r.head) == (0, 512, 1024)
    with pytest.raises(Corrupt, match="outside the live ring"):
        r.read_entry(pos + SIZE, esize)
    with pytest.raises(Corrupt, match="has size 512, index says 1024"):
        r.read_entry(pos, 1024)
    r.vol.buf[HDR_SIZE] ^= 1  # first payload byte
    with pytest.raises(Corrupt, match="checksum"):
        r.read_entry(pos, esize)
    r.head = 2 * SIZE  # pretend a lap passed: the same place now holds a stale entry
    with pytest.raises(Corrupt, match="bad entry header"):
        r.read_entry(SIZE, esize)


def test_the_head_never_passes_the_durable_tail():
    r = Ring(MemVolume(SIZE), 0, SIZE, 0, 0)
    for _ in range(16):
        r.append(T_DATA, 0, 7, 1, 1, 0, 1, b"x")
    assert r.room() == 0
    with pytest.raises(RingFull):
        r.append(T_DATA, 0, 7, 1, 1, 0, 1, b"x")

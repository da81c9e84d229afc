"""Reads of a volume from outside the mount (kvfs.engine.direct, published.py): extents
from the store, the entries read and checked by a ``DirectReader`` over a read-only
descriptor, never a wrong byte -- while the ring laps, files are cut and sessions dropped,
and when the volume's bytes are damaged."""

from __future__ import annotations

import mmap
import os
import random
import threading

import numpy as np
import pytest

from kvfs.engine.direct import DirectReader, FileExtents, Stale
from kvfs.engine.errors import Corrupt
from kvfs.engine.published import PublishedView
from kvfs.engine.store import Store
from kvfs.engine.types import StoreConfig

MB = 1 << 20


def kv(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).standard_normal(n // 2).astype(np.float16).tobytes()


def bf16(n: int, seed: int = 0) -> bytes:
    x = np.random.default_rng(seed).standard_normal(n // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype("<u2").tobytes()


class Reader:
    """A reader in "another process": its own read-only descriptor and mapping."""

    def __init__(self, store: Store) -> None:
        pub = store.publish()
        rfd = pub.reader_fd()
        self.view = PublishedView(rfd)
        os.close(rfd)
        self.r = DirectReader(store.vol.path, self.view)
        self.store = store

    def extents(self, sid: str, name: str) -> FileExtents:
        (_, (fe,)) = self.store.extents(sid, [(name, 0, -1)])
        assert fe is not None
        return fe

    def read(self, fe: FileExtents, off: int, n: int) -> bytes:
        out = bytearray(n)
        self.r.read([(fe, off, memoryview(out))])
        return bytes(out)

    def fresh(self, sid: str, name: str, off: int, n: int, tries: int = 50) -> bytes:
        for _ in range(tries):
            try:
                return self.read(self.extents(sid, name), off, n)
            except Stale:
                continue
        raise AssertionError("stale every time")

    def close(self) -> None:
        self.r.close()
        self.view.close()


@pytest.fixture
def vol(tmp_path):
    return str(tmp_path / "v.kvvol")


def test_reads_of_every_shape_equal_the_store(vol):
    s = Store.create(vol, 64 * MB)
    s.create_session("a")
    want: dict[str, bytes] = {}
    for name, step in (("rounds", 96 << 10), ("big", 1 << 20), ("small", 700), ("odd", 33333)):
        s.create_file("a", name)
        data = kv(1_500_000, len(want))
        for off in range(0, len(data), step):
            s.append("a", name, off, data[off:off + step])
        want[name] = data
    s.truncate("a", "big", 1_234_567)  # an entry cut in its middle
    want["big"] = want["big"][:1_234_567]
    rd = Reader(s)
    rng = random.Random(3)
    for name, data in want.items():
        fe = rd.extents("a", name)
        assert rd.read(fe, 0, len(data)) == data
        for _ in range(60):
            off = rng.randrange(len(data))
            n = rng.randrange(1, min(300_000, len(data) - off) + 1)
            assert rd.read(fe, off, n) == data[off:off + n] == s.read("a", name, off, n)
    # several files, one call: one plan, merged reads
    outs = {n: bytearray(len(d)) for n, d in want.items()}
    rd.r.read([(rd.extents("a", n), 0, memoryview(outs[n])) for n in want])
    assert all(outs[n] == want[n] for n in want)
    with pytest.raises(ValueError):
        rd.read(rd.extents("a", "small"), len(want["small"]) - 10, 20)  # past the end
    rd.close()
    s.close()


def test_compressed_blocks_are_decoded(vol):
    """Entries compressed at append (or when copied forward) do not match the guessed raw
    layout: the table is read, then the blocks, and decoded."""
    s = Store.create(vol, 32 * MB, StoreConfig(compress_on_copy=False))
    s.create_session("a")
    s.create_file("a", "layer_0")
    data = bf16(2_000_000, 5)
    for off in range(0, len(data), 300_000):
        s.append("a", "layer_0", off, data[off:off + 300_000])
    assert s.file_stat("a", "layer_0").stored < len(data) / 1.3
    rd = Reader(s)
    fe = rd.extents("a", "layer_0")
    assert rd.read(fe, 0, len(data)) == data
    assert rd.r.stats["guess_missed"] > 0
    rng = random.Random(1)
    for _ in range(40):
        off = rng.randrange(len(data))
        n = rng.randrange(1, min(100_000, len(data) - off) + 1)
        assert rd.read(fe, off, n) == data[off:off + n]
    rd.close()
    s.close()


def test_cuts_make_old_extents_stale(vol):
    s = Store.create(vol, 32 * MB)
    s.create_session("a")
    s.create_file("a", "f")
    s.create_file("a", "g")
    one, two = kv(200_000, 1), kv(200_000, 2)
    s.append("a", "f", 0, one)
    s.append("a", "g", 0, one)
    rd = Reader(s)
    fe = rd.extents("a", "f")
    assert rd.read(fe, 0, 1000) == one[:1000]
    s.truncate("a", "f", 0)  # an agent retrying a turn: new bytes at the same offsets
    s.append("a", "f", 0, two)
    with pytest.raises(Stale):
        rd.read(fe, 0, 1000)
    assert rd.fresh("a", "f", 0, 1000) == two[:1000]
    fg = rd.extents("a", "g")
    s.delete_file("a", "g")
    with pytest.raises(Stale):
        rd.read(fg, 0, 10)
    fe = rd.extents("a", "f")
    s.delete_session("a")
    s.create_session("a")  # the same name, another session number
    s.create_file("a", "f")
    s.append("a", "f", 0, one)
    with pytest.raises(Stale):
        rd.read(fe, 0, 10)
    assert rd.fresh("a", "f", 0, 100) == one[:100]
    rd.close()
    s.close()


def test_lapping_ring_never_returns_old_bytes(vol):
    """Extents kept while the ring laps: reclaim copies the entries forward, then the head
    writes over their old space; a read of the old space is Stale, never other bytes."""
    s = Store.create(vol, 8 * MB)
    s.create_session("keep")
    s.create_file("keep", "layer_0")
    data = kv(300_000, 9)
    s.append("keep", "layer_0", 0, data)
    rd = Reader(s)
    fe = rd.extents("keep", "layer_0")
    s.create_session("churn")
    s.create_file("churn", "f")
    size = k = stale = 0
    while s.ring.head < 4 * s.ring.size:
        if size > s.ring.size // 4:
            s.truncate("churn", "f", 0)
            size = 0
        s.append("churn", "f", size, kv(128 << 10, k))
        size += 128 << 10
        k += 1
        try:
            assert rd.read(fe, 0, len(data)) == data
        except Stale:
            stale += 1
            fe = rd.extents("keep", "layer_0")
    assert stale and s.counters["copied_forward"]
    assert rd.fresh("keep", "layer_0", 0, len(data)) == data
    rd.close()
    s.close()


def test_reads_racing_writes_truncates_and_laps_return_right_bytes_only(vol):
    """A reader thread keeps extents as long as they hold while a writer laps the ring,
    truncates and deletes: every read returns the file's bytes as they were when its
    extents were fetched (never a byte of another lap, file or incarnation), or Stale."""
    s = Store.create(vol, 8 * MB)
    rd = Reader(s)
    names = [f"s{i}" for i in range(4)]
    content: dict[str, bytes] = {}  # what each session's file holds, by generation
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[str] = []
    for n in names:
        s.create_session(n)
        s.create_file(n, "f")
        content[n] = b""

    def chunk(n: str, gen: int, k: int) -> bytes:  # distinct per session/generation/chunk
        return (f"{n}:{gen}:{k}:".encode() * 4000)[:40_000]

    def reader() -> None:
        rng = random.Random(7)
        reads = 0
        while not stop.is_set():
            n = rng.choice(names)
            try:
                with lock:
                    (_, (fe,)) = s.extents(n, [("f", 0, -1)])
                    snap = content[n]
                if fe is None or fe.size == 0:
                    continue
                for _ in range(5):  # the same extents, read again as the ring moves on
                    off = rng.randrange(fe.size)
                    ln = min(rng.randrange(1, 90_000), fe.size - off)
                    got = rd.read(fe, off, ln)
                    reads += 1
                    if got != snap[off:off + ln]:
                        errors.append(f"{n} [{off}, +{ln}): wrong bytes")
                        return
            except Stale:
                continue
            except Exception as e:  # noqa: BLE001 - reported by the test
                if "no session" in str(e):
                    continue
                errors.append(repr(e))
                return
        assert reads

    t = threading.Thread(target=reader)
    t.start()
    try:
        rng = random.Random(1)
        gen = dict.fromkeys(names, 0)
        k = 0
        while s.ring.head < 5 * s.ring.size and not errors:
            n = rng.choice(names)
            r = rng.random()
            with lock:
                if r < 0.08 and content[n]:
                    cut = rng.randrange(len(content[n]))
                    s.truncate(n, "f", cut)
                    content[n] = content[n][:cut]
                elif r < 0.12:
                    s.delete_session(n)
                    s.create_session(n)
                    s.create_file(n, "f")
                    gen[n] += 1
                    content[n] = b""
                elif len(content[n]) > s.ring.size // 6:
                    s.truncate(n, "f", 0)
                    content[n] = b""
                else:
                    c = chunk(n, gen[n], k)
                    s.append(n, "f", len(content[n]), c)
                    content[n] += c
                    k += 1
    finally:
        stop.set()
        t.join()
    assert not errors, errors[:3]
    rd.close()
    s.close()


def test_damaged_bytes_are_corrupt_never_returned(vol):
    s = Store.create(vol, 16 * MB)
    s.create_session("a")
    s.create_file("a", "f")
    data = kv(96 << 10, 4)
    s.append("a", "f", 0, data)
    s.sync()
    rd = Reader(s)
    fe = rd.extents("a", "f")
    pos = fe.ext[0][0]
    phys = s.ring.phys(pos)
    for where in (10, 72 + 5, 72 + 48 + 40_000):  # header, table, a block
        fd = os.open(vol, os.O_RDWR)
        try:
            b = os.pread(fd, 1, phys + where)
            os.pwrite(fd, bytes([b[0] ^ 0x10]), phys + where)
            rd.r.forget_tables()
            with pytest.raises(Corrupt):
                rd.read(fe, 0, len(data))
            os.pwrite(fd, b, phys + where)
        finally:
            os.close(fd)
    assert rd.read(fe, 0, len(data)) == data
    # extents naming another file's entry (a forged answer) are refused
    forged = FileExtents(fe.sno, fe.fno + 1, fe.size, fe.cuts, fe.lo, fe.hi, fe.off, fe.ext)
    rd.r.forget_tables()
    with pytest.raises(Corrupt):
        rd.read(forged, 0, 100)
    rd.close()
    s.close()


def test_published_block_cannot_be_written_by_readers(vol):
    s = Store.create(vol, 16 * MB)
    pub = s.publish()
    rfd = pub.reader_fd()
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(rfd, 4096)  # read-only descriptor: no writable mapping
        wfd = os.open(f"/proc/self/fd/{rfd}", os.O_RDWR)  # reopened for writing: sealed
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(wfd, 4096)
            with pytest.raises(PermissionError):
                os.pwrite(wfd, b"x", 40)
        finally:
            os.close(wfd)
        view = PublishedView(rfd)
        assert view.tail() == s.ring.durable_tail and view.ring_size == s.ring.size
        view.close()
    finally:
        os.close(rfd)
    s.close()

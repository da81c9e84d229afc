"""Tearing, truncating and flipping bits in a volume: right bytes or a clear error, always."""

from __future__ import annotations

import os
import random

import pytest

from kvfs.engine.errors import Corrupt, NotFound
from kvfs.engine.faults import FaultyVolume, PowerCut
from kvfs.engine.format import BLOCK, BLOCK_ENTRY, HDR_SIZE, SB_SLOT
from kvfs.engine.ring import ScanReport
from kvfs.engine.store import Store
from kvfs.engine.types import StoreConfig

MB = 1 << 20


def snapshot(store: Store) -> dict[str, dict[str, bytes]]:
    return {n: {f: store.read(n, f, 0, 10**9) for f in store.list_files(n)}
            for n in store.list_sessions()}


def _torn_last_entry(tmp_path, size: int, cuts, vol_size: int = 4 * MB) -> None:  # noqa: ANN001
    path = str(tmp_path / "v.kvvol")
    s = Store.create(path, vol_size, StoreConfig(compression="none"), volume=FaultyVolume)
    s.create_session("s")
    s.create_file("s", "layer_0")
    s.append("s", "layer_0", 0, b"a" * 3000)
    s.sync()
    before = snapshot(s)
    payload = os.urandom(size)
    s.append("s", "layer_0", 3000, payload)
    s.flush()
    vol = s.vol
    assert isinstance(vol, FaultyVolume) and vol.unsynced_writes() == 1
    off, pre, data = vol.journal[0]
    s.crash()
    nblocks = -(-size // BLOCK)
    complete = HDR_SIZE + nblocks * BLOCK_ENTRY.size + len(payload)
    fd = os.open(path, os.O_RDWR)
    try:
        for cut in cuts(len(data), nblocks):
            os.pwrite(fd, pre, off)
            os.pwrite(fd, data[:cut], off)
            r = Store.open(path, readonly=True)
            try:
                got = snapshot(r)
                # what the disk holds: the cut write over what was there (zeros, on a fresh
                # volume); when the payload ends in such bytes, a cut among them tears nothing
                if cut >= complete or data[cut:complete] == pre[cut:complete]:
                    assert got["s"]["layer_0"] == b"a" * 3000 + payload, cut
                else:
                    assert got == before, cut
                    assert r.open_report.end == r.ring.head
            finally:
                r.crash()
        # A writable open after a torn tail writes over the torn bytes and carries on.
        os.pwrite(fd, pre, off)
        os.pwrite(fd, data[:500], off)
    finally:
        os.close(fd)
    s = Store.open(path)
    s.append("s", "layer_0", 3000, b"b" * 10)
    s.sync()
    s.crash()
    s = Store.open(path)
    assert s.read("s", "layer_0", 0, 10**9) == b"a" * 3000 + b"b" * 10
    s.close()


def test_torn_last_entry_at_every_byte(tmp_path):
    _torn_last_entry(tmp_path, 1000, lambda n, _: range(n + 1))


def test_torn_entry_of_several_blocks(tmp_path):
    """Cut inside the header, inside the block table, and inside each block: never the
    torn entry's bytes, never a read error; the whole entry once it is all there."""
    def cuts(n: int, nblocks: int) -> list[int]:
        table_end = HDR_SIZE + nblocks * BLOCK_ENTRY.size
        return sorted({*range(table_end + 2), *range(table_end, n + 1, 997), n - 1, n})

    _torn_last_entry(tmp_path, 3 * BLOCK + 777, cuts, 32 * MB)  # one entry of 4 blocks


def test_failpoint_before_superblock_write(tmp_path):
    path = str(tmp_path / "v.kvvol")
    s = Store.create(path, 8 * MB, volume=FaultyVolume)
    s.create_session("s")
    s.create_file("s", "f")
    s.append("s", "f", 0, b"x" * 10_000)
    s.vol.fail_before_superblock = True
    with pytest.raises(PowerCut):
        s.checkpoint()  # the ring was synced; the superblock never written
    s.vol.power_cut(0)
    s = Store.open(path)
    assert s.read("s", "f", 0, 10**9) == b"x" * 10_000
    s.close()


def test_failpoint_mid_write_drops_only_unsynced(tmp_path):
    path = str(tmp_path / "v.kvvol")
    s = Store.create(path, 8 * MB, StoreConfig(write_buffer=8192), volume=FaultyVolume)
    s.create_session("s")
    s.create_file("s", "f")
    s.append("s", "f", 0, b"k" * 5000)
    s.sync()
    s.vol.fail_after_writes = 2
    with pytest.raises(PowerCut):
        for i in range(100):
            s.append("s", "f", 5000 + i * 3000, os.urandom(3000))
    s.vol.power_cut(keep=1, tear=100)
    s = Store.open(path)
    got = s.read("s", "f", 0, 10**9)
    assert got.startswith(b"k" * 5000) and len(got) % 1000 == 0
    s.close()


def build_volume(path: str, crash: bool) -> dict[str, dict[str, bytes]]:
    rng = random.Random(1)
    s = Store.create(path, 8 * MB, StoreConfig(write_buffer=32 << 10))
    for i in range(6):
        n = f"sess-{i}"
        s.create_session(n)
        for layer in range(3):
            f = f"layer_{layer}"
            s.create_file(n, f)
            size = 0
            for _ in range(4):
                chunk = bytes(rng.getrandbits(8) for _ in range(2000)) * rng.randint(1, 20)
                s.append(n, f, size, chunk)
                size += len(chunk)
            if layer == 1:  # retry a turn: truncate, then append again
                s.truncate(n, f, size // 2)
                s.append(n, f, size // 2, b"retry" * 100)
        if i == 2:
            s.checkpoint()  # later sessions live only in the ring: replay paths get flipped too
    want = snapshot(s)
    if crash:
        s.sync()
        s.crash()
    else:
        s.close()
    return want


@pytest.mark.parametrize("crash", [False, True], ids=["after-close", "after-crash"])
def test_bit_flips_never_return_wrong_bytes(tmp_path, crash):
    path = str(tmp_path / "v.kvvol")
    want = build_volume(path, crash)
    r = Store.open(path, readonly=True)
    ring_off, used_end = r.sb.ring_offset, r.ring.phys(r.ring.head)
    tree_end = r.sb.tree_offset + r.tree.stats()["pages_used"] * 4096 + 4096
    r.crash()
    regions = [(0, 2 * SB_SLOT), (2 * SB_SLOT, tree_end), (ring_off, used_end)]
    rng = random.Random(7)
    outcomes = {"exact": 0, "eio": 0, "missing": 0, "short": 0}
    fd = os.open(path, os.O_RDWR)
    try:
        for _ in range(250):
            a, b = rng.choices(regions, weights=[1, 2, 12])[0]
            off = rng.randrange(a, b)
            bit = 1 << rng.randrange(8)
            orig = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([orig[0] ^ bit]), off)
            try:
                s = Store.open(path, readonly=True)  # never refuses on a single flip
                try:
                    for n, files in want.items():
                        for f, data in files.items():
                            try:
                                got = s.read(n, f, 0, 10**9)
                            except Corrupt:
                                outcomes["eio"] += 1
                                continue
                            except NotFound:
                                outcomes["missing"] += 1
                                continue
                            assert got == data[: len(got)], f"wrong bytes after flip at {off}"
                            outcomes["exact" if got == data else "short"] += 1
                finally:
                    s.crash()
            finally:
                os.pwrite(fd, orig, off)
    finally:
        os.close(fd)
    assert outcomes["exact"] > 0 and outcomes["eio"] > 0


def test_no_read_returns_an_old_lap(tmp_path):
    path = str(tmp_path / "v.kvvol")
    s = Store.create(path, 8 * MB, StoreConfig(compression="none"))
    s.create_session("old")
    s.create_file("old", "f")
    s.append("old", "f", 0, b"OLD!" * 50_000)
    _, f = s._file("old", "f")
    old_pos, old_esize = f.ext[0][0], f.ext[0][3]
    s.delete_session("old")
    s.create_session("new")
    s.create_file("new", "f")
    lap = s.ring.size
    while s.ring.head < old_pos + 2 * lap:  # the old entry's space is written over
        size = s.file_stat("new", "f").size
        if size > lap // 4:
            s.truncate("new", "f", 0)
            size = 0
        s.append("new", "f", size, b"NEW!" * 25_000)
    with pytest.raises(Corrupt):
        s.ring.read_entry(old_pos, old_esize)  # outside the live ring
    s.ring.tail, saved = 0, s.ring.tail  # defeat the range check: the header check must hold
    try:
        with pytest.raises(Corrupt):
            s.ring.read_entry(old_pos, old_esize)
        with pytest.raises(Corrupt):
            s.ring.read_entry(old_pos + lap, old_esize)
    finally:
        s.ring.tail = saved
    s.sync()
    rep = ScanReport()
    assert list(s.ring.scan(s.ring.head, s.ring.tail + lap, rep)) == []  # old laps end the log
    s.close()


def test_bad_tree_page_found_at_run_time_rebuilds_from_the_ring(tmp_path):
    """Recovery reads tree pages lazily: a page found bad later must not make intact
    sessions unreadable. The index is rebuilt from the ring and a fresh checkpoint written."""
    import shutil

    src = str(tmp_path / "src.kvvol")
    s = Store.create(src, 8 * MB, StoreConfig(hot_sessions=4))
    want = {}
    for i in range(80):  # enough for a tree of several leaves
        n = f"session-{i:03d}"
        s.create_session(n)
        s.create_file(n, "layer_0")
        want[n] = bytes([i]) * (500 + i)
        s.append(n, "layer_0", 0, want[n])
    s.close()
    r = Store.open(src, readonly=True)
    root, base = r.tree.root, r.sb.tree_offset + r.tree.root.half * (r.sb.tree_pages // 2) * 4096
    r.crash()
    assert root.height >= 2
    runtime_rebuilds = 0
    for page in range(root.alloc):
        if page == root.root:
            continue
        path = str(tmp_path / f"p{page}.kvvol")
        shutil.copyfile(src, path)
        fd = os.open(path, os.O_RDWR)
        os.pwrite(fd, b"\xa5" * 8, base + page * 4096 + 200)
        os.close(fd)
        s = Store.open(path, StoreConfig(hot_sessions=4))
        at_open = s.counters["full_scans"]
        assert s.list_sessions() == sorted(want)
        for n, data in want.items():
            assert s.read(n, "layer_0", 0, 10**6) == data
        runtime_rebuilds += s.counters["full_scans"] - at_open
        s.close()
        s = Store.open(path)  # the fresh checkpoint is good
        assert s.counters["full_scans"] == 0
        assert s.read("session-042", "layer_0", 0, 10**6) == want["session-042"]
        s.close()
    assert runtime_rebuilds > 0

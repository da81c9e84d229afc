"""The request path's caching through the kernel: the page cache mode (``--page-cache``:
keep_cache across opens, coherent after truncate, dropped at unlink), the request sizes
the kernel sends, and fsync's device flush skipped when nothing changed."""

from __future__ import annotations

import errno
import json
import mmap
import os
import time
from pathlib import Path

import pytest
from conftest import Mount

MiB = 1 << 20


def fs_stats(m: Mount) -> dict:
    return json.loads((m.root / ".kvfs" / "stats").read_bytes())["fs"]


def read_aligned(path: Path) -> bytes:
    """The whole file in 1 MiB reads into a page-aligned buffer (as cat and dd do)."""
    buf = mmap.mmap(-1, MiB)
    out = bytearray()
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := os.readv(fd, [buf]):
            out += buf[:n]
    finally:
        os.close(fd)
    return bytes(out)


def test_page_cache_keeps_pages_and_stays_coherent(make_mount) -> None:
    m = make_mount(extra=("--page-cache",))
    d = m.sessions / "s"
    d.mkdir()
    path = d / "layer_0"
    first = os.urandom(4 * MiB)
    path.write_bytes(first)
    assert read_aligned(path) == first
    reads = fs_stats(m)["reads"]
    assert fs_stats(m)["read_req_max"] == MiB  # readahead raised: 1 MiB requests, not 128 KiB
    assert read_aligned(path) == first  # a new open keeps the pages: no request reaches us
    assert fs_stats(m)["reads"] == reads

    os.truncate(path, MiB)  # cut, then grown with other bytes: never the old pages
    tail = os.urandom(MiB)
    with open(path, "ab") as f:
        f.write(tail)
    assert read_aligned(path) == first[:MiB] + tail
    with open(path, "wb") as f:  # O_TRUNC
        f.write(tail)
    assert path.read_bytes() == tail

    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == tail[:4096]  # cached now
        path.unlink()
        path.write_bytes(b"new file")
        with pytest.raises(OSError) as e:  # the old handle: never its cached pages
            os.pread(fd, 4096, 0)
        assert e.value.errno == errno.ESTALE
    finally:
        os.close(fd)
    assert path.read_bytes() == b"new file"


def test_direct_io_requests_are_1_mib(kvfs: Mount) -> None:
    d = kvfs.sessions / "s"
    d.mkdir()
    buf = mmap.mmap(-1, MiB)
    buf.write(os.urandom(MiB))
    fd = os.open(d / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for _ in range(3):
            assert os.writev(fd, [buf]) == MiB
    finally:
        os.close(fd)
    assert read_aligned(d / "f") == bytes(buf) * 3
    fs = fs_stats(kvfs)
    assert fs["read_req_max"] == fs["write_req_max"] == MiB


def test_read_ahead_serves_sequential_readers_and_never_stale_bytes(kvfs: Mount) -> None:
    """Sequential 1 MiB reads are answered from the ranges read ahead; a truncate and a
    regrowth under a reader that has ranges in flight: it gets the new bytes, never the old."""
    d = kvfs.sessions / "ra"
    d.mkdir()
    path = d / "layer_0"
    first = os.urandom(8 * MiB)
    path.write_bytes(first)
    hits = fs_stats(kvfs)["readahead_hits"]
    assert read_aligned(path) == first
    assert fs_stats(kvfs)["readahead_hits"] - hits >= 5  # all but the first reads, minus slack

    buf = mmap.mmap(-1, MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        for i in range(2):  # the next range is being read ahead now
            assert os.preadv(fd, [buf], i * MiB) == MiB and bytes(buf) == first[i * MiB:(i + 1) * MiB]
        os.truncate(path, 3 * MiB)
        new = os.urandom(2 * MiB)
        with open(path, "ab") as f:
            f.write(new)
        for i in range(2, 5):
            assert os.preadv(fd, [buf], i * MiB) == MiB
            want = first[2 * MiB:3 * MiB] if i == 2 else new[(i - 3) * MiB:(i - 2) * MiB]
            assert bytes(buf) == want, i
        assert os.preadv(fd, [buf], 5 * MiB) == 0
    finally:
        os.close(fd)


def test_fsync_flushes_the_device_once_per_batch(kvfs: Mount) -> None:
    d = kvfs.sessions / "s"
    d.mkdir()
    for i in range(8):
        (d / f"l{i}").write_bytes(os.urandom(96 << 10))
    before = fs_stats(kvfs)["device_syncs"]
    fds = [os.open(d / f"l{i}", os.O_RDWR | os.O_APPEND) for i in range(8)]
    try:
        for fd in fds:
            os.fsync(fd)
        assert fs_stats(kvfs)["device_syncs"] == before + 1
        os.write(fds[3], b"more")  # a change since: the next fsync flushes again
        os.fsync(fds[5])
        os.fsync(fds[3])
        assert fs_stats(kvfs)["device_syncs"] == before + 2
    finally:
        for fd in fds:
            os.close(fd)
    assert (d / "l3").read_bytes().endswith(b"more")


def test_one_fsync_flushes_every_files_buffer(kvfs: Mount) -> None:
    """Files written and still open (their bytes buffered in the mount), then fsync'd one
    by one (the warm tier's migration): the first fsync stores every buffer and flushes
    the device once; the others find nothing to do."""
    d = kvfs.sessions / "g"
    d.mkdir()
    data = [os.urandom(300 << 10) for _ in range(6)]
    fds = [os.open(d / f"layer_{i}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) for i in range(6)]
    try:
        for fd, b in zip(fds, data, strict=True):
            assert os.write(fd, b) == len(b)
        before = fs_stats(kvfs)["device_syncs"]
        for fd in fds:
            os.fsync(fd)
        assert fs_stats(kvfs)["device_syncs"] == before + 1
    finally:
        for fd in fds:
            os.close(fd)
    kvfs.remount()
    for i, b in enumerate(data):
        assert (d / f"layer_{i}").read_bytes() == b


def test_page_cache_drops_pages_of_a_session_reclaim_dropped(make_mount) -> None:
    """keep_cache keeps a file's pages across opens; when reclaim drops an idle session
    (behind the kernel's back), its pages go too: an open handle reads no cached bytes of
    a file that is gone."""
    m = make_mount(size="16M", extra=("--page-cache", "-o", "retention_s=1"))
    (m.sessions / "old").mkdir()
    data = os.urandom(1 << 20)
    (m.sessions / "old" / "layer_0").write_bytes(data)
    fd = os.open(m.sessions / "old" / "layer_0", os.O_RDONLY)
    try:
        assert os.pread(fd, len(data), 0) == data  # now in the page cache
        time.sleep(1.5)  # idle past the retention
        (m.sessions / "new").mkdir()
        chunk = os.urandom(1 << 20)
        for k in range(40):  # laps the ring: reclaim drops "old" whole
            p = m.sessions / "new" / f"f{k % 4}"
            with open(p, "wb") as f:
                f.write(chunk)
        assert not (m.sessions / "old").exists()
        stats = json.loads((m.root / ".kvfs" / "stats").read_bytes())
        assert stats["store"]["counters"]["dropped_sessions"] >= 1
        deadline = time.monotonic() + 5
        while True:  # the pages are dropped by a thread of the mount: at once, or nearly
            try:
                got = os.pread(fd, 4096, 0)
            except OSError as e:
                assert e.errno in (errno.ENOENT, errno.ESTALE, errno.EIO)
                break
            assert got == data[:4096]  # never other bytes
            assert time.monotonic() < deadline, "cached pages of a dropped session still served"
            time.sleep(0.05)
    finally:
        os.close(fd)

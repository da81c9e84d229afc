"""Blocks and threads in the engine: a damaged block costs only its reads, reads run beside
reads, appends and reclaim and always return the right bytes, and a sync with nothing to
do costs no fsync."""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest

from kvfs.engine.errors import Corrupt, NotFound
from kvfs.engine.faults import FaultyVolume
from kvfs.engine.format import BLOCK, BLOCK_ENTRY, HDR_SIZE
from kvfs.engine.store import Store
from kvfs.engine.types import StoreConfig

MB = 1 << 20


def bf16(n: int, seed: int) -> bytes:
    x = np.random.default_rng(seed).standard_normal(n // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype("<u2").tobytes()


@pytest.mark.parametrize("compression", ["none", "auto"])
def test_bit_flip_in_one_block_fails_only_reads_of_that_block(tmp_path, compression):
    path = str(tmp_path / "v.kvvol")
    data = bf16(5 * BLOCK + 1000, 1) if compression == "auto" else os.urandom(5 * BLOCK + 1000)
    s = Store.create(path, 32 * MB, StoreConfig(compression=compression, compress_on_copy=False))
    s.create_session("s")
    s.create_file("s", "f")
    s.append("s", "f", 0, data)
    s.create_file("s", "g")
    s.append("s", "g", 0, b"after" * 100)  # the damaged entry is not the last one
    _, f = s._file("s", "f")
    assert len(f.ext) == 1
    pos, _, _, esize = f.ext[0]
    phys = s.ring.phys(pos)
    s.close()
    with open(path, "rb") as fh:
        fh.seek(phys)
        entry = fh.read(esize)
    nblocks = int.from_bytes(entry[64:68], "little")
    assert nblocks == 6
    table = entry[HDR_SIZE: HDR_SIZE + nblocks * BLOCK_ENTRY.size]
    sizes = [BLOCK_ENTRY.unpack_from(table, i * BLOCK_ENTRY.size)[0] for i in range(nblocks)]
    if compression == "auto":
        assert sum(sizes) < len(data) / 1.4  # bf16 blocks compressed independently
    start3 = HDR_SIZE + len(table) + sum(sizes[:3])
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, bytes([entry[start3 + 17] ^ 4]), phys + start3 + 17)
    os.close(fd)
    for crash in (False, True):  # from the checkpoint, and replayed from the ring
        s = Store.open(path, readonly=True)
        if crash:
            s.ring.tail = s.sb.tail
            from kvfs.engine.recovery import rebuild

            rebuild(s, Corrupt("test: replay the ring"))
            assert s.open_report.corrupt == [(pos, esize)]
        for a, b in ((0, 3 * BLOCK), (4 * BLOCK, len(data)), (100, 200), (3 * BLOCK - 5, 3 * BLOCK)):
            assert s.read("s", "f", a, b - a) == data[a:b]
        for a, b in ((3 * BLOCK, 3 * BLOCK + 1), (0, len(data)), (3 * BLOCK + 100, BLOCK)):
            with pytest.raises(Corrupt, match="block 3"):
                s.read("s", "f", a, b)
        assert s.read("s", "g", 0, 10**6) == b"after" * 100
        s.crash()


def test_sync_with_nothing_written_costs_no_fsync(tmp_path):
    path = str(tmp_path / "v.kvvol")
    s = Store.create(path, 8 * MB, volume=FaultyVolume)
    vol = s.vol
    assert isinstance(vol, FaultyVolume)
    s.create_session("s")
    for name in ("a", "b", "c"):
        s.create_file("s", name)
        s.append("s", name, 0, name.encode() * 50_000)
    n = vol.syncs
    for _ in ("a", "b", "c"):  # the migration pattern: a batch, then one fsync per file
        s.sync()
    assert vol.syncs == n + 1
    assert s.read("s", "b", 0, 3) == b"bbb"
    s.sync()
    assert vol.syncs == n + 1  # a read writes nothing
    s.append("s", "a", 50_000, b"more")
    s.sync()
    s.sync()
    assert vol.syncs == n + 2
    vol.power_cut(keep=0)  # everything synced survives
    s = Store.open(path)
    assert s.read("s", "a", 0, 10**6) == b"a" * 50_000 + b"more"
    assert s.read("s", "c", 0, 10**6) == b"c" * 50_000
    s.close()


def test_a_write_that_lands_during_an_fsync_is_synced_by_the_next_sync(tmp_path, monkeypatch):
    """Store.sync fsyncs outside the store's lock, so an append may complete while an fsync
    runs; that fsync need not cover it, and the next sync must not be skipped."""
    s = Store.create(str(tmp_path / "v.kvvol"), 8 * MB)
    vol = s.vol
    s.create_session("s")
    s.create_file("s", "a")
    s.append("s", "a", 0, b"x" * 1000)
    real, fsyncs = os.fsync, []

    def fsync_with_a_write_landing(fd: int) -> None:
        fsyncs.append(fd)
        if len(fsyncs) == 1:  # another thread's append completes while this fsync runs
            s.append("s", "a", 1000, b"y" * 1000)
            s.flush()
        real(fd)

    monkeypatch.setattr("kvfs.engine.volume.os.fsync", fsync_with_a_write_landing)
    assert s.unsynced() >= 1000  # the append's entry, in the ring's write buffer
    s.sync()
    assert len(fsyncs) == 1 and vol.dirty  # the append that landed meanwhile is not covered
    assert 1000 <= s.unsynced() < 4096  # its entry: the next fsync waits for it
    s.sync()
    assert len(fsyncs) == 2 and not vol.dirty and s.unsynced() == 0
    s.sync()
    assert len(fsyncs) == 2  # nothing new: no fsync
    s.close()


def test_concurrent_syncs_wait_for_the_fsync_in_flight(tmp_path, monkeypatch):
    """A second sync arriving while an fsync runs returns only after it, and costs no
    fsync of its own when nothing was written since that fsync began."""
    s = Store.create(str(tmp_path / "v.kvvol"), 8 * MB)
    s.create_session("s")
    s.create_file("s", "a")
    s.append("s", "a", 0, b"x" * 1000)
    real, fsyncs = os.fsync, []
    started, release = threading.Event(), threading.Event()

    def slow_fsync(fd: int) -> None:
        fsyncs.append(fd)
        started.set()
        release.wait(10)
        real(fd)

    monkeypatch.setattr("kvfs.engine.volume.os.fsync", slow_fsync)
    first = threading.Thread(target=s.sync)
    first.start()
    assert started.wait(10)
    done = []
    second = threading.Thread(target=lambda: (s.sync(), done.append(1)))
    second.start()
    time.sleep(0.2)
    assert not done  # not before the fsync in flight made the append durable
    release.set()
    first.join(10)
    second.join(10)
    assert done == [1] and len(fsyncs) == 1
    s.close()


def test_read_advice_is_given_in_batches_off_the_read_path(tmp_path, monkeypatch):
    """DONTNEED after reads: exactly the ranges read (never pages read ahead of them), a
    batch at a time, touching ranges in one call; close gives the rest."""
    from kvfs.engine import volume as volmod

    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def record(fd, off, n, advice):
        if advice == os.POSIX_FADV_DONTNEED:
            calls.append((off, n))
        return real(fd, off, n, advice)

    monkeypatch.setattr(volmod.os, "posix_fadvise", record)
    s = Store.create(str(tmp_path / "v.kvvol"), 64 * MB)
    vol, k = s.vol, 96 << 10
    calls.clear()
    for i in range(volmod.DROP_BATCH - 2):  # a sequential reader: touching ranges
        vol.dontneed(i * k, k)
    vol.dontneed(10 * MB, 4096)  # and one elsewhere
    time.sleep(0.2)
    assert calls == []  # noted only
    vol.dontneed(20 * MB, 4096)  # the batch is full
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls == [(0, (volmod.DROP_BATCH - 2) * k), (10 * MB, 4096), (20 * MB, 4096)]
    vol.dontneed(30 * MB, 10)
    s.close()  # what was noted since is advised before the descriptor closes
    assert calls[-1] == (30 * MB, 10)


def test_write_out_starts_per_run_of_writes_and_promises_nothing(tmp_path, monkeypatch):
    """Every ``writeback`` bytes of appended entries, their write-out is started on the
    advice thread: contiguous ranges of the ring, in order, none before the run is full;
    a failing call changes nothing (the data is still there after the fsync, and after a
    reopen); 0 turns it off."""
    from kvfs.engine import volume as volmod

    calls: list[tuple[int, int, int]] = []
    real = volmod._SYNC_FILE_RANGE

    def record(fd, off, n, flags):
        calls.append((off, n, flags))
        real(fd, off, n, flags)
        return -1  # as if it failed: advice only

    monkeypatch.setattr(volmod, "_SYNC_FILE_RANGE", record)
    path = str(tmp_path / "v.kvvol")
    s = Store.create(path, 64 * MB, StoreConfig(writeback=MB, compression="none"))
    s.create_session("s")
    s.create_file("s", "f")
    data = bf16(5 * MB + 12345, 3)
    calls.clear()
    for off in range(0, len(data), 96 << 10):
        s.append("s", "f", off, data[off: off + (96 << 10)])
    s.sync()
    s.close()  # the queued advice is given before the descriptor closes
    ring_lo, ring_hi = s.sb.ring_offset, s.sb.ring_offset + s.sb.ring_size
    assert len(calls) >= 4 and all(f == volmod.SYNC_FILE_RANGE_WRITE for _, _, f in calls)
    assert all(n >= MB and ring_lo <= off and off + n <= ring_hi for off, n, _ in calls)
    assert all(a + n <= b for (a, n, _), (b, _, _) in zip(calls, calls[1:], strict=False))
    assert sum(n for _, n, _ in calls) >= 4 * MB  # the last, partly filled run waits for fsync
    s = Store.open(path)
    assert s.read("s", "f", 0, len(data)) == data
    s.close()

    calls.clear()
    s = Store.create(str(tmp_path / "off.kvvol"), 64 * MB, StoreConfig(writeback=0))
    s.create_session("s")
    s.create_file("s", "f")
    s.append("s", "f", 0, data)
    s.close()
    assert calls == []


def test_readers_run_beside_an_appender_and_reclaim(tmp_path):
    """Readers on several threads, one appender that keeps the ring wrapping (live data is
    copied forward from under the readers): every byte right, no exception, no fsck mark."""
    path = str(tmp_path / "v.kvvol")
    s = Store.create(path, 8 * MB, StoreConfig(write_buffer=64 << 10))
    s.create_session("s")
    cap = 700_000
    content = {f"f{k}": (bf16(cap, k) if k % 2 else os.urandom(cap)) for k in range(4)}
    for name in content:
        s.create_file("s", name)
    stop = threading.Event()
    errors: list[BaseException] = []
    reads = [0]

    def appender() -> None:
        rng = random.Random(1)
        try:
            while not stop.is_set():
                name = rng.choice(sorted(content))
                size = s.file_stat("s", name).size
                if size >= cap - 200_000:
                    s.truncate("s", name, rng.randrange(0, size // 2))
                    size = s.file_stat("s", name).size
                n = rng.choice((1000, 20_000, 96 << 10, 150_000))
                s.append("s", name, size, content[name][size:size + n])
                if rng.random() < 0.1:
                    s.sync()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            stop.set()

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                name = rng.choice(sorted(content))
                a = rng.randrange(0, cap)
                got = s.read("s", name, a, rng.choice((1, 4096, 96 << 10, 300_000)))
                assert got == content[name][a:a + len(got)], f"wrong bytes in {name} at {a}"
                reads[0] += 1
        except NotFound:
            pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=appender)] + [
        threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < deadline and (
            s.counters["copied_forward"] == 0 or s.ring.head < 3 * s.ring.size):
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert s.ring.head >= 3 * s.ring.size and s.counters["copied_forward"] > 0
    assert reads[0] > 100 and not s.needs_fsck
    for name, data in content.items():
        got = s.read("s", name, 0, cap)
        assert got == data[:len(got)]
    s.close()
    s = Store.open(path)
    for name, data in content.items():
        got = s.read("s", name, 0, cap)
        assert got == data[:len(got)]
    s.close()


def test_read_that_meets_reclaimed_space_looks_up_again(tmp_path):
    """The entry a read looked up is copied forward and written over between the lookup and
    the read from the volume: the read looks up again and returns the right bytes."""
    path = str(tmp_path / "v.kvvol")
    s = Store.create(path, 4 * MB, StoreConfig(compression="none"))
    s.create_session("s")
    s.create_file("s", "old")
    old = os.urandom(50_000)
    s.append("s", "old", 0, old)
    s.create_file("s", "churn")
    s.flush()
    (pos, _, _, _), = s._file("s", "old")[1].ext
    real = s.ring.read_data
    raced = []

    def read_data(p, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if not raced:  # the writer runs between this read's lookup and its pread
            raced.append(p)
            size = 0
            while s.ring.tail <= p or s.ring.head < p + s.ring.size + 60_000:
                if size > 200_000:
                    s.truncate("s", "churn", 0)
                    size = 0
                s.append("s", "churn", size, b"\xee" * 60_000)
                size += 60_000
            s.flush()
        return real(p, *a, **kw)

    s.ring.read_data = read_data
    s.drop_caches()
    assert s.read("s", "old", 1000, 30_000) == old[1000:31_000]
    assert raced == [pos] and s.counters["read_retries"] == 1
    assert s._file("s", "old")[1].ext[0][0] > pos  # the bytes now come from the copy
    assert not s.needs_fsck
    s.close()


class AdvisedVolume(FaultyVolume):
    """Records the read-ahead advice the store gives."""

    advised: list[tuple[int, int]] = []

    def willneed(self, off: int, n: int) -> None:
        type(self).advised.append((off, n))
        super().willneed(off, n)


def test_read_ahead_advises_only_where_the_file_jumps_on_disk(tmp_path):
    """A file whose entries follow each other on disk gets no advice (the kernel's readahead
    serves it); a file interleaved with another gets one advice per jump, each covering
    exactly that file's next entries, and its bytes are right."""
    path = str(tmp_path / "v.kvvol")
    s = Store.create(path, 64 * MB, StoreConfig(compression="none"), volume=AdvisedVolume)
    s.create_session("s")
    for name in ("seq", "a", "b"):
        s.create_file("s", name)
    seq = os.urandom(8 * MB)
    for off in range(0, len(seq), MB):
        s.append("s", "seq", off, seq[off:off + MB])
    parts = {"a": [], "b": []}
    for i in range(16):  # a and b alternate: every entry of a is a jump from the last
        for name in parts:
            chunk = os.urandom(96 << 10)
            s.append("s", name, (96 << 10) * i, chunk)
            parts[name].append(chunk)
    s.close()
    s = Store.open(path, volume=AdvisedVolume)
    AdvisedVolume.advised = []
    got = b"".join(s.read("s", "seq", off, MB) for off in range(0, len(seq), MB))
    assert got == seq and AdvisedVolume.advised == []
    _, fa = s._file("s", "a")
    entries = {s.ring.phys(pos): esize for pos, _, _, esize in fa.ext}
    got = b"".join(s.read("s", "a", (96 << 10) * i, 96 << 10) for i in range(16))
    assert got == b"".join(parts["a"])
    assert AdvisedVolume.advised and all(entries.get(off) == n for off, n in AdvisedVolume.advised)
    assert len(AdvisedVolume.advised) == len(set(AdvisedVolume.advised)) <= 15  # each entry once
    s.close()


class ReadLog(FaultyVolume):
    """Records the advice and the reads, in order."""

    log: list[tuple[str, int, int]] = []

    def willneed(self, off: int, n: int) -> None:
        type(self).log.append(("advise", off, n))
        super().willneed(off, n)

    def pread(self, n: int, off: int) -> bytes:
        type(self).log.append(("read", off, n))
        return super().pread(n, off)


def test_a_random_read_with_a_jump_on_disk_asks_for_what_follows_it_first(tmp_path):
    """A range deep inside a large entry whose table is not known is read in two (header
    and table, then the blocks): the blocks are advised before the first read, at exactly
    where the second read finds them. What follows on disk (the next entry of a range over
    two) is not advised, nor is anything for a sequential reader. The bytes are right."""
    path = str(tmp_path / "v.kvvol")
    s = Store.create(path, 64 * MB, StoreConfig(compression="none"), volume=ReadLog)
    s.create_session("s")
    s.create_file("s", "f")
    data = os.urandom(2 * MB)
    s.append("s", "f", 0, data[:MB])
    s.append("s", "f", MB, data[MB:])
    s.close()
    s = Store.open(path, volume=ReadLog)
    # (offset, length, volume reads, advised): within the first blocks; deep inside;
    # across two; then on from where that read ended (sequential), deep in the second
    cases = [(0, 96 << 10, 1, 0), (512 << 10, 96 << 10, 2, 1), (MB - (32 << 10), 160 << 10, 3, 1),
             (MB + (128 << 10), 96 << 10, 2, 0)]
    for off, n, nreads, advised in cases:
        s.drop_caches()
        ReadLog.log = []
        assert s.read("s", "f", off, n) == data[off: off + n]
        adv = [(o, k) for what, o, k in ReadLog.log if what == "advise"]
        reads = [(o, k) for what, o, k in ReadLog.log if what == "read"]
        assert len(reads) == nreads
        assert adv == reads[1:1 + advised]  # only the read after the jump
        assert all(what == "advise" for what, _, _ in ReadLog.log[:len(adv)])  # first
    s.close()


def test_a_deep_read_in_a_compressed_entry_asks_for_nothing_past_its_end(tmp_path):
    """Where raw blocks would lie is only a guess for a compressed entry: a range deep in
    one that compresses well lies, raw, past the entry's end. Nothing is advised there (an
    advice of a negative length is EINVAL), and the read returns the bytes."""
    path = str(tmp_path / "v.kvvol")
    cfg = StoreConfig(compression="zstd", compress_on_copy=False)  # stored small at once
    s = Store.create(path, 64 * MB, cfg, volume=ReadLog)
    s.create_session("s")
    s.create_file("s", "f")
    data = bytes(range(256)) * (MB // 256)  # about 100x smaller stored
    s.append("s", "f", 0, data)
    s.close()
    s = Store.open(path, cfg, volume=ReadLog)
    for off in (512 << 10, MB - (96 << 10)):
        s.drop_caches()
        ReadLog.log = []
        assert s.read("s", "f", off, 96 << 10) == data[off: off + (96 << 10)]
        assert all(k > 0 for what, _, k in ReadLog.log if what == "advise"), ReadLog.log
    assert not s.needs_fsck
    s.close()

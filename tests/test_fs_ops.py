"""The filesystem API without the kernel: ``kvfs.fs.Operations`` over a real ``Store``.

Handlers are called directly under trio, so the write buffering, the error translation
and the fail-safe path (unexpected exception -> EIO + needs_fsck, mount alive) are
checked exactly, without /dev/fuse.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
from pyfuse3 import EntryAttributes, FUSEError

from kvfs.engine import errors
from kvfs.engine.store import Store
from kvfs.fuse.nodes import METRICS, SESSIONS, STATS
from kvfs.fuse.ops import ENTRY_MAX, Operations

CTX = SimpleNamespace(uid=1234, gid=5678, pid=1, umask=0o022)


@pytest.fixture
def store(tmp_path: Path):
    s = Store.create(str(tmp_path / "vol"), 16 << 20)
    yield s
    s.close()


def run(fn, *args):
    return trio.run(fn, *args)


async def _new_file(ops: Operations, session: str, name: str) -> tuple[int, int]:
    d = await ops.mkdir(SESSIONS, session.encode(), 0o777, CTX)
    fi, attr = await ops.create(d.st_ino, name.encode(), 0o644, os.O_WRONLY, CTX)
    return attr.st_ino, fi.fh


async def _new_files(ops: Operations, session: str, n: int) -> list[tuple[int, int]]:
    d = await ops.mkdir(SESSIONS, session.encode(), 0o777, CTX)
    out = []
    for i in range(n):
        fi, attr = await ops.create(d.st_ino, f"f{i}".encode(), 0o644, os.O_WRONLY, CTX)
        out.append((attr.st_ino, fi.fh))
    return out


def test_small_writes_are_gathered_into_entries(store) -> None:
    async def main() -> None:
        ops = Operations(store)
        ino, fh = await _new_file(ops, "s", "layer_0")
        for i in range(100):
            assert await ops.write(fh, i * 4096, bytes([i]) * 4096) == 4096
        assert (await ops.getattr(ino, CTX)).st_size == 100 * 4096
        assert await ops.read(fh, 4096 * 99, 8192) == bytes([99]) * 4096  # buffered tail
        assert store.file_stat("s", "layer_0").size == 0  # nothing reached the engine yet
        await ops.flush(fh)
        await ops.release(fh)
        assert store.counters["appends"] == ops.counters.appends == -(-100 * 4096 // ENTRY_MAX)
        assert store.read("s", "layer_0", 0, 1 << 20) == b"".join(
            bytes([i]) * 4096 for i in range(100))

    run(main)


def test_modes_and_owner_at_creation(store) -> None:
    async def main() -> None:
        ops = Operations(store)
        d = await ops.mkdir(SESSIONS, b"s", 0o755, CTX)
        assert (d.st_mode & 0o7777, d.st_uid, d.st_gid) == (0o700, 1234, 5678)
        fi, a = await ops.create(d.st_ino, b"f", 0o644, os.O_WRONLY, CTX)
        assert (a.st_mode & 0o7777, a.st_uid, a.st_gid) == (0o600, 1234, 5678)
        await ops.release(fi.fh)

    run(main)


def test_not_append_is_eperm_and_changes_nothing(store) -> None:
    async def main() -> None:
        ops = Operations(store)
        ino, fh = await _new_file(ops, "s", "f")
        await ops.write(fh, 0, b"abcdef")
        for off in (0, 3, 7):
            with pytest.raises(FUSEError) as e:
                await ops.write(fh, off, b"X")
            assert e.value.errno == errno.EPERM
        await ops.release(fh)
        assert store.read("s", "f", 0, 100) == b"abcdef"
        assert ops.counters.refused_writes == 3

    run(main)


def test_truncate_inside_buffer_and_longer(store) -> None:
    async def main() -> None:
        ops = Operations(store)
        ino, fh = await _new_file(ops, "s", "f")
        await ops.write(fh, 0, b"0123456789")
        await ops.flush(fh)
        await ops.write(fh, 10, b"abcdef")
        await ops.buffers.truncate(ops.inodes.get(ino), 12)  # inside the unflushed tail
        with pytest.raises(FUSEError) as e:
            await ops.buffers.truncate(ops.inodes.get(ino), 13)
        assert e.value.errno == errno.EINVAL
        await ops.buffers.truncate(ops.inodes.get(ino), 4)  # into the engine's part
        await ops.write(fh, 4, b"XY")
        await ops.release(fh)
        assert store.read("s", "f", 0, 100) == b"0123XY"

    run(main)


def test_engine_errors_map_to_errno(store) -> None:
    async def main() -> None:
        ops = Operations(store)
        await ops.mkdir(SESSIONS, b"s", 0o700, CTX)
        with pytest.raises(FUSEError) as e:
            await ops.mkdir(SESSIONS, b"s", 0o700, CTX)
        assert e.value.errno == errno.EEXIST
        with pytest.raises(FUSEError) as e:
            await ops.mkdir(SESSIONS, b"x" * 300, 0o700, CTX)
        assert e.value.errno == errno.ENAMETOOLONG
        with pytest.raises(FUSEError) as e:
            await ops.rmdir(SESSIONS, b"nope", CTX)
        assert e.value.errno == errno.ENOENT
        assert (await ops.lookup(SESSIONS, b"nope", CTX)).st_ino == 0  # negative entry
        assert not ops.needs_fsck

    run(main)


def test_unexpected_exception_is_eio_and_needs_fsck(store, monkeypatch, caplog) -> None:
    async def main() -> None:
        ops = Operations(store)
        ino, fh = await _new_file(ops, "s", "f")
        await ops.write(fh, 0, b"data")
        await ops.flush(fh)

        def boom(*a):
            raise RuntimeError("bug")

        monkeypatch.setattr(store, "read", boom)
        with pytest.raises(FUSEError) as e:
            await ops.read(fh, 0, 4)
        assert e.value.errno == errno.EIO
        assert ops.needs_fsck

        def corrupt(*a):
            raise errors.Corrupt("checksum")

        monkeypatch.setattr(store, "read", corrupt)
        with pytest.raises(FUSEError) as e:
            await ops.read(fh, 0, 4)
        assert e.value.errno == errno.EIO
        monkeypatch.undo()
        assert await ops.read(fh, 0, 4) == b"data"  # the mount carries on
        await ops.release(fh)
        sfh = (await ops.open(STATS, os.O_RDONLY, CTX)).fh
        doc = json.loads(await ops.read(sfh, 0, 1 << 20))
        assert doc["needs_fsck"] is True
        assert doc["fs"]["errors"] == 1 and doc["fs"]["corrupt_reads"] == 1

    run(main)
    assert "RuntimeError: bug" in caplog.text  # logged with its traceback


def test_generated_files_are_read_only(store) -> None:
    async def main() -> None:
        ops = Operations(store)
        for ino in (STATS, METRICS):
            with pytest.raises(FUSEError) as e:
                await ops.open(ino, os.O_WRONLY, CTX)
            assert e.value.errno == errno.EROFS
        fi = await ops.open(METRICS, os.O_RDONLY, CTX)
        assert fi.direct_io
        assert b"kv_cold_capacity_bytes" in await ops.read(fi.fh, 0, 1 << 20)

    run(main)


def test_handles_of_an_unlinked_file_are_stale(store) -> None:
    async def main() -> None:
        ops = Operations(store)
        ino, fh = await _new_file(ops, "s", "f")
        await ops.write(fh, 0, b"old bytes")
        d = ops.inodes.ino_of(("s",))
        await ops.unlink(d, b"f", CTX)
        new_fi, new_attr = await ops.create(d, b"f", 0o600, os.O_WRONLY, CTX)
        assert new_attr.st_ino != ino
        for call in (ops.read(fh, 0, 10), ops.write(fh, 0, b"X"), ops.fsync(fh, False)):
            with pytest.raises(FUSEError) as e:
                await call
            assert e.value.errno == errno.ESTALE
        a = await ops.getattr(ino, CTX)
        assert (a.st_nlink, a.st_size) == (0, 9)  # the old file as it was
        await ops.flush(fh)  # close succeeds: nothing of it is left to store
        await ops.release(fh)
        await ops.release(new_fi.fh)
        assert store.read("s", "f", 0, 100) == b""
        assert not ops.needs_fsck

    run(main)


@pytest.mark.parametrize("inline_reads", [True, False])
def test_read_of_buffered_tail_never_exceeds_request_across_a_flush(store, inline_reads) -> None:
    async def main() -> None:
        ops = Operations(store, inline_reads=inline_reads)
        ino, fh = await _new_file(ops, "s", "f")
        data = bytes(range(256)) * 64  # 16 KiB
        await ops.write(fh, 0, data[:8192])
        await ops.flush(fh)
        await ops.write(fh, 8192, data[8192:])  # buffered tail 8192..16384
        p = ops.buffers.get(ino)
        out: list[bytes] = []

        async def reader() -> None:
            out.append(await ops.read(fh, 8000, 4096))

        async with trio.open_nursery() as n:
            async with p.lock:  # a flush holds the file's lock while the read arrives
                n.start_soon(reader)
                await trio.sleep(0.01)
                await ops.buffers._flush_locked(p)
        assert out == [data[8000:8000 + 4096]]
        assert p.base == 16384 and not p.buf
        await ops.release(fh)

    run(main)


def test_unflushed_bytes_stay_under_the_mount_bound(store) -> None:
    async def main() -> None:
        ops = Operations(store, max_pending=64 << 10)
        files = await _new_files(ops, "s", 10)
        for r in range(8):
            for i, (_, fh) in enumerate(files):
                assert await ops.write(fh, r * 16384, bytes([i]) * 16384) == 16384
                assert ops.buffers.pending_bytes <= 64 << 10
        for i, (_, fh) in enumerate(files):
            await ops.release(fh)
            assert store.read("s", f"f{i}", 0, 1 << 20) == bytes([i]) * (8 * 16384)

    run(main)


def test_full_volume_refuses_at_write_and_keeps_what_was_acknowledged(store, caplog) -> None:
    async def main() -> None:
        ops = Operations(store)
        files = await _new_files(ops, "s", 40)
        acked = [0] * len(files)
        refused = 0
        piece = os.urandom(256 << 10)
        for _ in range(4):
            for i, (_, fh) in enumerate(files):
                try:
                    acked[i] += await ops.write(fh, acked[i], piece)
                except FUSEError as e:
                    assert e.errno == errno.ENOSPC
                    refused += 1
        assert refused and sum(acked) < 16 << 20
        for i, (_, fh) in enumerate(files):
            await ops.flush(fh)  # nothing acknowledged fails to store at close
            await ops.release(fh)
            assert store.file_stat("s", f"f{i}").size == acked[i]
            assert store.read("s", f"f{i}", 0, acked[i]) == (piece * 4)[:acked[i]]

    run(main)
    assert "could not be stored" not in caplog.text



def test_small_sequential_reads_come_from_a_window_never_across_a_truncate(store) -> None:
    async def main() -> None:
        ops = Operations(store)
        ino, fh = await _new_file(ops, "s", "f")
        data = os.urandom(600_000)
        assert await ops.write(fh, 0, data) == len(data)
        await ops.flush(fh)
        rfh = (await ops.open(ino, os.O_RDONLY, CTX)).fh
        got = b"".join([await ops.read(rfh, off, 4096) for off in range(0, 262_144, 4096)])
        assert got == data[:262_144]
        assert ops.counters.window_hits == 63  # one engine read for 64 reads of 4 KiB
        attr = EntryAttributes()
        attr.st_size = 8192
        fields = SimpleNamespace(update_size=True, update_mode=False, update_uid=False,
                                 update_gid=False, update_atime=False, update_mtime=False)
        await ops.setattr(ino, attr, fields, None, CTX)
        new = os.urandom(100_000)
        assert await ops.write(fh, 8192, new) == len(new)
        await ops.flush(fh)
        # the window covered these offsets, but they were cut and written anew
        assert await ops.read(rfh, 8192, 4096) == new[:4096]
        assert await ops.read(rfh, 12288, 4096) == new[4096:8192]
        assert await ops.read(rfh, 16384, 4096) == new[8192:12288]
        assert ops.counters.window_hits == 64  # from the window fetched after the cut
        await ops.release(rfh)
        await ops.release(fh)

    run(main)


def test_fsync_flushes_the_device_only_after_changes(store) -> None:
    async def main() -> None:
        ops = Operations(store)
        files = await _new_files(ops, "s", 4)
        for _, fh in files:
            await ops.write(fh, 0, b"x" * 1000)
            await ops.flush(fh)  # close: the bytes reach the engine, not the device
        for _, fh in files:
            await ops.fsync(fh, False)
        assert ops.worker.syncs == 1  # one device flush covers the whole batch
        await ops.fsync(files[0][1], False)
        assert ops.worker.syncs == 1  # nothing changed since
        await ops.write(files[2][1], 1000, b"y")  # buffered only: no engine change yet
        await ops.fsync(files[0][1], False)  # stores every file's buffer, then flushes
        assert ops.worker.syncs == 2
        assert store.read("s", "f2", 0, 2000) == b"x" * 1000 + b"y"
        await ops.fsync(files[2][1], False)  # its bytes are durable already
        await ops.fsync(files[1][1], False)
        assert ops.worker.syncs == 2
        for _, fh in files:
            await ops.release(fh)

    run(main)


def test_fsync_stores_every_free_buffer_in_one_job(store) -> None:
    """Files written and kept open, then fsync'd one by one (a group migration): the first
    fsync hands every buffer to the engine in one worker job ending in one device flush;
    the later fsyncs find their bytes durable and make no job at all."""
    async def main() -> None:
        ops = Operations(store)
        files = await _new_files(ops, "s", 6)
        for k, (_, fh) in enumerate(files):
            await ops.write(fh, 0, bytes([k]) * 5000)
        jobs: list[str] = []
        real = ops.worker.call

        async def call(fn, *args, changes=True, here=False):
            jobs.append(getattr(fn, "__name__", "?"))
            return await real(fn, *args, changes=changes, here=here)

        ops.worker.call = call
        for _, fh in files:
            await ops.fsync(fh, False)
        assert jobs == ["_append_batch"], jobs
        assert ops.worker.syncs == 1
        assert ops.buffers.pending_bytes == 0
        for k in range(6):
            assert store.read("s", f"f{k}", 0, 6000) == bytes([k]) * 5000
        for _, fh in files:
            await ops.release(fh)

    run(main)


def _sync_threads(store, monkeypatch) -> list[str]:
    """The names of the threads ``store.sync`` runs on, from now on."""
    import threading

    threads: list[str] = []
    real = store.sync

    def sync() -> bool:
        threads.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(store, "sync", sync)
    return threads


def test_offloaded_device_flushes_never_run_on_the_trio_thread(store, monkeypatch) -> None:
    """With ``inline_syncs`` off (``--offload-syncs``), an fsync's device flush never runs
    on the trio thread, with or without buffered bytes."""
    import threading

    threads = _sync_threads(store, monkeypatch)

    async def main() -> None:
        ops = Operations(store, inline_syncs=False)
        _, fh = await _new_file(ops, "s", "f")
        await ops.write(fh, 0, b"x" * 1000)
        await ops.fsync(fh, False)  # its append and the flush in one worker job
        await ops.flush(fh)
        await _new_file(ops, "t", "g")  # an engine change with nothing buffered for fh
        await ops.fsync(fh, False)  # nothing buffered: the flush alone
        await ops.fsync(fh, False)  # nothing changed since: no flush, no hand-off
        await ops.release(fh)

    run(main)
    assert len(threads) == 2 and threading.main_thread().name not in threads, threads


def test_a_small_fsync_runs_here_a_large_or_blocked_or_slow_one_on_a_worker(store, monkeypatch) -> None:
    """A small fsync skips both hand-offs: its append and flush run on the trio thread. One
    that would store more than INLINE_SYNC_BYTES, one that finds a change holding the
    writer lock (it would wait behind it), and any while the device's flushes are slow go
    to a worker; each still stores its bytes and flushes once."""
    import threading

    from kvfs.fuse.worker import INLINE_SYNC_BYTES, INLINE_SYNC_S

    threads = _sync_threads(store, monkeypatch)
    here = threading.current_thread().name

    async def main() -> None:
        ops = Operations(store)
        _, fh = await _new_file(ops, "s", "f")
        size = 0

        async def write_fsync(n: int) -> None:
            nonlocal size
            await ops.write(fh, size, bytes([n % 251]) * n)
            size += n
            await ops.fsync(fh, False)

        await write_fsync(1000)
        assert threads == [here] and ops.worker.syncs == 1
        await write_fsync(INLINE_SYNC_BYTES + 1)  # too much to flush with the loop waiting
        assert threads[-1] != here and ops.worker.syncs == 2

        held, release = threading.Event(), threading.Event()

        def long_change() -> None:  # a checkpoint or reclaim holding the writer lock
            assert store.try_writer()
            held.set()
            release.wait(10)
            store.release_writer()

        t = threading.Thread(target=long_change)
        t.start()
        held.wait(10)
        async with trio.open_nursery() as n:
            n.start_soon(write_fsync, 1000)
            await trio.sleep(0.05)  # the loop still answers: the fsync waits on a worker
            assert ops.worker.syncs == 2
            release.set()
        t.join()
        assert threads[-1] != here and ops.worker.syncs == 3

        ops.worker.flush_s = 2 * INLINE_SYNC_S  # the device's flushes became slow
        await write_fsync(1000)
        assert threads[-1] != here and ops.worker.syncs == 4
        assert ops.worker.flush_s != 2 * INLINE_SYNC_S  # every flush moves the average
        await ops.release(fh)
        assert store.read("s", "f", 0, size + 1) == b"".join(
            bytes([n % 251]) * n for n in (1000, INLINE_SYNC_BYTES + 1, 1000, 1000))

    run(main)
    assert len(threads) == 4, threads


def test_tail_keeps_the_bytes_and_the_mount_wide_count() -> None:
    from kvfs.fuse.buffers import Tail

    total = [0]
    a, b = Tail(total), Tail(total)
    a.add(b"abc")
    a.add(memoryview(b"defg"))
    b.add(b"xy")
    b.add(b"")
    assert (len(a), len(b), total[0]) == (7, 2, 9)
    assert a.slice(2, 5) == b"cde" and a.data() == b"abcdefg"
    a.drop_front(3)  # stored: they leave
    assert a.data() == b"defg" and total[0] == 6
    a.keep(2)  # a truncate inside the buffer
    assert a.data() == b"de" and total[0] == 4
    a.keep(5)  # longer than it holds: nothing changes
    assert a.data() == b"de" and total[0] == 4
    a.drop_front(2)
    assert not a and a.data() == b"" and total[0] == 2
    b.clear()
    assert total[0] == 0 and not b

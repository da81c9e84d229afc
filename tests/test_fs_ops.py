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
from pyfuse3 import FUSEError

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
        await ops.buffers.truncate(ino, ("s", "f"), 12)  # inside the unflushed tail
        with pytest.raises(FUSEError) as e:
            await ops.buffers.truncate(ino, ("s", "f"), 13)
        assert e.value.errno == errno.EINVAL
        await ops.buffers.truncate(ino, ("s", "f"), 4)  # into the engine's part
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

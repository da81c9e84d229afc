"""A filled volume: zeros written over the new file, so no space in it is left unwritten
(an fsync then commits no allocation); a sparse one keeps fallocate's unwritten space. The
state is read back from the filesystem with FIEMAP, the bytes through the engine."""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path

import pytest

from kvfs.engine import volume as volmod
from kvfs.engine.store import Store
from kvfs.fuse import mount as mountmod

FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 1
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNWRITTEN = 0x800
HEAD = struct.Struct("=QQIIII")  # fm_start, fm_length, fm_flags, fm_mapped, fm_count, reserved
EXTENT = struct.Struct("=QQQ2QI3I")  # logical, physical, length, reserved, flags, reserved
MiB = 1 << 20


def extents(path: Path) -> list[tuple[int, int, int]]:
    """(logical offset, length, flags) of every extent of ``path``; skips the test where
    the filesystem has no FIEMAP."""
    out: list[tuple[int, int, int]] = []
    start, count = 0, 64
    with open(path, "rb") as f:
        while True:
            buf = bytearray(HEAD.pack(start, (1 << 64) - 1 - start, FIEMAP_FLAG_SYNC, 0, count, 0)
                            + bytes(EXTENT.size * count))
            try:
                fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOTTY):
                    pytest.skip("no FIEMAP on this filesystem")
                raise
            mapped = HEAD.unpack_from(buf)[3]
            for k in range(mapped):
                logical, _, length, _, _, flags, *_ = EXTENT.unpack_from(buf, HEAD.size + k * EXTENT.size)
                out.append((logical, length, flags))
            if not mapped or out[-1][2] & FIEMAP_EXTENT_LAST:
                return out
            start = out[-1][0] + out[-1][1]


def unwritten(path: Path) -> int:
    return sum(n for _, n, flags in extents(path) if flags & FIEMAP_EXTENT_UNWRITTEN)


def covered(path: Path) -> int:
    return sum(n for _, n, _ in extents(path))


def test_a_filled_volume_has_no_unwritten_space_and_keeps_its_bytes(tmp_path: Path) -> None:
    vol = tmp_path / "kv.vol"
    s = Store.create(str(vol), 16 * MiB, fill=True)
    assert covered(vol) == 16 * MiB  # allocated whole ...
    assert unwritten(vol) == 0  # ... and written: nothing left for an fsync to convert
    data = os.urandom(300_000)
    s.create_session("a")
    s.create_file("a", "layer_0")
    s.append("a", "layer_0", 0, data)
    s.sync()
    s.close()
    s = Store.open(str(vol))
    try:
        assert s.read("a", "layer_0", 0, len(data)) == data
    finally:
        s.close()


def test_a_sparse_volume_keeps_fallocates_unwritten_space(tmp_path: Path) -> None:
    vol = tmp_path / "kv.vol"
    Store.create(str(vol), 16 * MiB).close()
    if unwritten(vol) == 0:
        pytest.skip("this filesystem reports no unwritten extents")
    assert unwritten(vol) > 8 * MiB  # the ring, never written yet


def test_a_fill_that_fails_leaves_no_volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vol = tmp_path / "kv.vol"
    real = volmod.pwrite_all
    calls = []

    def full(fd: int, data: bytes | memoryview, off: int) -> None:
        calls.append(off)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, off)

    monkeypatch.setattr(volmod, "FILL_CHUNK", 1 * MiB)
    monkeypatch.setattr(volmod, "pwrite_all", full)
    with pytest.raises(OSError) as e:
        Store.create(str(vol), 16 * MiB, fill=True)
    assert e.value.errno == errno.ENOSPC
    assert not vol.exists()


def _open_store(tmp_path: Path, *extra: str) -> Path:
    vol, mnt = tmp_path / "kv.vol", tmp_path / "mnt"
    mnt.mkdir(parents=True)
    args = mountmod.parse_args([str(vol), str(mnt), "--size", "16M", *extra])
    profile, size = mountmod.load_profile(args)
    mountmod.open_store(args, size, profile).close()
    return vol


def test_the_mount_fills_a_volume_it_creates_unless_sparse(tmp_path: Path) -> None:
    filled = _open_store(tmp_path / "a")
    assert covered(filled) == 16 * MiB and unwritten(filled) == 0
    sparse = _open_store(tmp_path / "b", "--sparse")
    if unwritten(sparse) == 0:
        pytest.skip("this filesystem reports no unwritten extents")
    assert unwritten(sparse) > 8 * MiB

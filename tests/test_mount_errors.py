"""Bad input through a real mount: each gets its errno, nothing stored changes, the
mount stays up."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from conftest import Mount


def expect_errno(code: int, fn, *args) -> None:
    with pytest.raises(OSError) as e:
        fn(*args)
    assert e.value.errno == code, f"{fn.__name__}{args}: {e.value}"


def test_bad_names(shared_mount: Mount) -> None:
    s = shared_mount.sessions
    expect_errno(errno.ENAMETOOLONG, os.mkdir, s / ("x" * 256))
    (s / "names").mkdir()
    expect_errno(errno.ENAMETOOLONG, os.open, s / "names" / ("y" * 256),
                 os.O_CREAT | os.O_WRONLY, 0o600)
    expect_errno(errno.ENAMETOOLONG, os.mkdir, s / ("é" * 128))  # 256 bytes
    expect_errno(errno.EEXIST, os.mkdir, s / ".")  # the kernel's answer for . and ..
    with pytest.raises(ValueError):
        os.mkdir(s / "a\0b")  # NUL never reaches a syscall
    assert sorted(os.listdir(s)) == ["names"]


def test_write_in_the_middle_is_eperm_and_changes_nothing(shared_mount: Mount) -> None:
    d = shared_mount.sessions / "mid"
    d.mkdir()
    f = d / "layer_0"
    f.write_bytes(b"0123456789")
    fd = os.open(f, os.O_WRONLY)
    try:
        expect_errno(errno.EPERM, os.pwrite, fd, b"XX", 4)
        expect_errno(errno.EPERM, os.pwrite, fd, b"XX", 0)
        expect_errno(errno.EPERM, os.pwrite, fd, b"XX", 20)  # a hole is not an append
        assert os.pwrite(fd, b"ab", 10) == 2  # at the end: fine
    finally:
        os.close(fd)
    assert f.read_bytes() == b"0123456789ab"
    assert "only appends are allowed" in shared_mount.log_text()


def test_truncate_longer_is_einval(shared_mount: Mount) -> None:
    d = shared_mount.sessions / "trunc"
    d.mkdir()
    f = d / "layer_0"
    f.write_bytes(b"abc")
    expect_errno(errno.EINVAL, os.truncate, f, 4)
    os.truncate(f, 3)  # equal: a no-op
    assert f.read_bytes() == b"abc"


def test_kvfs_dir_is_read_only(shared_mount: Mount) -> None:
    k = shared_mount.root / ".kvfs"
    expect_errno(errno.EROFS, os.open, k / "stats", os.O_WRONLY)
    expect_errno(errno.EROFS, os.open, k / "metrics", os.O_RDWR | os.O_APPEND)
    expect_errno(errno.EROFS, os.open, k / "new", os.O_CREAT | os.O_WRONLY, 0o600)
    expect_errno(errno.EROFS, os.unlink, k / "stats")
    expect_errno(errno.EROFS, os.mkdir, k / "d")
    expect_errno(errno.EROFS, os.chmod, k / "stats", 0o666)
    expect_errno(errno.EROFS, os.truncate, k / "stats", 0)
    assert (k / "stats").read_bytes().startswith(b"{")


def test_fixed_tree_allows_only_mkdir_in_sessions(shared_mount: Mount) -> None:
    root, s = shared_mount.root, shared_mount.sessions
    expect_errno(errno.EPERM, os.open, root / "f", os.O_CREAT | os.O_WRONLY, 0o600)
    expect_errno(errno.EPERM, os.open, s / "f", os.O_CREAT | os.O_WRONLY, 0o600)
    expect_errno(errno.EPERM, os.mkdir, root / "d")
    expect_errno(errno.EPERM, os.rmdir, s)
    expect_errno(errno.EPERM, os.chmod, s, 0o777)
    (s / "fixed").mkdir()
    expect_errno(errno.EPERM, os.mkdir, s / "fixed" / "nested")
    expect_errno(errno.EPERM, os.symlink, "x", s / "fixed" / "link")
    (s / "fixed" / "f").write_bytes(b"x")
    expect_errno(errno.EPERM, os.link, s / "fixed" / "f", s / "fixed" / "g")
    expect_errno(errno.ENOTEMPTY, os.rmdir, s / "fixed")
    os.unlink(s / "fixed" / "f")
    os.rmdir(s / "fixed")
    assert not (s / "fixed").exists()


def test_full_volume_is_enospc_and_keeps_data(make_mount, tmp_path: Path) -> None:
    m = make_mount("small", size="8M")
    keep = os.urandom(1 << 20)
    (m.sessions / "keep").mkdir()
    (m.sessions / "keep" / "layer_0").write_bytes(keep)
    (m.sessions / "fill").mkdir()
    stream = os.urandom(1 << 20) * 64
    synced = 0
    with pytest.raises(OSError) as e:
        with open(m.sessions / "fill" / "layer_0", "wb", buffering=0) as f:
            pos = 0
            while pos < len(stream):
                pos += f.write(stream[pos:pos + (1 << 20)])  # short when the volume fills
                os.fsync(f.fileno())
                synced = pos
    assert e.value.errno == errno.ENOSPC
    # the engine remembers the trip round the ring that freed nothing: more writes are
    # refused without another (each would copy every live byte forward again); a first
    # new file's small record may still get a trip of its own
    expect_errno(errno.ENOSPC, (m.sessions / "fill" / "more").write_bytes, stream[:1 << 20])
    before = m.stats()["store"]["counters"]
    for k in range(3):
        expect_errno(errno.ENOSPC, (m.sessions / "fill" / f"more{k}").write_bytes, stream[:1 << 20])
    after = m.stats()["store"]["counters"]
    assert after["reclaims"] == before["reclaims"]
    assert after["full_refusals"] >= before["full_refusals"] + 3
    assert (m.sessions / "keep" / "layer_0").read_bytes() == keep
    filled = (m.sessions / "fill" / "layer_0").read_bytes()
    assert len(filled) >= synced > 0 and filled == stream[:len(filled)]
    # the mount is still fine: free the space, write again
    os.unlink(m.sessions / "fill" / "layer_0")
    (m.sessions / "fill" / "again").write_bytes(b"x" * 1000)
    assert (m.sessions / "fill" / "again").read_bytes() == b"x" * 1000
    m.remount()
    assert (m.sessions / "keep" / "layer_0").read_bytes() == keep

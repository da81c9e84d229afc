"""Hardening through a real mount: handles bound to their file, reads racing appends, the
bound on unflushed bytes, log lines and file mode, utime of 0, other users' files."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, Mount

from kvfs.mount_runner import As


def expect_errno(code: int, fn, *args, **kw) -> None:
    with pytest.raises(OSError) as e:
        fn(*args, **kw)
    assert e.value.errno == code, f"{fn.__name__}: {e.value}"


def stats(m: Mount) -> dict:
    return json.loads((m.root / ".kvfs" / "stats").read_bytes())


# ---------------------------------------------------------------- handles follow the file
def test_fd_of_unlinked_file_never_reaches_the_new_file(kvfs: Mount) -> None:
    d = kvfs.sessions / "s"
    d.mkdir()
    f = d / "layer_0"
    f.write_bytes(b"old" * 100)
    wfd = os.open(f, os.O_RDWR | os.O_APPEND)
    rfd = os.open(f, os.O_RDONLY)
    try:
        os.unlink(f)
        expect_errno(errno.ESTALE, os.pread, rfd, 10, 0)
        f.write_bytes(b"new!")
        expect_errno(errno.ESTALE, os.write, wfd, b"XX")
        expect_errno(errno.ESTALE, os.pread, rfd, 10, 0)
        expect_errno(errno.ESTALE, os.pread, wfd, 10, 0)
        expect_errno(errno.ESTALE, os.ftruncate, wfd, 0)
        st = os.fstat(rfd)  # the old file as it was, with no links
        assert (st.st_size, st.st_nlink) == (300, 0)
        assert os.stat(f).st_size == 4
    finally:
        os.close(wfd)
        os.close(rfd)
    assert f.read_bytes() == b"new!"


def test_unflushed_bytes_of_unlinked_file_stay_out_of_the_new_one(kvfs: Mount) -> None:
    d = kvfs.sessions / "s"
    d.mkdir()
    f = d / "layer_0"
    wfd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        assert os.write(wfd, b"buffered") == 8  # still in the mount's buffer
        os.unlink(f)
        f.write_bytes(b"")
        expect_errno(errno.ESTALE, os.write, wfd, b"more")
        expect_errno(errno.ESTALE, os.fsync, wfd)
    finally:
        os.close(wfd)
    assert f.read_bytes() == b""


def test_rm_r_and_mkdir_leave_old_fds_stale(kvfs: Mount) -> None:
    d = kvfs.sessions / "chat"
    d.mkdir()
    (d / "layer_0").write_bytes(b"A" * 1000)
    rfd = os.open(d / "layer_0", os.O_RDONLY)
    wfd = os.open(d / "layer_0", os.O_WRONLY | os.O_APPEND)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        shutil.rmtree(d)
        d.mkdir()
        (d / "layer_0").write_bytes(b"B" * 10)
        expect_errno(errno.ESTALE, os.pread, rfd, 100, 0)
        expect_errno(errno.ESTALE, os.write, wfd, b"x")
        expect_errno(errno.ESTALE, os.ftruncate, wfd, 0)
        # names looked up through the removed directory are not the new session's
        expect_errno(errno.ENOENT, os.open, "layer_0", os.O_RDONLY, dir_fd=dfd)
        expect_errno(errno.ENOENT, os.open, "x", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=dfd)
    finally:
        for fd in (rfd, wfd, dfd):
            os.close(fd)
    assert (d / "layer_0").read_bytes() == b"B" * 10
    assert os.listdir(d) == ["layer_0"]


@pytest.mark.skipif(not HAVE_FUSE or os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs /dev/fuse, root and setpriv")
def test_old_fd_cannot_read_another_users_new_file(other_users_dir: Path) -> None:
    m = Mount(other_users_dir / "vol.kvfs", other_users_dir / "mnt", "64M", ("--allow-other",)).start()
    a, b = As(4101), As(4102)
    try:
        chat = f"{m.sessions}/chat"
        f = f"{chat}/layer_0"
        assert a(f"os.mkdir({chat!r})") == "None"
        assert a(f"fds.update(w=os.open({f!r}, os.O_RDWR | os.O_CREAT, 0o600))") == "None"
        assert a("os.write(fds['w'], b'A' * 100)") == "100"
        assert a(f"fds.update(r=os.open({f!r}, os.O_RDONLY))") == "None"
        assert a(f"os.unlink({f!r})") == "None"
        assert a(f"os.rmdir({chat!r})") == "None"
        assert b(f"os.mkdir({chat!r})") == "None"
        assert b(f"fds.update(w=os.open({f!r}, os.O_WRONLY | os.O_CREAT, 0o600))") == "None"
        assert b("os.write(fds['w'], b'secret of B')") == "11"
        assert b("os.close(fds['w'])") == "None"
        assert a(f"os.open({f!r}, os.O_RDONLY)") == f"errno {errno.EACCES}"
        assert a("os.pread(fds['r'], 100, 0)") == f"errno {errno.ESTALE}"
        assert a("os.pread(fds['w'], 100, 0)") == f"errno {errno.ESTALE}"
        assert a("os.write(fds['w'], b'from A')") == f"errno {errno.ESTALE}"
        assert a("os.ftruncate(fds['w'], 0)") == f"errno {errno.ESTALE}"
        assert Path(f).read_bytes() == b"secret of B"
        assert os.stat(f).st_uid == 4102
    finally:
        a.close()
        b.close()
        assert m.stop() == 0, m.log_text()


# ---------------------------------------------------------------- reads racing appends
def _block(k: int) -> bytes:
    return bytes([k % 251]) * 4096


@pytest.mark.parametrize("extra", [(), ("--offload-reads",)], ids=["reads-on-loop", "offloaded"])
def test_reads_racing_appends_get_right_bytes_never_eio(make_mount, extra) -> None:
    m = make_mount(size="128M", extra=extra)
    d = m.sessions / "race"
    d.mkdir()
    f = d / "layer_0"
    wfd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o600)
    rfd = os.open(f, os.O_RDONLY)
    written = [0]
    done = threading.Event()
    failures: list[str] = []

    def writer() -> None:
        k = 0
        while not done.is_set() and k < 6000:
            assert os.write(wfd, _block(k)) == 4096
            k += 1
            written[0] = k * 4096
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    reads = eio = 0
    try:
        while reads < 2000 and not done.is_set():
            end = written[0]
            off = max(0, end - 6000)
            try:
                data = os.pread(rfd, 8192, off)
            except OSError as e:
                eio += e.errno == errno.EIO
                failures.append(f"pread at {off}: {e}")
                continue
            finally:
                reads += 1
            if len(data) > 8192:
                failures.append(f"{len(data)} bytes for 8192 at {off}")
            want = b"".join(_block(k) for k in range(off // 4096, (off + len(data)) // 4096 + 1))
            skip = off % 4096
            if data != want[skip:skip + len(data)]:
                failures.append(f"wrong bytes at {off} ({len(data)})")
    finally:
        done.set()
        t.join()
        os.close(wfd)
        os.close(rfd)
    assert reads >= 500, reads
    assert eio == 0 and not failures, failures[:5]
    assert "Invalid argument" not in m.log_text()
    k = written[0] // 4096
    assert f.read_bytes() == b"".join(_block(i) for i in range(k))


# ---------------------------------------------------------------- the bound on buffered bytes
def _vm(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) << 10


def test_unflushed_bytes_bounded_and_enospc_at_write(make_mount) -> None:
    m = make_mount(size="32M", extra=("--write-buffer-max", "8M"))
    assert m.proc is not None
    pid = m.proc.pid
    d = m.sessions / "many"
    d.mkdir()
    piece = os.urandom((1 << 20) - 1)  # incompressible: the volume really fills
    base_rss = _vm(pid, "VmRSS")
    fds, acked, enospc, peak_pending = [], [], 0, 0
    try:
        for i in range(150):
            fd = os.open(d / f"f{i:03d}", os.O_WRONLY | os.O_CREAT, 0o600)
            fds.append(fd)
            n = 0
            try:
                while n < len(piece):
                    n += os.write(fd, piece[n:])
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                enospc += 1
            acked.append(n)
            if i % 10 == 0:
                peak_pending = max(peak_pending, stats(m)["fs"]["pending_bytes"])
        peak_pending = max(peak_pending, stats(m)["fs"]["pending_bytes"])
        growth = _vm(pid, "VmHWM") - base_rss
        print(f"acked {sum(acked)} bytes, {enospc} ENOSPC, peak pending {peak_pending}, "
              f"RSS growth {growth >> 20} MiB")
    finally:
        close_errors = []
        for fd in fds:
            try:
                os.close(fd)  # fails if acknowledged bytes cannot be stored
            except OSError as e:
                close_errors.append(e)
    assert not close_errors, close_errors[:3]
    assert enospc > 0, "the volume never filled"
    assert sum(acked) < 32 << 20
    assert peak_pending <= 8 << 20, peak_pending
    assert growth < 80 << 20, f"mount RSS grew by {growth >> 20} MiB"
    for i, n in enumerate(acked):
        assert (d / f"f{i:03d}").read_bytes() == piece[:n], f"f{i:03d}"
    assert "could not be stored" not in m.log_text()


# ---------------------------------------------------------------- logs, utime
def test_log_file_private_and_names_escaped(make_mount) -> None:
    m = make_mount()
    assert os.stat(m.log).st_mode & 0o777 == 0o600
    evil = "s\n2030-01-01 00:00:00,000 1 ERROR kvfs.fs: forged"
    d = m.sessions / evil
    d.mkdir()
    (d / "layer_0").write_bytes(b"abc")
    fd = os.open(d / "layer_0", os.O_WRONLY)
    try:
        expect_errno(errno.EPERM, os.pwrite, fd, b"X", 0)  # logged with the names
    finally:
        os.close(fd)
    text = m.log_text()
    assert "only appends are allowed" in text and "forged" in text
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \d+ [A-Z]+ ")
    for line in text.splitlines():
        if line.startswith(("Traceback", " ")):
            continue
        assert stamp.match(line), f"a log line not made by the logger: {line!r}"
        assert "forged" not in line or "\\n" in line


def test_utime_zero_is_honoured(kvfs: Mount) -> None:
    d = kvfs.sessions / "t"
    d.mkdir()
    f = d / "layer_0"
    f.write_bytes(b"x")
    os.utime(f, (0, 0))
    st = os.stat(f)
    assert (st.st_atime_ns, st.st_mtime_ns) == (0, 0)
    os.utime(d, ns=(0, 0))
    assert os.stat(d).st_mtime_ns == 0
    os.utime(f, (5, 7))
    assert os.stat(f).st_mtime == 7

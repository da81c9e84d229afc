"""mount.py as a command: refusals (one line, non-zero, nothing mounted), daemon mode,
signals, the metrics port, volume permissions."""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, Mount, fusermount_u, run_mount, wait_unmounted

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="/dev/fuse is absent")


def refused(r, *words: str) -> None:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0, r
    assert len(lines) == 1, f"want one line, got: {r.stderr!r}"
    for w in words:
        assert w in lines[0], lines[0]


def test_missing_volume_without_size(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    r = run_mount(str(tmp_path / "vol"), str(tmp_path / "mnt"), "--foreground")
    refused(r, "does not exist", "--size")
    assert not (tmp_path / "vol").exists() and not os.path.ismount(tmp_path / "mnt")


def test_wrong_format(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    (tmp_path / "vol").write_bytes(b"not a volume" * 100_000)
    r = run_mount(str(tmp_path / "vol"), str(tmp_path / "mnt"), "--foreground")
    refused(r, "not a usable kvfs volume")
    assert not os.path.ismount(tmp_path / "mnt")


def test_missing_mountpoint_and_bad_options(tmp_path: Path) -> None:
    vol = str(tmp_path / "vol")
    refused(run_mount(vol, str(tmp_path / "nope"), "--size", "16M"), "mountpoint")
    (tmp_path / "mnt").mkdir()
    mnt = str(tmp_path / "mnt")
    refused(run_mount(vol, mnt, "--size", "16M", "--profile", "bogus"), "profile")
    refused(run_mount(vol, mnt, "--size", "16M", "-o", "no_such_key=1"), "no_such_key")
    refused(run_mount(vol, mnt, "--size", "lots"), "--size")
    r = run_mount(vol, mnt, "--size", "16M", "-o", "max_kv_len=48")  # an agent setting
    refused(r, "max_kv_len")
    assert "KVRouter" in r.stderr
    assert not os.path.exists(vol)


def test_stats_publish_the_profile_and_the_volume_identity(make_mount) -> None:
    import json

    m = make_mount(extra=("--profile", "ecommerce"))
    stats = json.loads((m.root / ".kvfs" / "stats").read_bytes())
    assert stats["profile"]["name"] == "ecommerce" and stats["profile"]["max_kv_len"] == 12
    uuid = stats["store"]["volume"]["uuid"]
    assert len(uuid) == 32
    # what an agent reads at open comes from the root's user.kvfs.mount: the same values
    from kvfs.warm import mount_info

    facts = json.loads(os.getxattr(m.root, "user.kvfs.mount"))
    assert facts == mount_info(str(m.root))
    assert facts["profile"] == stats["profile"] and facts["store"]["volume"]["uuid"] == uuid
    assert facts["fs"]["direct_io"] == stats["fs"]["direct_io"] and facts["shared"] is stats["shared"] is None
    m.remount()
    assert json.loads((m.root / ".kvfs" / "stats").read_bytes())["store"]["volume"]["uuid"] == uuid
    assert mount_info(str(m.root))["store"]["volume"]["uuid"] == uuid


def test_already_mounted(kvfs: Mount, tmp_path: Path) -> None:
    (tmp_path / "mnt2").mkdir()
    r = run_mount(str(kvfs.volume), str(tmp_path / "mnt2"), "--foreground")
    refused(r, "already mounted")
    assert not os.path.ismount(tmp_path / "mnt2")
    assert os.listdir(kvfs.sessions) == []  # the live mount is untouched


def test_volume_permissions_and_profile(make_mount) -> None:
    m = make_mount(extra=("--profile", "iot", "-o", "hot_sessions=7"))
    assert stat.S_IMODE(os.stat(m.volume).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(m.sessions).st_mode) == 0o755
    with open("/proc/self/mounts") as f:
        line = next(ln for ln in f if ln.split()[1] == str(m.mountpoint))
    fsname, _, fstype, opts = line.split()[:4]
    assert (fsname, fstype) == ("kvfs", "fuse.kvfs")
    assert "default_permissions" in opts and "allow_other" not in opts


def test_sigterm_unmounts_cleanly(make_mount) -> None:
    m = make_mount()
    (m.sessions / "s").mkdir()
    fd = os.open(m.sessions / "s" / "layer_0", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"kept")  # still buffered when the signal comes; close flushes it
    os.close(fd)
    assert m.stop("sigterm") == 0
    assert not os.path.ismount(m.mountpoint)
    m.start()
    assert (m.sessions / "s" / "layer_0").read_bytes() == b"kept"


def _volume_unlocked(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    with open(path, "rb") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, "the daemon never released the volume"
                time.sleep(0.05)


def test_daemon_mode(tmp_path: Path) -> None:
    vol, mnt, log = tmp_path / "vol", tmp_path / "mnt", tmp_path / "log"
    mnt.mkdir()
    r = run_mount(str(vol), str(mnt), "--size", "16M", "--log", str(log))
    assert r.returncode == 0, r.stderr + log.read_text()
    try:
        assert os.path.ismount(mnt)  # live as soon as the parent returned
        (mnt / "sessions" / "d").mkdir()
        (mnt / "sessions" / "d" / "f").write_bytes(b"daemon")
    finally:
        assert fusermount_u(mnt).returncode == 0
    wait_unmounted(mnt)
    _volume_unlocked(vol)
    assert "unmounted" in log.read_text()
    # the daemon refuses in its parent's name: a busy volume is one line and exit 1
    m = Mount(vol, mnt, size=None).start()
    try:
        (tmp_path / "mnt2").mkdir()
        refused(run_mount(str(vol), str(tmp_path / "mnt2")), "already mounted")
        assert (mnt / "sessions" / "d" / "f").read_bytes() == b"daemon"
    finally:
        assert m.stop() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_port(make_mount) -> None:
    port = _free_port()
    m = make_mount(extra=("--metrics-port", str(port)))
    (m.sessions / "s").mkdir()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body = resp.read().decode()
    assert "kv_cold_read_ms" in body

"""A real mount: bytes and ordinary tools through the kernel (ls, stat, du, cp, tar, find)."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import Mount
from prometheus_client.parser import text_string_to_metric_families

from kvfs.fuse.ops import ENTRY_MAX


def kv_bytes(seed: int, n: int) -> bytes:
    """fp16 KV-like values (compress a little with the byte-plane codec)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n // 2 + 1).astype(np.float16).tobytes()[:n]


def write_layers(sessions: Path, n_sessions: int, n_layers: int) -> dict[str, bytes]:
    """Sessions of layer files written in uneven chunks, plus meta.json; what was written."""
    rnd = random.Random(1)
    want: dict[str, bytes] = {}
    for s in range(n_sessions):
        sdir = sessions / f"sess-{s}"
        sdir.mkdir()
        for layer in range(n_layers):
            data = kv_bytes(s * 100 + layer, rnd.randrange(1, 600_000))
            with open(sdir / f"layer_{layer}", "wb", buffering=0) as f:
                pos = 0
                while pos < len(data):
                    step = rnd.choice((1, 100, 4096, 65536, 300_000))
                    f.write(data[pos:pos + step])
                    pos += step
            want[f"sess-{s}/layer_{layer}"] = data
        meta = json.dumps({"format": 1, "num_layers": n_layers, "tokens": s}).encode()
        (sdir / "meta.json").write_bytes(meta)
        want[f"sess-{s}/meta.json"] = meta
    return want


def check_tree(sessions: Path, want: dict[str, bytes]) -> None:
    for rel, data in want.items():
        assert (sessions / rel).read_bytes() == data, rel


def test_many_sessions_and_layers_survive_remount(kvfs: Mount) -> None:
    want = write_layers(kvfs.sessions, n_sessions=6, n_layers=4)
    check_tree(kvfs.sessions, want)
    assert sorted(os.listdir(kvfs.sessions)) == [f"sess-{i}" for i in range(6)]
    stats = json.loads((kvfs.root / ".kvfs" / "stats").read_text())
    # the kernel writes of each file (all under 1 MiB) were gathered: one flush per file,
    # cut into ring entries of at most ENTRY_MAX bytes
    entries = sum(-(-len(d) // ENTRY_MAX) for d in want.values())
    assert stats["fs"]["appends"] == entries < stats["fs"]["writes"]
    kvfs.remount()
    check_tree(kvfs.sessions, want)
    # appending after the remount continues the same file
    with open(kvfs.sessions / "sess-0" / "layer_0", "ab") as f:
        f.write(b"tail")
    assert (kvfs.sessions / "sess-0" / "layer_0").read_bytes() == want["sess-0/layer_0"] + b"tail"


def test_ls_stat_du(shared_mount: Mount) -> None:
    sdir = shared_mount.sessions / "stat-s"
    sdir.mkdir()
    data = bytes(1 << 20)  # zeros: the high byte plane compresses away, the low one is raw
    (sdir / "layer_0").write_bytes(data)
    (sdir / "raw").write_bytes(os.urandom(200_000))
    out = subprocess.run(["ls", "-la", str(sdir)], capture_output=True, text=True, check=True)
    assert "layer_0" in out.stdout and "raw" in out.stdout and " .\n" in out.stdout

    st = os.stat(sdir / "layer_0")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == 1 << 20  # raw bytes
    assert st.st_size <= st.st_blocks * 512 < 1.1 * st.st_size  # stored raw until copied forward
    assert st.st_blksize == 1 << 20
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    dst = os.stat(sdir)
    assert stat.S_ISDIR(dst.st_mode) and stat.S_IMODE(dst.st_mode) == 0o700
    raw = os.stat(sdir / "raw")
    assert raw.st_blocks * 512 >= 200_000  # incompressible: stored raw plus headers

    du = subprocess.run(["du", "-s", "--block-size=1", str(sdir)], capture_output=True,
                        text=True, check=True)
    used = int(du.stdout.split()[0])
    assert 200_000 + (1 << 20) <= used < 1.1 * (200_000 + (1 << 20))  # stored usage
    du_apparent = subprocess.run(["du", "-s", "--apparent-size", "--block-size=1", str(sdir)],
                                 capture_output=True, text=True, check=True)
    assert int(du_apparent.stdout.split()[0]) >= (1 << 20) + 200_000


def test_du_shows_compressed_usage_when_compressing_at_append(make_mount) -> None:
    m = make_mount(extra=("-o", "compress_on_copy=false"))
    sdir = m.sessions / "z"
    sdir.mkdir()
    (sdir / "layer_0").write_bytes(bytes(1 << 20))  # zeros: the high byte plane compresses away
    st = os.stat(sdir / "layer_0")
    assert st.st_size == 1 << 20 and 0 < st.st_blocks * 512 < 0.6 * st.st_size
    du = subprocess.run(["du", "-s", "--block-size=1", str(sdir)], capture_output=True, text=True,
                        check=True)
    assert int(du.stdout.split()[0]) < 0.6 * (1 << 20)
    assert (sdir / "layer_0").read_bytes() == bytes(1 << 20)


def test_atime_mtime_chmod_chown_utime(shared_mount: Mount) -> None:
    sdir = shared_mount.sessions / "attr-s"
    sdir.mkdir()
    f = sdir / "layer_0"
    f.write_bytes(b"abc")
    before = os.stat(f)
    os.utime(f, (1_000_000_000, 1_100_000_000))
    st = os.stat(f)
    assert (st.st_atime, st.st_mtime) == (1_000_000_000, 1_100_000_000)
    f.read_bytes()  # a read refreshes atime (LRU and retention use it)
    assert os.stat(f).st_atime > 1_000_000_000
    os.chmod(f, 0o640)
    os.chown(f, 4321, 8765)
    os.chmod(sdir, 0o750)
    st = os.stat(f)
    assert stat.S_IMODE(st.st_mode) == 0o640 and (st.st_uid, st.st_gid) == (4321, 8765)
    assert stat.S_IMODE(os.stat(sdir).st_mode) == 0o750
    assert before.st_ctime > 0


def test_rm_r_cp_find(shared_mount: Mount, tmp_path: Path) -> None:
    s = shared_mount.sessions
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"layer_{i}").write_bytes(kv_bytes(i, 50_000 + i))
    subprocess.run(["cp", "-r", str(src), str(s / "cp-s")], check=True)
    for i in range(3):
        assert (s / "cp-s" / f"layer_{i}").read_bytes() == (src / f"layer_{i}").read_bytes()
    found = subprocess.run(["find", str(s / "cp-s"), "-type", "f"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert sorted(found) == sorted(str(s / "cp-s" / f"layer_{i}") for i in range(3))
    found_all = subprocess.run(["find", str(shared_mount.root)], capture_output=True,
                               text=True, check=True).stdout.split()
    assert str(shared_mount.root / ".kvfs" / "stats") in found_all
    subprocess.run(["rm", "-r", str(s / "cp-s")], check=True)
    assert "cp-s" not in os.listdir(s)
    # mv inside the mount: the engine has no rename, mv falls back to copy + unlink
    (s / "mv-s").mkdir()
    (s / "mv-s" / "a").write_bytes(b"moved")
    subprocess.run(["mv", str(s / "mv-s" / "a"), str(s / "mv-s" / "b")], check=True)
    assert os.listdir(s / "mv-s") == ["b"] and (s / "mv-s" / "b").read_bytes() == b"moved"


def test_tar_round_trip(shared_mount: Mount, tmp_path: Path) -> None:
    s = shared_mount.sessions
    (s / "tar-a").mkdir()
    files = {f"layer_{i}": kv_bytes(10 + i, 70_000 * (i + 1)) for i in range(3)}
    files["meta.json"] = b'{"format": 1}'
    for name, data in files.items():
        (s / "tar-a" / name).write_bytes(data)
    os.utime(s / "tar-a" / "layer_1", (1_500_000_000, 1_500_000_000))
    tarball = tmp_path / "a.tar"
    subprocess.run(["tar", "-C", str(s), "-cf", str(tarball), "tar-a"], check=True)
    subprocess.run(["tar", "-C", str(s), "-xf", str(tarball), "--transform", "s/^tar-a/tar-b/"],
                   check=True)
    assert sorted(os.listdir(s / "tar-b")) == sorted(files)
    for name, data in files.items():
        assert (s / "tar-b" / name).read_bytes() == data
    assert os.stat(s / "tar-b" / "layer_1").st_mtime == 1_500_000_000
    # and out of the mount onto the local disk
    subprocess.run(["tar", "-C", str(tmp_path), "-xf", str(tarball)], check=True)
    for name, data in files.items():
        assert (tmp_path / "tar-a" / name).read_bytes() == data


def test_own_buffered_bytes_readable_and_truncate(shared_mount: Mount) -> None:
    sdir = shared_mount.sessions / "rw-s"
    sdir.mkdir()
    path = sdir / "layer_0"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, b"hello ")
        os.write(fd, b"world")
        assert os.pread(fd, 100, 0) == b"hello world"  # served from the write buffer
        assert os.fstat(fd).st_size == 11
        os.fsync(fd)
        os.ftruncate(fd, 5)  # an agent retrying a turn
        os.write(fd, b"!")
        assert os.pread(fd, 100, 0) == b"hello!"
    finally:
        os.close(fd)
    assert path.read_bytes() == b"hello!"
    os.truncate(path, 2)
    assert path.read_bytes() == b"he"
    with open(path, "wb") as f:  # O_TRUNC then write
        f.write(b"new")
    assert path.read_bytes() == b"new"


def test_metrics_and_stats_files(shared_mount: Mount) -> None:
    sdir = shared_mount.sessions / "metrics-s"
    sdir.mkdir()
    (sdir / "layer_0").write_bytes(kv_bytes(5, 300_000))
    (sdir / "layer_0").read_bytes()
    text = (shared_mount.root / ".kvfs" / "metrics").read_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("kv_cold_bytes", "kv_cold_capacity_bytes", "kv_cold_sessions",
                 "kv_cold_read_ms", "kv_cold_read_p99_ms", "kv_hot_hit_rate"):
        assert name in families, name
    assert families["kv_cold_capacity_bytes"].samples[0].value > 0
    assert families["kv_cold_sessions"].samples[0].value >= 1
    st = os.stat(shared_mount.root / ".kvfs" / "stats")
    assert stat.S_IMODE(st.st_mode) == 0o444 and st.st_size > 0
    doc = json.loads((shared_mount.root / ".kvfs" / "stats").read_text())
    assert {"store", "usage", "fs", "needs_fsck", "alerts"} <= set(doc)
    assert doc["needs_fsck"] is False and doc["usage"]["sessions"] >= 1


@pytest.mark.parametrize("name", ["é-session", "with space", "x" * 255])
def test_unusual_but_valid_names(shared_mount: Mount, name: str) -> None:
    d = shared_mount.sessions / name
    d.mkdir()
    (d / name).write_bytes(b"ok")
    assert (d / name).read_bytes() == b"ok"
    assert name in os.listdir(shared_mount.sessions)

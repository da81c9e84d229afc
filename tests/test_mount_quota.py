"""Quotas through a real ``--allow-other`` mount: one unprivileged user cannot make the
volume unmountable.

The reproduction: 16,000 sessions with 255-byte names from one user filled the index
region of a 256 MiB volume; every checkpoint then failed, closing failed, and every later
mount crashed in ``recover -> checkpoint``. Now that user gets EDQUOT (the mount's default
quotas), everyone else keeps working, and the owner can unmount, remount, read and delete.
A volume an older kvfs filled that way mounts with every session (its index kept in the
ring), and fsck and ``--repair`` agree about it."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from conftest import HAVE_FUSE, Mount

from kvfs.engine import quota
from kvfs.engine.fsck import CLEAN, PROBLEMS, check_volume
from kvfs.engine.store import Store
from kvfs.mount_runner import run_as

pytestmark = pytest.mark.skipif(not HAVE_FUSE or os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs /dev/fuse, root and setpriv")
FLOODER, OTHER = 4301, 4302
MB = 1 << 20


def test_one_user_filling_the_index_gets_edquot_and_the_volume_lives(other_users_dir: Path) -> None:
    m = Mount(other_users_dir / "vol.kvfs", other_users_dir / "mnt", "64M", ("--allow-other",)).start()
    try:
        out = run_as(FLOODER, f"""
            import os
            n = 0
            try:
                for n in range(16000):
                    os.mkdir(os.path.join({str(m.sessions)!r}, f"{{n:05d}}".ljust(255, "x")))
            except OSError as e:
                print(n, e.errno)
        """)
        made, code = map(int, out.split())
        assert code == errno.EDQUOT and 16 <= made < 16000, out  # not ENOSPC, not a dead mount
        out = run_as(OTHER, f"""
            import os
            p = os.path.join({str(m.sessions)!r}, "other")
            os.mkdir(p)
            with open(os.path.join(p, "layer_0"), "wb") as f:
                f.write(b"o" * 100_000)
                os.fsync(f.fileno())
            print("ok")
        """)
        assert out == "ok"
        mine = m.sessions / "owner"
        mine.mkdir()
        (mine / "layer_0").write_bytes(b"w" * 300_000)
        m.remount()  # the checkpoint at unmount and the recovery at mount both work
        assert (mine / "layer_0").read_bytes() == b"w" * 300_000
        assert len(os.listdir(m.sessions)) == made + 2
        for name in os.listdir(m.sessions):
            if name.startswith("0"):
                os.rmdir(m.sessions / name)
        assert sorted(os.listdir(m.sessions)) == ["other", "owner"]
    finally:
        assert m.stop() == 0, m.log_text()
    assert check_volume(str(m.volume)).status == CLEAN


def test_byte_quota_is_edquot_at_write(other_users_dir: Path) -> None:
    m = Mount(other_users_dir / "vol.kvfs", other_users_dir / "mnt", "64M",
              ("--allow-other", "-o", "quota_bytes=4M")).start()
    try:
        out = run_as(FLOODER, f"""
            import os
            p = os.path.join({str(m.sessions)!r}, "big")
            os.mkdir(p)
            fd = os.open(os.path.join(p, "layer_0"), os.O_WRONLY | os.O_CREAT, 0o600)
            done = 0
            try:
                while done < 16 << 20:
                    done += os.write(fd, b"q" * (256 << 10))
                print(done, 0)
            except OSError as e:
                print(done, e.errno)
            os.close(fd)
        """)
        done, code = map(int, out.split())
        assert code == errno.EDQUOT and done <= 4 * MB, out
        assert (m.sessions / "big" / "layer_0").stat().st_size == done
        (m.sessions / "root-data").mkdir()
        (m.sessions / "root-data" / "l").write_bytes(b"r" * (8 * MB))  # root: no quota
    finally:
        assert m.stop() == 0, m.log_text()


def test_a_volume_whose_index_overflowed_mounts_with_every_session(other_users_dir: Path,
                                                                    monkeypatch) -> None:
    """Written by a kvfs without the index budget: 4,000 long-named sessions on 64 MiB."""
    vol = other_users_dir / "old.kvfs"
    names = [f"{i:05d}".ljust(255, "x") for i in range(4000)]
    with monkeypatch.context() as mp:
        mp.setattr(quota.Ledger, "admit", lambda self, uid, **kw: None)
        s = Store.create(str(vol), 64 * MB)
        for n in names:
            s.create_session(n, uid=FLOODER)
        s.create_file(names[7], "layer_0")
        s.append(names[7], "layer_0", 0, b"z" * 70_000)
        s.close()
    assert check_volume(str(vol)).status == PROBLEMS
    res = check_volume(str(vol), repair=True)  # before: "unusable", exit 2
    assert res.status == PROBLEMS and any("mounts with every session" in r for r in res.repaired)
    m = Mount(vol, other_users_dir / "mnt", None, ("--allow-other",)).start()
    try:
        assert len(os.listdir(m.sessions)) == len(names)
        assert (m.sessions / names[7] / "layer_0").read_bytes() == b"z" * 70_000
        os.unlink(m.sessions / names[7] / "layer_0")
        for n in names[:3500]:
            os.rmdir(m.sessions / n)
        m.remount()
        assert sorted(os.listdir(m.sessions)) == sorted(names[3500:])
    finally:
        assert m.stop() == 0, m.log_text()
    assert check_volume(str(vol)).status == CLEAN


# times a user may set: the whole signed-nanosecond range exactly, beyond it EOVERFLOW
TIME_MAX_NS = (1 << 63) - 1
EXACT = [-(1 << 63), -300_000_000_123_456_789, -1, 0, 1_700_000_000_123_456_789, TIME_MAX_NS]
BEYOND = [1.04e10, -1.1e10, 5e11]  # 2300-01-01, 1621, year ~17800 (seconds)


def test_extreme_times_and_ids_by_an_unprivileged_user_survive_a_remount(other_users_dir: Path) -> None:
    m = Mount(other_users_dir / "vol.kvfs", other_users_dir / "mnt", "64M", ("--allow-other",)).start()
    try:
        out = run_as(FLOODER, f"""
            import errno, os
            root = {str(m.sessions)!r}
            got = []
            for i, ns in enumerate({EXACT!r}):
                d = os.path.join(root, f"t{{i}}")
                os.mkdir(d)
                p = os.path.join(d, "f")
                with open(p, "wb") as f:
                    f.write(b"x" * 10)
                os.utime(p, ns=(ns, ns))
                os.utime(d, ns=(ns, ns))
                os.chmod(p, 0o640)  # writes the attribute entry with that time
                os.chmod(d, 0o750)
                got.append(os.stat(p).st_mtime_ns == ns and os.stat(d).st_mtime_ns == ns)
            codes = []
            p = os.path.join(root, "t0", "f")
            for t in {BEYOND!r}:
                try:
                    os.utime(p, (t, t))
                    codes.append(0)
                except OSError as e:
                    codes.append(e.errno)
            os.chmod(p, 0o600)
            os.mkdir(os.path.join(root, "w"))
            with open(os.path.join(root, "w", "f"), "ab") as f:
                f.write(b"y")
                os.fsync(f.fileno())
            print(all(got), codes, os.stat(p).st_mtime_ns)
        """)
        assert out == f"True {[errno.EOVERFLOW] * len(BEYOND)} {EXACT[0]}", out
        assert run_as(OTHER, f"""
            import os
            d = os.path.join({str(m.sessions)!r}, "other")
            os.mkdir(d)
            with open(os.path.join(d, "f"), "wb") as f:
                f.write(b"o")
                os.fsync(f.fileno())
            print("ok")
        """) == "ok"  # other users' writes go on: no checkpoint failed
        wide = m.sessions / "w" / "f"
        os.chown(wide, 0xFFFFFFFE, 0xFFFFFFFE)  # the largest ids chown can set
        before = {p.name: (p.stat().st_mtime_ns, (p / "f").stat().st_mtime_ns,
                           (p / "f").stat().st_mode, p.stat().st_mode)
                  for p in m.sessions.iterdir() if p.name.startswith("t")}
        m.remount()
        after = {p.name: (p.stat().st_mtime_ns, (p / "f").stat().st_mtime_ns,
                          (p / "f").stat().st_mode, p.stat().st_mode)
                 for p in m.sessions.iterdir() if p.name.startswith("t")}
        assert after == before
        assert (wide.stat().st_uid, wide.stat().st_gid) == (0xFFFFFFFE, 0xFFFFFFFE)
        assert [after[f"t{i}"][:2] for i in range(1, len(EXACT))] == [(n, n) for n in EXACT[1:]]
    finally:
        assert m.stop() == 0, m.log_text()
    r = check_volume(str(m.volume))
    assert r.status == CLEAN, r.problems


def test_mkdir_rmdir_churn_leaves_no_index_budget_behind(other_users_dir: Path) -> None:
    m = Mount(other_users_dir / "vol.kvfs", other_users_dir / "mnt", "64M", ("--allow-other",)).start()
    try:
        run_as(FLOODER, f"""
            import os
            p = os.path.join({str(m.sessions)!r}, "d")
            for _ in range(8050):  # past one bitmap chunk of session numbers
                os.mkdir(p)
                os.rmdir(p)
        """)
        os.mkdir(m.sessions / "kept")
        m.remount()
        assert os.listdir(m.sessions) == ["kept"]
    finally:
        assert m.stop() == 0, m.log_text()
    s = Store.open(str(m.volume), readonly=True)
    try:
        assert sorted(s.idx.chunks) == [8051 // 8000]  # the chunk of "kept" only
    finally:
        s.crash()
    r = check_volume(str(m.volume))
    assert r.status == CLEAN, r.problems
    # one chunk for the live session; the churned ones hold nothing
    assert FLOODER not in r.index_by_uid and r.index_used < quota.BITMAP_BYTES + 500, r

"""Warm tier against other local users: a private root, no symlink or squatting tricks.

Attackers run as other uids (``setpriv``); every test uses its own directories, never the
real /dev/shm/kvfs-warm.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvfs.mount_runner import HAVE_FUSE, Mount, run_as
from kvfs.warm import WarmError, WarmTier
from kvfs.warm.ids import shard_file_name
from kvfs.warm.owners import SessionLocks

ROOT = Path(__file__).resolve().parents[1]
ATTACKER, OTHER = 4201, 4202
as_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                             reason="needs root and setpriv")


@pytest.fixture
def shared() -> Iterator[Path]:
    """Like /dev/shm: anyone may create names in it (pytest's own tmp tree is root-only)."""
    d = Path(tempfile.mkdtemp(prefix="kvfs-warm-uids-"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_root_and_every_file_are_private(tmp_path):
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True)
    root = tmp_path / "warm"
    with WarmTier(str(cold), str(root), shards=4, volume_id="vol-1") as w:
        w.append("s", 0, b"secret KV")
        w.put_meta("s", {"tokens": 1})
        w.put_summary("s", 0, np.zeros(128, np.float32))
        w.sync()
        base, proc = root / "vol-1", root / "vol-1" / f"proc-{os.getpid()}"
        assert all(mode(d) == 0o700 for d in (root, base, base / "locks", proc))
        kvmaps = [n for n in os.listdir(proc) if n.endswith(".kvmap")]
        assert kvmaps and all(mode(proc / n) == 0o600 for n in os.listdir(proc))
        assert [mode(base / "locks" / n) for n in os.listdir(base / "locks")] == [0o600]
        w.migrate()
        d = cold / "sessions" / "s"
        assert mode(d) == 0o700
        assert sorted(os.listdir(d)) == [".incarnation", "layer_0", "meta.json", "summaries.f32"]
        assert all(mode(d / n) == 0o600 for n in os.listdir(d))


def test_an_older_readable_root_of_ours_is_made_private(tmp_path):
    root = tmp_path / "warm"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    WarmTier(None, str(root), shards=4).close()
    assert mode(root) == 0o700


@pytest.mark.parametrize("bits", [0o777, 0o1777, 0o720])
def test_root_writable_by_others_is_refused(tmp_path, bits):
    root = tmp_path / "warm"
    root.mkdir()
    os.chmod(root, bits)
    with pytest.raises(WarmError, match="writable by group/other"):
        WarmTier(None, str(root), shards=4)
    assert os.listdir(root) == []  # nothing made in it


def test_symlinked_root_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "warm").symlink_to(real)
    with pytest.raises(WarmError, match="symbolic link"):
        WarmTier(None, str(tmp_path / "warm"), shards=4)
    assert os.listdir(real) == []


@as_root
def test_planted_root_of_another_user_is_left_untouched_and_a_private_one_used(shared):
    """A user pre-creates the root 0777 and plants the names a root agent would write
    (.lock, the shard's temporary name) as symlinks to a precious file and to a new one."""
    root, victim, made = shared / "kvfs-warm", shared / "precious", shared / "created-by-agent"
    victim.write_text("do not truncate")
    tmp_name = shard_file_name(0, 4) + f".tmp.{os.getpid()}"
    run_as(ATTACKER, f"""
        import os
        os.mkdir({str(root)!r}); os.chmod({str(root)!r}, 0o777)
        os.symlink({str(victim)!r}, {str(root / '.lock')!r})
        os.symlink({str(victim)!r}, {str(root / tmp_name)!r})
        os.symlink({str(made)!r}, {str(root / shard_file_name(1, 4))!r})
    """)
    with WarmTier(None, str(root), shards=4) as w:  # a private fallback, logged
        w.append("s", 0, b"x")
        assert os.path.dirname(w.root_path) == str(shared) and w.root_path != str(root)
    assert victim.read_text() == "do not truncate" and not made.exists()
    assert os.lstat(root).st_uid == ATTACKER and len(os.listdir(root)) == 3


@as_root
def test_non_root_agent_meeting_another_users_root_gets_a_private_one(shared):
    root = shared / "kvfs-warm"
    out = run_as(ATTACKER, f"""
        from kvfs.warm import WarmTier
        with WarmTier(None, {str(root)!r}, shards=4) as w:
            w.append("mine", 0, b"x")
        print("ok")
    """)
    assert out == "ok" and os.lstat(root).st_uid == ATTACKER and mode(root) == 0o700
    out = run_as(OTHER, f"""
        from kvfs.warm import WarmTier
        with WarmTier(None, {str(root)!r}, shards=4) as w:
            w.append("mine", 0, b"y")
            print(w.root_path)
    """)
    assert out.startswith(str(root) + ".private-") and os.lstat(out).st_uid == OTHER
    assert mode(Path(out)) == 0o700 and os.lstat(root).st_uid == ATTACKER


@as_root
@pytest.mark.parametrize("plant", ["dir", "symlink", "file", "open-dir"])
def test_a_per_uid_root_squatted_by_another_user_falls_back_to_a_private_one(shared, plant,
                                                                           caplog):
    """Another user pre-creates our per-uid root (or its lock directory's path) in a
    world-writable tmpfs: the tier and the locks every process of ours takes move to one
    private fallback, logged, and the squatter's names are left alone."""
    from kvfs.warm.rootdir import open_root
    root = shared / f"kvfs-warm-{os.geteuid()}"
    decoy = shared / "decoy"
    run_as(ATTACKER, f"""
        import os
        kind = {plant!r}
        if kind == "dir":
            os.mkdir({str(root)!r}, 0o700)
        elif kind == "open-dir":
            os.mkdir({str(root)!r}); os.chmod({str(root)!r}, 0o777)
        elif kind == "file":
            open({str(root)!r}, "w").close()
        else:
            os.mkdir({str(decoy)!r}, 0o777); os.symlink({str(decoy)!r}, {str(root)!r})
        # a fake fallback name of its own must be skipped, not used
        os.mkdir({str(root) + ".private-0000"!r}, 0o777)
    """)
    with caplog.at_level("ERROR", logger="kvfs.warm"):
        with WarmTier(None, str(shared / "kvfs-warm-{uid}"), shards=4, volume_id="vol-1") as w:
            w.append("s", 0, b"x")
            got = Path(w.root_path)
    assert any("using the private warm root" in r.getMessage() for r in caplog.records)
    assert got.name.startswith(root.name + ".private-") and got.name != root.name + ".private-0000"
    assert os.lstat(got).st_uid == os.geteuid() and mode(got) == 0o700
    again = open_root(str(root))  # another process of ours (the vLLM store) finds the same
    try:
        assert again.path == str(got)
        SessionLocks(again.sub("vol-1").sub("locks"))
    finally:
        again.close()
    assert not decoy.exists() or os.listdir(decoy) == []


def test_a_root_of_ours_refused_outside_a_shared_directory_stays_an_error(tmp_path):
    from kvfs.warm.rootdir import open_root
    (tmp_path / "warm").symlink_to(tmp_path)
    with pytest.raises(WarmError, match="symbolic link"):
        open_root(str(tmp_path / "warm"))


def test_symlinks_planted_inside_our_root_are_never_followed(tmp_path):
    root, victim, elsewhere = tmp_path / "warm", tmp_path / "precious", tmp_path / "elsewhere"
    victim.write_text("do not truncate")
    elsewhere.mkdir(mode=0o700)
    WarmTier(None, str(root), shards=1).close()
    proc = root / f"proc-{os.getpid()}"
    lock = root / "locks" / SessionLocks.name("s")
    lock.symlink_to(victim)  # a session's lock file
    with WarmTier(None, str(root), shards=1) as w:
        with pytest.raises(WarmError, match="symbolic link"):
            w.append("s", 0, b"abc")
    lock.unlink()
    name = shard_file_name(0, 1)
    (proc / name).symlink_to(victim)  # where the shard lives: set aside, never opened
    (proc / f"{name}.tmp.{os.getpid()}").symlink_to(victim)  # its temporary name: removed
    with WarmTier(None, str(root), shards=1) as w:
        w.append("s", 0, b"abc")
        assert bytes(w.read("s", 0, 0, 3)) == b"abc"
    assert victim.read_text() == "do not truncate"
    assert stat.S_ISREG(os.lstat(proc / name).st_mode) and mode(proc / name) == 0o600
    shutil.rmtree(proc)
    proc.symlink_to(elsewhere)  # our process directory itself
    (root / "locks").rename(root / "locks.real")
    (root / "locks").symlink_to(elsewhere)
    with pytest.raises(WarmError, match="symbolic link"):
        WarmTier(None, str(root), shards=1)
    assert os.listdir(elsewhere) == [] and victim.read_text() == "do not truncate"


def _squat(sessions: Path) -> None:
    """As the attacker: sess-42 world-writable with a 0666 layer and a meta of theirs."""
    run_as(ATTACKER, f"""
        import os
        d = {str(sessions / 'sess-42')!r}
        os.mkdir(d); os.chmod(d, 0o777)
        for name, data in (("layer_0", b"attacker KV"), ("meta.json", b'{{"tokens": 999}}')):
            fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT, 0o666)
            os.write(fd, data); os.close(fd); os.chmod(os.path.join(d, name), 0o666)
    """)


def _check_squat_refused(cold: Path, root: Path) -> None:
    sq = cold / "sessions" / "sess-42"
    with WarmTier(str(cold), str(root), shards=4) as w:
        for call in (lambda: w.append("sess-42", 0, b"agent KV"), lambda: w.get_meta("sess-42"),
                     lambda: w.read("sess-42", 0, 0, 11), lambda: w.delete("sess-42")):
            with pytest.raises(WarmError, match=f"owned by uid {ATTACKER}"):
                call()
        w.append("sess-7", 0, b"agent KV")  # other sessions are unaffected
        w.migrate()
        assert bytes(w.read("sess-7", 0, 0, 8)) == b"agent KV"
    assert (sq / "layer_0").read_bytes() == b"attacker KV" and len(os.listdir(sq)) == 2
    assert os.stat(cold / "sessions" / "sess-7").st_uid == os.geteuid()


@as_root
def test_session_squatting_in_a_shared_cold_dir_is_refused(shared):
    cold = shared / "cold"
    (cold / "sessions").mkdir(parents=True)
    os.chmod(cold / "sessions", 0o1777)  # as a shared mount shows it
    _squat(cold / "sessions")
    _check_squat_refused(cold, shared / "warm")


def test_unsafe_cold_session_dirs_and_files_of_our_own_are_refused(tmp_path):
    cold = tmp_path / "cold"
    sessions = cold / "sessions"
    sessions.mkdir(parents=True)
    (sessions / "open").mkdir()
    os.chmod(sessions / "open", 0o777)  # ours, but anyone may swap files in it
    (sessions / "elsewhere").mkdir(mode=0o700)
    (sessions / "elsewhere" / "layer_0").write_bytes(b"other session")
    (sessions / "link").symlink_to(sessions / "elsewhere")
    (sessions / "w").mkdir(mode=0o700)
    (sessions / "w" / "layer_0").write_bytes(b"x")
    os.chmod(sessions / "w" / "layer_0", 0o646)
    with WarmTier(str(cold), str(tmp_path / "warm"), shards=4) as w:
        with pytest.raises(WarmError, match="writable by group/other"):
            w.append("open", 0, b"agent KV")
        with pytest.raises(WarmError, match="not a directory"):
            w.read("link", 0, 0, 13)
        with pytest.raises(WarmError, match="writable by group/other"):
            w.read("w", 0, 0, 1)
    assert (sessions / "elsewhere" / "layer_0").read_bytes() == b"other session"
    assert os.listdir(sessions / "open") == []


@pytest.mark.skipif(not HAVE_FUSE or os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs /dev/fuse, root and setpriv")
def test_session_squatting_on_a_shared_mount_is_refused(shared):
    m = Mount(shared / "vol.kvfs", shared / "mnt", "64M", ("--allow-other",)).start()
    try:
        assert mode(m.sessions) == 0o1777
        _squat(m.sessions)
        _check_squat_refused(m.root, shared / "warm")
    finally:
        assert m.stop() == 0, m.log_text()


@as_root
def test_default_root_is_per_user_so_nobody_locks_the_others_out(shared, monkeypatch):
    """The default RAM-tier root was one shared path: whoever created it first after boot
    owned it and every other user's agent (root's too) failed. It is now per uid
    (``/dev/shm/kvfs-warm-<uid>``), made 0700 by one mkdir whatever the umask."""
    from kvfs.ops import profiles
    from kvfs.warm import rootdir

    assert rootdir.DEFAULT_ROOT == "/dev/shm/kvfs-warm-{uid}"
    assert profiles.load("gov").warm_kwargs()["root"] == f"/dev/shm/kvfs-warm-{os.geteuid()}"
    template = str(shared / "kvfs-warm-{uid}")
    out = run_as(ATTACKER, f"""
        import os
        os.umask(0)
        from kvfs.warm import WarmTier
        with WarmTier(None, {template!r}, shards=4) as w:  # the attacker comes first
            w.append("mine", 0, b"x")
        print("ok")
    """)
    assert out == "ok"
    mine = shared / f"kvfs-warm-{ATTACKER}"
    assert os.lstat(mine).st_uid == ATTACKER and mode(mine) == 0o700
    old = os.umask(0)
    try:
        with WarmTier(None, template, shards=4) as w:  # root's agent still starts
            w.append("root-session", 0, b"y")
    finally:
        os.umask(old)
    assert os.lstat(shared / "kvfs-warm-0").st_uid == 0 and mode(shared / "kvfs-warm-0") == 0o700
    out = run_as(OTHER, f"""
        from kvfs.warm import WarmTier
        with WarmTier(None, {template!r}, shards=4) as w:
            print(w.root)
    """)
    assert out == template and mode(shared / f"kvfs-warm-{OTHER}") == 0o700

"""deploy/mount.fuse.kvfs: option translation, installation, and `mount -t fuse.kvfs` for real."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "deploy" / "mount.fuse.kvfs"
INSTALL = ROOT / "deploy" / "install_mount_helper.sh"
SBIN_HELPER = Path("/sbin/mount.fuse.kvfs")

FAKE_MOUNT_PY = """\
import json, sys
json.dump(sys.argv[1:], open(sys.argv[0] + ".argv.json", "w"))
"""


def _fake_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    fake = tmp_path / "fake_mount.py"
    fake.write_text(FAKE_MOUNT_PY)
    env = dict(os.environ, KVFS_PYTHON=sys.executable, KVFS_MOUNT_PY=str(fake))
    return env, Path(str(fake) + ".argv.json")


def _helper(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(HELPER), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=30)


def test_options_translate_to_mount_py_flags(tmp_path) -> None:
    env, argv_file = _fake_env(tmp_path)
    (tmp_path / "mnt").mkdir()
    r = _helper(["kv.vol", "mnt", "-n", "-o",
                 "rw,profile=iot,size=64M,sparse,allow_other,metrics_port=9100,metrics_addr=::,"
                 "config=/etc/kvfs.toml,"
                 "log=/var/log/kvfs.log,hot_sessions=8,_netdev,nofail,noauto,x-systemd.after=a,"
                 "nosuid,nodev,bogus"], env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "ignoring unknown option 'bogus'" in r.stderr
    assert json.loads(argv_file.read_text()) == [
        str(tmp_path / "kv.vol"), str(tmp_path / "mnt"), "--profile", "iot", "--size", "64M",
        "--sparse", "--allow-other", "--metrics-port", "9100", "--metrics-addr", "::",
        "--config", "/etc/kvfs.toml",
        "--log", "/var/log/kvfs.log", "-o", "hot_sessions=8"]


def test_fake_and_verbose_print_the_command(tmp_path) -> None:
    env, argv_file = _fake_env(tmp_path)
    (tmp_path / "m").mkdir()
    r = _helper(["/dev/sdz", str(tmp_path / "m"), "-fv", "-o", "profile=gov"], env, tmp_path)
    assert r.returncode == 0 and not argv_file.exists()  # -f: fake, nothing run
    assert f"/dev/sdz {tmp_path / 'm'} --profile gov" in r.stderr


def test_default_entry_is_the_package_module(tmp_path) -> None:
    """Without KVFS_MOUNT_PY the helper runs the installed package: PYTHON -m kvfs.cli.mount."""
    env = dict(os.environ, KVFS_PYTHON=sys.executable)
    env.pop("KVFS_MOUNT_PY", None)
    (tmp_path / "m").mkdir()
    r = _helper(["kv.vol", "m", "-f", "-v", "-o", "profile=iot"], env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert (f"{sys.executable} -m kvfs.cli.mount {tmp_path / 'kv.vol'} {tmp_path / 'm'} "
            "--profile iot") in r.stderr
    from kvfs.cli import mount as cli_mount
    from kvfs.fuse import mount as fuse_mount

    assert cli_mount.main is fuse_mount.main


@pytest.mark.parametrize("args,code,text", [
    (["v", "m", "-o", "ro"], 32, "read-only"),
    (["v", "missing"], 32, "does not exist"),
    (["v"], 2, "usage"),
    (["v", "m", "-x"], 2, "unknown flag"),
])
def test_helper_refusals(tmp_path, args, code, text) -> None:
    env, argv_file = _fake_env(tmp_path)
    (tmp_path / "m").mkdir()
    r = _helper(args, env, tmp_path)
    assert r.returncode == code and text in r.stderr and r.stderr.count("\n") == 1
    assert not argv_file.exists()


def test_missing_python_is_one_clear_line(tmp_path) -> None:
    env, _ = _fake_env(tmp_path)
    env["KVFS_PYTHON"] = str(tmp_path / "nopython")
    (tmp_path / "m").mkdir()
    r = _helper(["v", "m"], env, tmp_path)
    assert r.returncode == 1 and "KVFS_PYTHON" in r.stderr


def test_install_script(tmp_path) -> None:
    env = dict(os.environ, SBIN=str(tmp_path))
    dest = tmp_path / "mount.fuse.kvfs"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(INSTALL), *args], env=env, capture_output=True,
                              text=True, timeout=30)

    assert run().returncode == 0 and dest.resolve() == HELPER.resolve()
    assert run().returncode == 0  # idempotent
    assert os.access(HELPER, os.X_OK)
    dest.unlink()
    dest.symlink_to("/bin/true")
    assert run().returncode == 1 and "--force" in run().stderr
    assert run("--uninstall").returncode == 1 and dest.is_symlink()  # not ours: kept
    assert run("--force").returncode == 0 and dest.resolve() == HELPER.resolve()
    assert run("--uninstall").returncode == 0 and not dest.exists() and not dest.is_symlink()


# --- through mount(8): needs root, mount(8), and /sbin/mount.fuse.kvfs ------------------------

def _can_install() -> str | None:
    if os.geteuid() != 0:
        return "mount -t fuse.kvfs needs root (the helper goes into /sbin)"
    if not shutil.which("mount") or not shutil.which("umount"):
        return "mount(8)/umount(8) not installed"
    return None


@pytest.fixture
def installed_helper():
    """/sbin/mount.fuse.kvfs, installed for the test (removed after only if we put it there).
    Yields the environment to run mount(8) with, pointing the helper at this checkout."""
    reason = _can_install()
    if reason:
        pytest.skip(reason)
    ours = not (SBIN_HELPER.exists() or SBIN_HELPER.is_symlink())
    if ours:
        subprocess.run(["bash", str(INSTALL)], check=True, capture_output=True, timeout=30)
    try:
        yield dict(os.environ, KVFS_HOME=str(ROOT))
    finally:
        if ours:
            subprocess.run(["bash", str(INSTALL), "--uninstall"], capture_output=True, timeout=30)


def test_mount_t_finds_the_helper(tmp_path, installed_helper) -> None:
    env, argv_file = _fake_env(tmp_path)
    env.update(installed_helper, KVFS_MOUNT_PY=env["KVFS_MOUNT_PY"])
    (tmp_path / "m").mkdir()
    r = subprocess.run(["mount", "-t", "fuse.kvfs", str(tmp_path / "kv.vol"), str(tmp_path / "m"),
                        "-o", "profile=ecommerce,size=32M,lru_group=3"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(argv_file.read_text()) == [
        str(tmp_path / "kv.vol"), str(tmp_path / "m"), "--profile", "ecommerce", "--size", "32M",
        "-o", "lru_group=3"]


def _skip_real_mount() -> None:
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing (modprobe fuse, or run the container with --device /dev/fuse)")


def _wait_daemon_gone(volume: Path, timeout: float = 15.0) -> None:
    """After umount the mount daemon flushes and exits; wait so tmp_path can go."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(volume).encode() in cmd and b"kvfs.cli.mount" in cmd:
                alive = True
                break
        if not alive:
            return
        time.sleep(0.05)
    raise AssertionError(f"the mount daemon of {volume} did not exit after umount")


def _mounted_then_umount(mnt: Path, volume: Path, log: Path, r: subprocess.CompletedProcess) -> None:
    try:
        assert r.returncode == 0, f"{r.stderr}\n{log.read_text() if log.exists() else ''}"
        assert os.path.ismount(mnt)
        (mnt / "sessions" / "s1").mkdir()
        (mnt / "sessions" / "s1" / "layer_0").write_bytes(b"kv" * 100)
        assert json.loads((mnt / ".kvfs" / "stats").read_text())
    finally:
        u = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, timeout=60)
        if u.returncode != 0 and os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60)
    assert u.returncode == 0, u.stderr
    assert not os.path.ismount(mnt)
    _wait_daemon_gone(volume)
    assert volume.stat().st_size == 32 << 20


@pytest.mark.mount
def test_mount_t_fuse_kvfs_mounts_a_fresh_volume(tmp_path, installed_helper) -> None:
    _skip_real_mount()
    vol, mnt, log = tmp_path / "kv.vol", tmp_path / "mnt", tmp_path / "mount.log"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "fuse.kvfs", str(vol), str(mnt),
                        "-o", f"profile=gov,size=32M,log={log},hot_sessions=200"],
                       env=installed_helper, capture_output=True, text=True, timeout=60)
    _mounted_then_umount(mnt, vol, log, r)


@pytest.mark.mount
def test_fstab_line_mounts(tmp_path, installed_helper) -> None:
    _skip_real_mount()
    vol, mnt, log = tmp_path / "kv.vol", tmp_path / "mnt", tmp_path / "mount.log"
    mnt.mkdir()
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{vol}  {mnt}  fuse.kvfs  profile=iot,size=32M,log={log},noauto,nofail  0  0\n")
    r = subprocess.run(["mount", "--fstab", str(fstab), str(mnt)], env=installed_helper,
                       capture_output=True, text=True, timeout=60)
    _mounted_then_umount(mnt, vol, log, r)


@pytest.mark.mount
def test_bad_option_mounts_nothing(tmp_path, installed_helper) -> None:
    _skip_real_mount()
    vol, mnt = tmp_path / "kv.vol", tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "fuse.kvfs", str(vol), str(mnt),
                        "-o", "profile=gov,size=32M,warm_shards=1000"],
                       env=installed_helper, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "warm_shards" in r.stderr and "power of two" in r.stderr
    assert r.stderr.strip().count("\n") == 0
    assert not os.path.ismount(mnt) and not vol.exists()

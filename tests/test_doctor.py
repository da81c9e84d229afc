"""kvfs-doctor: real values on this host, and a fake /proc that needs fixing."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from kvfs.cli import doctor
from kvfs.ops.profiles import load
from kvfs.ops.units import parse_size

ROOT = Path(__file__).resolve().parents[1]

SYSCTLS = {"vm.swappiness": ("==", 1), "vm.vfs_cache_pressure": ("==", 50),
           "fs.aio-max-nr": (">=", 65536)}


def _by_name(checks) -> dict:
    return {c.name: c for c in checks}


def _fake_proc(tmp_path: Path, **values: int) -> Path:
    root = tmp_path / "proc_sys"
    for key, v in values.items():
        p = root.joinpath(*key.replace("__", "-").split("_dot_"))
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"{v}\n")
    return root


def _proc(tmp_path: Path, swappiness: int, pressure: int, aio: int) -> Path:
    return _fake_proc(tmp_path, **{"vm_dot_swappiness": swappiness,
                                   "vm_dot_vfs_cache_pressure": pressure,
                                   "fs_dot_aio__max__nr": aio})


def test_real_host_values() -> None:
    checks = _by_name(doctor.run_checks(warm_root="/dev/shm/kvfs-warm"))
    for key, (op, want) in SYSCTLS.items():
        path = Path("/proc/sys", *key.split("."))
        if not path.exists():
            assert checks[key].current == "unreadable"
            continue
        real = int(path.read_text().split()[0])
        c = checks[key]
        assert c.current == str(real)
        ok = real == want if op == "==" else real >= want
        assert c.status == ("ok" if ok else "warn")
        assert not c.blocking
    assert (checks["/dev/fuse"].status == "ok") == (
        os.path.exists("/dev/fuse") and os.access("/dev/fuse", os.R_OK | os.W_OK))
    assert (checks["fusermount3"].status == "ok") == (shutil.which("fusermount3") is not None)
    assert checks["fusermount3"].current == (shutil.which("fusermount3") or "not found")
    assert checks["pyfuse3"].status == ("ok" if importlib.util.find_spec("pyfuse3") else "fail")
    assert checks["volume room"].status == "skip"
    if os.path.isdir("/dev/shm"):
        assert "free of" in checks["warm tier room"].current


def test_fake_proc_flags_wrong_values_with_the_fix(tmp_path) -> None:
    proc = _proc(tmp_path, 60, 100, 1024)
    checks = _by_name(doctor.run_checks(proc_sys=proc))
    for key, want in (("vm.swappiness", 1), ("vm.vfs_cache_pressure", 50), ("fs.aio-max-nr", 65536)):
        c = checks[key]
        assert c.status == "warn" and not c.blocking
        assert any(f"sysctl -w {key}={want}" in f for f in c.fix)
        assert any(f"'{key} = {want}'" in f and "/etc/sysctl.d/" in f for f in c.fix)
    assert (checks["vm.swappiness"].current, checks["fs.aio-max-nr"].current) == ("60", "1024")
    text = doctor.render(list(checks.values()))
    assert "sysctl -w vm.swappiness=1" in text and "WARN" in text


def test_fake_proc_good_values(tmp_path) -> None:
    proc = _proc(tmp_path, 1, 50, 1 << 20)
    checks = _by_name(doctor.run_checks(proc_sys=proc))
    assert all(checks[k].status == "ok" and not checks[k].fix for k in SYSCTLS)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _by_name(doctor.run_checks(proc_sys=empty))["vm.swappiness"].current == "unreadable"


def test_blocking_failures(tmp_path) -> None:
    def no_import(name: str):
        raise ImportError(f"No module named {name!r}")

    checks = doctor.run_checks(proc_sys=_proc(tmp_path, 1, 50, 65536),
                               dev_fuse=tmp_path / "fuse", which=lambda _: None,
                               import_module=no_import)
    by = _by_name(checks)
    for name, fix in (("/dev/fuse", "modprobe fuse"), ("fusermount3", "apt-get install -y fuse3"),
                      ("pyfuse3", "pip install pyfuse3")):
        assert by[name].status == "fail" and by[name].blocking
        assert any(fix in f for f in by[name].fix), name
    assert doctor.blocked(checks)
    (tmp_path / "notdev").write_text("")
    assert doctor.check_dev_fuse(tmp_path / "notdev").status == "fail"


def test_tuning_alone_does_not_block(tmp_path) -> None:
    checks = doctor.run_checks(proc_sys=_proc(tmp_path, 60, 100, 1), dev_fuse="/dev/null",
                               which=lambda _: "/usr/bin/fusermount3",
                               import_module=lambda _: object())
    assert not doctor.blocked(checks)
    assert "kvfs can run here" in doctor.render(checks)


def test_warm_room(tmp_path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(f"tmpfs {tmp_path} tmpfs rw 0 0\n/dev/vda / ext4 rw 0 0\n")
    big = doctor.check_warm_room(tmp_path / "warm", 1 << 60, mounts)
    assert big.status == "warn"
    assert any("mount -o remount,size=" in f and str(tmp_path) in f for f in big.fix)
    assert any("warm_cap_bytes=" in f for f in big.fix)
    # every size it suggests is one kvfs-mount and mount(8) read back
    remount = next(f for f in big.fix if "remount,size=" in f)
    assert parse_size(remount.split("size=")[1].split()[0]) >= 1 << 60
    cap = next(f for f in big.fix if "warm_cap_bytes=" in f).split("warm_cap_bytes=")[1]
    assert 1 << 20 <= parse_size(cap) <= 1 << 60
    small = doctor.check_warm_room(tmp_path / "warm", 1 << 20, mounts)
    assert small.status == "ok" and "tmpfs" in small.current
    mounts.write_text("/dev/vda / ext4 rw 0 0\n")
    disk = doctor.check_warm_room(tmp_path / "warm", 1 << 20, mounts)
    assert disk.status == "warn" and any("--warm-root /dev/shm" in f for f in disk.fix)


def test_volume_room(tmp_path) -> None:
    vol = tmp_path / "kv.vol"
    assert doctor.check_volume_room(vol, 1 << 20).status == "ok"
    huge = doctor.check_volume_room(vol, 1 << 62)
    assert huge.status == "warn" and "--size" in huge.fix[0]
    vol.write_bytes(b"\0" * 4096)
    have = doctor.check_volume_room(vol, 1 << 62)
    assert have.status == "ok" and "exists" in have.current
    checks = _by_name(doctor.run_checks(load("gov", {"ring_size": "2M"}), volume=tmp_path / "n"))
    assert checks["volume room"].wanted == ">= 2.0 MiB free"


def test_main_exit_codes_and_json(tmp_path, capsys) -> None:
    proc = _proc(tmp_path, 60, 50, 65536)
    rc = doctor.main(["--proc-sys", str(proc), "--dev-fuse", str(tmp_path / "nofuse")])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out and "modprobe fuse" in out and "sysctl -w vm.swappiness=1" in out
    rc = doctor.main(["--json", "--proc-sys", str(proc), "--volume", str(tmp_path / "v"),
                      "--size", "1M", "--profile", "iot"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile"] == "iot" and rc == (1 if doc["blocked"] else 0)
    by = {c["name"]: c for c in doc["checks"]}
    assert by["vm.swappiness"]["current"] == "60" and by["volume room"]["status"] == "ok"


@pytest.mark.parametrize("argv,key", [(["-o", "warm_shards=3"], "warm_shards"),
                                      (["--profile", "bank"], "bank"),
                                      (["--size", "lots"], "--size")])
def test_main_bad_arguments(capsys, argv, key) -> None:
    assert doctor.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and key in err

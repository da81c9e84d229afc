#!/usr/bin/env python3
"""kvfs-doctor: check this host against the kvfs checklist and say what to change.

    kvfs-doctor [--profile gov] [--volume PATH] [--size SIZE] [--warm-root DIR] [--json]

Checks: vm.swappiness = 1, vm.vfs_cache_pressure = 50, fs.aio-max-nr >= 65536 (tuning:
warnings), /dev/fuse, fusermount3 and pyfuse3 (blocking: kvfs cannot mount without them),
free RAM-backed room for the warm tier and free disk for the volume (warnings). Prints a
table and, for each problem, the exact command that fixes it. Exit status 1 only when a
blocking check fails, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvfs.cli.output import pipe_safe
from kvfs.ops import profiles, units

SYSCTL_FILE = "/etc/sysctl.d/99-kvfs.conf"
RAM_FS = {"tmpfs", "ramfs"}

# (key, comparison, wanted, why)
SYSCTLS: list[tuple[str, str, int, str]] = [
    ("vm.swappiness", "==", 1, "keep warm shards and the hot path out of swap"),
    ("vm.vfs_cache_pressure", "==", 50, "keep dentries/inodes of the mount cached"),
    ("fs.aio-max-nr", ">=", 65536, "room for asynchronous I/O on the volume"),
]


@dataclass
class Check:
    name: str
    current: str
    wanted: str
    status: str  # "ok" | "warn" | "fail" | "skip"
    blocking: bool = False  # a failure here stops kvfs from running at all
    fix: list[str] = field(default_factory=list)
    detail: str = ""


def _sudo() -> str:
    return "" if os.geteuid() == 0 else "sudo "


def check_sysctl(proc_sys: str | Path, key: str, op: str, want: int, why: str) -> Check:
    path = Path(proc_sys, *key.split("."))
    wanted = f"{op} {want}" if op != "==" else str(want)
    try:
        raw = path.read_text().split()
        value = int(raw[0])
    except (OSError, ValueError, IndexError) as e:
        return Check(key, "unreadable", wanted, "warn", detail=f"{path}: {e}")
    ok = value == want if op == "==" else value >= want
    fix = [] if ok else [f"{_sudo()}sysctl -w {key}={want}",
                         f"echo '{key} = {want}' | {_sudo()}tee -a {SYSCTL_FILE}"]
    return Check(key, str(value), wanted, "ok" if ok else "warn", fix=fix, detail=why)


def check_dev_fuse(dev_fuse: str | Path) -> Check:
    p = str(dev_fuse)
    try:
        st = os.stat(p)
    except OSError:
        return Check("/dev/fuse", "missing", "character device", "fail", blocking=True,
                     fix=[f"{_sudo()}modprobe fuse",
                          "in a container: run it with --device /dev/fuse --cap-add SYS_ADMIN"])
    if not stat.S_ISCHR(st.st_mode):
        return Check("/dev/fuse", "not a character device", "character device", "fail",
                     blocking=True, fix=[f"{_sudo()}rm {p} && {_sudo()}modprobe fuse"])
    if not os.access(p, os.R_OK | os.W_OK):
        return Check("/dev/fuse", f"mode {stat.filemode(st.st_mode)}, no access", "read/write",
                     "fail", blocking=True, fix=[f"{_sudo()}chmod 0666 {p}"])
    return Check("/dev/fuse", "present", "character device", "ok")


def check_fusermount(which: Callable[[str], str | None]) -> Check:
    path = which("fusermount3")
    if path:
        return Check("fusermount3", path, "on PATH", "ok")
    return Check("fusermount3", "not found", "on PATH", "fail", blocking=True,
                 fix=[f"{_sudo()}apt-get install -y fuse3"])


def check_pyfuse3(import_module: Callable[[str], Any]) -> Check:
    try:
        mod = import_module("pyfuse3")
    except Exception as e:  # ImportError, or a broken libfuse3 behind it
        return Check("pyfuse3", f"not importable ({type(e).__name__})", "importable", "fail",
                     blocking=True, detail=str(e),
                     fix=[f"{_sudo()}apt-get install -y libfuse3-dev pkg-config",
                          f"{sys.executable} -m pip install pyfuse3  (or: make setup)"])
    return Check("pyfuse3", str(getattr(mod, "__version__", "importable")), "importable", "ok")


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _fstype(path: Path, mounts: str | Path) -> tuple[str, str]:
    """(mount point, fs type) of the filesystem holding ``path``, from /proc/mounts."""
    best = ("/", "unknown")
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return best
    real = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[0]):
            best = (mnt, parts[2])
    return best


def _free(path: Path) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def check_warm_room(warm_root: str | Path, cap: int, mounts: str | Path) -> Check:
    fmt = units.format_size
    root = Path(warm_root)
    where = _existing(root)
    mnt, fstype = _fstype(where, mounts)
    try:
        free, total = _free(where)
    except OSError as e:
        return Check("warm tier room", "unreadable", f">= {fmt(cap)} free", "warn", detail=str(e))
    used = 0
    if root.is_dir():  # what the warm tier already holds counts toward its cap
        used = sum(f.stat().st_blocks * 512 for f in root.rglob("*") if f.is_file())
    current = f"{fmt(free)} free of {fmt(total)} ({fstype} at {mnt})"
    wanted = f">= {fmt(cap)} free on tmpfs"
    fixes: list[str] = []
    if free + used < cap:
        if fstype in RAM_FS:
            want = units.size_arg(total + cap - free - used, up=True)
            fixes.append(f"{_sudo()}mount -o remount,size={want} {mnt}")
        fixes.append(f"or lower the cap: -o warm_cap_bytes={units.size_arg(max(free + used, 1 << 20))}")
    if fstype not in RAM_FS:
        fixes.append(f"use a RAM-backed warm root: --warm-root /dev/shm/kvfs-warm-{os.geteuid()} "
                     f"(or {_sudo()}mount -t tmpfs -o size={units.size_arg(cap, up=True)} tmpfs {root})")
    return Check("warm tier room", current, wanted, "warn" if fixes else "ok", fix=fixes,
                 detail=f"warm root {root}")


def check_volume_room(volume: str | Path | None, size: int) -> Check:
    fmt = units.format_size
    if volume is None:
        return Check("volume room", "no --volume given", f">= {fmt(size)} free", "skip")
    p = Path(volume)
    if p.exists():
        try:
            with open(p, "rb") as f:
                have = f.seek(0, os.SEEK_END)
        except OSError as e:
            return Check("volume room", f"{p}: {e.strerror}", "readable volume", "warn")
        kind = "block device" if p.is_block_device() else "file"
        return Check("volume room", f"{kind} of {fmt(have)} exists", "existing volume", "ok",
                     detail=str(p))
    where = _existing(p.parent)
    try:
        free, _total = _free(where)
    except OSError as e:
        return Check("volume room", "unreadable", f">= {fmt(size)} free", "warn", detail=str(e))
    ok = free >= size
    fix = [] if ok else [f"put the volume on a disk with {fmt(size)} free, or create it smaller: "
                         f"--size {units.size_arg(free * 9 // 10)}"]
    return Check("volume room", f"{fmt(free)} free at {where}", f">= {fmt(size)} free",
                 "ok" if ok else "warn", fix=fix, detail=str(p))


def run_checks(profile: profiles.Profile | None = None, *, warm_root: str | Path | None = None,
               volume: str | Path | None = None, size: int | None = None,
               proc_sys: str | Path = "/proc/sys", dev_fuse: str | Path = "/dev/fuse",
               mounts: str | Path = "/proc/mounts",
               which: Callable[[str], str | None] = shutil.which,
               import_module: Callable[[str], Any] = importlib.import_module) -> list[Check]:
    """Every check, in table order. Paths and look-ups are injectable for tests."""
    prof = profile or profiles.load("gov")
    checks = [check_sysctl(proc_sys, *s) for s in SYSCTLS]
    checks += [check_dev_fuse(dev_fuse), check_fusermount(which), check_pyfuse3(import_module)]
    checks.append(check_warm_room(profiles.user_path(str(warm_root or prof.warm_root)),
                                  prof.warm_cap_bytes, mounts))
    checks.append(check_volume_room(volume, size or prof.ring_size))
    return checks


def blocked(checks: list[Check]) -> bool:
    return any(c.status == "fail" and c.blocking for c in checks)


def render(checks: list[Check]) -> str:
    rows = [("check", "current", "wanted", "status")]
    rows += [(c.name, c.current, c.wanted, c.status.upper() if c.status != "ok" else "ok")
             for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    out = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    todo = [c for c in checks if c.fix and c.status in ("warn", "fail")]
    if todo:
        out += ["", "To fix:"]
        for c in todo:
            why = f"  ({c.detail})" if c.detail else ""
            out.append(f"  {c.name}{why}:")
            out += [f"    {cmd}" for cmd in c.fix]
    n_fail = sum(c.status == "fail" for c in checks)
    n_warn = sum(c.status == "warn" for c in checks)
    verdict = ("kvfs cannot mount on this host until the FAIL lines are fixed" if blocked(checks)
               else "kvfs can run here" + (" (tuning advice above)" if n_warn else ""))
    out += ["", f"{len(checks) - n_fail - n_warn} ok, {n_warn} warnings, {n_fail} failures: "
                f"{verdict}"]
    return "\n".join(out)


@pipe_safe
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfs-doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="gov", help="profile whose sizes are checked (gov)")
    ap.add_argument("--config", help="config file (TOML or JSON) of profile overrides")
    ap.add_argument("-o", dest="opts", action="append", default=[], metavar="KEY=VALUE",
                    help="profile override, as for kvfs-mount")
    ap.add_argument("--warm-root", help="warm tier directory (default: the profile's)")
    ap.add_argument("--volume", help="volume path to check free disk for")
    ap.add_argument("--size", help="volume size to expect instead of the profile's ring_size")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--proc-sys", default="/proc/sys", help=argparse.SUPPRESS)
    ap.add_argument("--dev-fuse", default="/dev/fuse", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        prof = profiles.load(args.profile, profiles.parse_overrides(args.opts), args.config)
        size = units.parse_size(args.size) if args.size else None
    except profiles.ProfileError as e:
        print(f"kvfs-doctor: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"kvfs-doctor: --size: {e}", file=sys.stderr)
        return 2
    checks = run_checks(prof, warm_root=args.warm_root, volume=args.volume, size=size,
                        proc_sys=args.proc_sys, dev_fuse=args.dev_fuse)
    if args.json:
        print(json.dumps({"profile": prof.name, "blocked": blocked(checks),
                          "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render(checks))
    return 1 if blocked(checks) else 0


if __name__ == "__main__":
    sys.exit(main())

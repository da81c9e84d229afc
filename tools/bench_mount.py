#!/usr/bin/env python3
"""Benchmarks through a real kvfs mount vs the same bytes in a plain ext4 directory.

Both sides are measured interleaved in the same run, on the same disk (the volume and the
peer directory are siblings under the work directory):

- ``fsync_appends`` (figure 2): one 96 KiB round appended then ``fsync``, over and over,
  through the mount vs ``os.write`` + ``os.fsync`` on an ext4 file (goal >= 0.8x).
- ``seq_read`` (figure 2): a 128 MiB layer file (32 MiB with ``quick``) read front to
  back in 1 MiB reads after dropping the caches (goal >= 0.9x). The mount is restarted
  before each sample so the engine's decoded-entry cache starts empty too.
- ``mount_time`` (figure 7): mount time, first lookup and the mount process's RSS with
  10k / 100k / 1M sessions (1k / 10k with ``quick``), vs the smallest count.
- ``random_read`` (figure 1): one 96 KiB round at random, caches dropped before each
  sample (DONTNEED on the volume, the peer and the mounted file), from a file appended
  round by round and one written in 1 MiB writes, never twice from one ring entry (the
  engine's decoded-entry cache never serves one); p50 and p99 (goals 1.5x and 1.3x).

Figures 1 and 2 also measure the same work through ``tools/fuse_floor.py``, a pyfuse3
passthrough over the same ext4 directory (rows marked ``[FUSE floor]``): what any pyfuse3
server loses to ext4 here, which bounds what kvfs can reach through FUSE.

Each takes ``quick`` and an optional ``workdir`` and returns ``{"results": [...],
"info": {...}}`` (see ``bench_common``); ``page_cache=True`` mounts with ``--page-cache``
(docs/mount.md's comparison). ``python tools/bench_mount.py [--quick] [--page-cache]
[--offload-reads|syncs] [--sparse] [--only append,seq,random,time]`` prints the figures.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import (
    KiB,
    MiB,
    Result,
    bench_dir,
    drop_caches,
    fadvise_dontneed,
    interleave,
    kv_bytes,
)

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("bench.mount")

ROUND = 96 * KiB  # one agent round of one layer
MOUNT_TIMEOUT = 30.0
MOUNT_ARGS: list[str] = []  # more kvfs-mount options for every mount (``--offload-*``, ``--sparse``)


@contextmanager
def mounted(volume: Path, mountpoint: Path, size: int | None,
            page_cache: bool = False) -> Iterator[Path]:
    """``mount.py VOLUME MOUNTPOINT --foreground`` for the duration, the volume created at
    ``size`` when missing (None: it must exist); RuntimeError when it does not come up."""
    with _mount_process(volume, mountpoint, size, page_cache) as (path, _):
        yield path


@contextmanager
def _mount_process(volume: Path, mountpoint: Path, size: int | None,
                   page_cache: bool = False) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    args = [sys.executable, "-m", "kvfs.cli.mount", str(volume), str(mountpoint), "--foreground",
            "--log", str(volume) + ".log"]
    if size is not None:
        args += ["--size", str(size)]
    if page_cache:
        args.append("--page-cache")
    with _serving(args + MOUNT_ARGS, mountpoint, "mount.py") as proc:
        yield mountpoint, proc


@contextmanager
def floor_mounted(backing: Path, mountpoint: Path) -> Iterator[Path]:
    """``tools/fuse_floor.py BACKING MOUNTPOINT`` (a pyfuse3 passthrough: the FUSE stack's
    floor) for the duration; yields the mountpoint."""
    backing.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, str(ROOT / "tools" / "fuse_floor.py"), str(backing), str(mountpoint)]
    with _serving(args, mountpoint, "fuse_floor.py"):
        yield mountpoint


@contextmanager
def _serving(args: list[str], mountpoint: Path, what: str) -> Iterator[subprocess.Popen[str]]:
    """A FUSE server process started with ``args``, once ``mountpoint`` is live (else
    RuntimeError); unmounted and waited for on the way out."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + MOUNT_TIMEOUT
    try:
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None:
                raise RuntimeError(f"{what} failed: {proc.stderr.read() if proc.stderr else ''}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: mount not live in time")
            time.sleep(0.005)
        yield proc
    finally:
        if os.path.ismount(mountpoint):
            subprocess.run(["fusermount3", "-u", str(mountpoint)], check=False)
        try:
            rc = proc.wait(timeout=MOUNT_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        if rc != 0:
            log.warning("%s exited with %s", what, rc)


FLOOR = "pyfuse3 passthrough (tools/fuse_floor.py)"


def _floor_result(fig: str, name: str, vals: dict[str, list[float]], unit: str, better: str,
                  what: str, note: str, stat: str = "median") -> dict[str, Any]:
    """The FUSE floor's figure beside kvfs's: the same work through a pyfuse3 passthrough
    over the same ext4 directory vs ext4 itself (no goal: it bounds kvfs's)."""
    return Result(fig, f"{name} [FUSE floor]", f"{FLOOR}: {what}", f"ext4 file: {what}", unit,
                  {"subject": vals["floor"], "peer": vals["ext4"]}, better=better, stat=stat,
                  note=note).to_dict()


def _fresh(*paths: Path) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _append_rounds(path: Path, data: bytes, fsync: bool = True) -> float:
    """Seconds to append ``data`` round by round, fsync after each (a new file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
    mv = memoryview(data)
    try:
        t0 = time.perf_counter()
        for off in range(0, len(data), ROUND):
            os.write(fd, mv[off:off + ROUND])
            if fsync:
                os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _write_big(path: Path, data: bytes) -> None:
    """The bytes in 1 MiB writes (a layer file copied or migrated in one go)."""
    with open(path, "wb", buffering=0) as f:
        mv = memoryview(data)
        for off in range(0, len(data), MiB):
            f.write(mv[off:off + MiB])
        os.fsync(f.fileno())


def read_all(path: Path) -> float:
    """Seconds to read a whole file front to back in 1 MiB reads into a page-aligned
    buffer, as cat and dd do (an unaligned one splits each direct read in two)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = mmap.mmap(-1, MiB)
        t0 = time.perf_counter()
        while os.readv(fd, [buf]):
            pass
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def fsync_appends(quick: bool = False, workdir: str | None = None,
                  page_cache: bool = False) -> dict[str, Any]:
    """Figure 2: fsync'd 96 KiB appends through the mount vs on ext4 (MiB/s)."""
    work = bench_dir(workdir) / "mount_append"
    _fresh(work)
    work.mkdir(parents=True)
    size = 8 * MiB if quick else 32 * MiB
    reps = 3 if quick else 5
    data = kv_bytes(size, seed=2)
    vol, mnt, peer = work / "vol", work / "mnt", work / "ext4"
    peer.mkdir()
    mib = size / MiB
    with mounted(vol, mnt, 8 * (reps + 1) * size, page_cache) as m, \
            floor_mounted(work / "floor", work / "floor_mnt") as fm:
        (m / "sessions" / "bench").mkdir()
        counter = iter(range(1 << 30))
        vals = interleave([
            ("kvfs", lambda: mib / _append_rounds(m / "sessions" / "bench" / f"l{next(counter)}", data)),
            ("ext4", lambda: mib / _append_rounds(peer / "layer", data)),
            ("floor", lambda: mib / _append_rounds(fm / "layer", data)),
        ], reps, warmup=1)
        written = (m / "sessions" / "bench" / "l0").read_bytes()
    _fresh(work)
    if written != data:
        raise RuntimeError("the mount returned different bytes than were appended")
    name = f"append {mib:g} MiB as fsync'd {ROUND // KiB} KiB rounds"
    note = f"{'page cache' if page_cache else 'direct_io'}; fp16 random-normal KV"
    res = Result("2", name, "kvfs mount: write + fsync", "ext4 file: write + fsync", "MiB/s",
                 {"subject": vals["kvfs"], "peer": vals["ext4"]}, better="higher", goal=0.8,
                 note=note)
    floor = _floor_result("2", name, vals, "MiB/s", "higher", "write + fsync", note)
    return {"results": [res.to_dict(), floor], "info": {"bytes": size, "reps": reps}}


def seq_read(quick: bool = False, workdir: str | None = None,
             page_cache: bool = False) -> dict[str, Any]:
    """Figure 2: sequential read of a 128 MiB layer file with caches dropped (MiB/s)."""
    work = bench_dir(workdir) / "mount_seq"
    _fresh(work)
    work.mkdir(parents=True)
    size = 32 * MiB if quick else 128 * MiB
    reps = 3 if quick else 5
    data = kv_bytes(size, seed=3)
    vol, mnt, peer = work / "vol", work / "mnt", work / "ext4.layer"
    vsize = 2 * size + 64 * MiB
    with mounted(vol, mnt, vsize, page_cache) as m:
        (m / "sessions" / "bench").mkdir()
        _write_big(m / "sessions" / "bench" / "layer_0", data)
    _write_big(peer, data)
    floor_file = work / "floor" / "layer_0"
    floor_file.parent.mkdir()
    _write_big(floor_file, data)
    mib = size / MiB
    how: list[str] = []

    def kvfs_once() -> float:
        with mounted(vol, mnt, vsize, page_cache) as m:
            how.append(drop_caches([vol, peer]))
            return mib / read_all(m / "sessions" / "bench" / "layer_0")

    def ext4_once() -> float:
        drop_caches([vol, peer])
        return mib / read_all(peer)

    def floor_once() -> float:
        with floor_mounted(floor_file.parent, work / "floor_mnt") as fm:
            drop_caches([floor_file, peer])
            return mib / read_all(fm / "layer_0")

    try:
        vals = interleave([("kvfs", kvfs_once), ("ext4", ext4_once), ("floor", floor_once)],
                          reps, warmup=1)
    finally:
        _fresh(work)
    name = f"sequential read of a {mib:g} MiB layer file, caches dropped"
    note = (f"{'page cache' if page_cache else 'direct_io'}; written in 1 MiB writes; "
            f"caches dropped by {how[-1] if how else '?'}; mount restarted per sample")
    res = Result("2", name, "kvfs mount: 1 MiB reads", "ext4 file: 1 MiB reads", "MiB/s",
                 {"subject": vals["kvfs"], "peer": vals["ext4"]}, better="higher", goal=0.9,
                 note=note)
    floor = _floor_result("2", name, vals, "MiB/s", "higher", "1 MiB reads", note)
    return {"results": [res.to_dict(), floor], "info": {"bytes": size, "reps": reps}}


def _read_many(paths: list[Path]) -> float:
    """Seconds for one thread per file to read its whole file at once (``read_all``)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(paths)) as pool:
        t0 = time.perf_counter()
        list(pool.map(read_all, paths))
        return time.perf_counter() - t0


def concurrent_read(quick: bool = False, workdir: str | None = None,
                    page_cache: bool = False) -> dict[str, Any]:
    """Figure 2: 8 readers at once, each reading its own layer file, caches dropped
    (aggregate MiB/s) through the mount vs the same on ext4."""
    work = bench_dir(workdir) / "mount_conc"
    _fresh(work)
    work.mkdir(parents=True)
    readers = 8
    size = 4 * MiB if quick else 16 * MiB
    reps = 3 if quick else 5
    vol, mnt, peer_dir = work / "vol", work / "mnt", work / "ext4"
    peer_dir.mkdir()
    vsize = 2 * readers * size + 64 * MiB
    files = [f"layer_{i}" for i in range(readers)]
    with mounted(vol, mnt, vsize, page_cache) as m:
        (m / "sessions" / "bench").mkdir()
        for i, name in enumerate(files):
            data = kv_bytes(size, seed=10 + i)
            _write_big(m / "sessions" / "bench" / name, data)
            _write_big(peer_dir / name, data)
    total = readers * size / MiB

    def kvfs_once() -> float:
        with mounted(vol, mnt, vsize, page_cache) as m:
            drop_caches([vol, peer_dir])
            return total / _read_many([m / "sessions" / "bench" / n for n in files])

    def ext4_once() -> float:
        drop_caches([vol, peer_dir])
        return total / _read_many([peer_dir / n for n in files])

    try:
        vals = interleave([("kvfs", kvfs_once), ("ext4", ext4_once)], reps, warmup=1)
    finally:
        _fresh(work)
    res = Result("2", f"{readers} readers at once, {size // MiB} MiB layer file each, caches dropped",
                 f"kvfs mount: {readers} threads, 1 MiB reads", f"ext4: {readers} threads, 1 MiB reads",
                 "MiB/s", {"subject": vals["kvfs"], "peer": vals["ext4"]}, better="higher",
                 note=f"aggregate throughput; {'page cache' if page_cache else 'direct_io'}; "
                      "mount restarted per sample")
    return {"results": [res.to_dict()], "info": {"bytes": readers * size, "reps": reps}}


def _unshared_rounds(rounds: int, n: int) -> list[int]:
    """Up to ``n`` random rounds no two of which touch the same ring entry of a file written
    in 1 MiB writes (entries of ``ENTRY_MAX``): the engine's decoded-entry cache, which the
    benchmark cannot drop from outside, then never serves a sample."""
    from kvfs.fuse.ops import ENTRY_MAX

    used: set[int] = set()
    out = []
    for r in random.Random(7).sample(range(rounds), rounds):
        entries = {r * ROUND // ENTRY_MAX, ((r + 1) * ROUND - 1) // ENTRY_MAX}
        if not entries & used:
            used |= entries
            out.append(r)
            if len(out) == n:
                break
    return out


def random_read(quick: bool = False, workdir: str | None = None,
                page_cache: bool = False) -> dict[str, Any]:
    """Figure 1: one 96 KiB round at random, caches dropped, p50/p99 (ms).

    Two kvfs files hold the same bytes: one appended round by round (a live agent: one
    ring entry per round), one written in 1 MiB writes (a session migrated from warm:
    entries of the mount's maximum entry size, so a round is part of a bigger entry).
    """
    work = bench_dir(workdir) / "mount_random"
    _fresh(work)
    work.mkdir(parents=True)
    size = 32 * MiB if quick else 128 * MiB
    samples = 60 if quick else 300
    data = kv_bytes(size, seed=4)
    rounds = size // ROUND
    vol, mnt, peer = work / "vol", work / "mnt", work / "ext4.layer"
    peer.write_bytes(data)
    (work / "floor").mkdir()
    (work / "floor" / "layer").write_bytes(data)
    order = _unshared_rounds(rounds, samples + 10)
    names = ("rounds", "big", "ext4", "floor")
    vals: dict[str, list[float]] = {n: [] for n in names}
    try:
        with mounted(vol, mnt, 3 * size + 64 * MiB, page_cache) as m, \
                floor_mounted(work / "floor", work / "floor_mnt") as fm:
            (m / "sessions" / "bench").mkdir()
            paths = {"rounds": m / "sessions" / "bench" / "rounds", "ext4": peer,
                     "big": m / "sessions" / "bench" / "big", "floor": fm / "layer"}
            backing = [vol, work / "floor" / "layer"]
            for off in range(0, size, ROUND):  # each close flushes: one entry per round
                with open(paths["rounds"], "ab", buffering=0) as f:
                    f.write(data[off:off + ROUND])
            _write_big(paths["big"], data)
            fds = {n: os.open(paths[n], os.O_RDONLY) for n in names}
            try:
                for i, r in enumerate(order):
                    for name in (names if i % 2 == 0 else names[::-1]):
                        for b in backing:
                            fadvise_dontneed(b)
                        for fd in fds.values():
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        t0 = time.perf_counter()
                        out = os.pread(fds[name], ROUND, r * ROUND)
                        dt = (time.perf_counter() - t0) * 1e3
                        if out != data[r * ROUND:(r + 1) * ROUND]:
                            raise RuntimeError(f"{name}: wrong bytes for round {r}")
                        if i >= 10:
                            vals[name].append(dt)
            finally:
                for fd in fds.values():
                    os.close(fd)
    finally:
        _fresh(work)
    results = []
    for subject, how in (("rounds", "appended round by round"), ("big", "written in 1 MiB writes")):
        for stat, goal in (("p50", 1.5), ("p99", 1.3)):
            results.append(Result(
                "1", f"random {ROUND // KiB} KiB round read through the mount, caches dropped, "
                     f"{stat} (file {how})",
                "kvfs mount: pread", "ext4 file: pread", "ms",
                {"subject": vals[subject], "peer": vals["ext4"]}, better="lower", goal=goal,
                stat=stat,
                note=f"{'page cache' if page_cache else 'direct_io'}; {len(vals['ext4'])} distinct "
                     f"rounds of a {size // MiB} MiB file; DONTNEED on every file before each read",
            ).to_dict())
    for stat in ("p50", "p99"):
        results.append(_floor_result(
            "1", f"random {ROUND // KiB} KiB round read through the mount, caches dropped, {stat}",
            vals, "ms", "lower", "pread", "direct_io; the same rounds and samples", stat=stat))
    return {"results": results, "info": {"bytes": size, "samples": samples}}


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def mount_time(quick: bool = False, workdir: str | None = None) -> dict[str, Any]:
    """Figure 7 (mount part): mount.py start to a live mount, then the first lookup + read
    of one session, and the mount process's RSS, vs the session count (the volumes of
    ``bench_sessions.sessions_volume``; their pages dropped before each sample)."""
    from bench_sessions import sessions_volumes

    counts = [1000, 10000] if quick else [10000, 100000, 1000000]
    reps = 2 if quick else 3
    work = bench_dir(workdir) / "mount_time"
    _fresh(work)
    vols, info = sessions_volumes(counts)
    samples: dict[int, dict[str, list[float]]] = {
        n: {"mount_ms": [], "lookup_ms": [], "rss_mib": []} for n in vols}

    def measure(n: int) -> float:
        fadvise_dontneed(vols[n])
        name = f"sess-{random.Random(n).randrange(n):07d}"
        t0 = time.perf_counter()
        with _mount_process(vols[n], work / f"mnt{n}", None) as (m, proc):
            t1 = time.perf_counter()
            (m / "sessions" / name / "meta.json").read_bytes()
            t2 = time.perf_counter()
            samples[n]["rss_mib"].append(_rss_kib(proc.pid) / 1024)
        samples[n]["mount_ms"].append((t1 - t0) * 1e3)
        samples[n]["lookup_ms"].append((t2 - t1) * 1e3)
        return t1 - t0

    try:
        interleave([(str(n), partial(measure, n)) for n in vols], reps)
    finally:
        _fresh(work)
    results: list[dict[str, Any]] = []
    series: dict[str, list[float]] = {"sessions": [], "mount_ms": [], "rss_mib": [], "lookup_ms": []}
    base = min(vols) if vols else None
    for n in sorted(vols):
        series["sessions"].append(n)
        for k in ("mount_ms", "rss_mib", "lookup_ms"):
            series[k].append(float(np.median(samples[n][k])))
        if n == base:
            continue
        for key, label, unit, goal in (("mount_ms", "mount time (mount.py start to live)", "ms", 2.0),
                                       ("rss_mib", "mount process RSS after one lookup", "MiB", 1.25),
                                       ("lookup_ms", "first ls + cat of one session's meta.json",
                                        "ms", None)):
            results.append(Result(
                "7", f"{label}, {n:,} sessions vs {base:,}", f"kvfs mount, {n:,} sessions",
                f"kvfs mount, {base:,} sessions", unit,
                {"subject": samples[n][key], "peer": samples[base][key]}, better="lower",
                goal=goal, note="a fresh mount.py per sample (Python start-up included), the "
                                "volume's pages dropped first; goals: no growth with the count",
            ).to_dict())
    return {"results": results, "series": {"7-mount": series}, "info": info}


FIGURES = {"append": fsync_appends, "seq": seq_read, "random": random_read, "time": mount_time,
           "concurrent": concurrent_read}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--page-cache", action="store_true", help="mount without direct_io")
    for flag in ("--offload-reads", "--offload-syncs", "--sparse"):
        ap.add_argument(flag, action="store_true", help=f"mount with {flag} (docs/mount.md)")
    ap.add_argument("--only", default=",".join(FIGURES))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    MOUNT_ARGS.extend(f"--{w.replace('_', '-')}" for w in ("offload_reads", "offload_syncs", "sparse")
                      if getattr(a, w))
    for f in a.only.split(","):
        kw = {"page_cache": a.page_cache} if f != "time" else {}
        r = FIGURES[f](quick=a.quick, workdir=a.out, **kw)
        for x in r["results"]:
            print(json.dumps({k: x[k] for k in ("name", "unit", "subject_value", "peer_value",
                                                "ratio", "goal_text", "goal_met", "note")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Micro-benchmarks of the mount's request path (the FUSE layer, not the disk).

- ``small_read``: 4 KiB ``pread`` at random offsets of a 4 MiB file the engine holds
  decoded (its entry cache), so every sample is the request path alone: kernel round trip,
  dispatch, hand-off to the engine worker, reply. p50/p99 in µs. With direct I/O every read
  is a request; with the page cache the kernel answers from cached pages once read.
- ``fsync_batch``: 16 files of 96 KiB written and closed, then each opened and fsync'd:
  the time of the 16 fsyncs (ms); the first pays one device flush, the rest should not.
- ``sizes``: the largest read and write request the mount received for 1 MiB aligned
  reads and writes (``fs.read_req_max`` / ``fs.write_req_max`` in ``/.kvfs/stats``).

``python tools/bench_requests.py [--page-cache] [--reads N] [--reps R]`` prints one JSON
line per figure and repetition.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvfs.mount_runner import Mount

KiB, MiB = 1 << 10, 1 << 20

log = logging.getLogger("bench.requests")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def small_read(m: Mount, n: int) -> dict[str, float]:
    path = m.sessions / "b" / "small"
    data = os.urandom(4 * MiB)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in range(0, len(data), MiB):  # decoded once into the engine's cache
            os.pread(fd, MiB, off)
        rnd = random.Random(1)
        lat = []
        for _ in range(n):
            off = rnd.randrange(0, len(data) // 4096) * 4096
            t0 = time.perf_counter()
            got = os.pread(fd, 4096, off)
            lat.append((time.perf_counter() - t0) * 1e6)
            if got != data[off:off + 4096]:
                raise RuntimeError(f"wrong bytes at {off}")
    finally:
        os.close(fd)
    return {"p50_us": _pct(lat, 0.5), "p99_us": _pct(lat, 0.99), "mean_us": statistics.fmean(lat)}


def small_seq(m: Mount) -> dict[str, float]:
    """µs per 4 KiB read of a 4 MiB file read front to back (engine-cached)."""
    path = m.sessions / "b" / "small"
    fd = os.open(path, os.O_RDONLY)
    try:
        n = 0
        t0 = time.perf_counter()
        while os.read(fd, 4096):
            n += 1
        return {"us_per_read": (time.perf_counter() - t0) * 1e6 / n}
    finally:
        os.close(fd)


def fsync_batch(m: Mount, files: int = 16) -> dict[str, float]:
    d = m.sessions / f"f{time.monotonic_ns()}"
    d.mkdir()
    blob = os.urandom(96 * KiB)
    for i in range(files):
        (d / f"l{i}").write_bytes(blob)
    fds = [os.open(d / f"l{i}", os.O_RDONLY) for i in range(files)]
    try:
        t0 = time.perf_counter()
        for fd in fds:
            os.fsync(fd)
        return {"ms": (time.perf_counter() - t0) * 1e3}
    finally:
        for fd in fds:
            os.close(fd)


def sizes(m: Mount) -> dict[str, int]:
    path = m.sessions / "b" / "big"
    buf = mmap.mmap(-1, MiB)  # page aligned, as cat and dd use
    buf.write(os.urandom(MiB))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    for _ in range(4):
        os.writev(fd, [buf])
    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    while os.readv(fd, [buf]):
        pass
    os.close(fd)
    fs = json.loads((m.root / ".kvfs" / "stats").read_bytes())["fs"]
    return {"read_req_max": fs.get("read_req_max", -1), "write_req_max": fs.get("write_req_max", -1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-cache", action="store_true")
    ap.add_argument("--reads", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="small,fsync,sizes")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    work = Path(tempfile.mkdtemp(prefix="kvfs-req-", dir="/var/tmp"))
    extra = ("--page-cache",) if a.page_cache else ()
    m = Mount(work / "vol", work / "mnt", "256M", extra).start()
    try:
        (m.sessions / "b").mkdir()
        only = a.only.split(",")
        for rep in range(a.reps):
            if "small" in only:
                print(json.dumps({"figure": "small_read", "rep": rep, **small_read(m, a.reads)}))
            if "small" in only:
                print(json.dumps({"figure": "small_seq", "rep": rep, **small_seq(m)}))
            if "fsync" in only:
                print(json.dumps({"figure": "fsync_batch", "rep": rep, **fsync_batch(m)}))
        if "sizes" in only:
            print(json.dumps({"figure": "sizes", **sizes(m)}))
    finally:
        rc = m.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""The torture scenarios' plumbing: results, mounts that are never left running, KV-like
byte streams, whole-file writes and checks. Imported by ``torture.py`` and its scenario
modules (``torture_crash``, ``torture_mount``, ``torture_input``)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvfs.mount_runner import Mount, MountFailed  # noqa: F401 - re-exported to the scenarios

ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("kvfs.torture")

# kill9: kills; faults: power cuts/failpoints; flips: bits; full, quota: rounds; load:
# seconds; flood: idle connections
FULL = {"kill9": 200, "faults": 10_000, "flips": 10_000, "full": 3, "badinput": 1, "load": 60,
        "stale": 2_000, "race": 20_000, "buffers": 3, "nrace": 20_000, "nkill9": 100,
        "quota": 10, "flood": 5_000}
QUICK = {"kill9": 5, "faults": 60, "flips": 300, "full": 1, "badinput": 1, "load": 10,
         "stale": 40, "race": 1_000, "buffers": 1, "nrace": 600, "nkill9": 4, "quota": 2,
         "flood": 1_000}
MB = 1 << 20
_COUNT_LOCK = threading.Lock()


# ============================================================================ plumbing
@dataclass
class Result:
    """One scenario's outcome: trials done, counters, failures (first 50 kept)."""

    name: str
    planned: int
    done: int = 0
    counts: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    nfail: int = 0
    seconds: float = 0.0
    rows: list[list[str]] = field(default_factory=list)  # a table for the docs (badinput)

    def add(self, key: str, n: float = 1) -> None:
        with _COUNT_LOCK:  # writer threads share one Result
            self.counts[key] = self.counts.get(key, 0) + n

    def peak(self, key: str, v: float) -> None:
        self.counts[key] = max(self.counts.get(key, v), v)

    def fail(self, msg: str) -> None:
        with _COUNT_LOCK:
            self.nfail += 1
            if len(self.failures) < 50:
                self.failures.append(msg)
        log.error("%s: %s", self.name, msg)

    @property
    def ok(self) -> bool:
        return self.nfail == 0


def start(m: Mount) -> Mount:
    return m.start()


@contextlib.contextmanager
def mounted(m: Mount) -> Iterator[Mount]:
    """Start ``m``; whatever happens inside, it is not left running (killed if still up)."""
    start(m)
    try:
        yield m
    finally:
        if m.proc is not None:
            m.kill()


def stop(m: Mount, res: Result) -> None:
    """Clean unmount; a non-zero exit of mount.py is a failure."""
    rc = m.stop()
    if rc != 0:
        res.fail(f"mount.py exited {rc} at unmount:\n{m.log_text()[-2000:]}")
    text = m.log_text()
    new, m.log_seen = text[getattr(m, "log_seen", 0):], len(text)  # each line checked once
    if "internal error" in new or "Traceback" in new:
        res.fail(f"the mount logged an unexpected exception:\n{new[-3000:]}")


def alive(m: Mount, res: Result, where: str) -> bool:
    if m.proc is None or m.proc.poll() is not None:
        res.fail(f"{where}: the mount process died:\n{m.log_text()[-3000:]}")
        return False
    return True


def fsck(volume: Path) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "kvfs.cli.fsck", str(volume), "-q"], capture_output=True,
                       text=True, timeout=600)
    return r.returncode, (r.stdout + r.stderr)[-2000:]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))


def mount_stats(m: Mount) -> dict:
    return json.loads((m.root / ".kvfs" / "stats").read_bytes())


@functools.lru_cache(maxsize=512)
def stream(seed: int, n: int) -> bytes:
    """``n`` bytes of KV-like data: fp16 noise (compressible high bytes, noisy low bytes)."""
    return np.random.default_rng(seed).standard_normal(n // 2 + 1).astype(np.float16).tobytes()[:n]


def seed_of(*parts: object) -> int:
    return zlib.crc32(":".join(map(str, parts)).encode())


def first_diff(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def chunk_size(rng: random.Random, hi: int = 256 << 10) -> int:
    return rng.choice((rng.randint(1, 4096), rng.randint(4096, 65536), rng.randint(65536, hi)))


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def put(path: Path, data: bytes, sync: bool = True) -> None:
    """Write a whole file through the mount (append-only: a new or empty file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def check_files(files: dict[Path, bytes], res: Result, where: str) -> None:
    for p, data in files.items():
        try:
            got = p.read_bytes()
        except OSError as e:
            res.fail(f"{where}: {p}: {e!r}")
            continue
        if got != data:
            res.fail(f"{where}: {p}: {len(got)} bytes, expected {len(data)} (first diff "
                     f"{first_diff(got, data)})")
        res.add("bytes_verified", len(got))

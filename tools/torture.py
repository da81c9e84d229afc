#!/usr/bin/env python3
"""kvfs torture: crash loops, power cuts, bit flips, full volume, bad input, load.

    python tools/torture.py [--trials N] [--seconds S] [--only NAME[,NAME]] [--json OUT]
                            [--workdir DIR] [--seed N] [--quick]

Scenarios (``docs/reliability.md`` says what each one checks): ``kill9``, ``faults``
(``torture_crash.py``), ``flips``, ``full`` (``torture_mount.py``), ``badinput``, ``load``
(``torture_input.py``). Each is bounded by a count -- its full-run default, ``--quick``
for the pytest-sized one, or ``--trials`` (kills, power cuts, flipped bits, rounds; for
``load``, seconds) -- and by ``--seconds``, a time cap per scenario; it stops by itself. A
summary table is printed; the exit status is 1 when any check failed.
``tests/test_reliability.py`` calls the same functions with small counts. The mount-level
scenarios reuse the real-mount helper of ``tests/conftest.py`` (``mount.py --foreground``
in a subprocess).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import pytest  # noqa: E402  (conftest's Mount reports a failed start with pytest.fail)
from conftest import Mount  # noqa: E402

log = logging.getLogger("kvfs.torture")

# kill9: kills; faults: power cuts/failpoints; flips: bits; full: rounds; load: seconds
FULL = {"kill9": 200, "faults": 10_000, "flips": 10_000, "full": 3, "badinput": 1, "load": 60}
QUICK = {"kill9": 5, "faults": 60, "flips": 300, "full": 1, "badinput": 1, "load": 10}
FSCK = ROOT / "tools" / "fsck.py"
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


class MountFailed(Exception):
    """mount.py did not come up, or did not unmount cleanly."""


def start(m: Mount) -> Mount:
    try:
        return m.start()
    except pytest.fail.Exception as e:
        raise MountFailed(str(e)) from None


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
    try:
        rc = m.stop()
    except AssertionError as e:
        raise MountFailed(str(e)) from None
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
    r = subprocess.run([sys.executable, str(FSCK), str(volume), "-q"], capture_output=True,
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



Scenario = Callable[[Path, int, float, random.Random], Result]
NAMES = ("kill9", "faults", "flips", "full", "badinput", "load")


def scenarios() -> dict[str, Scenario]:
    """Name -> function: 1-2 in ``torture_crash.py``, 3-4 in ``torture_mount.py``, 5-6 in
    ``torture_input.py``."""
    import torture_crash as tc  # noqa: PLC0415 - they import this module's plumbing
    import torture_input as ti  # noqa: PLC0415
    import torture_mount as tm  # noqa: PLC0415

    return {"kill9": tc.kill9, "faults": tc.faults, "flips": tm.flips, "full": tm.full,
            "badinput": ti.badinput, "load": ti.load}


def table(results: list[Result]) -> str:
    rows = [f"{'scenario':<9} {'trials':>11} {'seconds':>8} {'failures':>8}  figures"]
    for r in results:
        figs = " ".join(f"{k}={v:,}" if float(v).is_integer() else f"{k}={v:g}"
                        for k, v in sorted(r.counts.items()))
        rows.append(f"{r.name:<9} {f'{r.done}/{r.planned}':>11} {r.seconds:>8.1f} {r.nfail:>8}  {figs}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, help="count for every scenario run (default: full run)")
    ap.add_argument("--seconds", type=float, default=900.0, help="time cap per scenario")
    ap.add_argument("--only", help="comma-separated scenario names: " + ",".join(NAMES))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workdir", help="keep volumes and logs here (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the pytest-sized counts")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = a.only.split(",") if a.only else list(NAMES)
    bad = [x for x in names if x not in NAMES]
    if bad:
        ap.error(f"unknown scenario {bad}; choose from {', '.join(NAMES)}")
    run = scenarios()
    counts = QUICK if a.quick else FULL
    results = []
    with contextlib.ExitStack() as stack:
        work = Path(a.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvfs-torture-")))
        for name in names:
            d = work / name
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            n = a.trials if a.trials is not None else counts[name]
            t0 = time.monotonic()
            log.info("=== %s: %d, at most %.0f s", name, n, a.seconds)
            try:
                r = run[name](d, n, t0 + a.seconds, random.Random(a.seed))
            except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 - a broken scenario fails
                log.exception("%s broke", name)
                r = Result(name, n)
                r.fail(f"scenario aborted: {e!r}")
            r.seconds = round(time.monotonic() - t0, 1)
            results.append(r)
            log.info("=== %s: %s in %.1f s", name, "ok" if r.ok else f"{r.nfail} FAILURES", r.seconds)
    print(table(results))
    for r in results:
        for msg in r.failures:
            print(f"FAIL {r.name}: {msg}")
    if a.json:
        doc = {"argv": sys.argv[1:], "time": time.strftime("%Y-%m-%d %H:%M:%S"),
               "results": [asdict(r) for r in results]}
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.modules.setdefault("torture", sys.modules[__name__])  # torture_mount imports "torture"
    sys.exit(main())

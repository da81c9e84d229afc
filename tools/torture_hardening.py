"""Torture scenarios for the mount's handle and buffer rules.

``stale``: unlink / ``rm -r`` + re-create under open descriptors, many times: an old fd
reads, writes and truncates only its own file (ESTALE once it is gone), never the new one.
``race``: ``pread`` near the end of a file that another thread appends to: right bytes,
never EIO, never a reply longer than asked.
``buffers``: many open files holding unflushed bytes on a small volume: the mount's memory
stays bounded and a write that cannot be stored fails at ``write()`` with ENOSPC, never at
close; every acknowledged byte reads back.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from functools import partial
from pathlib import Path

from torture_common import Mount, Result, mounted, stop, stream

_STALE_OPS = ("pread", "write", "ftruncate")


def _expect_stale(fn, res: Result, what: str) -> None:
    try:
        fn()
    except OSError as e:
        if e.errno == errno.ESTALE:
            res.add("estale")
            return
        res.fail(f"{what}: {e!r}, expected ESTALE")
        return
    res.fail(f"{what}: succeeded on a stale handle")


def stale(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """``n`` cycles of: open old file (read + write fds), remove it (unlink or rm -r of the
    session), create a new file of the same name, use the old fds, check the new file."""
    res = Result("stale", n)
    m = Mount(work / "stale.kvfs", work / "stale.mnt", "64M")
    with mounted(m):
        for trial in range(n):
            if time.monotonic() > deadline:
                break
            sess = m.sessions / f"s{trial % 7}"
            sess.mkdir(exist_ok=True)
            f = sess / "layer_0"
            old = stream(trial, rng.randint(1, 200_000))
            f.write_bytes(old)
            wfd = os.open(f, os.O_WRONLY | os.O_APPEND)
            rfd = os.open(f, os.O_RDONLY)
            try:
                if rng.random() < 0.5:
                    os.unlink(f)
                else:
                    for c in sess.iterdir():
                        c.unlink()
                    sess.rmdir()
                    sess.mkdir()
                new = stream(trial + 1_000_000, rng.randint(1, 4096))
                f.write_bytes(new)
                calls = {"pread": partial(os.pread, rfd, 4096, 0),
                         "write": partial(os.write, wfd, b"X" * 64),
                         "ftruncate": partial(os.ftruncate, wfd, 0)}
                for op in rng.sample(_STALE_OPS, len(_STALE_OPS)):
                    _expect_stale(calls[op], res, f"trial {trial} {op}")
            finally:
                os.close(wfd)
                os.close(rfd)
            got = f.read_bytes()
            if got != new:
                res.fail(f"trial {trial}: the new file holds {len(got)} bytes, not its own {len(new)}")
            res.add("bytes_verified", len(got))
            res.done += 1
        stop(m, res)
    return res


def _block(k: int) -> bytes:
    return bytes([k % 251]) * 4096


def race(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """``n`` preads near the end of a file that a writer thread keeps appending to."""
    res = Result("race", n)
    m = Mount(work / "race.kvfs", work / "race.mnt", "256M")
    with mounted(m):
        d = m.sessions / "race"
        d.mkdir()
        f = d / "layer_0"
        wfd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o600)
        rfd = os.open(f, os.O_RDONLY)
        written = [0]
        done = threading.Event()

        def writer() -> None:
            k = 0
            while not done.is_set() and k < 40_000:
                os.write(wfd, _block(k))
                k += 1
                written[0] = k * 4096
            done.set()

        t = threading.Thread(target=writer)
        t.start()
        try:
            while res.done < n and not done.is_set() and time.monotonic() < deadline:
                end = written[0]
                want_len = rng.choice((512, 4096, 8192, 65536))
                off = max(0, end - rng.randint(0, 3 * want_len))
                res.done += 1
                try:
                    data = os.pread(rfd, want_len, off)
                except OSError as e:
                    res.fail(f"pread({want_len}) at {off}: {e!r}")
                    continue
                if len(data) > want_len:
                    res.fail(f"{len(data)} bytes for {want_len} at {off}")
                    continue
                first, last = off // 4096, (off + len(data)) // 4096 + 1
                want = b"".join(_block(k) for k in range(first, last))[off % 4096:][:len(data)]
                if data != want:
                    res.fail(f"wrong bytes at {off} ({len(data)})")
                res.add("bytes_verified", len(data))
        finally:
            done.set()
            t.join()
            os.close(wfd)
            os.close(rfd)
        if "Invalid argument" in m.log_text():
            res.fail("pyfuse3 reported a reply larger than the request")
        stop(m, res)
    return res


def _vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(ln.split()[1]) for ln in fh if ln.startswith(field + ":"))


def buffers(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """``n`` rounds: 200 open files each holding up to 1 MiB - 1 unflushed on a 32 MiB volume
    with an 8 MiB bound; closes never fail, acknowledged bytes read back, RSS bounded."""
    res = Result("buffers", n)
    for rnd in range(n):
        if time.monotonic() > deadline:
            break
        m = Mount(work / f"buf{rnd}.kvfs", work / f"buf{rnd}.mnt", "32M",
                  ("--write-buffer-max", "8M"))
        with mounted(m):
            assert m.proc is not None
            base = _vm_kib(m.proc.pid, "VmRSS")
            d = m.sessions / "many"
            d.mkdir()
            piece = os.urandom((1 << 20) - 1)
            fds, acked = [], []
            for i in range(200):
                try:
                    fd = os.open(d / f"f{i:03d}", os.O_WRONLY | os.O_CREAT, 0o600)
                except OSError as e:  # a full volume may refuse the new file itself
                    if e.errno != errno.ENOSPC:
                        res.fail(f"round {rnd}: create f{i}: {e!r}")
                    res.add("enospc_at_create")
                    break
                fds.append(fd)
                k = 0
                try:
                    while k < len(piece):
                        k += os.write(fd, piece[k:k + rng.randint(4096, 1 << 20)])
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        res.fail(f"round {rnd} f{i}: {e!r}")
                    res.add("enospc_at_write")
                acked.append(k)
            growth_mib = (_vm_kib(m.proc.pid, "VmHWM") - base) >> 10
            res.peak("rss_growth_mib", growth_mib)
            if growth_mib > 80:
                res.fail(f"round {rnd}: mount RSS grew by {growth_mib} MiB")
            for fd in fds:
                try:
                    os.close(fd)
                except OSError as e:
                    res.fail(f"round {rnd}: close failed: {e!r} (loss reported at close)")
            for i, k in enumerate(acked):
                if (d / f"f{i:03d}").read_bytes() != piece[:k]:
                    res.fail(f"round {rnd}: f{i:03d} lost acknowledged bytes")
                res.add("bytes_verified", k)
            if "could not be stored" in m.log_text():
                res.fail(f"round {rnd}: the mount lost buffered bytes")
            stop(m, res)
        res.done += 1
    return res

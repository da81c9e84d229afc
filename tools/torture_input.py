"""Scenarios 5 and 6 of ``tools/torture.py``: what users throw at a mount.

``badinput``: a table of bad requests (names with '/', NUL, '..', 256+ bytes; mid-file
writes; truncate beyond the end; writes in /.kvfs; a meta.json that does not parse; another
model resuming a session): each gets its specific error and the tree is unchanged
(snapshot before/after). Then what is odd but allowed (non-UTF-8 names, 255-byte names,
one 64 MiB write) works, survives a remount, and fsck is clean; a 64 MiB write on a
32 MiB volume fails cleanly.
``load``: 64 sessions, one thread each, appending, reading back and truncating through one
mount for a bounded time: no errors, no mismatches, the mount's RSS sampled.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from torture_common import (
    MB,
    Result,
    alive,
    check_files,
    chunk_size,
    first_diff,
    fsck,
    mounted,
    put,
    rss_kib,
    seed_of,
    stop,
    stream,
)

from kvfs.mount_runner import Mount


# ============================================================================ 5. bad input
def snapshot(root: Path) -> dict[bytes, tuple]:
    """Every session, file (size, crc) and the /.kvfs listing: what bad input must not change."""
    out: dict[bytes, tuple] = {b"/.kvfs": tuple(sorted(os.listdir(root / ".kvfs")))}
    top = os.fsencode(root / "sessions")
    for d in sorted(os.listdir(top)):
        p = os.path.join(top, d)
        out[d] = ("dir", os.stat(p).st_mode)
        for f in sorted(os.listdir(p)):
            with open(os.path.join(p, f), "rb") as fh:
                data = fh.read()
            out[d + b"/" + f] = (len(data), zlib.crc32(data))
    return out


def outcome(fn: Callable[[], object]) -> str:
    """"ok", the errno's name, or the exception's class name."""
    try:
        fn()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    except Exception as e:  # noqa: BLE001 - the class name is the outcome
        return type(e).__name__
    return "ok"


def _opened(path: Path | bytes, flags: int) -> None:
    os.close(os.open(path, flags, 0o600))


def _at(path: Path, fn: Callable[[int], object], flags: int = os.O_WRONLY) -> Callable[[], None]:
    def run() -> None:
        fd = os.open(path, flags)
        try:
            fn(fd)
        finally:
            os.close(fd)
    return run


def _cases(m: Mount, size: int) -> list[tuple[str, str, Callable[[], object]]]:
    s, k = m.sessions, m.root / ".kvfs"
    base, l0 = m.sessions / "base", m.sessions / "base" / "layer_0"
    w = os.O_WRONLY | os.O_CREAT
    return [
        ("mkdir 'nope/b': a '/' in a name (the kernel walks nope/, missing)", "ENOENT",
         lambda: os.mkdir(s / "nope" / "b")),
        ("mkdir 'base/sub': a '/' reaching into a session", "EPERM", lambda: os.mkdir(base / "sub")),
        ("mkdir 'x\\0y': NUL (Python refuses before any syscall)", "ValueError",
         lambda: os.mkdir(f"{s}/x\0y")),
        ("mkdir '..'", "EEXIST", lambda: os.mkdir(f"{s}/..")),
        ("mkdir '.'", "EEXIST", lambda: os.mkdir(f"{s}/.")),
        ("mkdir, name of 256 bytes", "ENAMETOOLONG", lambda: os.mkdir(s / ("n" * 256))),
        ("mkdir, name of 256 bytes in UTF-8 (128 x 'é')", "ENAMETOOLONG", lambda: os.mkdir(s / ("é" * 128))),
        ("mkdir, name of 4096 bytes", "ENAMETOOLONG", lambda: os.mkdir(s / ("n" * 4096))),
        ("create a file, name of 256 bytes", "ENAMETOOLONG", lambda: _opened(base / ("f" * 256), w)),
        ("create a file in /sessions itself", "EPERM", lambda: _opened(s / "loose", w)),
        ("rmdir a session that has files", "ENOTEMPTY", lambda: os.rmdir(base)),
        ("rename a session", "EXDEV", lambda: os.rename(base, s / "base2")),
        ("symlink in a session", "EPERM", lambda: os.symlink("layer_0", base / "ln")),
        ("hard link in a session", "EPERM", lambda: os.link(l0, base / "hl")),
        ("mkfifo in a session", "EPERM", lambda: os.mkfifo(base / "fifo")),
        ("pwrite at offset 0 of a written file", "EPERM", _at(l0, lambda fd: os.pwrite(fd, b"XX", 0))),
        ("pwrite in the middle", "EPERM", _at(l0, lambda fd: os.pwrite(fd, b"XX", size // 2))),
        ("pwrite past the end (a hole)", "EPERM", _at(l0, lambda fd: os.pwrite(fd, b"XX", size + 1))),
        ("write without O_APPEND at offset 0", "EPERM", _at(l0, lambda fd: os.write(fd, b"XX"))),
        ("truncate beyond the size", "EINVAL", lambda: os.truncate(l0, size + 1)),
        ("ftruncate beyond the size", "EINVAL", _at(l0, lambda fd: os.ftruncate(fd, size + 4096))),
        ("open /.kvfs/stats for writing", "EROFS", lambda: _opened(k / "stats", os.O_WRONLY)),
        ("open /.kvfs/metrics O_RDWR|O_APPEND", "EROFS", lambda: _opened(k / "metrics", os.O_RDWR | os.O_APPEND)),
        ("open /.kvfs/stats with O_TRUNC", "EROFS", lambda: _opened(k / "stats", os.O_RDONLY | os.O_TRUNC)),
        ("create /.kvfs/new", "EROFS", lambda: _opened(k / "new", w)),
        ("unlink /.kvfs/metrics", "EROFS", lambda: os.unlink(k / "metrics")),
        ("mkdir /.kvfs/d", "EROFS", lambda: os.mkdir(k / "d")),
        ("truncate /.kvfs/stats", "EROFS", lambda: os.truncate(k / "stats", 0)),
        ("chmod /.kvfs/stats", "EROFS", lambda: os.chmod(k / "stats", 0o666)),
        ("rename /.kvfs/stats into a session", "EXDEV", lambda: os.rename(k / "stats", base / "stats")),
        ("rmdir /.kvfs", "EPERM", lambda: os.rmdir(k)),
        ("rmdir /sessions", "EPERM", lambda: os.rmdir(s)),
        ("setxattr on a layer file", "ENOTSUP", lambda: os.setxattr(l0, "user.x", b"1")),
    ]


def _torch_cases(m: Mount, work: Path, res: Result,
                 cleanup: list[Callable[[], None]]) -> list[tuple[str, str, Callable[[], object]]]:
    """The hot tier's refusals over this mount (skipped when torch is not installed)."""
    try:
        import torch  # noqa: PLC0415

        from kvfs.torch import KVRouter  # noqa: PLC0415
        from kvfs.torch.reference import generate_turns, prompt, tiny_llama  # noqa: PLC0415
    except ImportError as e:
        res.counts["torch_cases_skipped"] = 1
        print(f"badinput: hot-tier cases skipped: {e}", file=sys.stderr)
        return []
    model = tiny_llama(seed=0)

    def router() -> KVRouter:
        return KVRouter(mount=str(m.root), warm_root=str(work / "warm"), max_kv_len=8,
                        warm_options={"shards": 16})

    r = router()
    generate_turns(model, r.cache("wm", model), [prompt(1, 9)], 4)
    r.close(to_cold=True)  # the session is now only on the mount
    d = m.sessions / "badmeta"
    d.mkdir()
    for f in ("layer_0", "layer_1"):
        put(d / f, bytes(4 * 2 * 2 * 16 * 9))  # 9 tokens of a 2-layer, 2-head, 16-dim fp32 model
    put(d / "meta.json", b'{"format": "kvfs-kv/1", "model": "')  # cut short: not JSON
    r2 = router()
    cleanup.append(r2.close)
    other, bf16 = tiny_llama(seed=0, num_hidden_layers=3), tiny_llama(seed=0, dtype=torch.bfloat16)
    right = lambda: r2.release("wm") if r2.resume("wm", model).seen == 12 else 1 / 0  # noqa: E731
    return [
        ("resume with another model (3 layers)", "KVMismatch", lambda: r2.resume("wm", other)),
        ("resume with another dtype (bf16)", "KVMismatch", lambda: r2.resume("wm", bf16)),
        ("resume: meta.json does not parse", "KVCorrupt", lambda: r2.resume("badmeta", model)),
        ("router.cache() of that session", "KVCorrupt", lambda: r2.cache("badmeta", model)),
        ("(then the right model resumes: 12 tokens)", "ok", right),
    ]


def _odd_but_allowed(m: Mount, res: Result) -> dict[Path, bytes]:
    """Non-UTF-8 and 255-byte names, one 64 MiB write: they work (checked again after a remount)."""
    files: dict[Path, bytes] = {}
    raw = os.fsencode(m.sessions) + b"/\xff\xfe-not-utf8"
    os.mkdir(raw)
    put(Path(os.fsdecode(raw + b"/\xfflayer_0")), b"bytes under a non-UTF-8 name")
    files[Path(os.fsdecode(raw + b"/\xfflayer_0"))] = b"bytes under a non-UTF-8 name"
    if b"\xff\xfe-not-utf8" not in os.listdir(os.fsencode(m.sessions)):
        res.fail("a non-UTF-8 session name does not list as the same bytes")
    long = m.sessions / ("L" * 255)
    long.mkdir()
    files[long / ("l" * 255)] = b"255-byte names"
    put(long / ("l" * 255), b"255-byte names")
    (m.sessions / "huge").mkdir()
    data = stream(seed_of("huge"), 64 * MB)
    fd = os.open(m.sessions / "huge" / "layer_0", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        n = os.write(fd, data)  # one write(2) of 64 MiB
        os.fsync(fd)
    finally:
        os.close(fd)
    res.add("huge_write_bytes", n)
    files[m.sessions / "huge" / "layer_0"] = data[:n]
    if n != len(data):
        res.fail(f"one 64 MiB write on a 256 MiB volume stored only {n} bytes")
    check_files(files, res, "odd but allowed")
    return files


def _huge_on_small(work: Path, res: Result, rows: list[list[str]]) -> None:
    """64 MiB in one write(2) on a 32 MiB volume: a short count or ENOSPC, a correct prefix."""
    m = Mount(work / "small.kvfs", work / "small.mnt", "32M")
    with mounted(m):
        (m.sessions / "keep").mkdir()
        put(m.sessions / "keep" / "layer_0", keep := stream(seed_of("keep"), MB))
        (m.sessions / "huge").mkdir()
        data = stream(seed_of("huge"), 64 * MB)
        fd = os.open(m.sessions / "huge" / "layer_0", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        took: list[int] = []
        got = outcome(lambda: took.append(os.write(fd, data)))
        closed = outcome(lambda: os.close(fd))
        stored = (m.sessions / "huge" / "layer_0").read_bytes()
        res.add("small_huge_accepted", sum(took))
        rows.append(["one 64 MiB write(2) on a 32 MiB volume", "ENOSPC or a short count",
                     f"write: {got} ({sum(took)} bytes), close: {closed}",
                     f"{len(stored)} bytes, a prefix" if stored == data[:len(stored)] else "WRONG"])
        if got not in ("ok", "ENOSPC") or closed not in ("ok", "ENOSPC") or stored != data[:len(stored)]:
            res.fail(f"64 MiB on a 32 MiB volume: write {got}, close {closed}, "
                     f"{len(stored)} bytes stored, prefix={stored == data[:len(stored)]}")
        check_files({m.sessions / "keep" / "layer_0": keep}, res, "after the huge write")
        if alive(m, res, "huge write on a small volume"):
            stop(m, res)


def badinput(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """The bad-input table (each case: its error, nothing changed), then the odd-but-allowed."""
    res = Result("badinput", n)
    rows: list[list[str]] = []
    cleanup: list[Callable[[], None]] = []
    m = Mount(work / "bad.kvfs", work / "bad.mnt", "256M")
    with mounted(m):
        (m.sessions / "base").mkdir()
        put(m.sessions / "base" / "layer_0", base := stream(seed_of("base"), 100_000))
        put(m.sessions / "base" / "meta.json", b'{"tokens": 0}')
        try:
            cases = _cases(m, len(base)) + _torch_cases(m, work, res, cleanup)
            for label, want, fn in cases:
                before = snapshot(m.root)
                got = outcome(fn)
                changed = snapshot(m.root) != before
                rows.append([label, want, got, "CHANGED" if changed else "unchanged"])
                res.add("cases")
                if got != want or changed:
                    res.fail(f"{label}: expected {want} and no change; got {got}"
                             f"{', and the tree changed' if changed else ''}")
                if not alive(m, res, label):
                    return res
        finally:
            for close in cleanup:
                close()
        files = _odd_but_allowed(m, res)
        m.remount()
        check_files(files, res, "odd but allowed, after a remount")
        check_files({m.sessions / "base" / "layer_0": base}, res, "after every bad input")
        stop(m, res)
    rc, text = fsck(m.volume)
    if rc:
        res.fail(f"fsck exit {rc} after the bad-input table:\n{text}")
    _huge_on_small(work, res, rows)
    res.rows = rows
    res.done = 1
    return res


# ============================================================================ 6. load
LOAD_THREADS, LOAD_CAP = 64, 512 << 10


def _load_worker(m: Mount, i: int, rng: random.Random, stop_: threading.Event, res: Result,
                 sizes: dict[tuple[int, int], int]) -> None:
    d = m.sessions / f"load-{i:02d}"
    d.mkdir()
    data = [stream(seed_of("load", i, k), LOAD_CAP) for k in (0, 1)]
    flags = os.O_RDWR | os.O_CREAT | os.O_APPEND
    fds = [os.open(d / f"layer_{k}", flags, 0o600) for k in (0, 1)]
    size = [0, 0]
    try:
        while not stop_.is_set():
            k, r = rng.randrange(2), rng.random()
            try:
                if r < 0.5:
                    n = min(LOAD_CAP - size[k], chunk_size(rng, 64 << 10))
                    if n <= 0:
                        os.ftruncate(fds[k], 0)
                        size[k] = 0
                        continue
                    w = os.write(fds[k], data[k][size[k]:size[k] + n])
                    size[k] += w
                    res.add("bytes_written", w)
                    if w != n:
                        res.fail(f"load-{i}/layer_{k}: short write {w} of {n}")
                    if rng.random() < 0.2:
                        os.fsync(fds[k])
                elif r < 0.9:
                    o, ln = rng.randint(0, size[k]), rng.randint(1, 128 << 10)
                    b = os.pread(fds[k], ln, o)  # this thread is the file's only writer
                    if b != data[k][o:min(size[k], o + ln)]:
                        res.add("mismatches")
                        res.fail(f"load-{i}/layer_{k}: read of {ln} at {o}: {len(b)} bytes, "
                                 f"wrong from {first_diff(b, data[k][o:])}")
                    res.add("bytes_read", len(b))
                elif r < 0.97:
                    size[k] = rng.randint(0, size[k])  # retry a turn
                    os.ftruncate(fds[k], size[k])
                else:
                    os.close(fds[k])
                    fds[k] = os.open(d / f"layer_{k}", flags, 0o600)
                res.add("ops")
            except OSError as e:
                res.add("errors")
                res.fail(f"load-{i}/layer_{k}: {e!r}")
                time.sleep(0.05)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        sizes[(i, 0)], sizes[(i, 1)] = size


def load(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """64 sessions, one thread each, appending, reading back, truncating through one mount."""
    seconds = max(1.0, min(float(n), deadline - time.monotonic() - 30))  # n: seconds of load
    res = Result("load", n)
    res.counts.update(threads=LOAD_THREADS, seconds=round(seconds, 1))
    m = Mount(work / "load.kvfs", work / "load.mnt", "256M")
    with mounted(m):
        _load_run(m, rng, seconds, res)
    if res.counts.get("rss_end_kib"):
        rc, text = fsck(m.volume)
        if rc:
            res.fail(f"fsck exit {rc} after the load:\n{text}")
    res.done = round(seconds)
    return res


def _load_run(m: Mount, rng: random.Random, seconds: float, res: Result) -> None:
    pid = m.proc.pid
    res.counts["rss_start_kib"] = rss_kib(pid)
    stop_ = threading.Event()
    sizes: dict[tuple[int, int], int] = {}
    threads = [threading.Thread(target=_load_worker, daemon=True, args=(
        m, i, random.Random(rng.random()), stop_, res, sizes)) for i in range(LOAD_THREADS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for i in range(1, 11):  # RSS every tenth of the run; "warm" is the sample at 20 %
        time.sleep(max(0.0, t0 + seconds * i / 10 - time.monotonic()))
        res.rows.append([f"{time.monotonic() - t0:.0f} s", f"{rss_kib(pid)} KiB"])
        if i == 2:
            res.counts["rss_warm_kib"] = rss_kib(pid)
    stop_.set()
    for t in threads:
        t.join(timeout=60)
        if t.is_alive():
            res.fail("a load thread is stuck")
    if alive(m, res, "after the load"):
        res.counts["rss_end_kib"] = rss_kib(pid)
        warm, end = res.counts["rss_warm_kib"], res.counts["rss_end_kib"]
        if seconds >= 30 and end > warm + 64 * 1024:
            res.fail(f"mount RSS grew from {warm} KiB to {end} KiB under load")
        m.remount()
        files = {m.sessions / f"load-{i:02d}" / f"layer_{k}":
                 stream(seed_of("load", i, k), LOAD_CAP)[:n] for (i, k), n in sizes.items()}
        check_files(files, res, "after the load and a remount")
        stop(m, res)

"""Torture scenarios for the limits other users meet on a shared mount.

``quota``: on an ``--allow-other`` volume, unprivileged users flood it each round -- one
creates sessions with 255-byte names until refused, one appends until refused -- while the
owner writes and fsyncs its own sessions. Each flooder must get EDQUOT (its quota), never
ENOSPC or another error, and other users must keep working; then the owner unmounts,
remounts (every other round after a kill -9 of the mount), reads back every byte it
fsynced, deletes the flood, and fsck of the unmounted volume is clean.

``flood``: the metrics port under the connections one user can open: idle partial
requests (``n`` of them), byte-at-a-time requests, and connect/close churn, each phase
while the mount serves small create/write/fsync/read cycles. FUSE p99 must stay within a
generous bound of its own baseline, the mount's threads and memory must not grow with the
connections, and a real scrape must be answered during every phase. The latency bound is
generous (10 times the baseline p99, or the baseline + 1 s): the cycles fsync on a shared
disk; the flood this guards against stalled FUSE requests for up to 34 s.
"""

from __future__ import annotations

import errno
import os
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

from torture_common import ROOT, Mount, Result, alive, fsck, mounted, rss_kib, stop, stream

FLOODERS = (4401, 4402)  # sessions, bytes
BYSTANDER = 4403


def _as(uid: int, code: str, timeout: float = 300) -> tuple[int, str]:
    p = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                        sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return p.returncode, (p.stdout.strip() if p.returncode == 0 else p.stderr[-2000:])


_SESSIONS = """
    import os
    n = 0
    try:
        for n in range({limit}):
            os.mkdir(os.path.join({d!r}, "{tag}-" + f"{{n:05d}}".ljust(240, "x")))
        print(n + 1, 0)
    except OSError as e:
        print(n, e.errno)
"""
_BYTES = """
    import os
    p = os.path.join({d!r}, "{tag}-bytes")
    os.mkdir(p)
    fd = os.open(os.path.join(p, "layer_0"), os.O_WRONLY | os.O_CREAT, 0o600)
    done, err = 0, 0
    try:
        while done < {limit}:
            done += os.write(fd, b"q" * (512 << 10))
        os.fsync(fd)
    except OSError as e:
        err = e.errno
    try:
        os.close(fd)
    except OSError as e:
        err = err or e.errno
    print(done, err)
"""
_BYSTANDER = """
    import os
    p = os.path.join({d!r}, "{tag}-bystander")
    os.mkdir(p)
    with open(os.path.join(p, "layer_0"), "wb") as f:
        f.write(b"b" * 200_000)
        os.fsync(f.fileno())
    print("ok")
"""


def quota(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    res = Result("quota", n)
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        res.fail("needs root and setpriv (other uids flood the mount)")
        return res
    shared = Path(tempfile.mkdtemp(prefix="kvfs-torture-quota-"))  # other uids reach it
    os.chmod(shared, 0o755)
    try:
        _quota(shared, res, n, deadline, rng)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    return res


def _quota(shared: Path, res: Result, n: int, deadline: float, rng: random.Random) -> None:
    vol = shared / "vol.kvfs"
    m = Mount(vol, shared / "mnt", "256M", ("--allow-other",))
    mine: dict[Path, bytes] = {}
    with mounted(m):
        for rnd in range(n):
            if time.monotonic() > deadline:
                break
            d = str(m.sessions)
            rc, out = _as(FLOODERS[0], _SESSIONS.format(d=d, tag=f"r{rnd}", limit=16000))
            made, code = map(int, out.split()) if rc == 0 else (0, -1)
            if code != errno.EDQUOT:
                res.fail(f"round {rnd}: the session flood ended with {out!r}, expected EDQUOT")
            res.add("flood_sessions_made", made)
            res.add("edquot_sessions")
            rc, out = _as(FLOODERS[1], _BYTES.format(d=d, tag=f"r{rnd}", limit=1 << 30))
            wrote, code = map(int, out.split()) if rc == 0 else (0, -1)
            if code != errno.EDQUOT:
                res.fail(f"round {rnd}: the byte flood ended with {out!r}, expected EDQUOT")
            res.add("flood_bytes_written", wrote)
            res.add("edquot_writes")
            rc, out = _as(BYSTANDER, _BYSTANDER.format(d=d, tag=f"r{rnd}"))
            if out != "ok":
                res.fail(f"round {rnd}: another user could not write during the flood: {out}")
            for k in range(3):  # the owner's own sessions, fsynced
                s = m.sessions / f"own-{rnd}-{k}"
                s.mkdir()
                data = stream(rnd * 10 + k, rng.randint(10_000, 2_000_000))
                p = s / "layer_0"
                fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
                os.write(fd, data)
                os.fsync(fd)
                os.close(fd)
                mine[p] = data
            if not alive(m, res, f"round {rnd}"):
                return
            t0 = time.monotonic()
            if rnd % 2:
                m.kill()  # a crash with the flood on the volume
                rcode, text = fsck(vol)
                if rcode != 0:
                    res.fail(f"round {rnd}: fsck after kill -9 exit {rcode}: {text}")
            else:
                stop(m, res)
            m.start()
            res.peak("slowest_remount_s", round(time.monotonic() - t0, 2))
            for p, data in mine.items():
                got = p.read_bytes() if p.exists() else b""
                if got != data:
                    res.fail(f"round {rnd}: {p.name} of {p.parent.name}: {len(got)} bytes, "
                             f"expected {len(data)}")
                res.add("bytes_verified", len(got))
            for s in m.sessions.iterdir():  # the owner (root) clears the flood
                if s.name.startswith(f"r{rnd}-"):
                    for f in s.iterdir():
                        f.unlink()
                    s.rmdir()
                    res.add("flood_sessions_deleted")
            res.done += 1
        stop(m, res)
    rcode, text = fsck(vol)
    res.add("fsck_clean", rcode == 0)
    if rcode != 0:
        res.fail(f"fsck after the last round: exit {rcode}: {text}")


# ------------------------------------------------------------------------------ flood
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cycles(m: Mount, tag: str, n: int) -> list[float]:
    d = m.sessions / tag
    d.mkdir()
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        p = d / f"f{i}"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"k" * 4096)
        os.fsync(fd)
        os.close(fd)
        p.read_bytes()
        out.append(time.perf_counter() - t0)
    return out


def _p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else 0.0


def _scrape(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.status == 200 and b"kv_cold_bytes" in r.read()
    except OSError:
        return False


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("Threads:"))


def open_idle(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that each send half a request and then say nothing."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
            s.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            pass  # refused or reset by the server: what a flood should get
        socks.append(s)
    return socks


def _dribble(port: int, n: int, seconds: float) -> None:
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            pass
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for s in socks:
            try:
                s.send(b"G")
            except OSError:
                pass
        time.sleep(0.2)
    for s in socks:
        s.close()


def _churn(port: int, seconds: float) -> int:
    end, k = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            k += 1
        except OSError:
            pass
    return k


def flood(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """``n``: idle connections of the first phase."""
    import threading

    res = Result("flood", n)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 1000)), hard))
    port = _port()
    m = Mount(work / "flood.kvfs", work / "flood.mnt", "128M", ("--metrics-port", str(port)))
    with mounted(m):
        assert m.proc is not None
        _cycles(m, "warmup", 20)
        base = _cycles(m, "base", 200)
        res.counts["fuse_p99_base_ms"] = round(_p99(base) * 1e3, 2)
        # generous: the cycles fsync, and the disk is shared (one slow fsync is a p99 of
        # 200); the flood this guards against stalled FUSE for up to 34 s
        limit = max(10 * _p99(base), _p99(base) + 1.0)
        threads0, rss0 = _threads(m.proc.pid), rss_kib(m.proc.pid)
        phases = {
            "idle": lambda: open_idle(port, n),
            "dribble": lambda: threading.Thread(target=_dribble, args=(port, 500, 8.0)),
            "churn": lambda: threading.Thread(target=lambda: res.add("churn_connections",
                                                                     _churn(port, 8.0))),
        }
        for name, start in phases.items():
            if time.monotonic() > deadline:
                break
            held = start()
            if isinstance(held, threading.Thread):
                held.start()
            else:
                res.done = len(held)  # the idle connections opened
            during = _cycles(m, f"during-{name}", 200)
            if not _scrape(port):
                res.fail(f"{name}: a scrape was not answered during the flood")
            threads, rss = _threads(m.proc.pid), rss_kib(m.proc.pid)
            if isinstance(held, threading.Thread):
                held.join()
            else:
                for s in held:
                    s.close()
            after = _cycles(m, f"after-{name}", 200)
            res.counts[f"fuse_p99_{name}_ms"] = round(_p99(during) * 1e3, 2)
            res.counts[f"fuse_p99_after_{name}_ms"] = round(_p99(after) * 1e3, 2)
            res.peak("mount_threads_max", threads)
            res.peak("mount_rss_growth_mib", round((rss - rss0) / 1024, 1))
            if _p99(during) > limit or _p99(after) > limit:
                res.fail(f"{name}: FUSE p99 {_p99(during) * 1e3:.1f} ms during, "
                         f"{_p99(after) * 1e3:.1f} ms after, baseline {_p99(base) * 1e3:.1f} ms")
            if threads > threads0 + 2:
                res.fail(f"{name}: the mount went from {threads0} to {threads} threads")
            if rss - rss0 > 64 << 10:
                res.fail(f"{name}: the mount's RSS grew by {(rss - rss0) >> 10} MiB")
            if not alive(m, res, name):
                return res
        stop(m, res)
    return res

"""Scenarios 1 and 2 of ``tools/torture.py``: crashes.

``kill9``: writers append and fsync through the mount; the mount process is SIGKILLed at a
random moment; fsck; remount; every fsynced byte is there and every byte is right.
``faults``: random engine workloads ended by power cuts (``kvfs.faults``: unsynced writes
kept in part, one torn at any byte), failpoints (a write, the superblock write, the
checkpoint of a reopen) and torn superblocks; reopen; check against a model.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from torture_common import MB, Result, chunk_size, first_diff, fsck, seed_of, start, stop, stream

from kvfs.engine.errors import Corrupt, NoSpace
from kvfs.engine.faults import FaultyVolume, PowerCut
from kvfs.engine.format import SB_SIZE, SB_SLOT, unpack_header
from kvfs.engine.fsck import check_volume
from kvfs.engine.quota import Ledger, session_use
from kvfs.engine.store import Store
from kvfs.engine.types import StoreConfig
from kvfs.mount_runner import Mount

# ============================================================================ 1. kill -9 loop
K9_SESSIONS, K9_WRITERS, K9_CAP = 12, 4, 768 << 10


@dataclass
class Tracked:
    """A file written through the mount: ``stream(seed)`` prefix; what was written/fsynced."""

    path: Path
    seed: int
    written: int = 0  # bytes os.write accepted
    attempted: int = 0  # end of the last write tried (it may have reached the disk)
    synced: int = 0  # length at the last fsync that returned
    fd: int = -1


def _k9_writer(files: list[Tracked], rng: random.Random, killed: threading.Event,
               stop_: threading.Event, res: Result) -> None:
    try:
        while not stop_.is_set():
            f = rng.choice(files)
            if f.written >= K9_CAP:
                time.sleep(0.002)
                continue
            if f.fd < 0:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(f.path.parent)
                f.fd = os.open(f.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            n = min(K9_CAP - f.written, chunk_size(rng))
            f.attempted = f.written + n
            f.written += os.write(f.fd, stream(f.seed, K9_CAP)[f.written:f.attempted])
            res.add("bytes_written", n)
            r = rng.random()
            if r < 0.3:
                os.fsync(f.fd)
                f.synced = f.written
                res.add("fsyncs")
            elif r < 0.36:
                os.close(f.fd)
                f.fd = -1
    except OSError as e:
        if not killed.is_set():
            res.fail(f"writer error while the mount was alive: {e!r}")
    finally:
        for f in files:
            if f.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(f.fd)
                f.fd = -1


def _k9_verify(m: Mount, files: list[Tracked], res: Result, trial: int) -> None:
    names = {f.path.parent.name for f in files}
    extra = set(os.listdir(m.sessions)) - names
    if extra:
        res.fail(f"trial {trial}: sessions appeared from nowhere: {sorted(extra)}")
    for f in files:
        try:
            data = f.path.read_bytes()
        except FileNotFoundError:
            data = b""
            if f.synced:
                res.fail(f"trial {trial}: {f.path} lost after kill -9 ({f.synced} bytes fsynced)")
        n = len(data)
        if n < f.synced:
            res.fail(f"trial {trial}: {f.path}: {n} bytes, {f.synced} were fsynced")
        if n > max(f.attempted, f.written):
            res.fail(f"trial {trial}: {f.path}: {n} bytes, only {f.attempted} ever written")
        want = stream(f.seed, K9_CAP)[:n]
        if data != want:
            res.fail(f"trial {trial}: {f.path}: wrong byte at {first_diff(data, want)}")
            res.add("wrong_files")
        res.add("bytes_verified", n)
        res.add("fsynced_bytes_checked", f.synced)
        f.written = f.attempted = f.synced = n


def _k9_rotate(m: Mount, files: list[Tracked], gen: dict[str, int]) -> None:
    """Delete (durably) the sessions that are nearly full; their names start a new stream."""
    for name in sorted({f.path.parent.name for f in files if f.written >= K9_CAP * 0.9}):
        d = m.sessions / name
        for p in d.iterdir():
            p.unlink()
        d.rmdir()
        gen[name] += 1
        for f in files:
            if f.path.parent.name == name:
                f.seed, f.written, f.attempted, f.synced = seed_of(name, gen[name], f.path.name), 0, 0, 0
    fd = os.open(m.sessions, os.O_RDONLY)
    try:
        os.fsync(fd)  # fsyncdir: the deletions are durable before the next kill
    finally:
        os.close(fd)


def kill9(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """Writers append and fsync through the mount; SIGKILL it; fsck; remount; verify."""
    res = Result("kill9", n)
    m = Mount(work / "k9.kvfs", work / "k9.mnt", "64M")
    gen = {f"s{i:02d}": 0 for i in range(K9_SESSIONS)}
    files = [Tracked(m.sessions / s / f, seed_of(s, 0, f)) for s in gen for f in ("layer_0", "layer_1")]
    start(m)
    try:
        for trial in range(n):
            if time.monotonic() > deadline:
                break
            killed, stop_ = threading.Event(), threading.Event()
            threads = [threading.Thread(target=_k9_writer, daemon=True, args=(
                files[2 * i::2 * K9_WRITERS] + files[2 * i + 1::2 * K9_WRITERS],
                random.Random(rng.random()), killed, stop_, res)) for i in range(K9_WRITERS)]
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.05, 1.5))
            killed.set()
            m.kill()  # SIGKILL, then fusermount3 -u -z of the dead mountpoint
            stop_.set()
            for t in threads:
                t.join(timeout=30)
                if t.is_alive():
                    res.fail(f"trial {trial}: a writer is stuck after the kill")
            res.add("kills")
            rc, out = fsck(m.volume)
            if rc:
                res.fail(f"trial {trial}: fsck exit {rc} after kill -9:\n{out}")
            else:
                res.add("fsck_clean")
            t0 = time.monotonic()
            start(m)
            res.peak("max_recovery_s", round(time.monotonic() - t0, 3))
            _k9_verify(m, files, res, trial)
            _k9_rotate(m, files, gen)
            res.done += 1
        if m.proc is not None:
            stop(m, res)
        rc, out = fsck(m.volume)
        if rc:
            res.fail(f"fsck exit {rc} after the final clean unmount:\n{out}")
        s = Store.open(str(m.volume), readonly=True)
        res.counts["ring_laps"] = round(s.ring.head / s.ring.size, 1)
        s.crash()
    finally:
        if m.proc is not None:
            m.kill()
    return res


# ============================================================================ 2. faults
class TortureVolume(FaultyVolume):
    """FaultyVolume plus a torn superblock write and a failpoint armed at the next open."""

    arm_on_open: int | None = None  # the next instance fails after this many writes

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)
        self.tear_superblock = False
        self.fail_after_writes, TortureVolume.arm_on_open = TortureVolume.arm_on_open, None

    def write_superblock(self, sb) -> None:  # noqa: ANN001
        if self.tear_superblock:  # the write reaches the journal, its fsync never happens
            self.pwrite(sb.pack()[:SB_SIZE], (sb.seq % 2) * SB_SLOT)
            raise self.cut("after the superblock write, before its fsync")
        super().write_superblock(sb)


class FaultModel:
    """What a Store must hold after a crash: per file, a prefix of a state it had since
    the last durable point, never shorter than that point unless it shrank since."""

    SESSIONS, FILES = ("a", "b", "c", "dd", "e"), ("layer_0", "layer_1", "meta.json")

    def __init__(self, store: Store, rng: random.Random) -> None:
        self.s, self.rng = store, rng
        self.cur: dict[tuple[str, str], bytes] = {}
        self.live: set[str] = set()
        self.durable_now()

    def durable_now(self) -> None:
        self.synced = dict(self.cur)
        self.synced_sessions = set(self.live)
        self.seen_sessions = set(self.live)
        self.hist = {k: [v] for k, v in self.cur.items()}
        self.shrunk: set[tuple[str, str]] = set()

    def _state(self, k: tuple[str, str], v: bytes | None, shrunk: bool = False) -> None:
        if v is not None:
            self.hist.setdefault(k, []).append(v)
        if shrunk:
            self.shrunk.add(k)

    def op(self, res: Result) -> None:
        """One random operation (the model records its outcome before the engine runs it)."""
        s, rng = self.s, self.rng
        n, f = rng.choice(self.SESSIONS), rng.choice(self.FILES)
        k, r = (n, f), rng.random()
        if n not in self.live:
            self.seen_sessions.add(n)
            s.create_session(n, uid=1000 + self.SESSIONS.index(n) % 3)  # three owners
            self.live.add(n)
        elif k not in self.cur:
            self._state(k, b"")
            s.create_file(n, f)
            self.cur[k] = b""
        elif r < 0.6:
            cur = self.cur[k]
            if len(cur) > 400_000:
                self._state(k, b"", shrunk=True)
                s.truncate(n, f, 0)
                self.cur[k] = cur = b""
            size = chunk_size(rng, 200_000)
            data = rng.randbytes(size) if rng.random() < 0.5 else stream(rng.randrange(64), size)
            self._state(k, cur + data)
            try:
                s.append(n, f, len(cur), data)
            except NoSpace:
                res.add("enospc")
                return
            self.cur[k] = cur + data
            res.add("bytes_appended", size)
        elif r < 0.7:
            t = rng.randint(0, len(self.cur[k]))
            self._state(k, self.cur[k][:t], shrunk=True)
            s.truncate(n, f, t)
            self.cur[k] = self.cur[k][:t]
        elif r < 0.74:
            self._state(k, None, shrunk=True)
            s.delete_file(n, f)
            del self.cur[k]
        elif r < 0.76:
            for kk in [kk for kk in self.cur if kk[0] == n]:
                self._state(kk, None, shrunk=True)
                del self.cur[kk]
            self.live.discard(n)
            s.delete_session(n)
        elif r < 0.85:
            s.sync()
            self.durable_now()
        elif r < 0.88:
            s.checkpoint()
            self.durable_now()

    def check(self, store: Store, res: Result, where: str) -> None:
        """Compare the reopened ``store`` with the model, then adopt what it holds."""
        self.s = store
        got: dict[tuple[str, str], bytes] = {}
        names = store.list_sessions()
        for n in names:
            if n not in self.seen_sessions:
                res.fail(f"{where}: session {n!r} appeared from nowhere")
            for f in store.list_files(n):
                try:
                    got[(n, f)] = data = store.read(n, f, 0, 1 << 40)
                except Corrupt as e:
                    res.fail(f"{where}: {n}/{f} unreadable after recovery: {e}")
                    continue
                res.add("bytes_verified", len(data))
                states = self.hist.get((n, f))
                if states is None or not any(st[:len(data)] == data for st in states):
                    res.fail(f"{where}: {n}/{f} holds {len(data)} bytes it never had")
        for k, v in self.synced.items():
            if k in self.shrunk:
                continue
            if k not in got:
                res.fail(f"{where}: synced file {k} lost")
            elif not got[k].startswith(v):
                res.fail(f"{where}: {k}: synced bytes lost ({len(got[k])} < {len(v)})")
        lost = self.synced_sessions - set(names) - {k[0] for k in self.shrunk}
        if lost:
            res.fail(f"{where}: synced sessions lost: {sorted(lost)}")
        counted = Ledger()  # the usage records, moved on by the replay, against the sessions
        for n in names:
            counted.add(store.idx.find(n).uid, session_use(store.idx.find(n)))
        if counted.use != store.quota.use:
            res.fail(f"{where}: usage records {store.quota.use} != the sessions' {counted.use}")
        res.add("usage_checks")
        self.cur, self.live = got, set(names)
        self.durable_now()  # the writable open checkpointed what it found


def faults(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """Random engine workloads ended by power cuts, torn writes and failpoints; reopen; check."""
    res = Result("faults", n)
    path = str(work / "faults.kvfs")
    cfg = StoreConfig(write_buffer=rng.choice((8 << 10, 64 << 10, 1 << 20)), hot_sessions=2)
    model = FaultModel(Store.create(path, 8 * MB, cfg, volume=TortureVolume), rng)
    for trial in range(n):
        if time.monotonic() > deadline:
            break
        for _ in range(rng.randint(1, 40)):
            model.op(res)
        mode = rng.choice(("cut", "cut", "write_fail", "sb_fail", "sb_tear", "recovery_fail"))
        res.add(f"mode_{mode}")
        vol = model.s.vol
        try:
            if mode == "write_fail":
                vol.fail_after_writes = rng.randint(0, 6)
            elif mode == "sb_fail":
                vol.fail_before_superblock = True
            elif mode == "sb_tear":
                vol.tear_superblock = True
            armed = mode in ("write_fail", "sb_fail", "sb_tear")
            if mode in ("sb_fail", "sb_tear") and rng.random() < 0.5:
                model.s.checkpoint()  # raises after the ring and tree are synced
            for _ in range(300 if armed else 0):
                model.op(res)  # until the failpoint fires (reclaim checkpoints too)
            if armed:
                model.s.sync()
                model.s.checkpoint()
                res.add("failpoint_not_reached")
            elif rng.random() < 0.5:
                model.s.flush()
        except PowerCut:
            res.add("failpoints_fired")
        keep = rng.randint(0, len(vol.journal))
        tear = rng.randint(0, len(vol.journal[keep][2])) if keep < len(vol.journal) else None
        if mode == "sb_tear" and vol.journal and unpack_header(vol.journal[-1][2]) is None:
            keep, tear = len(vol.journal) - 1, rng.randint(0, SB_SIZE)  # tear the superblock
            res.add("torn_superblocks")
        res.add("torn_writes" if tear is not None else "clean_cuts")
        vol.power_cut(keep, tear)
        if mode == "recovery_fail":  # a second power cut, inside the reopen's checkpoint
            TortureVolume.arm_on_open = 0  # its superblock write fails
            try:
                Store.open(path, cfg, volume=TortureVolume).crash()
            except PowerCut:
                res.add("recovery_cuts")
                v = FaultyVolume.last
                keep = rng.randint(0, len(v.journal))
                v.power_cut(keep, rng.randint(0, 600) if keep < len(v.journal) else None)
            TortureVolume.arm_on_open = None
        model.check(Store.open(path, cfg, volume=TortureVolume), res, f"trial {trial} ({mode})")
        res.done += 1
        if trial % 25 == 24 or trial == n - 1:
            model.s.close()
            c = check_volume(path)
            if c.status:
                res.fail(f"trial {trial}: fsck status {c.status}: {c.problems[:5]}")
            res.add("fsck_runs")
            model.s = Store.open(path, cfg, volume=TortureVolume)
    model.s.close()
    res.counts["ring_laps"] = round(Store.open(path, readonly=True).ring.head / (8 * MB), 1)
    return res

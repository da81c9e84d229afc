"""Scenarios 3 and 4 of ``tools/torture.py``, through a real mount: damage and fullness.

``flips``: single-bit flips in a written volume, in batches in distinct places; per batch
fsck, mount, read every file (right bytes or EIO, the mount never dies), unmount, restore.
``full``: fill to ENOSPC (nothing else lost, reads served, deleting frees space), then
with ``evict_when_full`` (sessions dropped whole, never partially).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from torture_common import (
    MB,
    MountFailed,
    Result,
    alive,
    check_files,
    chunk_size,
    first_diff,
    fsck,
    mount_stats,
    mounted,
    put,
    seed_of,
    stop,
    stream,
    write_all,
)

from kvfs.engine.blocks import parse_table
from kvfs.engine.format import BLOCK_ENTRY, HDR_SIZE, PAGE, SB_SIZE, SB_SLOT, T_DATA
from kvfs.engine.fsck import CheckResult, check_volume
from kvfs.engine.ring import ScanReport
from kvfs.engine.store import Store
from kvfs.mount_runner import Mount

READ_CHUNK = 128 << 10


# ============================================================================ 3. bit flips
@dataclass
class Target:
    """A flippable place: ``kind`` sb/tree/live/dead/entry/free, bytes [start, end) of the
    volume; for ``live`` (a data entry's header and block table, or one of its blocks, that
    some file reads), the (session, file, offset, length) of file bytes it guards. ``dead``:
    a block of a live entry that no file reads any more (cut by a truncation): a flip there
    is harmless, only checked never to produce wrong bytes."""

    kind: str
    start: int
    end: int
    holds: list[tuple[str, str, int, int]]


FLIP_SESSIONS = 30
MOSTLY_DATA = {"live": 85, "dead": 3, "entry": 4, "tree": 4, "sb": 2, "free": 5}
ANY_KIND = {"live": 1, "dead": 1, "entry": 1, "tree": 1, "sb": 1, "free": 1}


def _flip_build(work: Path, rng: random.Random, res: Result) -> tuple[Mount, dict[tuple[str, str], bytes]]:
    """A 16 MiB volume written through the mount: fsynced appends, retried turns, a deleted
    session; cleanly unmounted. Returns the mount (stopped) and every file's bytes."""
    m = Mount(work / "flip.kvfs", work / "flip.mnt", "16M")
    with mounted(m):
        want = _flip_write(m, rng, res)
    return m, want


def _flip_write(m: Mount, rng: random.Random, res: Result) -> dict[tuple[str, str], bytes]:
    want: dict[tuple[str, str], bytes] = {}
    for i in range(FLIP_SESSIONS):  # enough sessions for a B+ tree of several leaves
        d = m.sessions / f"f{i}"
        d.mkdir()
        for name in ("layer_0", "layer_1", "meta.json"):
            fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            data = b""
            for _ in range(rng.randint(2, 5)):
                chunk = stream(rng.randrange(1 << 30), chunk_size(rng, 96 << 10))
                write_all(fd, chunk)
                os.fsync(fd)  # one ring entry per fsync
                data += chunk
                if rng.random() < 0.2:  # retry a turn: truncate, append again
                    data = data[:len(data) // 2]
                    os.ftruncate(fd, len(data))
            os.close(fd)
            want[(f"f{i}", name)] = data
    gone = f"f{FLIP_SESSIONS - 1}"
    shutil.rmtree(m.sessions / gone)  # dead entries and a tombstone in the ring
    want = {k: v for k, v in want.items() if k[0] != gone}
    for (s, f), data in want.items():
        if (m.sessions / s / f).read_bytes() != data:
            res.fail(f"flip volume: {s}/{f} wrong before any flip")
    stop(m, res)
    return want


def _flip_targets(path: Path, rng: random.Random) -> list[Target]:
    s = Store.open(str(path), readonly=True)
    try:
        ring = s.ring
        live: dict[int, list[tuple[str, str, int, int, int]]] = {}
        for name in s.list_sessions():
            for f in s.idx.find(name).files.values():
                for k, (pos, skip, n, _esize) in enumerate(f.ext):
                    live.setdefault(pos, []).append((name, f.name, f.off[k], skip, n))
        out = [Target("sb", 0, SB_SIZE, []), Target("sb", SB_SLOT, SB_SLOT + SB_SIZE, [])]
        for it in ring.scan(ring.tail, ring.head, ScanReport()):
            h, p = it.hdr, ring.phys(it.hdr.pos)
            hit = live.get(h.pos, []) if h.type == T_DATA else []
            if not hit:
                out.append(Target("entry", p, p + HDR_SIZE + h.stored_len, []))
                continue
            tab = parse_table(h, s.vol.pread(h.nblocks * BLOCK_ENTRY.size, p + HDR_SIZE))
            every = [(sn, fn, off, n) for sn, fn, off, _skip, n in hit]
            out.append(Target("live", p, p + tab.st_off[0], every))  # header + block table
            for i in range(tab.nblocks):  # a block guards the file bytes it holds, no others
                ra, rb = tab.raw_off[i], tab.raw_off[i + 1]
                guards = [(sn, fn, off + max(ra, skip) - skip, min(rb, skip + n) - max(ra, skip))
                          for sn, fn, off, skip, n in hit if ra < skip + n and skip < rb]
                out.append(Target("live" if guards else "dead", p + tab.st_off[i],
                                  p + tab.st_off[i + 1], guards))
        for pg in range(s.sb.tree_pages):
            off = s.sb.tree_offset + pg * PAGE
            if any(s.vol.pread(PAGE, off)):
                out.append(Target("tree", off, off + PAGE, []))
        head, lap_end = ring.phys(ring.head), ring.offset + ring.size
        for _ in range(8 if lap_end - head > 4096 else 0):
            a = rng.randrange(head, lap_end - 512)
            out.append(Target("free", a, a + 512, []))
        return out
    finally:
        s.crash()


def _pick(targets: list[Target], k: int, rng: random.Random,
          weights: dict[str, int]) -> list[Target]:
    """``k`` distinct targets, mostly live data, at most one metadata place (superblock,
    tree page or non-data entry): one metadata fault per mount, as many data faults as k.
    (Two metadata faults at once -- an unusable checkpoint and a corrupt truncation record
    -- revive a truncated tail: the known limit of docs/format.md.)"""
    by: dict[str, list[Target]] = {}
    for t in targets:
        by.setdefault(t.kind, []).append(t)
    kinds = [x for x in weights if by.get(x)]
    chosen: list[Target] = []
    for _ in range(k * 8):
        if len(chosen) == k:
            break
        kind = rng.choices(kinds, [weights[x] for x in kinds])[0]
        t = rng.choice(by[kind])
        meta = ("sb", "tree", "entry")
        if t in chosen or (kind in meta and any(c.kind in meta for c in chosen)):
            continue
        chosen.append(t)
    return chosen


def _read_all(m: Mount, want: dict[tuple[str, str], bytes], res: Result,
              where: str) -> tuple[dict, dict, set]:
    """Read every file through the mount in chunks: right bytes or EIO per chunk."""
    eio: dict[tuple[str, str], list[tuple[int, int]]] = {}
    sizes: dict[tuple[str, str], int] = {}
    missing: set[tuple[str, str]] = set()
    for key, data in want.items():
        try:
            fd = os.open(m.sessions / key[0] / key[1], os.O_RDONLY)
        except FileNotFoundError:
            missing.add(key)
            res.add("files_missing")
            continue
        except OSError as e:  # EIO: the index entry of the file could not be read
            if e.errno != errno.EIO:
                res.fail(f"{where}: open {key}: {e!r} (only EIO is allowed)")
            eio[key] = [(0, 1 << 62)]
            res.add("opens_eio")
            continue
        try:
            size = sizes[key] = os.fstat(fd).st_size
            if size > len(data):
                res.fail(f"{where}: {key} is {size} bytes, only {len(data)} were written")
            o = 0
            while o < size:
                try:
                    b = os.pread(fd, READ_CHUNK, o)
                except OSError as e:
                    if e.errno != errno.EIO:
                        res.fail(f"{where}: {key} read at {o}: {e!r} (only EIO is allowed)")
                    eio.setdefault(key, []).append((o, o + READ_CHUNK))
                    res.add("reads_eio")
                    o += READ_CHUNK
                    continue
                if not b:
                    res.fail(f"{where}: {key}: read at {o} returned nothing before size {size}")
                    break
                if b != data[o:o + len(b)]:
                    res.fail(f"{where}: {key}: WRONG BYTES at {o + first_diff(b, data[o:])}")
                    res.add("wrong_reads")
                res.add("bytes_verified", len(b))
                res.add("reads_ok")
                o += len(b)
        finally:
            os.close(fd)
    return eio, sizes, missing


def flips(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """``n`` single-bit flips, in batches in distinct places of a written volume; per batch:
    fsck (must report a flip in live data), mount, read every file, clean unmount, restore."""
    res = Result("flips", n)
    m, want = _flip_build(work, rng, res)
    pristine = work / "pristine.kvfs"
    shutil.copyfile(m.volume, pristine)
    targets = _flip_targets(pristine, rng)
    res.counts["targets"] = len(targets)
    cycle = 0
    while res.done < n and time.monotonic() < deadline:
        single = cycle % 10 >= 6  # 4 cycles in 10: one flip, any kind alike
        k = 1 if single else min(40, n - res.done)
        cycle += 1
        shutil.copyfile(pristine, m.volume)  # restores every flip and what the last mount wrote
        batch = _pick(targets, k, rng, ANY_KIND if single else MOSTLY_DATA)
        fd = os.open(m.volume, os.O_RDWR)
        try:
            for t in batch:
                off = rng.randrange(t.start, t.end)
                os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ (1 << rng.randrange(8))]), off)
                res.add(f"flips_{t.kind}")
        finally:
            os.close(fd)
        res.done += len(batch)
        where = f"cycle {cycle} ({', '.join(t.kind for t in batch[:6])}...)"
        try:
            c = check_volume(str(m.volume))
        except Exception as e:  # noqa: BLE001 - fsck must report damage, never crash on it
            res.fail(f"{where}: fsck crashed: {e!r}")
            c = CheckResult(status=2)
        live = [t for t in batch if t.kind == "live"]
        if c.status == 2 and c.problems:
            res.fail(f"{where}: fsck calls the volume unusable: {c.problems[:3]}")
        elif live and c.status == 0:
            res.fail(f"{where}: fsck clean although {len(live)} flips hit live data")
        res.add("fsck_reported" if c.status else "fsck_clean")
        if len(batch) == 1:  # what fsck sees of one flip, by place
            res.add(f"single_{batch[0].kind}_fsck_{'reported' if c.status else 'clean'}")
        try:
            with mounted(m):
                _flip_read(m, want, batch, res, where)
        except MountFailed as e:
            res.fail(f"{where}: the mount refused the volume or did not unmount: {e}")
    return res


def _flip_read(m: Mount, want: dict[tuple[str, str], bytes], batch: list[Target], res: Result,
               where: str) -> None:
    """Read everything through the mount: right bytes or EIO; each live-data flip is seen."""
    live = [t for t in batch if t.kind == "live"]
    eio, sizes, missing = _read_all(m, want, res, where)
    if missing and all(t.kind in ("live", "free") for t in batch):
        res.fail(f"{where}: files vanished though no metadata was hit: {sorted(missing)}")
    for t in live:  # every flip in live data is seen: EIO there, or the file cut before it
        for s, f, off, ln in t.holds:
            key = (s, f)
            if key in missing or sizes.get(key, 0) <= off or any(
                    a < off + ln and off < b for a, b in eio.get(key, [])):
                res.add("live_flips_detected")
            else:
                res.fail(f"{where}: flip in {s}/{f} bytes {off}..{off + ln} read as good")
    if alive(m, res, where):
        st = mount_stats(m)
        # the flips are corruption the store met, so the volume is marked needs-fsck (the
        # top level of the stats says so); a handler's own failure is an internal error
        if st["fs"]["errors"]:
            res.fail(f"{where}: the mount had internal errors: {st['fs']}")
        elif st["needs_fsck"] and not st["store"]["volume"]["needs_fsck"]:
            res.fail(f"{where}: needs_fsck set by the FUSE layer, not by corruption: {st['fs']}")
        stop(m, res)


# ============================================================================ 4. full volume
def _filler(m: Mount, j: int, out: dict[int, tuple[int, int, int | None]]) -> None:
    """Append and fsync to fill-<j>/layer_0 until an error; (written, fsynced, errno)."""
    data = stream(seed_of("fill", j), 16 * MB)
    pos = synced = 0
    err = None
    with contextlib.suppress(FileExistsError):
        os.mkdir(m.sessions / f"fill-{j}")
    fd = os.open(m.sessions / f"fill-{j}" / "layer_0", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while pos < len(data):
            pos += os.write(fd, data[pos:pos + (256 << 10)])
            os.fsync(fd)
            synced = pos
    except OSError as e:
        err = e.errno
    finally:
        try:
            os.close(fd)
        except OSError as e:
            err = err or e.errno
    out[j] = (pos, synced, err)


def _full_enospc(work: Path, rng: random.Random, res: Result) -> None:
    m = Mount(work / "full.kvfs", work / "full.mnt", "32M")
    with mounted(m):
        _fill_and_free(m, res)
    rc, text = fsck(m.volume)
    if rc:
        res.fail(f"fsck exit {rc} after the full-volume run:\n{text}")


def _fill_and_free(m: Mount, res: Result) -> None:
    """Keep sessions, then 4 writers until ENOSPC; reads still served; delete; write again."""
    files: dict[Path, bytes] = {}
    for i in range(4):
        (m.sessions / f"keep-{i}").mkdir()
        files[m.sessions / f"keep-{i}" / "layer_0"] = data = stream(seed_of("keep", i), MB)
        put(m.sessions / f"keep-{i}" / "layer_0", data)
    out: dict[int, tuple[int, int, int | None]] = {}
    threads = [threading.Thread(target=_filler, args=(m, j, out)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    errs = [e for _, _, e in out.values() if e is not None]
    if not errs or any(e != errno.ENOSPC for e in errs):
        res.fail(f"filling the volume: errors {[errno.errorcode.get(e, e) for e in errs]}, "
                 "expected ENOSPC and nothing else")
    res.add("enospc", errs.count(errno.ENOSPC))
    res.add("bytes_filled", sum(p for p, _, _ in out.values()))
    for j, (pos, synced, _) in out.items():
        got = (m.sessions / f"fill-{j}" / "layer_0").read_bytes()
        if not synced <= len(got) <= pos or got != stream(seed_of("fill", j), 16 * MB)[:len(got)]:
            res.fail(f"fill-{j}: {len(got)} bytes, fsynced {synced}, written {pos} or wrong bytes")
        files[m.sessions / f"fill-{j}" / "layer_0"] = got
    check_files(files, res, "at ENOSPC")  # the mount keeps serving reads
    try:
        put(m.sessions / "fill-0" / "layer_0", b"x" * MB)
        res.fail("a 1 MiB write succeeded on the full volume")
    except OSError as e:
        if e.errno != errno.ENOSPC:
            res.fail(f"write on the full volume: {e!r}, expected ENOSPC")
    check_files(files, res, "after a refused write")
    try:  # deleting a session at ENOSPC must work: it is how space comes back
        for j in (0, 1):
            shutil.rmtree(m.sessions / f"fill-{j}")
            del files[m.sessions / f"fill-{j}" / "layer_0"]
            res.add("deleted_at_full")
        (m.sessions / "after").mkdir()
        files[m.sessions / "after" / "layer_0"] = data = stream(seed_of("after"), 4 * MB)
        put(m.sessions / "after" / "layer_0", data)
        res.add("written_after_delete", len(data))
    except OSError as e:
        res.fail(f"delete a session then write, on the full volume: {e!r}")
    check_files(files, res, "after delete + write")
    m.remount()
    check_files(files, res, "after remount")
    stop(m, res)


def _evict_check(m: Mount, written: dict[str, dict[str, bytes]], res: Result, where: str) -> None:
    """Every session written is there whole (every file, every byte) or gone whole."""
    present = set(os.listdir(m.sessions))
    for name, files in written.items():
        if name not in present:
            continue
        for f, data in files.items():
            try:
                got = (m.sessions / name / f).read_bytes()
            except FileNotFoundError:
                got = None
            if got != data:
                res.fail(f"{where}: session {name} is partial: {f} "
                         f"{'missing' if got is None else f'{len(got)} of {len(data)} bytes'}")
            res.add("bytes_verified", len(data))


def _full_evict(work: Path, rng: random.Random, res: Result) -> None:
    m = Mount(work / "evict.kvfs", work / "evict.mnt", "32M", ("-o", "evict_when_full=true"))
    with mounted(m):
        _fill_evicting(m, rng, res)
    rc, text = fsck(m.volume)
    if rc:
        res.fail(f"fsck exit {rc} after the eviction run:\n{text}")


def _fill_evicting(m: Mount, rng: random.Random, res: Result) -> None:
    """Write 3 volumes' worth of sessions; each is always there whole or gone whole."""
    written: dict[str, dict[str, bytes]] = {}
    total, i = 0, 0
    while total < 90 * MB:
        name = f"ev-{i:04d}"
        (m.sessions / name).mkdir()
        files = written[name] = {}
        for f in ("layer_0", "layer_1", "meta.json"):
            size = 1024 if f == "meta.json" else rng.randint(256 << 10, 3 * MB // 2)
            files[f] = data = stream(seed_of("ev", i, f), size)
            try:
                put(m.sessions / name / f, data)
            except OSError as e:
                res.fail(f"write with evict_when_full: {name}/{f}: {e!r}")
                return
            total += size
        i += 1
        if i % 8 == 0:
            _evict_check(m, written, res, f"after {i} sessions")
    res.add("sessions_written", i)
    res.add("bytes_written_evict", total)
    m.remount()
    _evict_check(m, written, res, "after remount")
    present = set(os.listdir(m.sessions))
    gone = [x for x in written if x not in present]
    res.add("sessions_evicted", len(gone))
    oldest_kept = next((i for i, x in enumerate(written) if x in present), len(written))
    res.add("evicted_newer_than_a_kept_one", sum(1 for i, x in enumerate(written)
                                                 if x not in present and i > oldest_kept))
    if not gone:
        res.fail(f"{total} bytes through a 32 MiB volume and no session evicted")
    stop(m, res)


def full(work: Path, n: int, deadline: float, rng: random.Random) -> Result:
    """Fill to ENOSPC (nothing lost, reads served, delete frees space); then with eviction."""
    res = Result("full", n)
    for r in range(n):
        if time.monotonic() > deadline:
            break
        d = work / f"round{r}"
        d.mkdir()
        _full_enospc(d, rng, res)
        _full_evict(d, rng, res)
        res.done += 1
    return res

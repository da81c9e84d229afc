#!/usr/bin/env python3
"""Benchmarks of the native channel (kvfs.channel) beside the FUSE face, vs plain ext4 files.

Each measures kvfs's own client path and its peer interleaved in one run, on one disk:

- ``random_read`` (figure 1): one 96 KiB round of one layer at random, caches dropped,
  read through the channel (the client holds the file's extents, as an agent that wrote
  or read the session before does; reads go to the volume with ``O_DIRECT``) vs ``pread``
  of the same bytes in a per-layer ext4 file (goals p50 <= 1.1x, p99 <= 1.2x). Beside it,
  the same read asking the mount for the extents first, and its bound: the checked-read
  floor (a direct ``preadv`` of the entry, a CRC-32C of each 32 KiB block and one copy
  out, with no Python around them).
- ``piece_read`` (figure 11): a 1 KiB piece of a random session's layer by (session,
  layer, offset) among 2,000 sessions, the page, dentry and inode caches dropped before
  each read: through the channel vs open + pread + close of the per-layer ext4 file by
  path (goal <= 1.0x); beside it the channel asking for the extents each time and the
  same through the FUSE face.
- ``round_durable`` (figure 2): one agent round made durable, every layer's new tokens
  (22 layers of 96 KiB) in one request with one durability point vs the same bytes
  appended to 22 ext4 files, each fsync'd (goal >= 1.5x); beside it the same through the
  FUSE face.
- ``fresh_read``: a new client process reading sessions it has never seen (2,000
  sessions of 4 layers, the page cache dropped once before the timed part): a 1 KiB piece
  and a whole session through the process's kept channel vs open + pread + close of the
  ext4 files, p50 and p99; it reports the channel's first and second open too, and the
  I/O floor of each (the direct reads alone, at sessions nothing has read).

Each returns ``{"results": [...], "info": {...}}`` (bench_common). Alone:
``python tools/bench_native.py [--quick] [--only read,piece,round,fresh]``.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import crc32c
from bench_common import (
    KiB,
    MiB,
    Result,
    bench_dir,
    drop_caches,
    fadvise_dontneed,
    kv_bytes,
    run_json_child,
)
from bench_mount import mounted

log = logging.getLogger("bench.native")
ROUND = 96 * KiB
LAYERS = 22  # a 1.1 B Llama (TinyLlama: 22 layers, 4 KV heads x 64, bf16: 1 KiB per token)
PIECE = 1 * KiB


def _channel(mnt: Path) -> Any:
    from kvfs.channel import Channel

    ch = Channel.open(str(mnt))
    if ch is None:
        raise RuntimeError(f"{mnt} serves no native channel this process may use")
    return ch


def _fresh(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)
    p.mkdir(parents=True)


# ------------------------------------------------------------------------ figure 1
def random_read(quick: bool = False, workdir: str | None = None) -> dict[str, Any]:
    """Figure 1: a random 96 KiB round of one layer through the channel vs ``pread``."""
    work = bench_dir(workdir) / "native_random"
    _fresh(work)
    size = 32 * MiB if quick else 128 * MiB
    samples = 60 if quick else 300
    data = kv_bytes(size, seed=4)
    peer = work / "ext4.layer"
    peer.write_bytes(data)
    names = ("native", "ext4", "asked", "floor")
    vals: dict[str, list[float]] = {n: [] for n in names}
    vol = work / "vol"
    try:
        with mounted(vol, work / "mnt", 3 * size + 64 * MiB) as m:
            (m / "sessions" / "bench").mkdir()
            for off in range(0, size, ROUND):  # each close flushes: one entry per round
                with open(m / "sessions" / "bench" / "rounds", "ab", buffering=0) as f:
                    f.write(data[off:off + ROUND])
            ch = _channel(m)
            bare = _channel(m)  # a client that keeps no extents: asks the mount each read
            try:
                (_, (fe,)) = ch.extents("bench", [("rounds", 0, -1)])  # the agent's extents
                out = bytearray(ROUND)
                mv = memoryview(out)
                scratch = mmap.mmap(-1, 2 * ROUND)
                smv = memoryview(scratch)
                pfd = os.open(peer, os.O_RDONLY)
                rounds = random.Random(7).sample(range(size // ROUND), min(size // ROUND, samples + 10))

                def floor(r: int) -> bytes:
                    """A direct read of the entry, each block's CRC-32C, one copy out."""
                    pos, _, n, esize = fe.ext[r]
                    phys = ch.reader.roff + pos % ch.reader.rsize
                    os.preadv(ch.reader.dfd, [smv[:esize]], phys)
                    t = 72 + 16 * -(-n // (32 * KiB))
                    for b in range(t, t + n, 32 * KiB):
                        crc32c.crc32c(smv[b:min(b + 32 * KiB, t + n)])
                    mv[:] = smv[t:t + n]
                    return bytes(out)

                def one(name: str, r: int) -> bytes:
                    if name == "ext4":
                        os.preadv(pfd, [mv], r * ROUND)
                    elif name == "floor":
                        return floor(r)
                    elif name == "asked":
                        bare.cache.drop("bench")
                        bare.read("bench", [("rounds", r * ROUND, mv)])
                    else:
                        ch.read("bench", [("rounds", r * ROUND, mv)])
                    return bytes(out)

                try:
                    for i, r in enumerate(rounds):
                        for name in (names if i % 2 == 0 else names[::-1]):
                            fadvise_dontneed(vol)
                            os.posix_fadvise(pfd, 0, 0, os.POSIX_FADV_DONTNEED)
                            t0 = time.perf_counter()
                            got = one(name, r)
                            dt = (time.perf_counter() - t0) * 1e3
                            if got != data[r * ROUND:(r + 1) * ROUND]:
                                raise RuntimeError(f"{name}: wrong bytes for round {r}")
                            if i >= 10:
                                vals[name].append(dt)
                finally:
                    os.close(pfd)
                    smv.release()
                    scratch.close()
                stats = dict(ch.reader.stats)
            finally:
                ch.close()
                bare.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = len(vals["ext4"])
    note = (f"{n} distinct rounds of a {size // MiB} MiB layer file appended round by round; the "
            "volume's and the peer's pages dropped before every read")
    results = []
    for stat, goal in (("p50", 1.1), ("p99", 1.2)):
        results.append(Result(
            "1", f"random {ROUND // KiB} KiB round read of one layer through the native channel, "
                 f"caches dropped, {stat}",
            "kvfs native channel (the client holds the extents)", "ext4 file: pread", "ms",
            {"subject": vals["native"], "peer": vals["ext4"]}, better="lower", goal=goal,
            stat=stat, note=note).to_dict())
    for stat in ("p50", "p99"):
        results.append(Result(
            "1", f"random {ROUND // KiB} KiB round read of one layer through the native channel, "
                 f"caches dropped, {stat} [extents asked each read]",
            "kvfs native channel, the mount asked for the extents first", "ext4 file: pread",
            "ms", {"subject": vals["asked"], "peer": vals["ext4"]}, better="lower", stat=stat,
            note="the same rounds and samples").to_dict())
        results.append(Result(
            "1", f"random {ROUND // KiB} KiB round read of one layer through the native channel, "
                 f"caches dropped, {stat} [checked-read floor]",
            "direct preadv of the entry + CRC-32C of each block + one copy out",
            "ext4 file: pread", "ms", {"subject": vals["floor"], "peer": vals["ext4"]},
            better="lower", stat=stat,
            note="what bounds any read that checks what it returns: the same reads with no "
                 "Python around them").to_dict())
    return {"results": results, "info": {"bytes": size, "samples": n, "reader": stats}}


# ------------------------------------------------------------------------ figure 11
def piece_read(quick: bool = False, workdir: str | None = None) -> dict[str, Any]:
    """Figure 11: a 1 KiB piece of a random session's layer among 2,000 sessions, every
    cache dropped (pages, dentries, inodes), through the channel vs open+pread+close."""
    work = bench_dir(workdir) / "native_piece"
    _fresh(work)
    sessions = 500 if quick else 2000
    layers, per_layer = 4, 64 * KiB  # a short session: 4 layers of a 64-token round
    samples = 60 if quick else 300
    peer = work / "ext4" / "sessions"
    vol = work / "vol"
    rng = random.Random(11)
    names = ("native", "ext4", "asked", "fuse")
    vals: dict[str, list[float]] = {n: [] for n in names}
    how = ""
    try:
        with mounted(vol, work / "mnt", sessions * layers * per_layer * 3 + 128 * MiB) as m:
            ms = m / "sessions"
            _lay_sessions(ms, peer, sessions, layers, per_layer)
            ch = _channel(m)
            bare = _channel(m)  # keeps no extents: asks the mount each read
            try:
                for s in range(sessions):  # the agent's extents (it wrote these sessions)
                    ch.extents(f"s{s:05d}", [(f"layer_{x}", 0, -1) for x in range(layers)])
                out = bytearray(PIECE)
                mv = memoryview(out)

                def by_path(root: Path, sid: str, layer: int, off: int) -> bytes:
                    fd = os.open(root / sid / f"layer_{layer}", os.O_RDONLY)
                    try:
                        return os.pread(fd, PIECE, off)
                    finally:
                        os.close(fd)

                for i in range(samples + 10):
                    s, layer = rng.randrange(sessions), rng.randrange(layers)
                    off = rng.randrange(per_layer - PIECE)
                    sid = f"s{s:05d}"
                    want = kv_bytes(per_layer, seed=s * layers + layer)[off:off + PIECE]
                    for name in (names if i % 2 == 0 else names[::-1]):
                        how = drop_caches([vol, *[peer / sid / f"layer_{x}" for x in range(layers)]])
                        t0 = time.perf_counter()
                        if name == "ext4":
                            got = by_path(peer, sid, layer, off)
                        elif name == "fuse":
                            got = by_path(ms, sid, layer, off)
                        else:
                            c = bare if name == "asked" else ch
                            if name == "asked":
                                c.cache.drop(sid)
                            c.read(sid, [(f"layer_{layer}", off, mv)])
                            got = bytes(out)
                        dt = (time.perf_counter() - t0) * 1e3
                        if got != want:
                            raise RuntimeError(f"{name}: wrong bytes for {sid}/layer_{layer}@{off}")
                        if i >= 10:
                            vals[name].append(dt)
            finally:
                ch.close()
                bare.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    note = (f"{sessions} sessions x {layers} layers of {per_layer // KiB} KiB, one random "
            f"{PIECE // KiB} KiB piece per sample; caches dropped before each read ({how})")
    full = how == "drop_caches"
    name = (f"read one {PIECE // KiB} KiB piece of a random session's layer, {sessions:,} sessions, "
            f"caches dropped{' (dentries and inodes too)' if full else ''}")
    results = [Result("11", name, "kvfs native channel (the client holds the extents)",
                      "ext4: open + pread + close by path", "ms",
                      {"subject": vals["native"], "peer": vals["ext4"]}, better="lower",
                      goal=1.0, note=note).to_dict(),
               Result("11", f"{name} [extents asked each read]",
                      "kvfs native channel, the mount asked for the extents first",
                      "ext4: open + pread + close by path", "ms",
                      {"subject": vals["asked"], "peer": vals["ext4"]}, better="lower",
                      note="the same pieces; the mount's index may need its tree pages from "
                           "the disk").to_dict(),
               Result("11", f"{name} [FUSE face]", "kvfs mount: open + pread + close by path",
                      "ext4: open + pread + close by path", "ms",
                      {"subject": vals["fuse"], "peer": vals["ext4"]}, better="lower",
                      note="the same pieces through the mount").to_dict()]
    return {"results": results, "info": {"sessions": sessions, "layers": layers,
                                         "per_layer": per_layer, "drop": how}}


def _lay_sessions(ms: Path, peer: Path, sessions: int, layers: int, per_layer: int) -> None:
    """``sessions`` short sessions written through the mount at ``ms`` and, the same
    bytes, as per-layer ext4 files under ``peer``; synced."""
    for s in range(sessions):
        sid = f"s{s:05d}"
        (ms / sid).mkdir()
        (peer / sid).mkdir(parents=True)
        for layer in range(layers):
            b = kv_bytes(per_layer, seed=s * layers + layer)
            (ms / sid / f"layer_{layer}").write_bytes(b)
            (peer / sid / f"layer_{layer}").write_bytes(b)
    os.sync()


def _wait_published(mount: Path, sessions: int, timeout: float = 60) -> int:
    """Until the mount's catalog holds ``sessions`` sessions (it is rebuilt milliseconds
    after writes; a fresh client then asks nothing); how many it holds."""
    deadline = time.monotonic() + timeout
    held = 0
    while time.monotonic() < deadline:
        doc = json.loads((mount / ".kvfs" / "stats").read_bytes())
        held = (doc["store"].get("catalog") or {}).get("sessions", 0)
        if held >= sessions:
            break
        time.sleep(0.05)
    return held


# ------------------------------------------------------------------------ fresh client
def fresh_read(quick: bool = False, workdir: str | None = None) -> dict[str, Any]:
    """A new agent process reading sessions it has never seen: a 1 KiB piece by (session,
    layer, offset) and a whole short session, through the process's kept channel
    (``kvfs.channel.kept``: opened once, each session's extents found in the mount's
    catalog) vs open + pread + close of per-layer ext4 files, the page cache dropped first."""
    work = bench_dir(workdir) / "native_fresh"
    _fresh(work)
    sessions = 300 if quick else 2000
    layers, per_layer = 4, 64 * KiB
    samples = min(sessions // 2, 100 if quick else 400)
    peer = work / "ext4" / "sessions"
    vol = work / "vol"
    try:
        with mounted(vol, work / "mnt", sessions * layers * per_layer * 3 + 128 * MiB) as m:
            _lay_sessions(m / "sessions", peer, sessions, layers, per_layer)
            published = _wait_published(m, sessions)
            order = random.Random(13).sample(range(sessions), 3 * samples)
            job = {"mount": str(m), "peer": str(peer), "volume": str(vol), "layers": layers,
                   "per_layer": per_layer, "pieces": order[:samples],
                   "wholes": order[samples:2 * samples], "floors": order[2 * samples:]}
            got = run_json_child([__file__, "--child", json.dumps(job)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("a new client's kept channel: first open %.2f ms, second %.1f us; finding the "
             "socket: the root's xattr %.2f ms, /.kvfs/stats %.2f ms", got["first_open_ms"],
             got["second_open_us"], got["xattr_ms"], got["stats_ms"])
    split = {w: {part: round(statistics.median(v), 4) if v else None for part, v in d.items()}
             for w, d in got["split"].items()}
    for w, d in split.items():
        log.info("a new client's %s read, p50 of its parts: the direct reads %s ms, the rest "
                 "(the client's Python) %s ms", w, d["io"], d["rest"])
    note = (f"{sessions} sessions x {layers} layers of {per_layer // KiB} KiB; a new process, "
            f"{samples} sessions it never read, one per sample; {published} sessions in the "
            f"mount's catalog; caches dropped before the "
            f"timed part ({got['drop']}); its first channel open took "
            f"{got['first_open_ms']:.2f} ms, a second {got['second_open_us']:.1f} us")
    results = []
    for what, label in (("piece", f"read one {PIECE // KiB} KiB piece by (session, layer, offset)"),
                        ("whole", f"read a whole {layers}-layer session "
                                  f"({layers * per_layer // KiB} KiB)")):
        for stat in ("p50", "p99"):
            goal = 0.5 if stat == "p50" else 1.0 if what == "piece" else None
            results.append(Result(
                "11", f"{label}, a new client, {sessions:,} sessions never seen, {stat}",
                "kvfs native channel, kept client (extents from the mount's catalog)",
                "ext4: open + pread + close by path", "ms",
                {"subject": got[what]["native"], "peer": got[what]["ext4"]}, better="lower",
                goal=goal, stat=stat, note=note).to_dict())
            reads = ("one O_DIRECT pread of what the channel reads for a piece in an entry's "
                     "first block (header, block table, one 32 KiB block: 36 KiB)" if what == "piece"
                     else "one O_DIRECT preadv of each run of the session's entries that lie "
                     "within 64 KiB of each other on disk (what the channel's reader reads; one "
                     "run here)")
            for tag, key, how in (("I/O floor", what, reads),
                                  ("checked-read floor", what + "_checked",
                                   f"{reads}, a CRC-32C of every 32 KiB read and one copy out")):
                results.append(Result(
                    "11", f"{label}, a new client, {sessions:,} sessions never seen, {stat} "
                    f"[{tag}]", f"{how}, of another never-read session, no Python around it",
                    "ext4: open + pread + close by path", "ms",
                    {"subject": got["floors"][key], "peer": got[what]["ext4"]}, better="lower",
                    stat=stat, note=note).to_dict())
    return {"results": results, "info": {"sessions": sessions, "layers": layers,
                                         "per_layer": per_layer, "samples": samples,
                                         "first_open_ms": got["first_open_ms"],
                                         "second_open_us": got["second_open_us"],
                                         "xattr_ms": got["xattr_ms"], "stats_ms": got["stats_ms"],
                                         "drop": got["drop"], "catalog_hits": got["catalog_hits"],
                                         "p50_parts_ms": split,
                                         "published": published}}


def _fresh_child(job: dict[str, Any]) -> dict[str, Any]:
    """The timed part of ``fresh_read``, in a process that never used the mount."""
    from kvfs.channel import kept
    from kvfs.engine.format import BLOCK, BLOCK_ENTRY, HDR_SIZE

    mnt, peer, layers, per_layer = job["mount"], Path(job["peer"]), job["layers"], job["per_layer"]
    how = drop_caches([job["volume"]])  # (a user without root drops only the volume's pages)
    t0 = time.perf_counter()
    ch = kept(mnt)
    t1 = time.perf_counter()
    if kept(mnt) is not ch or ch is None:
        raise RuntimeError(f"{mnt}: no kept native channel")
    t2 = time.perf_counter()
    # how the socket is found (the root's xattr) against how it was (rendering the stats)
    os.getxattr(mnt, "user.kvfs.channel")
    t3 = time.perf_counter()
    (Path(mnt) / ".kvfs" / "stats").read_bytes()
    t4 = time.perf_counter()
    opens = {"first_open_ms": (t1 - t0) * 1e3, "second_open_us": (t2 - t1) * 1e6,
             "xattr_ms": (t3 - t2) * 1e3, "stats_ms": (t4 - t3) * 1e3}
    rng = random.Random(17)
    vals: dict[str, dict[str, list[float]]] = {w: {"native": [], "ext4": []} for w in ("piece", "whole")}

    def ext4(sid: str, names: list[str], off: int, n: int) -> bytes:
        out = b""
        for name in names:
            fd = os.open(peer / sid / name, os.O_RDONLY)
            try:
                out += os.pread(fd, n, off)
            finally:
                os.close(fd)
        return out

    # where a native read's time goes: its direct reads (the reader's preadv, timed) and
    # the rest (the client's Python: lookup, plan, checks, copy out)
    reader = ch.channel().reader
    io_s = [0.0]
    pread = reader._pread

    def timed_pread(buf: memoryview, off: int) -> int:
        t = time.perf_counter()
        try:
            return pread(buf, off)
        finally:
            io_s[0] += time.perf_counter() - t

    reader._pread = timed_pread  # type: ignore[method-assign]
    split: dict[str, dict[str, list[float]]] = {w: {"io": [], "rest": []} for w in ("piece", "whole")}
    for what in ("piece", "whole"):
        for i, s in enumerate(job[what + "s"]):
            sid = f"s{s:05d}"
            if what == "piece":
                layer, off, n = rng.randrange(layers), rng.randrange(per_layer - PIECE), PIECE
                names = [f"layer_{layer}"]
                want = kv_bytes(per_layer, seed=s * layers + layer)[off:off + n]
            else:
                off, n = 0, per_layer
                names = [f"layer_{x}" for x in range(layers)]
                want = b"".join(kv_bytes(per_layer, seed=s * layers + x) for x in range(layers))
            for arm in (("native", "ext4") if i % 2 == 0 else ("ext4", "native")):
                bufs = [bytearray(n) for _ in names]
                t = time.perf_counter()
                if arm == "ext4":
                    got = ext4(sid, names, off, n)
                else:
                    io_s[0] = 0.0
                    ch.read(sid, [(name, off, memoryview(b)) for name, b in zip(names, bufs, strict=True)])
                    got = b"".join(bufs)
                    split[what]["io"].append(io_s[0] * 1e3)
                    split[what]["rest"].append((time.perf_counter() - t - io_s[0]) * 1e3)
                vals[what][arm].append((time.perf_counter() - t) * 1e3)
                if got != want:
                    raise RuntimeError(f"{arm}: wrong bytes for {sid} {names} @{off}")
    # the floors: the direct reads a piece and a whole session cost at least, at other
    # sessions' entries (extents from the catalog; never read, so no cache between the disk
    # and the read), half the floor sessions each; and beside each, the same read with what
    # any checked read adds: a CRC-32C of every 32 KiB block read, and one copy out
    c = ch.channel()
    fd = os.open(job["volume"], os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 36 * KiB)  # an entry's header, table and first block, from its page
    whole_buf = mmap.mmap(-1, 2 * layers * (per_layer + 64 * KiB))
    floors: dict[str, list[float]] = {"piece": [], "piece_checked": [], "whole": [], "whole_checked": []}
    first = HDR_SIZE + BLOCK_ENTRY.size * -(-per_layer // BLOCK)  # an entry's first block, its offset

    def check_and_copy(m: mmap.mmap, start: int, n: int, out: bytearray, at: int) -> None:
        mv = memoryview(m)
        for o in range(start, start + n, BLOCK):
            crc32c.crc32c(mv[o:min(o + BLOCK, start + n)])
        out[:] = mv[at:at + len(out)]

    try:
        for i, s in enumerate(job["floors"]):
            sid = f"s{s:05d}"
            if i % 2 == 0:
                fe = c.locator.find(sid, "layer_0", 0, PIECE, None)
                if fe is None:
                    continue
                phys = c.view.ring_offset + fe.ext[0][0] % c.view.ring_size
                piece = bytearray(PIECE)
                r0 = time.perf_counter()
                os.preadv(fd, [buf], phys - phys % 4096)
                r1 = time.perf_counter()
                check_and_copy(buf, phys % 4096 + first, BLOCK, piece, phys % 4096 + first)
                r2 = time.perf_counter()
                floors["piece"].append((r1 - r0) * 1e3)
                floors["piece_checked"].append((r2 - r0) * 1e3)
                continue
            runs = _entry_runs(c, sid, [f"layer_{x}" for x in range(layers)], per_layer)
            if runs is None or sum(b - a for a, b in runs) > len(whole_buf):
                continue
            whole = bytearray(layers * per_layer)
            r0 = time.perf_counter()
            o = 0
            for a, b in runs:
                os.preadv(fd, [memoryview(whole_buf)[o:o + b - a]], a)
                o += b - a
            r1 = time.perf_counter()
            check_and_copy(whole_buf, 0, len(whole), whole, 0)
            r2 = time.perf_counter()
            floors["whole"].append((r1 - r0) * 1e3)
            floors["whole_checked"].append((r2 - r0) * 1e3)
    finally:
        os.close(fd)
    reader._pread = pread  # type: ignore[method-assign]
    return {**vals, "floors": floors, "split": split, "drop": how, "catalog_hits": ch.channel().locator.catalog_hits, **opens}


def _entry_runs(c: Any, sid: str, names: list[str], size: int) -> list[tuple[int, int]] | None:
    """The volume ranges (4 KiB aligned) the channel reads for every entry of ``names``
    (``size`` bytes each): entries within ``MERGE_GAP`` of each other on disk are one
    run, as the client's reader merges them. None when a file is not in the catalog."""
    from kvfs.engine.direct import MERGE_GAP

    spans = []
    for name in names:
        fe = c.locator.find(sid, name, 0, size, None)
        if fe is None:
            return None
        for pos, _skip, _n, esize in fe.ext:
            phys = c.view.ring_offset + pos % c.view.ring_size
            spans.append((phys - phys % 4096, -(-(phys + esize) // 4096) * 4096))
    runs: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if runs and a - runs[-1][1] <= MERGE_GAP:
            runs[-1] = (runs[-1][0], max(runs[-1][1], b))
        else:
            runs.append((a, b))
    return runs


# ------------------------------------------------------------------------ figure 2
def round_durable(quick: bool = False, workdir: str | None = None) -> dict[str, Any]:
    """Figure 2: one round of every layer made durable: one request, one durability point
    vs 22 per-layer ext4 appends each fsync'd (and the same through the FUSE face)."""
    from kvfs.channel import APPEND, Item

    work = bench_dir(workdir) / "native_round"
    _fresh(work)
    rounds = 30 if quick else 120
    data = [kv_bytes(ROUND, seed=k) for k in range(LAYERS)]
    total = ROUND * LAYERS
    peer = work / "ext4"
    peer.mkdir()
    names = ("native", "ext4", "fuse")
    vals: dict[str, list[float]] = {n: [] for n in names}
    try:
        with mounted(work / "vol", work / "mnt", rounds * total * 3 + 128 * MiB) as m:
            sess = m / "sessions" / "bench"
            sess.mkdir()
            (m / "sessions" / "fuse").mkdir()
            ch = _channel(m)
            fds = {"ext4": [os.open(peer / f"layer_{k}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                            for k in range(LAYERS)],
                   "fuse": [os.open(m / "sessions" / "fuse" / f"layer_{k}",
                                    os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) for k in range(LAYERS)]}
            try:
                for r in range(rounds + 3):
                    for name in (names if r % 2 == 0 else names[::-1]):
                        t0 = time.perf_counter()
                        if name == "native":
                            ch.write("bench", [Item(APPEND, f"layer_{k}", r * ROUND, data[k])
                                               for k in range(LAYERS)], sync=True)
                        else:
                            for k, fd in enumerate(fds[name]):
                                os.write(fd, data[k])
                                os.fsync(fd)
                        dt = time.perf_counter() - t0
                        if r >= 3:
                            vals[name].append(total / MiB / dt)
                for k in range(LAYERS):
                    got = bytearray(ROUND)
                    ch.read("bench", [(f"layer_{k}", (rounds + 2) * ROUND, memoryview(got))])
                    if got != data[k]:
                        raise RuntimeError(f"layer_{k}: wrong bytes read back")
            finally:
                for fd in fds["ext4"] + fds["fuse"]:
                    os.close(fd)
                ch.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    note = f"{LAYERS} layers x {ROUND // KiB} KiB per round, {len(vals['ext4'])} rounds each"
    results = [Result("2", f"one round made durable: {LAYERS} layers' new tokens, one durability point",
                      "kvfs native channel: one request, one sync",
                      f"{LAYERS} ext4 files: append + fsync each", "MiB/s",
                      {"subject": vals["native"], "peer": vals["ext4"]}, better="higher",
                      goal=1.5, note=note).to_dict(),
               Result("2", f"one round made durable: {LAYERS} layers' new tokens [FUSE face]",
                      f"kvfs mount: {LAYERS} files, append + fsync each",
                      f"{LAYERS} ext4 files: append + fsync each", "MiB/s",
                      {"subject": vals["fuse"], "peer": vals["ext4"]}, better="higher",
                      note=note).to_dict()]
    return {"results": results, "info": {"rounds": rounds, "layers": LAYERS, "round": ROUND}}


def channel_stream(cold_root: str, tmp: str, *, total_bytes: int = 87_000_000, layers: int = 24,
                   chunk: int = 1 << 20, batch: int = 8 << 20, repeats: int = 3) -> dict[str, Any]:
    """Figure 3's bound on write-behind: the same bytes as ``bench_warm.bench_writebehind``
    sent through the channel alone (requests of ``batch`` bytes, a round of every layer at a
    time, one sync at the end; no warm tier), against dd of the same bytes."""
    import subprocess
    import tempfile

    from kvfs.channel import APPEND, Item

    per_layer = total_bytes // layers // chunk * chunk
    total = per_layer * layers
    data = kv_bytes(per_layer, seed=5)
    src_dir = tempfile.mkdtemp(dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else tmp)
    src = os.path.join(src_dir, "src")
    with open(src, "wb") as f:
        for _ in range(layers):
            f.write(data)
    ch = _channel(Path(cold_root))
    ours, dds = [], []
    try:
        for rep in range(repeats):
            sid = f"bench-stream-{os.getpid()}-{rep}"
            os.mkdir(os.path.join(cold_root, "sessions", sid))
            t0 = time.perf_counter()
            items = []
            size = 0
            for off in range(0, per_layer, chunk):
                for layer in range(layers):
                    items.append(Item(APPEND, f"layer_{layer}", off, memoryview(data)[off:off + chunk]))
                    size += chunk
                    if size >= batch:
                        ch.write(sid, items)
                        items, size = [], 0
            ch.write(sid, items, sync=True)
            ours.append(time.perf_counter() - t0)
            shutil.rmtree(os.path.join(cold_root, "sessions", sid))
            dd_dir = os.path.join(cold_root, "sessions", f"bench-stream-dd-{os.getpid()}")
            os.mkdir(dd_dir)
            t0 = time.perf_counter()
            subprocess.run(["dd", f"if={src}", f"of={dd_dir}/layer_0", "bs=4M", "conv=fsync",
                            "status=none"], check=True)
            dds.append(time.perf_counter() - t0)
            shutil.rmtree(dd_dir)
    finally:
        ch.close()
        shutil.rmtree(src_dir, ignore_errors=True)
    med = sorted(ours)[len(ours) // 2]
    dmed = sorted(dds)[len(dds) // 2]
    return {"bytes": total, "channel_MBps": round(total / 1e6 / med, 1),
            "dd_MBps": round(total / 1e6 / dmed, 1), "batch": batch}


FIGURES = {"read": random_read, "piece": piece_read, "round": round_durable, "fresh": fresh_read}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=",".join(FIGURES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # fresh_read's new process
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if a.child:
        print(json.dumps(_fresh_child(json.loads(a.child))))
        return 0
    for f in a.only.split(","):
        r = FIGURES[f](quick=a.quick, workdir=a.out)
        for x in r["results"]:
            print(json.dumps({k: x[k] for k in ("name", "unit", "subject_value", "peer_value",
                                                "ratio", "goal_text", "goal_met")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Storage-engine benchmarks: the engine's own parts of figures 1, 2 and 7 of the page
(figure 7's is ``bench_sessions``; figure 8, the codec, is ``bench_codec``).

Drives ``kvfs.engine.Store`` directly, no FUSE, against the plain-file peer a user would
otherwise use, both measured interleaved in the same run on the same disk:

- ``append_throughput``: 64 MiB of KV-like fp16 data appended in round-sized chunks, then
  ``sync()``, vs ``dd bs=1M conv=fsync`` of the same bytes (goal >= 0.9x).
- ``cold_read``: one 96 KiB round (one entry, as appended) read at random, 600 distinct
  rounds of a 128 MiB layer file, with every file's pages dropped (``posix_fadvise``) and
  the engine's decoded-entry cache emptied before each sample, vs ``os.pread`` of the same
  range of an ext4 file holding the raw bytes (p50 and p99 <= 1.2x); compression
  ``auto`` and ``none``. A floor row does what any store that checks its bytes must: the
  ``pread``, a CRC-32C of each 32 KiB block compared with the stored one, and the copy
  out of the blocks into one result. Another reads each round's entry through the ring
  alone (header, block table, block checks), without the store's index, locks and
  caches. A last pair of rows times the same reads with every
  page cached (the engine's DONTNEED advice off): the engine's read path against that
  checked ``pread``, the disk taken out.
- ``open_sessions`` (from ``bench_sessions``): open time and RSS vs the session count.
Before timing, the engine's recent-latency windows are filled (2100 appends and reads) as
in a long-running mount.

Each function takes ``quick`` and an optional ``workdir`` and returns ``{"results":
[Result.to_dict(), ...], "info": {...}}`` (see ``bench_common``).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import crc32c
from bench_common import (
    KiB,
    MiB,
    Result,
    bench_dir,
    dd_seconds,
    fadvise_dontneed,
    interleave,
    kv_bytes,
)
from bench_common import unlink as _unlink
from bench_sessions import open_sessions

log = logging.getLogger("bench.engine")

ROUND = 96 * KiB  # one agent round of one layer (the unit a recall reads)


def _store():
    from kvfs.engine.store import Store
    from kvfs.engine.types import StoreConfig

    return Store, StoreConfig


def _steady_state(work: Path) -> None:
    """Fill the engine's recent-latency windows as a long-running mount has them full."""
    Store, StoreConfig = _store()
    p = work / "steady.vol"
    _unlink(p)
    s = Store.create(str(p), 16 * MiB, StoreConfig())
    s.create_session("w")
    s.create_file("w", "f")
    blob = b"\1" * 1024
    for i in range(2100):
        s.append("w", "f", i * 1024, blob)
    for i in range(2100):
        s.read("w", "f", (i * 7919 % 2100) * 1024, 1024)
    s.close()
    _unlink(p)


# ------------------------------------------------------------------------ append vs dd
def _engine_append(vol: Path, data: bytes, chunk: int, compression: str) -> float:
    """Seconds to append ``data`` in ``chunk``-byte appends to a fresh volume, then sync."""
    Store, StoreConfig = _store()
    _unlink(vol)
    s = Store.create(str(vol), max(4 * len(data), 64 * MiB), StoreConfig(compression=compression))
    try:
        s.create_session("bench")
        s.create_file("bench", "layer_0")
        s.sync()
        mv = memoryview(data)
        t0 = time.perf_counter()
        for off in range(0, len(data), chunk):
            s.append("bench", "layer_0", off, mv[off: off + chunk])
        s.sync()
        return time.perf_counter() - t0
    finally:
        s.close()
        _unlink(vol)


def _pwrite_floor(path: Path, data: bytes, chunk: int) -> float:
    """Seconds to ``os.pwrite`` ``data`` in ``chunk``-byte writes into a fresh preallocated
    file, then fsync: the system calls any store writing records of that size into
    preallocated space makes, with nothing else (no headers, checksums or index)."""
    _unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, len(data))
        os.fsync(fd)
        mv = memoryview(data)
        t0 = time.perf_counter()
        for off in range(0, len(data), chunk):
            os.pwrite(fd, mv[off: off + chunk], off)
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        _unlink(path)


def append_throughput(quick: bool = False, workdir: str | None = None) -> dict[str, Any]:
    """Figure 2 (engine part): append throughput vs ``dd conv=fsync`` of the same bytes."""
    work = bench_dir(workdir)
    size = 8 * MiB if quick else 64 * MiB
    reps = 2 if quick else 7
    data = kv_bytes(size)
    src, dst, vol = work / "append_src.bin", work / "append_dd.bin", work / "append.vol"
    src.write_bytes(data)
    src.read_bytes()  # dd reads its input from the page cache, as the engine from memory
    _steady_state(work)
    mib = size / MiB
    combos = [(c, ch) for c in ("auto", "none") for ch in (ROUND, MiB)]
    pairs = [("dd", lambda: mib / dd_seconds(src, dst)),
             ("floor", lambda: mib / _pwrite_floor(work / "append_floor.bin", data, ROUND))]
    for comp, ch in combos:
        pairs.append((f"{comp}/{ch}", partial(lambda c, k: mib / _engine_append(vol, data, k, c), comp, ch)))
    try:
        vals = interleave(pairs, reps, warmup=1)
    finally:
        _unlink(src, dst, vol)
    results = []
    for comp, ch in combos:
        results.append(Result(
            "2", f"append {mib:g} MiB in {ch // KiB} KiB chunks + sync, compression={comp}",
            f"kvfs engine append (compression={comp})", "dd bs=1M conv=fsync", "MiB/s",
            {"subject": vals[f"{comp}/{ch}"], "peer": vals["dd"]}, better="higher", goal=0.9,
            note="engine API, no FUSE; fp16 random-normal KV; fresh preallocated volume per run",
        ).to_dict())
    results.append(Result(
        "2", f"append {mib:g} MiB in {ROUND // KiB} KiB chunks + sync [pwrite floor]",
        f"os.pwrite of {ROUND // KiB} KiB chunks into a fresh preallocated file + fsync",
        "dd bs=1M conv=fsync", "MiB/s", {"subject": vals["floor"], "peer": vals["dd"]},
        better="higher", note="the bare system calls of 96 KiB records in preallocated space: "
                              "what bounds the engine's 96 KiB rows",
    ).to_dict())
    return {"results": results, "info": {"bytes": size, "reps": reps, "workdir": str(work)}}


# ------------------------------------------------------------------------ cold random read
def cold_read(quick: bool = False, workdir: str | None = None) -> dict[str, Any]:
    """Figure 1: one 96 KiB round at random, page cache dropped, vs ``os.pread`` on ext4."""
    Store, StoreConfig = _store()
    work = bench_dir(workdir)
    size = 16 * MiB if quick else 128 * MiB
    samples = 40 if quick else 600
    data = kv_bytes(size, seed=1)
    rounds = size // ROUND
    peer_path = work / "read_peer.bin"
    peer_path.write_bytes(data)
    stores, paths = {}, {}
    # "auto"/"none": one entry per round, as appended round by round; "auto/1MiB": written
    # in 1 MiB appends, so a round is a range inside an entry (what blocks are for)
    for key, comp, chunk in (("auto", "auto", ROUND), ("none", "none", ROUND), ("auto/1MiB", "auto", MiB)):
        paths[key] = work / f"read_{key.replace('/', '_')}.vol"
        _unlink(paths[key])
        s = Store.create(str(paths[key]), 4 * size, StoreConfig(compression=comp))
        s.create_session("bench")
        s.create_file("bench", "layer_0")
        for off in range(0, size, chunk):
            s.append("bench", "layer_0", off, data[off: off + chunk])
        s.close()
        stores[key] = Store.open(str(paths[key]), StoreConfig(compression=comp))
    _steady_state(work)
    os.sync()  # nothing dirty left: DONTNEED then drops every page
    peer_fd = os.open(peer_path, os.O_RDONLY)
    rng = random.Random(7)
    every = [peer_path, *paths.values()]

    def drop() -> None:
        for p in every:
            fadvise_dontneed(p, sync=False)  # all synced when written
        for s in stores.values():  # the engine's decoded-entry cache would serve re-reads
            s.drop_caches()

    warm = 10
    order = rng.sample(range(rounds), min(rounds, samples + warm))  # no round read twice

    def one(fn, r: int) -> float:
        drop()
        t0 = time.perf_counter()
        out = fn(r)
        dt = (time.perf_counter() - t0) * 1e3
        if len(out) != ROUND:
            raise RuntimeError(f"short read: {len(out)} bytes")
        return dt

    from kvfs.engine.format import BLOCK
    crcs = [crc32c.crc32c(data[o: o + BLOCK]) for o in range(0, size, BLOCK)]

    def checked(r: int) -> bytes:
        """The peer's read plus what checking it costs: each block's CRC, one copy out."""
        got = memoryview(os.pread(peer_fd, ROUND, r * ROUND))
        blocks = [got[o: o + BLOCK] for o in range(0, ROUND, BLOCK)]
        if [crc32c.crc32c(b) for b in blocks] != crcs[r * ROUND // BLOCK: (r + 1) * ROUND // BLOCK]:
            raise RuntimeError("peer file changed under the benchmark")
        return b"".join(blocks)

    ring = stores["auto"].ring
    layer = stores["auto"].idx.find("bench").file("layer_0")
    entry_of = {r: layer.ext[layer.find(r * ROUND)] for r in order}  # one entry per round

    def entry_alone(r: int) -> bytes:
        """The ring's read of the round's entry, without the store around it."""
        pos, _, _, esize = entry_of[r]
        return b"".join(ring.read_data(pos, esize, 0, ROUND, None, None, ROUND)[0])

    fns = [(k, partial(lambda st, r: st.read("bench", "layer_0", r * ROUND, ROUND), stores[k]))
           for k in stores] + [("peer", lambda r: os.pread(peer_fd, ROUND, r * ROUND)),
                               ("checked", checked), ("entry", entry_alone)]
    vals: dict[str, list[float]] = {k: [] for k, _ in fns}
    try:
        for r in range(0, rounds, 7):  # warm the engine's index
            stores["auto"].read("bench", "layer_0", r * ROUND, ROUND)
        for i, r in enumerate(order):  # the same round for every reader; order alternates
            for name, fn in (fns if i % 2 == 0 else fns[::-1]):
                dt = one(fn, r)
                if i >= warm:
                    vals[name].append(dt)
        r = order[0]
        for name, fn in fns:  # correctness spot check: every reader returns the written bytes
            if fn(r) != data[r * ROUND: (r + 1) * ROUND]:
                raise RuntimeError(f"the {name} read returned wrong bytes")
        ratio_stored = stores["auto"].stats().get("compression_ratio")
        cpu = _cached_reads(stores["auto"], checked, order[warm:], data)
    finally:
        os.close(peer_fd)
        for s in stores.values():
            s.close()
        _unlink(peer_path, *paths.values())
    results = []
    for key in stores:
        comp, how = (key.split("/") + ["96 KiB appends"])[:2]
        how = how if how == "96 KiB appends" else "1 MiB appends"
        for stat, goal in (("p50", 1.2), ("p99", 1.2)):
            results.append(Result(
                "1", f"random 96 KiB read, page cache dropped, {stat} (compression={comp}, {how})",
                f"kvfs engine read (compression={comp})", "os.pread, ext4 file", "ms",
                {"subject": vals[key], "peer": vals["peer"]}, better="lower", goal=goal, stat=stat,
                note=f"{samples} samples over {size // MiB} MiB; posix_fadvise(DONTNEED) on every "
                     "file before each sample",
            ).to_dict())
    pread = "os.pread, ext4 file"
    bounds = [  # rows that bound the engine's from below: (label, subject, peer, unit, samples, note)
        ("page cache dropped", "checked-read floor", "os.pread + CRC-32C of each 32 KiB block + one copy out",
         pread, "ms", {"subject": vals["checked"], "peer": vals["peer"]},
         "what any store that checks the bytes it returns adds to the read: bounds the engine's "
         "rows from below"),
        ("page cache dropped", "entry read alone", "the ring's read of the round's entry (compression=auto)",
         pread, "ms", {"subject": vals["entry"], "peer": vals["peer"]},
         "pread of the entry, its header, block table and block checks, one copy out: the engine's "
         "rows without the store's index lookup, locks, caches and bookkeeping"),
        ("pages cached", "CPU of the read path", "kvfs engine read (compression=auto), pages cached",
         "os.pread + CRC-32C of each block + one copy out, pages cached", "µs", cpu,
         "the disk taken out: what the engine's rows spend above the checked-read floor (index "
         "lookup, header and block table, bookkeeping); the volume's DONTNEED advice is off and "
         "both files' pages are cached"),
    ]
    for how, label, subject, peer, unit, got, note in bounds:
        for stat in ("p50", "p99"):
            results.append(Result("1", f"random 96 KiB read, {how}, {stat} [{label}]", subject, peer,
                                  unit, got, better="lower", stat=stat, note=note).to_dict())
    return {"results": results, "info": {"bytes": size, "samples": samples,
                                         "compression_ratio_auto": ratio_stored}}


def _cached_reads(store: Any, checked: Callable[[int], bytes], rounds: list[int], data: bytes
                  ) -> dict[str, list[float]]:
    """Engine reads (its own caches emptied) and checked preads with every page cached,
    interleaved, in µs."""
    store.vol.fadvise = False  # keep the volume's pages: time the CPU only
    for r in rounds:  # bring every page in
        store.read("bench", "layer_0", r * ROUND, ROUND)
        checked(r)
    out: dict[str, list[float]] = {"subject": [], "peer": []}
    for i, r in enumerate(rounds):
        for key in (("subject", "peer") if i % 2 == 0 else ("peer", "subject")):
            store.drop_caches()
            t0 = time.perf_counter()
            got = store.read("bench", "layer_0", r * ROUND, ROUND) if key == "subject" else checked(r)
            out[key].append((time.perf_counter() - t0) * 1e6)
            if got != data[r * ROUND: (r + 1) * ROUND]:
                raise RuntimeError(f"wrong bytes from the cached read of round {r} ({key})")
    return out


FIGURES = {"1": cold_read, "2": append_throughput, "7": open_sessions}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=",".join(FIGURES), help="figures to run, e.g. 1,7")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("kvfs").setLevel(logging.WARNING)
    for f in a.only.split(","):
        r = FIGURES[f](quick=a.quick, workdir=a.out)
        for x in r["results"]:
            print(f"[{x['figure']}] {x['name']}: ratio {x['ratio'] if x['ratio'] is None else round(x['ratio'], 3)}"
                  f" goal {x['goal_text']} met={x['goal_met']}")
    if a.out:
        shutil.rmtree(Path(a.out) / "work", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

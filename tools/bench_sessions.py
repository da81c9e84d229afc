#!/usr/bin/env python3
"""Open time and RSS against the session count (the engine's part of figure 7), and the
cached volumes holding 10k / 100k / 1M sessions that figure 7's mount rows use too.

- ``open_sessions``: open time, process RSS and a first lookup on volumes holding 10k /
  100k / 1M sessions (one small ``meta.json`` each), each in a fresh child process with the
  volume's pages dropped (growth vs the smallest count). The volumes are built once and
  cached under ``$KVFS_BENCH_CACHE`` (default /var/tmp/kvfs-bench-cache); a count whose build
  would pass 10 minutes is skipped. They are formatted with 1/4 of the volume for the index
  (the default 1/32 would need a ~30 GB file for 1M sessions; the tree's size per session
  and the open path do not depend on the region's size).

``python tools/bench_sessions.py --open-child VOLUME`` is the child that measures one open.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import KiB, MiB, Result, fadvise_dontneed, interleave, run_json_child, vm_rss_kib
from bench_common import unlink as _unlink

log = logging.getLogger("bench.sessions")

CACHE = Path(os.environ.get("KVFS_BENCH_CACHE", "/var/tmp/kvfs-bench-cache"))
SESSION_BUILD_LIMIT_S = 600.0


def _store():  # noqa: ANN202
    from kvfs.engine.store import Store
    from kvfs.engine.types import StoreConfig

    return Store, StoreConfig


# ------------------------------------------------------------------------ open time and RSS
def _source_key() -> str:
    """Hash of the sources that define the on-disk format: a cached volume from older code is
    rebuilt (and so is one that fails to open)."""
    root = Path(__file__).resolve().parents[1] / "kvfs" / "engine"
    h = hashlib.sha1()
    for name in ("format.py", "blocks.py", "btree.py", "btree_page.py", "records.py", "index.py"):
        p = root / name
        h.update(p.read_bytes() if p.exists() else b"")
    return h.hexdigest()[:12]


@contextmanager
def _tree_fraction(frac: float) -> Iterator[None]:
    """Format volumes with a larger index-region share (the default is 1/32 of the volume)."""
    import kvfs.engine.volume as eng  # where a new volume is laid out
    from kvfs.engine.volume import geometry

    saved = eng.geometry
    eng.geometry = partial(geometry, tree_fraction=frac)
    try:
        yield
    finally:
        eng.geometry = saved


def build_sessions_volume(path: Path, n: int, limit_s: float = SESSION_BUILD_LIMIT_S) -> float | None:
    """Create ``path`` holding ``n`` sessions with one small ``meta.json`` each; build seconds.

    None (and no file) when the build would pass ``limit_s``.
    """
    Store, StoreConfig = _store()
    _unlink(path)
    meta = json.dumps({"format": "kvfs-kv-1", "model": "0" * 16, "num_layers": 16, "num_kv_heads": 8,
                       "head_dim": 64, "dtype": "bfloat16", "tokens": 24, "rounds": [[0, 24]]}).encode()
    t0 = time.perf_counter()
    with _tree_fraction(1 / 4):
        s = Store.create(str(path), max(256 * MiB, n * 4 * KiB), StoreConfig())
    try:
        for i in range(n):
            name = f"sess-{i:07d}"
            s.create_session(name)
            s.create_file(name, "meta.json")
            s.append(name, "meta.json", 0, meta)
            if i % 1000 == 999:
                s.maybe_checkpoint()
                el = time.perf_counter() - t0
                if el > limit_s or (i > 20000 and el / (i + 1) * n > limit_s * 1.2):
                    log.warning("building %d sessions would take %.0f s: skipped", n, el / (i + 1) * n)
                    s.crash()
                    _unlink(path)
                    return None
                if i % 50000 == 49999:
                    log.info("  %d / %d sessions (%.0f s)", i + 1, n, el)
    except BaseException:
        s.crash()
        _unlink(path)
        raise
    s.close()
    return time.perf_counter() - t0


def _opens(path: Path) -> bool:
    Store, StoreConfig = _store()
    try:
        Store.open(str(path), StoreConfig(), readonly=True).close()
        return True
    except Exception as e:  # any failure: the cached volume is rebuilt
        log.warning("cached %s does not open (%s): rebuilding it", path, e)
        return False


def sessions_volume(n: int) -> tuple[Path | None, dict[str, Any]]:
    """A cached volume with ``n`` sessions (built once per on-disk format version)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    key = _source_key()
    path, side = CACHE / f"sessions-{n}.vol", CACHE / f"sessions-{n}.json"
    if path.exists() and side.exists():
        info = json.loads(side.read_text())
        if info.get("source") == key and _opens(path):
            return path, info
    skip = CACHE / f"sessions-{n}.skipped"
    if skip.exists() and skip.read_text().strip() == key:
        return None, {"skipped": f"building {n} sessions takes over {SESSION_BUILD_LIMIT_S:.0f} s"}
    log.info("building a volume with %d sessions under %s (cached for later runs)", n, CACHE)
    build_s = build_sessions_volume(path, n)
    if build_s is None:
        skip.write_text(key)
        return None, {"skipped": f"building {n} sessions takes over {SESSION_BUILD_LIMIT_S:.0f} s"}
    info = {"source": key, "sessions": n, "build_s": round(build_s, 2), "bytes": path.stat().st_size}
    side.write_text(json.dumps(info))
    return path, info


def sessions_volumes(counts: list[int]) -> tuple[dict[int, Path], dict[str, Any]]:
    """The cached volumes of each session count that could be built, and how each was got."""
    vols: dict[int, Path] = {}
    info: dict[str, Any] = {}
    for n in counts:
        p, i = sessions_volume(n)
        info[str(n)] = i
        if p is not None:
            vols[n] = p
    return vols, info


def open_child(path: str) -> dict[str, Any]:
    """Run in a fresh process: open ``path``, look one session up, close. Times and RSS."""
    Store, StoreConfig = _store()
    import gc

    gc.collect()
    rss0 = vm_rss_kib()  # the interpreter with kvfs imported
    t0 = time.perf_counter()
    s = Store.open(path, StoreConfig())
    t_open = time.perf_counter() - t0
    rss_open = vm_rss_kib()
    n = s.usage().sessions
    name = f"sess-{random.Random(n).randrange(n):07d}"
    t1 = time.perf_counter()
    st = s.session_stat(name)
    s.read(name, "meta.json", 0, 4096)
    t_lookup = time.perf_counter() - t1
    rss_lookup = vm_rss_kib()
    t2 = time.perf_counter()
    s.close()
    t_close = time.perf_counter() - t2
    import tracemalloc  # again, traced (slower, so untimed): the Python heap the open keeps

    tracemalloc.start()
    s = Store.open(path, StoreConfig())
    s.session_stat(name)
    heap, heap_peak = tracemalloc.get_traced_memory()
    s.close()
    tracemalloc.stop()
    return {"open_ms": t_open * 1e3, "lookup_ms": t_lookup * 1e3, "close_ms": t_close * 1e3,
            "rss_base_kib": rss0, "rss_open_kib": rss_open, "rss_lookup_kib": rss_lookup,
            "rss_growth_kib": rss_lookup - rss0, "heap_kib": heap / 1024, "heap_peak_kib": heap_peak / 1024,
            "sessions": n, "files": st.files}


def open_sessions(quick: bool = False, workdir: str | None = None) -> dict[str, Any]:
    """Figure 7 (engine part): open time and RSS vs session count, each open in a new process."""
    counts = [1000, 10000] if quick else [10000, 100000, 1000000]
    reps = 2 if quick else 7
    vols, info = sessions_volumes(counts)
    me = str(Path(__file__).resolve())
    samples: dict[int, list[dict[str, Any]]] = {n: [] for n in vols}

    def measure(n: int) -> float:
        fadvise_dontneed(vols[n])
        r = run_json_child([me, "--open-child", str(vols[n])])
        samples[n].append(r)
        return r["open_ms"]

    interleave([(str(n), partial(measure, n)) for n in vols], reps)
    results: list[dict[str, Any]] = []
    series: dict[str, list[float]] = {"sessions": [], "open_ms": [], "lookup_ms": [],
                                      "heap_after_open_kib": [], "heap_peak_during_open_kib": []}
    base = min(vols) if vols else None
    for n in sorted(vols):
        med = {k: float(np.median([x[k] for x in samples[n]])) for k in samples[n][0] if k != "files"}
        series["sessions"].append(n)
        series["open_ms"].append(med["open_ms"])
        series["heap_after_open_kib"].append(med["heap_kib"])
        series["heap_peak_during_open_kib"].append(med["heap_peak_kib"])
        series["lookup_ms"].append(med["lookup_ms"])
        if n == base:
            continue
        for key, label, unit, scale, goal in (
                ("open_ms", "open time", "ms", 1.0, 2.0),
                ("rss_lookup_kib", "process RSS after open + one lookup", "MiB", 1 / 1024, 1.25),
                ("lookup_ms", "first lookup + read of one session (cold)", "ms", 1.0, None)):
            results.append(Result(
                "7", f"{label}, {n:,} sessions vs {base:,}", f"kvfs engine, {n:,} sessions",
                f"kvfs engine, {base:,} sessions", unit,
                {"subject": [x[key] * scale for x in samples[n]],
                 "peer": [x[key] * scale for x in samples[base]]},
                better="lower", goal=goal,
                note="each sample opens the volume in a fresh process after dropping its pages "
                     "(posix_fadvise); RSS is the whole process's VmRSS, kvfs imported "
                     f"(~{med['rss_base_kib'] / 1024:.0f} MiB before the open; the Python heap the "
                     "open keeps, traced with tracemalloc, is in the curve); goals: "
                     "open time and memory do not grow with the session count; volumes built once "
                     f"and cached under {CACHE} (index region 1/4 of the volume)",
            ).to_dict())
    for n in counts:
        if n not in vols:
            results.append(Result("7", f"open time, {n:,} sessions", f"kvfs engine, {n:,} sessions",
                                  "", "ms", {}, note=info[str(n)].get("skipped", "not built")).to_dict())
    return {"results": results, "series": {"7": series}, "info": info}


if __name__ == "__main__":  # the child of ``open_sessions``
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--open-child", metavar="VOLUME", required=True)
    print(json.dumps(open_child(ap.parse_args().open_child)))
    sys.exit(0)

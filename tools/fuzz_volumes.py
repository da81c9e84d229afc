#!/usr/bin/env python3
"""Fuzz the volume readers with crafted volumes: no traceback, no hang, bounded memory.

    python tools/fuzz_volumes.py [--seconds S] [--seed N] [--case-timeout S]
                                 [--memory-mb MB] [--workdir DIR] [--json OUT]

Two real volumes are written first (one closed cleanly, one left with entries after its
checkpoint, so recovery replays them). Each case copies one, makes one to three crafted
changes with ``volcraft.mutate`` (superblock fields, the tree root, B+ tree pages, ring
entry headers and payloads -- every checksum made right, so only the field checks stand
between the bytes and the code), then runs what an operator would on it: ``check_volume``
(kvfs-fsck), a read-only open that lists every session and reads every file, ``kvfs-dump``,
and ``check_volume(repair=True)`` followed by a writable open and close (a mount's start
and end). The documented outcomes pass: fsck's 0/1/2 with a message, engine errors
(``KVFSError``) on open and read, dump's exit 0/1/2. Anything else fails the case: another
exception, fsck's "internal error" (its last-resort catch), a case running past
``--case-timeout`` (SIGALRM), or memory past ``--memory-mb`` over the start (RLIMIT_AS, so
an allocation a crafted size asks for raises MemoryError). Stops after ``--seconds``; exit
status 1 when any case failed, each printed with its seed and changes to reproduce it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import volcraft

from kvfs.cli import dump
from kvfs.engine.errors import KVFSError
from kvfs.engine.fsck import check_volume
from kvfs.engine.store import Store
from kvfs.engine.types import StoreConfig

MB = 1 << 20


class CaseTimeout(Exception):
    """SIGALRM: the case ran past its time."""


def base_volumes(work: Path, rng: random.Random) -> list[Path]:
    """A cleanly closed volume and one with unreplayed entries after its checkpoint."""
    out = []
    for name, crash in (("clean", False), ("replay", True)):
        path = work / f"{name}.kvfs"
        s = Store.create(str(path), 8 * MB, StoreConfig(hot_sessions=4, write_buffer=16 << 10))
        for i in range(40):
            sid = f"s{i:02d}" if i % 5 else f"{i:02d}".ljust(120, "n")
            s.create_session(sid, uid=1000 + i % 3)
            for f in ("layer_0", "layer_1", "meta.json"):
                s.create_file(sid, f)
                data = rng.randbytes(rng.randint(1, 20_000))
                s.append(sid, f, 0, data)
                if i % 7 == 0:
                    s.truncate(sid, f, len(data) // 2)
            if i % 9 == 0:
                s.delete_file(sid, "layer_1")
        s.delete_session("s01")
        s.checkpoint()
        for i in range(40, 48):  # after the checkpoint: replayed by every open
            s.create_session(f"late{i}", uid=1001)
            s.create_file(f"late{i}", "layer_0")
            s.append(f"late{i}", "layer_0", 0, rng.randbytes(3000))
        if crash:
            s.sync()
            s.crash()
        else:
            s.close()
        out.append(path)
    return out


def _operate(path: Path, spare: Path) -> list[str]:
    """Run the readers on a crafted volume; what went wrong (empty: all as documented)."""
    bad: list[str] = []
    res = check_volume(str(path))
    if res.status not in (0, 1, 2) or any("internal error" in p or "a bug" in p for p in res.problems):
        bad.append(f"fsck: {res.status} {res.problems[:3]}")
    try:
        s = Store.open(str(path), readonly=True, force=True)
    except KVFSError:
        s = None
    if s is not None:
        try:
            for name in s.list_sessions():
                for f in s.list_files(name):
                    with contextlib.suppress(KVFSError):
                        s.read(name, f, 0, 1 << 20)
        except KVFSError:
            pass
        finally:
            s.crash()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = dump.main([str(path)])
    if rc not in (0, 1, 2):
        bad.append(f"kvfs-dump: exit {rc}")
    if "\x1b" in out.getvalue():
        bad.append("kvfs-dump printed a raw escape character")
    shutil.copyfile(path, spare)
    rep = check_volume(str(spare), repair=True)
    if any("internal error" in p or "a bug" in p for p in rep.problems):
        bad.append(f"fsck --repair: {rep.problems[:3]}")
    try:
        w = Store.open(str(spare), force=True)
        w.list_sessions()
        w.close()
    except KVFSError:
        pass
    return bad


def run(seconds: float, seed: int, work: Path, case_timeout: float) -> dict:
    rng = random.Random(seed)
    bases = base_volumes(work, rng)
    case_path, spare = work / "case.kvfs", work / "spare.kvfs"
    results: dict = {"seed": seed, "cases": 0, "failures": [], "kinds": {}}

    def alarm(signum: int, frame: object) -> None:
        raise CaseTimeout(f"case ran past {case_timeout} s")

    signal.signal(signal.SIGALRM, alarm)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        case_seed = rng.randrange(1 << 30)
        crng = random.Random(case_seed)
        base = crng.choice(bases)
        shutil.copyfile(base, case_path)
        changes = [volcraft.mutate(case_path, crng) for _ in range(crng.choice((1, 1, 2, 3)))]
        for c in changes:
            kind = c.split()[0]
            results["kinds"][kind] = results["kinds"].get(kind, 0) + 1
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, case_timeout)
        try:
            bad = _operate(case_path, spare)
        except CaseTimeout as e:
            bad = [str(e)]
        except BaseException as e:  # noqa: BLE001 - the point: nothing else may escape
            bad = [f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        results["cases"] += 1
        took = round(time.monotonic() - t0, 3)
        if took > results.get("slowest_s", 0.0):
            results["slowest_s"], results["slowest_case"] = took, case_seed
        peak = _peak_mib()
        if peak > results.get("max_rss_mb", 0):  # which case raised the peak, to look at
            results["max_rss_mb"], results["max_rss_case"] = peak, case_seed
        if bad:
            results["failures"].append({"case_seed": case_seed, "base": base.name,
                                        "changes": changes, "problems": bad})
    return results


def _peak_mib() -> int:
    """This process's peak RSS (VmHWM: of its own address space; ``ru_maxrss`` would
    count the parent it was forked from)."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) // 1024


def _limit_memory(mb: int) -> None:
    """Address space: what this process maps now plus ``mb``."""
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[0]) * resource.getpagesize()
    limit = now + mb * MB
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--case-timeout", type=float, default=10.0)
    ap.add_argument("--memory-mb", type=int, default=1024)
    ap.add_argument("--workdir")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # crafted volumes are meant to log errors
    with contextlib.ExitStack() as stack:
        work = Path(a.workdir) if a.workdir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvfs-fuzz-")))
        work.mkdir(parents=True, exist_ok=True)
        _limit_memory(a.memory_mb)
        res = run(a.seconds, a.seed, work, a.case_timeout)
    print(f"{res['cases']} cases, {len(res['failures'])} failures, slowest "
          f"{res.get('slowest_s', 0)} s (case {res.get('slowest_case')}), max RSS {res.get('max_rss_mb')} MiB (case "
          f"{res.get('max_rss_case')}); changes: {res['kinds']}")
    for f in res["failures"][:20]:
        print(f"FAIL case_seed={f['case_seed']} base={f['base']} changes={f['changes']}")
        for p in f["problems"]:
            print("   ", p)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

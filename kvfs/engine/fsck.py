"""Consistency checking (fsck) as a library: ``check_volume(path, repair=False)``.

Checks, in order: both superblock slots; that the checkpoint tree is readable and well
formed (else recovery needed a full scan); corrupt ring regions met by recovery; and that
every extent of every live file reads back with a valid checksum. Repair rebuilds the
checkpoint (a writable open does that) and cuts each damaged file before its first bad
extent, so what stays readable is a correct prefix. Never imports pyfuse3 or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import Corrupt, FormatError, KVFSError
from .volume import VolumeFile

log = logging.getLogger(__name__)

CLEAN, PROBLEMS, UNUSABLE = 0, 1, 2


@dataclass
class CheckResult:
    status: int = CLEAN
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    sessions: int = 0
    files: int = 0
    bytes_checked: int = 0

    def problem(self, msg: str) -> None:
        self.problems.append(msg)
        self.status = max(self.status, PROBLEMS)


def check_volume(path: str, repair: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> CheckResult:
    from .store import Store

    res = CheckResult()
    try:
        vol = VolumeFile.open(path, readonly=True)
    except (FormatError, OSError) as e:
        res.status = UNUSABLE
        res.problems.append(str(e))
        return res
    try:
        sbs = vol.read_superblocks()
    finally:
        vol.close()
    if not sbs:
        res.status = UNUSABLE
        res.problems.append("both superblock slots are corrupt")
        return res
    if len(sbs) == 1:
        res.problem("one superblock slot is corrupt (the other is used)")
    try:
        store = Store.open(path, readonly=not repair)
    except FormatError as e:
        res.status = UNUSABLE
        res.problems.append(str(e))
        return res
    except KVFSError as e:
        res.status = UNUSABLE
        res.problems.append(f"cannot open: {e}")
        return res
    try:
        _check_store(store, res, repair, progress)
        if repair and res.problems:
            store.checkpoint()
            store.checkpoint()  # both slots rewritten
            res.repaired.append("checkpoint and both superblock slots rewritten")
    finally:
        store.close() if repair else store.crash()
    return res


def _check_store(store, res: CheckResult, repair: bool,
                 progress: Callable[[int, int], None] | None) -> None:
    rep = store.open_report
    if store.counters["full_scans"]:
        res.problem("checkpoint unusable: the index was rebuilt by a full ring scan")
    for pos, n in (rep.corrupt or []) if rep else []:
        res.problem(f"corrupt ring region at position {pos} ({n} bytes)")
    if not store.counters["full_scans"]:
        for p in store.tree.check():
            res.problem(f"checkpoint tree: {p}")
    try:
        names = store.list_sessions()
    except Corrupt as e:  # a tree page recovery did not read: report it, never crash
        res.problem(f"checkpoint tree: {e}: sessions cannot be listed from the checkpoint")
        return
    res.sessions = len(names)
    for i, name in enumerate(names):
        try:
            s = store.idx.find(name)
        except Corrupt as e:
            res.problem(f"session {name!r}: its checkpoint record is unreadable: {e}")
            continue
        if s is None:
            res.problem(f"session {name!r} listed but not loadable")
            continue
        for f in list(s.files.values()):
            res.files += 1
            for k, (pos, _skip, n, esize) in enumerate(f.ext):
                try:
                    store.entry_bytes(pos, esize)
                    res.bytes_checked += n
                except Corrupt as e:
                    res.problem(f"session {name!r} file {f.name!r}: bytes {f.off[k]}..{f.off[k] + n}: {e}")
                    if repair:
                        cut = f.off[k]
                        store.truncate(name, f.name, cut)
                        res.repaired.append(f"session {name!r} file {f.name!r} cut to {cut} bytes")
                    break
            store._decoded.clear()
            store._decoded_bytes = 0
        if progress:
            progress(i + 1, len(names))

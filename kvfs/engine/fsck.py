"""Consistency checking (fsck) as a library: ``check_volume(path, repair=False)``.

Refuses a volume in use (a mount holds its lock): "unmount first", unusable. Checks, in
order: both superblock slots (checksum and layout against the file); the needs-fsck mark
(an error was seen while mounted); that the checkpoint tree is readable and well formed
(else recovery needed a full scan); corrupt ring regions met by recovery; that every
extent of every live file reads back with a valid checksum; that the usage records agree
with the sessions; that no index budget is held by nothing (bitmap chunks without a live
session, records of deleted sessions); and that the index fits the tree region (else it is kept in the ring
only). Repair rebuilds the checkpoint (a writable open does that), cuts each damaged file
before its first bad extent, so what stays readable is a correct prefix, rewrites the usage
records, and clears the mark; an index too large for the tree region stays in the ring,
where every session stays readable and deletable. A crafted volume ends in a message,
never an exception: fields are checked before use (docs/format.md). Never imports pyfuse3
or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import BadSuperblock, Corrupt, FormatError, KVFSError, VolumeBusy
from .quota import BITMAP_BYTES, Ledger, session_use
from .records import session_key_sno
from .store import Store
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
    in_use: bool = False  # a mount holds the volume: nothing was checked
    # the index budget: leaf bytes the checkpoint takes (about), the volume's limit, and
    # each uid's charged index bytes (the per-uid share is the mount's option, not stored)
    index_used: int = 0
    index_budget: int = 0
    index_by_uid: dict[int, int] = field(default_factory=dict)

    def problem(self, msg: str) -> None:
        self.problems.append(msg)
        self.status = max(self.status, PROBLEMS)


def check_volume(path: str, repair: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> CheckResult:
    res = CheckResult()
    try:
        return _check_volume(path, res, repair, progress)
    except MemoryError:
        return _unusable(res, "the volume asks for more memory than this machine has: "
                              "a field kvfs-fsck does not check yet (a bug; please report it)")
    except Exception as e:  # noqa: BLE001 - a checker reports, never crashes
        log.exception("fsck of %s failed", path)
        return _unusable(res, f"internal error while checking: {type(e).__name__}: {e} "
                              "(a bug; please report it)")


def _check_volume(path: str, res: CheckResult, repair: bool,
                  progress: Callable[[int, int], None] | None) -> CheckResult:
    try:
        probe = VolumeFile.open(path, readonly=True)
    except (FormatError, OSError) as e:
        return _unusable(res, str(e))
    try:
        # A shared lock: no mount may start while a read-only check runs; a repair lets go
        # of it just before its writable open takes the exclusive one.
        probe.lock(shared=True)
        slots = probe.read_slots()
        if not repair:
            return _check(path, res, slots, repair, progress)
    except VolumeBusy:
        res.in_use = True
        return _unusable(res, f"{path} is in use (mounted): unmount it first")
    finally:
        probe.close()
    return _check(path, res, slots, repair, progress)


def _unusable(res: CheckResult, msg: str) -> CheckResult:
    res.status = UNUSABLE
    res.problems.append(msg)
    return res


def _check(path: str, res: CheckResult, slots: list, repair: bool,
           progress: Callable[[int, int], None] | None) -> CheckResult:
    bad = [(i, e) for i, e in enumerate(slots) if isinstance(e, BadSuperblock)]
    if len(bad) == 1:
        i, e = bad[0]
        res.problem(f"superblock slot {i}: {e} (the other slot is used)")
    try:
        store = Store.open(path, readonly=not repair, force=True)
    except VolumeBusy:
        res.in_use = True
        return _unusable(res, f"{path} is in use (mounted): unmount it first")
    except FormatError as e:
        return _unusable(res, str(e))
    except KVFSError as e:
        return _unusable(res, f"cannot open: {e}")
    try:
        if store.needs_fsck:
            res.problem("volume marked as needing fsck: an error was seen while it was in use")
        _check_store(store, res, repair, progress)
        if repair and res.problems:
            if store.needs_fsck:
                store.clear_needs_fsck()
                res.repaired.append("needs-fsck mark cleared")
            store.checkpoint()
            store.checkpoint()  # both slots rewritten
            if store.ring_only:
                res.repaired.append("both superblock slots rewritten; the index stays in the "
                                    "ring only (it does not fit the tree region): the volume "
                                    "mounts with every session, each mount scanning the ring")
            else:
                res.repaired.append("checkpoint and both superblock slots rewritten")
    finally:
        store.close() if repair else store.crash()
    return res


def _check_store(store: Store, res: CheckResult, repair: bool,
                 progress: Callable[[int, int], None] | None) -> None:
    rep = store.open_report
    scans = store.counters["full_scans"]
    if store.ring_only:
        res.problem("the index did not fit the tree region: it is kept in the ring only "
                    "(each mount scans the whole ring); delete sessions to bring the "
                    "checkpoint back")
    elif store.counters["full_scans"]:
        why = store.full_scan_why or "checkpoint unusable"
        res.problem(f"the index was rebuilt by a full ring scan ({why})")
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
    counted = Ledger(store.quota.limits)
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
                    store.reads.entry_bytes(pos, esize)
                    res.bytes_checked += n
                except Corrupt as e:
                    res.problem(f"session {name!r} file {f.name!r}: bytes {f.off[k]}..{f.off[k] + n}: {e}")
                    if repair:
                        cut = f.off[k]
                        try:
                            store.truncate(name, f.name, cut)
                        except KVFSError as e:  # e.g. no ring room for the record
                            res.problem(f"session {name!r} file {f.name!r}: not cut: {e}")
                        else:
                            res.repaired.append(f"session {name!r} file {f.name!r} cut to "
                                                f"{cut} bytes")
                    break
        counted.add(s.uid, session_use(s))  # after any cut of its files
        if progress:
            progress(i + 1, len(names))
    if store.counters["full_scans"] > scans:  # a record the open did not read was bad
        res.problem(f"the index was rebuilt by a full ring scan ({store.full_scan_why})")
    _check_usage(store, res, counted, repair)


def _check_orphans(store: Store, res: CheckResult, repair: bool) -> None:
    """Record chunks of sessions the bitmap says are gone (and no delete since the
    checkpoint purges): index budget charged to nobody; repair purges them."""
    orphans: dict[int, int] = {}
    nbytes = 0
    for key, val in store.tree.scan(b"S"):
        try:
            sno = session_key_sno(key)
        except Corrupt:
            continue  # the tree check reports keys of the wrong shape
        if not store.idx.live(sno) and sno not in store.idx.purge:
            orphans[sno] = int.from_bytes(key[1:9], "big")
            nbytes += len(key) + len(val) + 3
    if orphans:
        res.problem(f"{len(orphans)} session records of sessions that no longer exist: "
                    f"{nbytes} bytes of the index budget held by nothing")
        if repair:
            store.idx.purge.update(orphans)
            res.repaired.append(f"{len(orphans)} records of deleted sessions purged")


def _check_usage(store: Store, res: CheckResult, counted: Ledger, repair: bool) -> None:
    """The usage records against the sessions; the index's size against the tree region."""
    recorded = store.quota
    wrong = sorted(uid for uid in set(recorded.use) | set(counted.use)
                   if recorded.of(uid) != counted.of(uid))
    for uid in wrong[:10]:
        res.problem(f"usage of uid {uid}: recorded {recorded.of(uid)}, the sessions hold "
                    f"{counted.of(uid)} (sessions, files, bytes, index bytes)")
    if len(wrong) > 10:
        res.problem(f"usage of {len(wrong) - 10} more uids disagrees with the sessions")
    if repair and wrong:
        recorded.replace(counted)
        res.repaired.append(f"usage records of {len(wrong)} uids rewritten")
    counted.bitmap_chunks = len(store.idx.chunks)
    res.index_used, res.index_budget = counted.estimate(), counted.limits.budget
    res.index_by_uid = {uid: u[3] for uid, u in sorted(counted.use.items())}
    if not store.ring_only and not store.counters["full_scans"]:
        _check_orphans(store, res, repair)
    if store.idx.empty_loaded:
        res.problem(f"{store.idx.empty_loaded} bitmap chunks of the checkpoint mark no live "
                    f"session: {store.idx.empty_loaded * BITMAP_BYTES} bytes of the index "
                    "budget held by nothing")
        if repair:
            res.repaired.append(f"{store.idx.empty_loaded} empty bitmap chunks deleted")
    if not counted.fits() and not store.ring_only:
        res.problem(f"the index (about {counted.estimate()} bytes) does not fit a half of the "
                    f"tree region ({counted.limits.capacity} bytes): a mount keeps it in the "
                    "ring only; delete sessions to bring the checkpoint back")

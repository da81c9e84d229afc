"""Recovery: newest superblock -> checkpoint -> replay of the ring after it.

One function, two passes over the entries found (jbd2's shape): metadata first (which
sessions and files exist, with tombstones taking precedence since session and file numbers
are never reused), then data and truncations in ring order. A bad checkpoint (a tree page
failing its checksum) falls back to a full scan of the ring from the tail with a fresh
tree: the checkpoint is a shortcut, never the only truth.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import TYPE_CHECKING

from .btree import BTree, TreeRoot
from .errors import Corrupt
from .format import (
    F_COPY,
    FMETA_FMT,
    MAX_SNO,
    NO_CKPT,
    SMETA_FMT,
    T_DATA,
    T_DELF,
    T_DELS,
    T_FMETA,
    T_SMETA,
    T_TRUNC,
)
from .quota import session_use
from .records import MAX_FNO, FileRec, Session, loaded_name, name_hash
from .ring import ScanItem, ScanReport

if TYPE_CHECKING:
    from .state import StoreState

log = logging.getLogger(__name__)


def recover(store: StoreState) -> ScanReport:
    sb, ring = store.sb, store.ring
    full = not (sb.tail <= sb.ckpt_pos <= sb.tail + ring.size)
    store.full_scan_why = "" if not full else "the checkpoint does not cover the ring"
    if sb.ckpt_pos == NO_CKPT:
        store.full_scan_why = "ring-only"
        log.warning("%s: the index is kept in the ring only (it did not fit the tree region): "
                    "scanning the whole ring", store.vol.path)
    if not full:
        try:
            store.idx.load_bitmap(sb.next_sno)
            store.quota.load(store.tree.scan(b"U"))
            if not store.quota.tracked and store.tree.root.count:
                log.info("%s: the checkpoint has no usage records (written by an older kvfs): "
                         "counting them by a full ring scan", store.vol.path)
                store.full_scan_why = "no usage records"
                full = True
            else:
                report = _replay(store, sb.ckpt_pos, full=False)
        except Corrupt as e:
            log.error("%s: checkpoint unusable (%s); recovering by a full ring scan", store.vol.path, e)
            store.full_scan_why = f"checkpoint unusable: {e}"
            full = True
    if full:
        _reset(store)
        report = _replay(store, sb.tail, full=True)
        store.counters["full_scans"] += 1
    store.open_report = report
    if report.corrupt:
        log.error("%s: %d corrupt ring regions skipped during recovery", store.vol.path, len(report.corrupt))
    if not store.readonly:
        store.checkpoint()  # marks the volume in use (not clean) and shortens the next replay
    return report


def rebuild(store: StoreState, err: Exception) -> None:
    """At run time a checkpoint page turned out bad: rebuild the index by a full ring scan
    (the ring holds every change) and, if writable, write a fresh checkpoint."""
    log.error("%s: checkpoint unusable at run time (%s); rebuilding the index from the ring",
              store.vol.path, err)
    store.full_scan_why = f"checkpoint unusable: {err}"
    store.ring.flush()
    store.drop_caches()  # the scan may end the log earlier: positions after it are reused
    _reset(store)
    store.open_report = _replay(store, store.ring.tail, full=True)
    store.counters["full_scans"] += 1
    if not store.readonly:
        store.checkpoint()


def _reset(store: StoreState) -> None:
    """Forget everything the checkpoint said; start a fresh tree away from the old root."""
    old = store.tree.root
    half = 1 - old.half if old.half in (0, 1) else 0
    fresh = TreeRoot(-1, 0, 0, half, 0, old.half if old.half in (0, 1) else -1, old.generation + 1)
    store.idx.reset(BTree(store.vol, store.sb.tree_offset, store.sb.tree_pages, fresh))
    store.next_sno = store.sb.next_sno


def _replay(store: StoreState, start: int, full: bool) -> ScanReport:
    ring = store.ring
    report = ScanReport()
    t0 = time.perf_counter()
    # Data payloads are not needed to rebuild the index: keep only whether they checked out.
    items = [ScanItem(it.hdr, b"" if it.payload is not None else None) if it.hdr.type == T_DATA
             else it for it in ring.scan(start, ring.tail + ring.size, report)]
    ring.head = report.end
    ring.flush()  # re-bases the (empty) write buffer at the new head
    before = None if full else _usage_before(store, items)
    _apply(store, items, full, report)
    if before is None:  # every live session is in memory after a full scan
        store.quota.rebuild(store.idx.pinned.values())
    else:
        _usage_after(store, before)
    log.info("%s: replayed %d entries from %d (%s) in %.3f s", store.vol.path, len(items), start,
             "full scan" if full else "after checkpoint", time.perf_counter() - t0)
    return report


def _usage_before(store: StoreState, items: list[ScanItem]) -> dict[int, tuple[int, tuple | None]]:
    """Per session the replay touches: its name hash and (owner, usage) as checkpointed."""
    out: dict[int, tuple[int, tuple | None]] = {}
    for it in items:
        h = it.hdr
        if h.sno not in out and h.sno < MAX_SNO:
            s = store.idx.load(h.name_hash, h.sno)
            out[h.sno] = (h.name_hash, None if s is None else (s.uid, session_use(s)))
    return out


def _usage_after(store: StoreState, before: dict[int, tuple[int, tuple | None]]) -> None:
    """The checkpoint's usage records, moved on by what the replay changed."""
    for sno, (nh, pre) in before.items():
        if pre is not None:
            store.quota.sub(*pre)
        s = store.idx.load(nh, sno)
        if s is not None:
            store.quota.add(s.uid, session_use(s))


def _named(it: ScanItem, fmt: struct.Struct, what: str, report: ScanReport
           ) -> tuple[tuple, str] | None:
    """The fields and name of a metadata entry, or None (reported as corrupt) when its
    payload is not one the engine writes: too short, a name ``check_name`` refuses, a
    session name whose hash is not the header's."""
    p, h = it.payload, it.hdr
    try:
        if p is None or len(p) < fmt.size:
            raise Corrupt(f"{what} entry payload of {0 if p is None else len(p)} bytes")
        name = loaded_name(p[fmt.size:], what)
        if what == "session" and name_hash(name) != h.name_hash:
            raise Corrupt(f"session entry name {name!r} does not hash to its header's")
        fields = fmt.unpack_from(p)
        if max(fields[-2:]) >= 1 << 63:  # ctime, mtime: signed 64-bit in the index
            raise Corrupt(f"{what} entry times {fields[-2:]} out of range")
    except Corrupt as e:
        log.error("ring entry at %d: %s; skipped", h.pos, e)
        assert report.corrupt is not None
        report.corrupt.append((h.pos, h.size))
        return None
    return fmt.unpack_from(p), name


def _apply(store: StoreState, items: list[ScanItem], full: bool, report: ScanReport) -> None:
    base_next = store.sb.next_sno
    ok = []
    for it in items:
        h = it.hdr
        # fields the index keeps must fit its records: a session number below MAX_SNO, a
        # file number below MAX_FNO (the next one is a u32), a time that is a signed 64-bit
        # nanosecond count
        if h.sno < MAX_SNO and h.ts_ns < 1 << 63 and h.fno < MAX_FNO:
            ok.append(it)
            continue
        log.error("ring entry at %d: session %d, file %d, time %d; skipped", h.pos, h.sno,
                  h.fno, h.ts_ns)
        assert report.corrupt is not None
        report.corrupt.append((h.pos, h.size))
    items = ok
    dels = {it.hdr.sno for it in items if it.hdr.type == T_DELS}
    delf = {(it.hdr.sno, it.hdr.fno) for it in items if it.hdr.type == T_DELF}
    max_sno = base_next - 1
    for it in items:  # pass 1: what exists
        h = it.hdr
        if h.type == T_SMETA:
            max_sno = max(max_sno, h.sno)
            if it.payload is None or h.sno in dels:
                continue
            got = _named(it, SMETA_FMT, "session", report)
            if got is None:
                continue
            (mode, uid, gid, next_fno, ctime, mtime), name = got
            s = store.idx.load(h.name_hash, h.sno)
            if s is None:
                if not full and h.sno < base_next:
                    continue  # deleted before the checkpoint was taken
                s = Session(h.sno, name, h.name_hash, mode, uid, gid, ctime, mtime, mtime, h.pos, next_fno)
                store.idx.set_live(h.sno, True)
            s.mode, s.uid, s.gid, s.ctime = mode, uid, gid, ctime
            s.mtime = max(s.mtime, mtime)
            s.next_fno = max(s.next_fno, next_fno)
            s.meta_pos = h.pos
            s.dirty = False
            store.idx.dirty(s)
        elif h.type == T_FMETA:
            if it.payload is None or (h.sno, h.fno) in delf:
                continue
            got = _named(it, FMETA_FMT, "file", report)
            s = store.idx.load(h.name_hash, h.sno)
            if s is None or got is None:
                continue
            (mode, uid, gid, ctime, mtime), name = got
            f = s.files.get(h.fno)
            if f is None:
                f = FileRec(h.fno, name, mode, uid, gid, ctime, mtime, mtime, h.pos)
                s.add_file(f)
            f.mode, f.uid, f.gid, f.meta_pos = mode, uid, gid, h.pos
            store.idx.dirty(s)
        elif h.type == T_DELS:
            s = store.idx.load(h.name_hash, h.sno)
            if s is not None:
                store.idx.drop(s)
        elif h.type == T_DELF:
            s = store.idx.load(h.name_hash, h.sno)
            if s is not None and h.fno in s.files:
                s.drop_file(h.fno)
                store.idx.dirty(s)
    touched: dict[tuple[int, int], tuple[Session, FileRec]] = {}
    for it in items:  # pass 2: the bytes, in ring order
        h = it.hdr
        if h.type not in (T_DATA, T_TRUNC):
            continue
        s = store.idx.load(h.name_hash, h.sno)
        f = s.files.get(h.fno) if s is not None else None
        if f is None:
            continue
        if h.type == T_DATA:
            if not h.flags & F_COPY:
                # An append says the file ended at file_off: this also covers a truncation
                # whose record was lost to corruption.
                f.truncate(min(h.file_off, f.size))
            f.replace_range(h.file_off, h.pos, h.raw_len, h.size)
            f.mtime = max(f.mtime, h.ts_ns)
        else:
            f.truncate(min(h.file_off, f.size))
        touched[(h.sno, h.fno)] = (s, f)
        store.idx.dirty(s)
    for s, f in touched.values():
        lost = f.close_gaps()
        if lost:
            log.error("session %r file %r: %d bytes after a lost entry dropped", s.name, f.name, lost)
    store.next_sno = max(store.next_sno, max_sno + 1)

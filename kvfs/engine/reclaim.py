"""Reclaiming ring space: move the tail forward over whole entries.

Each entry met at the tail is dead (superseded, truncated away, deleted: skipped), live
in a session used within the retention (copied forward to the head, trimmed to its live
bytes), or live in an idle session (the whole session is dropped: tombstone first, never
part of a session). With ``evict_when_full`` a second pass drops sessions at the tail
regardless of retention, like a cache. The new tail is made durable by a checkpoint
before the head may write over the space behind it.

A trip that finds only live data within the retention copies the whole ring forward and
gains nothing (seconds of the single writer on a large volume). Until something is cut
(a truncate, a deletion, a drop: ``counters["cuts"]``) or the least recently used session
it met leaves the retention, another trip would do the same: ``FullRing`` remembers that, and
a write needing as much room meanwhile is refused at once (``counters["full_refusals"]``).
The room a trip leaves is no sign of space freed: copying forward moves it up and down.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .blocks import Encoded, decode_payload, encode_entries, parse_table
from .errors import NoSpace
from .format import F_COPY, T_DATA, T_DELS, T_FMETA, T_SMETA, T_TRUNC, entry_size
from .quota import file_use, session_use
from .records import FileRec, Session, fmeta_payload, smeta_payload
from .ring import RingFull, ScanItem, ScanReport
from .types import FullRing

if TYPE_CHECKING:
    from .format import Header
    from .state import StoreState

log = logging.getLogger(__name__)

TOMBSTONE_RESERVE = 16 << 10
FULL_RECHECK_S = 60.0  # a full ring is tried again at least this often (metadata superseded)


def reclaim(store: StoreState, need: int, keep: Session | None = None) -> None:
    """Make ``ring.room() >= need`` or raise NoSpace (what was done stays consistent)."""
    ring = store.ring
    if need > ring.size // 2:
        raise NoSpace(f"a write of {need} bytes cannot fit a ring of {ring.size}")
    full = store.ring_full
    if full is not None and (store.counters["cuts"] != full.cuts or store.clock() >= full.until):
        full = store.ring_full = None
    if full is not None and need >= full.need:
        store.counters["full_refusals"] += 1
        raise NoSpace(full.why)
    target = min(ring.size // 2, max(need, ring.size // 8))  # reclaim in large steps
    evict = False
    budget = ring.used() + ring.size // 4  # one trip round the ring, then give up
    store.counters["reclaims"] += 1
    oldest = [float("inf")]  # last use (s) of the least recently used live session met
    while ring.room() < need:
        moved = _step(store, target, evict, keep.sno if keep is not None else -1, oldest)
        budget -= moved
        store.checkpoint()  # the new tail is durable before the head passes the old one
        if ring.room() >= need:
            break
        if moved == 0 or budget <= 0:
            if store.cfg.evict_when_full and not evict:
                evict, budget = True, ring.used() + ring.size // 4
                continue
            why = (f"volume full: {ring.used()} of {ring.size} ring bytes hold live data of "
                   "sessions within retention")
            until = min(oldest[0] + store.cfg.retention_s, store.clock() + FULL_RECHECK_S)
            smallest = need if full is None else min(need, full.need)
            store.ring_full = FullRing(store.counters["cuts"], smallest, until, why)
            raise NoSpace(why)


def _in_retention(store: StoreState, s: Session) -> bool:
    return s.last_use_ns() >= (store.clock() - store.cfg.retention_s) * 1e9


def _step(store: StoreState, target: int, evict: bool, keep: int, oldest: list[float]) -> int:
    ring = store.ring
    start_tail = ring.tail
    report = ScanReport()
    done = True
    for item in ring.scan(ring.tail, ring.head, report):
        h = item.hdr
        ring.tail = h.pos  # pads and corrupt regions before it are dead
        if not _handle(store, item, evict, keep, oldest):
            done = False
            break
        ring.tail = h.pos + h.size
        if ring.size - ring.used() >= target:
            done = False
            break
    if done:
        ring.tail = max(ring.tail, report.end)
    return ring.tail - start_tail


def _handle(store: StoreState, item: ScanItem, evict: bool, keep: int = -1,
            oldest: list[float] | None = None) -> bool:
    """Copy forward or drop what is live in one tail entry; False when there is no room.
    ``oldest[0]``: lowered to the last use (seconds) of a live session copied forward."""
    h = item.hdr
    if h.type not in (T_DATA, T_SMETA, T_FMETA):
        return True  # truncations and tombstones only matter for older entries, also gone
    s = store.idx.load(h.name_hash, h.sno)
    if s is None:
        return True
    f = s.files.get(h.fno) if h.type != T_SMETA else None
    if h.type == T_SMETA:
        live = s.meta_pos == h.pos
    elif f is None:
        live = False
    elif h.type == T_FMETA:
        live = f.meta_pos == h.pos
    else:
        live = any(e[0] == h.pos for e in f.ext)
    if not live:
        return True
    if s.sno != keep and (evict or not _in_retention(store, s)):  # never the one being written
        return _drop(store, s, evicted=evict)
    if oldest is not None and s.sno != keep:
        oldest[0] = min(oldest[0], s.last_use_ns() / 1e9)
    meta: bytes | None = None  # a metadata entry's payload, as the index says now
    data: list[tuple[int, Encoded]] = []  # a data entry's live parts: (extent, entry)
    if h.type == T_SMETA:
        meta = smeta_payload(s)
    elif h.type == T_FMETA:
        assert f is not None  # live
        meta = fmeta_payload(f)
    elif item.payload is None:
        assert f is not None
        # A corrupt entry cannot be copied: the file ends where its good bytes end.
        i = next(i for i, e in enumerate(f.ext) if e[0] == h.pos)
        log.error("session %r file %r: corrupt entry at %d at the tail; file cut to %d bytes",
                  s.name, f.name, h.pos, f.off[i])
        store.mark_needs_fsck(f"corrupt entry at ring position {h.pos} met by reclaim")
        return _emit_trunc(store, s, f, f.off[i])
    else:
        assert f is not None
        for i, (pos, skip, n, _) in enumerate(f.ext):
            if pos != h.pos:
                continue
            if skip == 0 and n == h.raw_len and not _compress_now(store, h, item.payload):
                # the payload as it is: blocks and table
                data.append((i, Encoded([item.payload], h.payload_crc, h.nblocks, n)))
            else:  # only the live part survives: the copy must not revive truncated bytes
                raw = memoryview(decode_payload(h, item.payload)[skip: skip + n])
                data.append((i, encode_entries(store.codec, raw, n, (s.sno, f.fno))[0]))
    sizes = [entry_size(len(meta))] if meta is not None else [
        entry_size(enc.stored_len) for _, enc in data]
    lap_left = store.ring.lap_left(store.ring.head)
    cost = sum(sizes) + (lap_left if sum(sizes) > lap_left else 0)
    if cost + TOMBSTONE_RESERVE > store.ring.room():
        return False
    try:
        if h.type == T_SMETA:
            assert meta is not None
            s.meta_pos, _ = store.ring.append(T_SMETA, 0, s.name_hash, s.sno, 0, 0, 0, meta)
        elif h.type == T_FMETA:
            assert f is not None and meta is not None
            f.meta_pos, _ = store.ring.append(T_FMETA, 0, s.name_hash, s.sno, f.fno, 0, 0, meta)
        else:
            assert f is not None
            for i, enc in data:
                pos, esize, _ = store.ring.append_data(F_COPY, s.name_hash, s.sno, f.fno, f.off[i], enc)
                f.ext[i] = (pos, 0, enc.raw_len, esize)
                store.counters["copied_forward"] += esize
    except RingFull as e:
        raise NoSpace(str(e)) from e
    store.idx.dirty(s)
    return True


def _compress_now(store: StoreState, h: Header, payload: bytes | memoryview) -> bool:
    """Whether a data entry appended raw (``compress_on_copy``) is compressed as it is
    copied forward: every block raw and a codec that compresses."""
    if not store.cfg.compress_on_copy or store.codec.mode == "none":
        return False
    return not any(parse_table(h, payload).flags)


def _emit_trunc(store: StoreState, s: Session, f: FileRec, length: int) -> bool:
    try:
        store.ring.append(T_TRUNC, 0, s.name_hash, s.sno, f.fno, length, 0)
    except RingFull:
        return False
    before = file_use(f)
    f.truncate(length)
    store.mark_cut(s.sno)
    store.quota.sub(s.uid, before)
    store.quota.add(s.uid, file_use(f))
    store.idx.dirty(s)
    return True


def _drop(store: StoreState, s: Session, evicted: bool) -> bool:
    try:
        store.ring.append(T_DELS, 0, s.name_hash, s.sno, 0, 0, 0)
    except RingFull:
        return False
    store.idx.drop(s)
    store.mark_cut(s.sno)
    store.quota.sub(s.uid, session_use(s))
    key = "evicted_sessions" if evicted else "dropped_sessions"
    store.counters[key] += 1
    log.info("session %r %s at the ring tail", s.name, "evicted (volume full)" if evicted else
             "dropped (idle past retention)")
    return True

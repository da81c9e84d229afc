"""Opening an existing ``.kvmap`` file: validation and recovery (one scan, four passes).

1. Header: the newest of the two slots whose magic, version and CRC are good. A file of
   another format version is ``ShardOutdated`` (the tier discards it: a cache).
2. Index: every live entry must have a known kind, an extent inside the file and a good
   CRC; a failure makes the whole file untrusted (``ShardCorrupt``: the tier logs it, sets
   the file aside and treats its sessions as missing), never a crash.
3. Seals: every live entry's seal (``used`` and the checksums it covers) must match. A
   session with a bad one is dropped from the file, logged (``damaged``): its cold copy,
   if any, serves it; nothing is guessed from an unchecked ``used``.
4. Repair what a killed process can leave behind, logged: segments whose session entry is
   gone (an interrupted drop), a stream tail after a non-full segment (an interrupted
   truncate), superseded meta extents. Free space is then the gaps between live extents.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os

import crc32c
import numpy as np

from kvfs.session.formats import tokens_claimed
from kvfs.session.names import META

from .extent import name_seal, seal_of
from .ids import WarmCorrupt, WarmError, check_sid
from .kvmap_format import (
    ALIGN,
    DEAD,
    ENTRY_SIZE,
    HEADER,
    HEADER_CRC,
    HEADER_SLOT,
    HEADER_SLOTS,
    K_LAYER,
    K_META,
    K_NAME,
    K_SUMMARY,
    LIVE,
    MAGIC,
    VERSION,
    footprint,
)
from .rootdir import RootDir
from .shard import DATA_START, ShardFile
from .shard_index import Seg, ShardCorrupt, Stream, WarmSession

log = logging.getLogger("kvfs.warm")


class ShardOutdated(ShardCorrupt):
    """A shard file of another format version."""


def load_shard(root: RootDir, name: str) -> ShardFile:
    """Open and validate an existing file; ShardCorrupt when it cannot be trusted.
    ``damaged`` on the result lists the sessions dropped for a bad seal."""
    sh = ShardFile(root, name)
    fd = root.open(name)
    try:
        st = os.fstat(fd)
        head = os.pread(fd, DATA_START, 0)
    finally:
        os.close(fd)
    sh.fsize, sh.ino = st.st_size, st.st_ino
    best, other = None, None
    for slot in HEADER_SLOTS:
        raw = head[slot:slot + HEADER_SLOT]
        if len(raw) < HEADER_SLOT:
            continue
        body = raw[:HEADER.size]
        (crc,) = HEADER_CRC.unpack(raw[HEADER.size:])
        fields = HEADER.unpack(body)
        if fields[0] != MAGIC or crc != crc32c.crc32c(body):
            continue
        if fields[1] != VERSION:
            other = fields[1]
            continue
        if best is None or fields[3] > best[3]:
            best = fields
    if best is None:
        if other is not None:
            raise ShardOutdated(f"format version {other}, this is version {VERSION}")
        raise ShardCorrupt("no valid header (bad magic, version or checksum)")
    (_, _, sh.dim, sh.seq, sh.created, sh.shard, sh.shards, sh.key, sh.index_cap,
     sh.index_off, _, _, _) = best
    tbl_end = sh.index_off + sh.index_cap * ENTRY_SIZE
    if sh.index_off < DATA_START or sh.index_off % ALIGN or tbl_end > sh.fsize or not sh.index_cap:
        raise ShardCorrupt(f"index table {sh.index_off}+{sh.index_cap} outside the file")
    try:
        sh.damaged = _load_index(sh)
    except ShardCorrupt:
        raise
    except (ValueError, IndexError, UnicodeDecodeError, WarmError) as e:
        raise ShardCorrupt(f"unreadable index: {e}") from e
    return sh


def _load_index(sh: ShardFile) -> dict[str, str]:
    t = np.array(sh.tbl)  # private copy: parsing must not race our own fixes below
    raw = t.view(np.uint8).reshape(-1, ENTRY_SIZE)
    mm = sh.map()
    if np.any(t["state"] > DEAD):
        raise ShardCorrupt("index entry with an unknown state")
    live = [int(i) for i in np.nonzero(t["state"] == LIVE)[0]]
    names: list[int] = []
    others: list[int] = []
    sealed: dict[int, bool] = {}
    for i in live:
        kind, off, cap = int(t["kind"][i]), int(t["off"][i]), int(t["cap"][i])
        if kind not in (K_NAME, K_LAYER, K_SUMMARY, K_META):
            raise ShardCorrupt(f"entry {i}: unknown kind {kind}")
        if off < DATA_START or off + footprint(kind, cap) > sh.fsize:
            raise ShardCorrupt(f"entry {i}: extent {off}+{cap} outside the file")
        extra = mm[off:off + cap].tobytes() if kind == K_NAME else b""
        if crc32c.crc32c(raw[i, 8:48].tobytes() + extra) != int(t["crc"][i]):
            raise ShardCorrupt(f"entry {i}: checksum mismatch")
        seal = int(t["seal"][i])
        used = seal & 0xFFFFFFFF
        if kind == K_NAME:
            sealed[i] = seal == name_seal(used)
        else:
            sealed[i] = used <= cap and seal == seal_of(mm, off, cap, used)
        (names if kind == K_NAME else others).append(i)
    sh.next_uid = max((int(t["uid"][i]) for i in live), default=0) + 1
    damaged: dict[str, str] = {}
    for i in names:
        name = check_sid(mm[int(t["off"][i]):int(t["off"][i]) + int(t["cap"][i])].tobytes().decode())
        flags = int(t["seal"][i]) & 0xFFFFFFFF if sealed[i] else 0
        s = WarmSession(name, int(t["uid"][i]), i, float(t["aux"][i]), flags, int(t["start"][i]))
        old = sh.sessions.get(name)
        if old is not None:  # never written by us; keep the most recently used copy
            log.warning("%s: session %r indexed twice; keeping the newer", sh.path, name)
            if old.last_used >= s.last_used:
                sh.kill_entry(i)
                continue
            sh.kill_entry(old.idx)
            del sh.by_uid[old.uid]
        sh.sessions[name] = s
        sh.by_uid[s.uid] = s
        if not sealed[i]:
            damaged[name] = "session flags fail their checksum"
    for i in others:
        owner = sh.by_uid.get(int(t["uid"][i]))
        if owner is None:  # the session was dropped and the process died before its segments
            sh.kill_entry(i)
            continue
        s = owner
        kind = int(t["kind"][i])
        if not sealed[i]:
            what = META if kind == K_META else f"kind {kind} layer {int(t['layer'][i])}"
            damaged.setdefault(s.name, f"{what} extent fails its checksum")
        seg = Seg(i, int(t["start"][i]), int(t["off"][i]), int(t["cap"][i]),
                  int(t["seal"][i]) & 0xFFFFFFFF)
        if kind == K_META:
            if s.meta is not None and s.meta_seq > seg.start:
                sh.kill_entry(i)
                continue
            if s.meta is not None:
                sh.kill_entry(s.meta.idx)
            s.meta, s.meta_seq = seg, seg.start
        else:
            s.stream(kind, int(t["layer"][i])).segs.append(seg)
    for name, why in damaged.items():  # dropped whole: a partial session is no state
        log.error("%s: session %r: %s; its warm copy is dropped (the cold copy, if any, "
                  "serves it)", sh.path, name, why)
        s = sh.sessions.pop(name)
        del sh.by_uid[s.uid]
        for g in [*(g for st in s.layers.values() for g in st.segs), *s.summary.segs,
                  *([s.meta] if s.meta else [])]:
            sh.kill_entry(g.idx)
        sh.kill_entry(s.idx)
    for s in sh.sessions.values():
        for st in [*s.layers.values(), s.summary]:
            _check_stream(sh, s, st)
        s.layers = {k: v for k, v in s.layers.items() if v.segs}
        if s.meta is not None:
            with contextlib.suppress(WarmCorrupt):  # then reading meta.json says so
                s.tokens = tokens_claimed(sh.meta_bytes(s) or b"")
    _rebuild_free(sh, t)
    sh.total_bytes = sum(s.held for s in sh.sessions.values())
    sh.total_tokens = sum(s.tokens for s in sh.sessions.values())
    return damaged


def _check_stream(sh: ShardFile, s: WarmSession, st: Stream) -> None:
    """Keep the longest contiguous run from the first segment: what follows a gap or a
    non-full segment is the tail of a truncate that a crash interrupted."""
    st.segs.sort(key=lambda g: g.start)
    for k in range(1, len(st.segs)):
        prev = st.segs[k - 1]
        if prev.used != prev.cap or st.segs[k].start != prev.start + prev.cap:
            for g in st.segs[k:]:
                sh.kill_entry(g.idx)
            log.warning("%s: session %r: dropped %d segment(s) after an unfinished truncate",
                        sh.path, s.name, len(st.segs) - k)
            del st.segs[k:]
            return


def _rebuild_free(sh: ShardFile, t: np.ndarray) -> None:
    live = {s.idx for s in sh.sessions.values()}
    for s in sh.sessions.values():
        live.update(g.idx for st in [*s.layers.values(), s.summary] for g in st.segs)
        if s.meta is not None:
            live.add(s.meta.idx)
    keep = [(sh.index_off, sh.index_cap * ENTRY_SIZE)]
    keep += [(int(t["off"][i]), footprint(int(t["kind"][i]), int(t["cap"][i]))) for i in live]
    keep.sort()
    pos = DATA_START
    for off, n in keep:
        if off < pos and n:
            raise ShardCorrupt(f"overlapping extents at {off}")
        if off > pos:
            sh.free.append((pos, off - pos))
        pos = max(pos, off + n)
    sh.end = pos
    sh.free_slots = [i for i in range(sh.index_cap) if i not in live]
    heapq.heapify(sh.free_slots)

"""Opening an existing ``.kvmap`` file: validation and recovery (one scan, three passes).

1. Header: the newest of the two slots whose magic, version and CRC are good.
2. Index: every live entry must have a known kind, an extent inside the file and a good
   CRC; a failure makes the whole file untrusted (``ShardCorrupt``: the tier logs it, sets
   the file aside and treats its sessions as missing), never a crash.
3. Repair what a killed process can leave behind, logged: segments whose session entry is
   gone (an interrupted drop), a stream tail after a non-full segment (an interrupted
   truncate), superseded meta extents. Free space is then the gaps between live extents.
"""

from __future__ import annotations

import heapq
import logging
import os

import crc32c
import numpy as np

from .format import (
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
)
from .ids import WarmError, check_sid
from .records import Seg, Session, ShardCorrupt, Stream, tokens_of
from .shard import DATA_START, ShardFile

log = logging.getLogger("kvfs.warm")


def load_shard(path: str) -> ShardFile:
    """Open and validate an existing file; ShardCorrupt when it cannot be trusted."""
    sh = ShardFile(path)
    with open(path, "rb") as f:
        head = f.read(DATA_START)
    sh.fsize = os.stat(path).st_size
    best = None
    for slot in HEADER_SLOTS:
        raw = head[slot:slot + HEADER_SLOT]
        if len(raw) < HEADER_SLOT:
            continue
        body = raw[:HEADER.size]
        (crc,) = HEADER_CRC.unpack(raw[HEADER.size:])
        fields = HEADER.unpack(body)
        if fields[0] != MAGIC or fields[1] != VERSION or crc != crc32c.crc32c(body):
            continue
        if best is None or fields[3] > best[3]:
            best = fields
    if best is None:
        raise ShardCorrupt("no valid header (bad magic, version or checksum)")
    (_, _, sh.dim, sh.seq, sh.created, sh.shard, sh.shards, sh.key, sh.index_cap,
     sh.index_off, _, _, _) = best
    tbl_end = sh.index_off + sh.index_cap * ENTRY_SIZE
    if sh.index_off < DATA_START or sh.index_off % ALIGN or tbl_end > sh.fsize or not sh.index_cap:
        raise ShardCorrupt(f"index table {sh.index_off}+{sh.index_cap} outside the file")
    try:
        _load_index(sh)
    except ShardCorrupt:
        raise
    except (ValueError, IndexError, UnicodeDecodeError, WarmError) as e:
        raise ShardCorrupt(f"unreadable index: {e}") from e
    return sh


def _load_index(sh: ShardFile) -> None:
    t = np.array(sh.tbl)  # private copy: parsing must not race our own fixes below
    raw = t.view(np.uint8).reshape(-1, ENTRY_SIZE)
    mm = sh.map()
    if np.any(t["state"] > DEAD):
        raise ShardCorrupt("index entry with an unknown state")
    live = [int(i) for i in np.nonzero(t["state"] == LIVE)[0]]
    names: list[int] = []
    others: list[int] = []
    for i in live:
        off, cap = int(t["off"][i]), int(t["cap"][i])
        if off < DATA_START or off + cap > sh.fsize or int(t["used"][i]) > cap and t["kind"][i] != K_NAME:
            raise ShardCorrupt(f"entry {i}: extent {off}+{cap} outside the file")
        extra = mm[off:off + cap].tobytes() if t["kind"][i] == K_NAME else b""
        if crc32c.crc32c(raw[i, 8:48].tobytes() + extra) != int(t["crc"][i]):
            raise ShardCorrupt(f"entry {i}: checksum mismatch")
        if t["kind"][i] not in (K_NAME, K_LAYER, K_SUMMARY, K_META):
            raise ShardCorrupt(f"entry {i}: unknown kind {t['kind'][i]}")
        (names if t["kind"][i] == K_NAME else others).append(i)
    sh.next_uid = max((int(t["uid"][i]) for i in live), default=0) + 1
    for i in names:
        name = check_sid(mm[int(t["off"][i]):int(t["off"][i]) + int(t["cap"][i])].tobytes().decode())
        s = Session(name, int(t["uid"][i]), i, float(t["aux"][i]), int(t["used"][i]))
        old = sh.sessions.get(name)
        if old is not None:  # never written by us; keep the most recently used copy
            log.warning("%s: session %r indexed twice; keeping the newer", sh.path, name)
            if old.last_used >= s.last_used:
                sh._kill(i)
                continue
            sh._kill(old.idx)
            del sh.by_uid[old.uid]
        sh.sessions[name] = s
        sh.by_uid[s.uid] = s
    for i in others:
        s = sh.by_uid.get(int(t["uid"][i]))
        if s is None:  # the session was dropped and the process died before its segments
            sh._kill(i)
            continue
        seg = Seg(i, int(t["start"][i]), int(t["off"][i]), int(t["cap"][i]), int(t["used"][i]))
        kind = int(t["kind"][i])
        if kind == K_META:
            if s.meta is not None and s.meta_seq > seg.start:
                sh._kill(i)
                continue
            if s.meta is not None:
                sh._kill(s.meta.idx)
            s.meta, s.meta_seq = seg, seg.start
        else:
            s.stream(kind, int(t["layer"][i])).segs.append(seg)
    for s in sh.sessions.values():
        for st in [*s.layers.values(), s.summary]:
            _check_stream(sh, s, st)
        s.layers = {k: v for k, v in s.layers.items() if v.segs}
        if s.meta is not None:
            s.tokens = tokens_of(sh.meta_bytes(s))
    _rebuild_free(sh, t)
    sh.total_bytes = sum(s.held for s in sh.sessions.values())
    sh.total_tokens = sum(s.tokens for s in sh.sessions.values())


def _check_stream(sh: ShardFile, s: Session, st: Stream) -> None:
    """Keep the longest contiguous run from the first segment: what follows a gap or a
    non-full segment is the tail of a truncate that a crash interrupted."""
    st.segs.sort(key=lambda g: g.start)
    for k in range(1, len(st.segs)):
        prev = st.segs[k - 1]
        if prev.used != prev.cap or st.segs[k].start != prev.start + prev.cap:
            for g in st.segs[k:]:
                sh._kill(g.idx)
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
    keep += [(int(t["off"][i]), int(t["cap"][i])) for i in live]
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

"""One ``.kvmap`` shard file: its sessions, their byte streams, extents and index table.

Owns the file format of ``layout.py``: reading and validating a file, allocating extents,
appending to and truncating streams, and persisting the index in place. Data is written
and read through one ``numpy.memmap`` of the whole file (slices, never a Python object per
token). Appends fill the last segment of a stream, then add a segment of twice the size
at a free place; nothing already written moves, so an append never rewrites the file.

Not thread-safe: WarmTier holds this shard's lock around every call. Knows nothing of the
cold tier, the LRU or the byte cap. Never imports torch.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import logging
import mmap
import os

import crc32c
import numpy as np

from .format import (
    ALIGN,
    DEAD,
    EMPTY,
    ENTRY,
    ENTRY_SIZE,
    FIRST_TABLE,
    FIRST_TABLE_ENTRIES,
    HEADER,
    HEADER_CRC,
    HEADER_SLOT,
    HEADER_SLOTS,
    IMMUTABLE,
    K_LAYER,
    K_META,
    K_NAME,
    LIVE,
    MAGIC,
    MAX_GROW,
    MAX_SEGMENT,
    MIN_SEGMENT,
    VERSION,
)
from .records import Seg, Session, Stream, tokens_of

log = logging.getLogger("kvfs.warm")
PAGE = mmap.PAGESIZE
DATA_START = HEADER_SLOT * len(HEADER_SLOTS)


def _up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class ShardFile:
    """A ``.kvmap`` file. Use ``create`` or ``shardload.load_shard``; map/unmap freely
    (remapped lazily)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.mm: np.memmap | None = None
        self._buf: np.ndarray | None = None
        self._tbl: np.ndarray | None = None
        self.sessions: dict[str, Session] = {}
        self.by_uid: dict[int, Session] = {}
        self.free: list[tuple[int, int]] = []  # sorted (off, len) gaps
        self.free_slots: list[int] = []  # heap of non-live entry numbers
        self.seq = 0
        self.next_uid = 1
        self.end = 0  # first byte after the last allocated extent
        self.fsize = 0
        self.created = 0.0
        self.shard = self.shards = self.key = self.dim = 0
        self.index_off, self.index_cap = FIRST_TABLE, FIRST_TABLE_ENTRIES
        self.total_bytes = self.total_tokens = 0

    # ---- header -------------------------------------------------------------------
    @classmethod
    def create(cls, path: str, shard: int, shards: int, key: int, dim: int, now: float) -> ShardFile:
        sh = cls(path)
        sh.created, sh.shard, sh.shards, sh.key, sh.dim = now, shard, shards, key, dim
        sh.free = [(DATA_START, FIRST_TABLE - DATA_START)]  # rest of the header page
        sh.end = FIRST_TABLE + FIRST_TABLE_ENTRIES * ENTRY_SIZE
        sh.fsize = max(_up(sh.end, PAGE), 64 << 10)  # sparse: costs no RAM until written
        sh.free_slots = list(range(FIRST_TABLE_ENTRIES))
        # build under a temporary name and rename: a crash never leaves a half-made shard
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.truncate(sh.fsize)
        os.rename(tmp, path)
        sh._write_header()
        return sh

    def _write_header(self) -> None:
        self.seq += 1
        body = HEADER.pack(MAGIC, VERSION, self.dim, self.seq, self.created, self.shard,
                           self.shards, self.key, self.index_cap, self.index_off,
                           self.total_bytes, self.total_tokens, len(self.sessions))
        slot = HEADER_SLOTS[self.seq % 2]
        mm = self.map()
        mm[slot:slot + HEADER.size] = np.frombuffer(body, np.uint8)
        # the checksum last: a torn slot fails it and the other, older slot is used
        mm[slot + HEADER.size:slot + HEADER_SLOT] = np.frombuffer(
            HEADER_CRC.pack(crc32c.crc32c(body)), np.uint8)

    # ---- mapping ------------------------------------------------------------------
    def map(self) -> np.ndarray:
        """The whole file as a uint8 array over its ``numpy.memmap`` (a plain ndarray view:
        slicing a memmap subclass costs several microseconds per slice)."""
        if self._buf is None:
            self.mm = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(self.fsize,))
            self._buf = self.mm.view(np.ndarray)
            self._tbl = None
        return self._buf

    def unmap(self) -> None:
        """Drop our mapping (arrays still referring to it keep it alive)."""
        if self.mm is not None:
            self.mm.flush()
        self.mm = self._buf = self._tbl = None

    @property
    def tbl(self) -> np.ndarray:
        if self._tbl is None:
            mm = self.map()
            self._tbl = mm[self.index_off:self.index_off + self.index_cap * ENTRY_SIZE].view(ENTRY)
        return self._tbl

    def flush(self) -> None:
        if self.mm is not None:
            self.mm.flush()

    # ---- space --------------------------------------------------------------------
    def _alloc(self, size: int) -> int:
        align = PAGE if size >= PAGE else ALIGN
        for k, (off, n) in enumerate(self.free):
            a = _up(off, align)
            if a + size <= off + n:
                del self.free[k]
                if a > off:
                    self._add_free(off, a - off, advise=False)
                if off + n > a + size:
                    self._add_free(a + size, off + n - a - size, advise=False)
                return a
        a = _up(self.end, align)
        if a > self.end:
            self._add_free(self.end, a - self.end, advise=False)
        self.end = a + size
        if self.end > self.fsize:
            new = max(self.end, min(self.fsize * 2, self.fsize + MAX_GROW))
            self.fsize = _up(new, PAGE)
            os.truncate(self.path, self.fsize)  # sparse growth; remapped on next access
            self.mm = self._buf = self._tbl = None
        return a

    def _add_free(self, off: int, n: int, advise: bool = True) -> None:
        if n <= 0:
            return
        if advise:
            # give the pages back to tmpfs now (page-aligned interior only); other
            # filesystems may refuse, then the pages are simply reused later
            a, b = _up(off, PAGE), (off + n) // PAGE * PAGE
            if b > a:
                self.map()
                with contextlib.suppress(AttributeError, OSError, ValueError):
                    self.mm._mmap.madvise(mmap.MADV_REMOVE, a, b - a)
        k = bisect.bisect_left(self.free, (off, n))
        if k < len(self.free) and self.free[k][0] == off + n:  # merge with the next gap
            n += self.free.pop(k)[1]
        if k > 0 and self.free[k - 1][0] + self.free[k - 1][1] == off:  # and the previous
            off, n0 = self.free.pop(k - 1)
            n += n0
            k -= 1
        if off + n == self.end:
            self.end = off  # the tail is simply unallocated again
            return
        self.free.insert(k, (off, n))

    def _slot(self) -> int:
        if not self.free_slots:
            self._grow_table()
        return heapq.heappop(self.free_slots)

    def _grow_table(self) -> None:
        old_off, old_cap = self.index_off, self.index_cap
        new_cap = old_cap * 2
        off = self._alloc(new_cap * ENTRY_SIZE)
        mm = self.map()
        n = old_cap * ENTRY_SIZE
        mm[off:off + n] = mm[old_off:old_off + n]
        mm[off + n:off + 2 * n] = 0  # the extent may be a reused gap: no stale entries
        self.index_off, self.index_cap, self._tbl = off, new_cap, None
        # the switch: before it the old table is the valid one. Both slots, so that no
        # header copy still points at the old table once its space can be reused.
        self._write_header()
        self._write_header()
        self._add_free(old_off, n)
        for i in range(old_cap, new_cap):
            heapq.heappush(self.free_slots, i)

    # ---- entries ------------------------------------------------------------------
    def _put_entry(self, uid: int, kind: int, layer: int, start: int, off: int, cap: int,
                   used: int, aux: float = 0.0, extra: bytes = b"") -> int:
        """Write a complete entry, not yet live (``_live`` publishes it)."""
        i = self._slot()
        t = self.tbl
        t["state"][i] = DEAD
        crc = crc32c.crc32c(IMMUTABLE.pack(uid, kind, layer, start, off, cap) + extra)
        t[i] = (crc, DEAD, uid, kind, layer, start, off, cap, used, aux)
        return i

    def _live(self, i: int) -> None:
        self.tbl["state"][i] = LIVE

    def _kill(self, i: int) -> None:
        t = self.tbl
        if t["state"][i] != EMPTY:
            t["state"][i] = DEAD
        heapq.heappush(self.free_slots, i)  # callers kill each live entry once

    # ---- sessions -----------------------------------------------------------------
    def new_session(self, name: str, now: float, live: bool = True) -> Session:
        """Add a session. ``live=False``: its name entry is published later by
        ``publish_session``, so what is written before (meta and summaries loaded from a
        cold copy) is all there or, after a crash, all orphaned."""
        nb = name.encode("utf-8")
        off = self._alloc(len(nb))
        self.map()[off:off + len(nb)] = np.frombuffer(nb, np.uint8)
        uid = self.next_uid
        self.next_uid += 1
        i = self._put_entry(uid, K_NAME, 0, 0, off, len(nb), 0, now, extra=nb)
        if live:
            self._live(i)
        s = Session(name, uid, i, now, 0)
        self.sessions[name] = s
        self.by_uid[uid] = s
        self._write_header()
        return s

    def publish_session(self, s: Session) -> None:
        self._live(s.idx)

    def drop(self, s: Session) -> int:
        """Remove a session; returns the bytes it held. Killing the name entry first makes
        the removal atomic for a later load (its segments become orphans, reclaimed)."""
        held = s.held
        t = self.tbl
        self._kill(s.idx)
        # the last session: the caller unlinks the file, which frees the pages at once
        advise = len(self.sessions) > 1
        self._add_free(int(t["off"][s.idx]), int(t["cap"][s.idx]), advise)
        for st in [*s.layers.values(), s.summary]:
            self._release(st.segs, advise)
        if s.meta is not None:
            self._release([s.meta], advise)
        del self.sessions[s.name]
        del self.by_uid[s.uid]
        self.total_bytes -= held
        self.total_tokens -= s.tokens
        self._write_header()
        return held

    def _release(self, segs: list[Seg], advise: bool = True) -> None:
        for g in reversed(segs):
            self._kill(g.idx)
            self._add_free(g.off, g.cap, advise)

    def set_last_used(self, s: Session, t: float) -> None:
        s.last_used = t
        self.tbl["aux"][s.idx] = t

    def set_flags(self, s: Session, flags: int) -> None:
        s.flags = flags
        self.tbl["used"][s.idx] = flags

    # ---- streams ------------------------------------------------------------------
    def write(self, s: Session, kind: int, layer: int, pos: int, buf: np.ndarray, base: int = 0) -> int:
        """Write ``buf`` (uint8) at stream offset ``pos`` (base <= pos <= end): overwrite in
        place up to the end, append the rest. ``base`` is the start of a stream's first
        segment when it has none. Returns the change in held bytes."""
        st = s.stream(kind, layer)
        if not st.segs:
            st_end = base
            if pos != base:
                raise ValueError(f"write at {pos} into an empty stream based at {base}")
        else:
            st_end = st.end
            if not st.base <= pos <= st_end:
                raise ValueError(f"write at {pos} outside [{st.base}, {st_end}]")
        n = len(buf)
        mm = self.map()
        done = 0
        for g in st.segs:  # overwrite (summaries of a redone round), then fill the last
            a, b = max(pos, g.start), min(pos + n, g.start + g.cap)
            if a >= b:
                continue
            mm[g.off + a - g.start:g.off + b - g.start] = buf[a - pos:b - pos]
            if b - g.start > g.used:
                self.tbl["used"][g.idx] = g.used = b - g.start  # after the data
            done = b - pos
        while done < n:
            prev = st.segs[-1].cap if st.segs else 0
            start = st.segs[-1].start + st.segs[-1].cap if st.segs else base
            cap = max(n - done, min(max(2 * prev, MIN_SEGMENT), MAX_SEGMENT))
            off = self._alloc(cap)
            mm = self.map()
            take = min(cap, n - done)
            mm[off:off + take] = buf[done:done + take]
            i = self._put_entry(s.uid, kind, layer, start, off, cap, take)
            self._live(i)
            st.segs.append(Seg(i, start, off, cap, take))
            done += take
        delta = max(0, pos + n - st_end)
        self.total_bytes += delta
        s.gen += 1
        self._write_header()
        return delta

    def prepend(self, s: Session, layer: int, data_len: int) -> tuple[Seg, np.ndarray]:
        """Allocate the segment [0, data_len) under a layer's current base (promotion from
        cold). Fill the returned view, then ``publish`` it."""
        off = self._alloc(data_len)  # data_len > 0: the caller skips empty prefixes
        i = self._put_entry(s.uid, K_LAYER, layer, 0, off, data_len, data_len)
        return Seg(i, 0, off, data_len, data_len), self.map()[off:off + data_len]

    def abandon(self, seg: Seg) -> None:
        """Give back a prepared segment that will not be published (a failed cold read)."""
        self._kill(seg.idx)
        self._add_free(seg.off, seg.cap)

    def publish(self, s: Session, layer: int, seg: Seg) -> None:
        self._live(seg.idx)
        s.stream(K_LAYER, layer).segs.insert(0, seg)
        self.total_bytes += seg.used
        s.gen += 1
        self._write_header()

    def read_into(self, st: Stream, start: int, end: int, out: np.ndarray) -> None:
        """Copy stream bytes [start, end) (all within the warm part) into ``out``."""
        mm = self.map()
        for g in st.segs:
            a, b = max(start, g.start), min(end, g.start + g.used)
            if a < b:
                out[a - start:b - start] = mm[g.off + a - g.start:g.off + b - g.start]

    def segments(self, st: Stream, start: int, end: int):
        """(memmap slice) pieces covering [start, end) of the warm part, in order."""
        mm = self.map()
        for g in st.segs:
            a, b = max(start, g.start), min(end, g.start + g.used)
            if a < b:
                yield mm[g.off + a - g.start:g.off + b - g.start]

    def truncate(self, s: Session, kind: int, layer: int, length: int) -> int:
        """Cut the warm part of a stream to ``length`` (everything when length <= base).
        Returns the bytes released. The cut segment's ``used`` is stored first: a load that
        finds later segments after a non-full one drops them, completing the truncate."""
        st = s.layers.get(layer) if kind == K_LAYER else s.summary
        if st is None or not st.segs or length >= st.end:
            return 0
        before = st.held
        if length <= st.base:
            self._release(st.segs)
            st.segs = []
        else:
            k = max(j for j, g in enumerate(st.segs) if g.start < length)
            g = st.segs[k]
            self.tbl["used"][g.idx] = g.used = length - g.start
            self._release(st.segs[k + 1:])
            del st.segs[k + 1:]
        if kind == K_LAYER and not st.segs:
            del s.layers[layer]
        freed = before - st.held
        self.total_bytes -= freed
        s.gen += 1
        self._write_header()
        return freed

    # ---- meta ---------------------------------------------------------------------
    def put_meta(self, s: Session, raw: bytes) -> int:
        """Store meta.json bytes in a new extent, then retire the old one (never torn)."""
        old = s.meta
        off = self._alloc(max(len(raw), 1))
        self.map()[off:off + len(raw)] = np.frombuffer(raw, np.uint8)
        s.meta_seq += 1
        i = self._put_entry(s.uid, K_META, 0, s.meta_seq, off, len(raw), len(raw))
        self._live(i)
        s.meta = Seg(i, s.meta_seq, off, len(raw), len(raw))
        if old is not None:
            self._release([old])
        delta = len(raw) - (old.used if old else 0)
        tokens = tokens_of(raw)
        self.total_tokens += tokens - s.tokens
        s.tokens = tokens
        self.total_bytes += delta
        s.gen += 1
        self._write_header()
        return delta

    def meta_bytes(self, s: Session) -> bytes | None:
        if s.meta is None:
            return None
        return self.map()[s.meta.off:s.meta.off + s.meta.used].tobytes()

"""One ``.kvmap`` shard file: its sessions, their byte streams, extents and index table.

Owns the file format of ``kvmap_format.py``: allocating extents, appending to and truncating
streams, sealing and checking extents, and persisting the index in place. Data is written
and read through one shared mapping of the whole file (numpy slices, never a Python
object per token). Appends fill the last segment of a stream, then add a segment of
twice the size at a free place; nothing already written moves. Every read checks the
checksums of what it returns (``WarmCorrupt`` otherwise); every change checks what it
builds on first, so a damaged byte is never sealed as good.

The file is opened relative to the checked root (``RootDir``) each time it is mapped and
must still be the same inode. Not thread-safe: WarmTier holds this shard's lock around
every call. Knows nothing of the cold tier, the LRU or the byte cap. Never imports torch.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import mmap
import os

import crc32c
import numpy as np

from kvfs.session.formats import tokens_claimed
from kvfs.session.names import META

from .extent import fill_blocks, name_seal, seal_of
from .ids import WarmCorrupt, WarmError
from .kvmap_format import (
    BLOCK,
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
    MAX_EXTENT,
    MAX_SEGMENT,
    MIN_SEGMENT,
    VERSION,
    footprint,
)
from .rootdir import RootDir
from .shard_index import Seg, Stream, WarmSession
from .space import PAGE, Space, reserve_fd, round_up

log = logging.getLogger("kvfs.warm")
DATA_START = HEADER_SLOT * len(HEADER_SLOTS)


class ShardFile(Space):
    """A ``.kvmap`` file. Use ``create`` or ``shardload.load_shard``; map/unmap freely
    (remapped lazily)."""

    def __init__(self, root: RootDir, name: str) -> None:
        self.root, self.name, self.path = root, name, root.join(name)
        self.ino = 0  # the inode we made or loaded: a file swapped under us is refused
        self._mm: mmap.mmap | None = None
        self._buf: np.ndarray | None = None
        self._tbl: np.ndarray | None = None
        self.sessions: dict[str, WarmSession] = {}
        self.by_uid: dict[int, WarmSession] = {}
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
        self.damaged: dict[str, str] = {}  # sessions a load dropped for a bad seal: why

    # ---- header -------------------------------------------------------------------
    @classmethod
    def create(cls, root: RootDir, name: str, shard: int, shards: int, key: int, dim: int,
               now: float) -> ShardFile:
        sh = cls(root, name)
        sh.created, sh.shard, sh.shards, sh.key, sh.dim = now, shard, shards, key, dim
        sh.free = [(DATA_START, FIRST_TABLE - DATA_START)]  # rest of the header page
        sh.end = FIRST_TABLE + FIRST_TABLE_ENTRIES * ENTRY_SIZE
        sh.fsize = max(round_up(sh.end, PAGE), 64 << 10)  # sparse: costs no RAM until written
        sh.free_slots = list(range(FIRST_TABLE_ENTRIES))
        # build under a temporary name and rename: a crash never leaves a half-made shard
        tmp = f"{name}.tmp.{os.getpid()}"
        root.unlink(tmp)  # a leftover of a killed process with our pid
        fd = root.create(tmp)
        try:
            os.ftruncate(fd, sh.fsize)
            sh.ino = os.fstat(fd).st_ino
            # header page and first table: the pages every shard writes (space.py)
            sh.can_reserve = reserve_fd(fd, 0, FIRST_TABLE + FIRST_TABLE_ENTRIES * ENTRY_SIZE,
                                        root.join(tmp))
        except OSError as e:
            root.unlink(tmp)
            raise WarmError(f"warm file {root.join(tmp)!r}: {e.strerror}") from e
        except BaseException:
            root.unlink(tmp)
            raise
        finally:
            os.close(fd)
        root.rename(tmp, name)
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
    def open_fd(self) -> int:
        """A descriptor of our file, opened relative to the root; WarmError if the name
        now holds another file or one of a different size (a mapping past its end would
        fault on access)."""
        fd = self.root.open(self.name)
        st = os.fstat(fd)
        if (self.ino and st.st_ino != self.ino) or (self.fsize and st.st_size != self.fsize):
            os.close(fd)
            raise WarmError(f"warm file {self.path!r} was replaced or resized by someone else")
        self.ino = st.st_ino
        return fd

    def map(self) -> np.ndarray:
        """The whole file as a writable uint8 array over one shared mapping."""
        if self._buf is None:
            fd = self.open_fd()
            try:
                self._mm = mmap.mmap(fd, self.fsize)
            finally:
                os.close(fd)
            self._buf = np.frombuffer(self._mm, np.uint8)
            self._tbl = None
        return self._buf

    def unmap(self, flush: bool = True) -> None:
        """Drop our mapping (arrays still referring to it keep it alive); ``flush=False``
        for a file about to be removed."""
        if self._mm is not None and flush:
            with contextlib.suppress(ValueError):  # already closed
                self._mm.flush()
        self._mm = self._buf = self._tbl = None

    def discard(self) -> None:
        """Unmap now, without msync: the file is being removed."""
        mm, self._mm, self._buf, self._tbl = self._mm, None, None, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view still alive: freed with it
                mm.close()

    @property
    def tbl(self) -> np.ndarray:
        if self._tbl is None:
            mm = self.map()
            self._tbl = mm[self.index_off:self.index_off + self.index_cap * ENTRY_SIZE].view(ENTRY)
        return self._tbl

    def flush(self) -> None:
        if self._mm is not None:
            self._mm.flush()

    # ---- space (allocation and reservations: space.py) ----------------------------
    def _slot(self) -> int:
        if not self.free_slots:
            self._grow_table()
        return heapq.heappop(self.free_slots)

    def _grow_table(self) -> None:
        old_off, old_cap = self.index_off, self.index_cap
        new_cap = old_cap * 2
        off = self.alloc_reserved(new_cap * ENTRY_SIZE, [(0, new_cap * ENTRY_SIZE)])
        mm = self.map()
        n = old_cap * ENTRY_SIZE
        mm[off:off + n] = mm[old_off:old_off + n]
        mm[off + n:off + 2 * n] = 0  # the extent may be a reused gap: no stale entries
        self.index_off, self.index_cap, self._tbl = off, new_cap, None
        # the switch: before it the old table is the valid one. Both slots, so that no
        # header copy still points at the old table once its space can be reused.
        self._write_header()
        self._write_header()
        self.add_free(old_off, n)
        for i in range(old_cap, new_cap):
            heapq.heappush(self.free_slots, i)

    # ---- entries and checks -------------------------------------------------------
    def _put_entry(self, uid: int, kind: int, layer: int, start: int, off: int, cap: int,
                   seal: int, aux: float = 0.0, extra: bytes = b"") -> int:
        """Write a complete entry, not yet live (``_live`` publishes it)."""
        i = self._slot()
        t = self.tbl
        t["state"][i] = DEAD
        crc = crc32c.crc32c(IMMUTABLE.pack(uid, kind, layer, start, off, cap) + extra)
        t[i] = (crc, DEAD, uid, kind, layer, start, off, cap, seal, aux)
        return i

    def _live(self, i: int) -> None:
        self.tbl["state"][i] = LIVE

    def kill_entry(self, i: int) -> None:
        """Retire entry ``i`` and make its number reusable (each live entry once)."""
        t = self.tbl
        if t["state"][i] != EMPTY:
            t["state"][i] = DEAD
        heapq.heappush(self.free_slots, i)

    def _new_extent(self, uid: int, kind: int, layer: int, start: int, data: np.ndarray,
                    cap: int) -> Seg:
        """Allocate, fill, checksum and publish an extent holding ``data`` (only the data
        written and the block checksums are reserved: unused capacity stays sparse)."""
        size = footprint(kind, cap)
        off = self.alloc_reserved(size, [(0, len(data)), (cap, size - cap)])
        try:
            mm = self.map()
            mm[off:off + len(data)] = data
            fill_blocks(mm, off, cap, 0, len(data))
            i = self._put_entry(uid, kind, layer, start, off, cap, seal_of(mm, off, cap, len(data)))
        except BaseException:
            self.add_free(off, size)
            raise
        self._live(i)
        return Seg(i, start, off, cap, len(data))

    def check(self, s: WarmSession, g: Seg, lo: int, hi: int, what: str = "",
              seal: bool | None = None) -> None:
        """WarmCorrupt unless the blocks of ``g`` overlapping [lo, hi) (extent-relative)
        match their checksums, and its seal too when ``seal`` (default: when the range
        reaches into the partial tail block, which only the seal covers, or is empty).
        ``used`` itself is this process's own, so a read of full blocks needs no seal."""
        mm = self._buf if self._buf is not None else self.map()
        full = g.used // BLOCK
        if seal is None:
            seal = hi <= lo or hi > full * BLOCK
        bad = seal and int(self.tbl["seal"][g.idx]) != seal_of(mm, g.off, g.cap, g.used)
        k0, k1 = lo // BLOCK, min(-(-hi // BLOCK), full)
        if not bad and k1 > k0:
            at = g.off + g.cap
            bc = mm[at + 4 * k0:at + 4 * k1].view("<u4").tolist()
            at = g.off + k0 * BLOCK
            for want in bc:
                if crc32c.crc32c(mm[at:at + BLOCK].data) != want:
                    bad = True
                    break
                at += BLOCK
        if bad:
            raise WarmCorrupt(f"warm file {self.path!r}: session {s.name!r} {what or 'extent'} "
                              f"bytes [{g.start}, {g.start + g.used}): checksum mismatch")

    # ---- sessions -----------------------------------------------------------------
    def new_session(self, name: str, now: float, live: bool = True, inc: int = 0) -> WarmSession:
        """Add a session (incarnation id ``inc``, kept in the name entry's ``start``).
        ``live=False``: its name entry is published later by ``publish_session``, so what
        is written before (meta and summaries loaded from a cold copy) is all there or,
        after a crash, all orphaned."""
        nb = name.encode("utf-8")
        off = self.alloc_reserved(len(nb), [(0, len(nb))])
        try:
            self.map()[off:off + len(nb)] = np.frombuffer(nb, np.uint8)
            uid = self.next_uid
            i = self._put_entry(uid, K_NAME, 0, inc, off, len(nb), name_seal(0), now, extra=nb)
        except BaseException:
            self.add_free(off, len(nb))
            raise
        self.next_uid += 1
        if live:
            self._live(i)
        s = WarmSession(name, uid, i, now, 0, inc)
        self.sessions[name] = s
        self.by_uid[uid] = s
        self._write_header()
        return s

    def publish_session(self, s: WarmSession) -> None:
        self._live(s.idx)

    def drop(self, s: WarmSession) -> int:
        """Remove a session; returns the bytes it held. Killing the name entry first makes
        the removal atomic for a later load (its segments become orphans, reclaimed)."""
        held = s.held
        t = self.tbl
        self.kill_entry(s.idx)
        # the last session: the caller unlinks the file, which frees the pages at once
        advise = len(self.sessions) > 1
        self.add_free(int(t["off"][s.idx]), int(t["cap"][s.idx]), advise)
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
            self.kill_entry(g.idx)
            self.add_free(g.off, footprint(K_LAYER, g.cap), advise)

    def set_last_used(self, s: WarmSession, t: float) -> None:
        s.last_used = t
        self.tbl["aux"][s.idx] = t

    def set_flags(self, s: WarmSession, flags: int) -> None:
        s.flags = flags
        self.tbl["seal"][s.idx] = name_seal(flags)

    # ---- streams ------------------------------------------------------------------
    def write(self, s: WarmSession, kind: int, layer: int, pos: int, buf: np.ndarray,
              base: int = 0) -> int:
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
        what = f"layer {layer}" if kind == K_LAYER else "summaries"
        # check everything this write builds on before changing anything
        touched = [g for g in st.segs if max(pos, g.start) < min(pos + n, g.start + g.cap)]
        for g in touched:
            lo = max(pos, g.start) - g.start
            self.check(s, g, lo, min(pos + n - g.start, g.used), what, seal=True)
        # room first (space.py): reserve what the existing segments take, make the new
        # segments (each complete and live; a crash leaves them after a non-full segment,
        # which a load drops); on a full RAM filesystem nothing has changed
        for g in touched:
            a, b = max(pos, g.start) - g.start, min(pos + n, g.start + g.cap) - g.start
            self.reserve(g.off + a, b - a)
            self.reserve(g.off + g.cap + 4 * (a // BLOCK), 4 * (b // BLOCK - a // BLOCK))
        done = max((min(pos + n, g.start + g.cap) - pos for g in touched), default=0)
        new: list[Seg] = []
        prev = st.segs[-1] if st.segs else None
        try:
            while done < n:
                start = prev.start + prev.cap if prev is not None else base
                grow = min(max(2 * prev.cap if prev else 0, MIN_SEGMENT), MAX_SEGMENT)
                cap = min(max(n - done, grow), MAX_EXTENT)
                take = min(cap, n - done)
                prev = self._new_extent(s.uid, kind, layer, start, buf[done:done + take], cap)
                new.append(prev)
                done += take
        except BaseException:
            self._release(new)
            if kind == K_LAYER and not st.segs:
                del s.layers[layer]
            raise
        mm = self.map()
        for g in touched:  # overwrite (summaries of a redone round), then fill the last
            a, b = max(pos, g.start), min(pos + n, g.start + g.cap)
            mm[g.off + a - g.start:g.off + b - g.start] = buf[a - pos:b - pos]
            g.used = max(g.used, b - g.start)
            fill_blocks(mm, g.off, g.cap, a - g.start, g.used)
            self.tbl["seal"][g.idx] = seal_of(mm, g.off, g.cap, g.used)  # after the data
        st.segs.extend(new)
        delta = max(0, pos + n - st_end)
        self.total_bytes += delta
        s.gen += 1
        self._write_header()
        return delta

    def prepend(self, s: WarmSession, layer: int, data_len: int) -> list[tuple[Seg, np.ndarray]]:
        """Allocate segments for [0, data_len) under a layer's current base (promotion
        from cold). Fill the returned views, then ``publish`` (or ``abandon``) them."""
        out: list[tuple[Seg, np.ndarray]] = []
        try:
            for start in range(0, data_len, MAX_EXTENT):  # data_len > 0: empty prefixes skipped
                n = min(MAX_EXTENT, data_len - start)
                size = footprint(K_LAYER, n)
                off = self.alloc_reserved(size, [(0, size)])
                out.append((Seg(-1, start, off, n, n), self.map()[off:off + n]))
        except BaseException:
            self.abandon(out)
            raise
        return out

    def abandon(self, pieces: list[tuple[Seg, np.ndarray]]) -> None:
        """Give back prepared segments that will not be published (a failed cold read)."""
        for g, _ in pieces:
            self.add_free(g.off, footprint(K_LAYER, g.cap))

    def publish(self, s: WarmSession, layer: int, pieces: list[tuple[Seg, np.ndarray]]) -> None:
        mm = self.map()
        for g, _ in pieces:
            fill_blocks(mm, g.off, g.cap, 0, g.used)
            g.idx = self._put_entry(s.uid, K_LAYER, layer, g.start, g.off, g.cap,
                                    seal_of(mm, g.off, g.cap, g.used))
            self._live(g.idx)
            self.total_bytes += g.used
        s.stream(K_LAYER, layer).segs[:0] = [g for g, _ in pieces]
        s.gen += 1
        self._write_header()

    def segments(self, s: WarmSession, st: Stream, start: int, end: int, what: str = ""):
        """Checked (memmap slice) pieces covering [start, end) of the warm part, in order."""
        for g in st.segs:
            a, b = max(start, g.start), min(end, g.start + g.used)
            if a < b:
                self.check(s, g, a - g.start, b - g.start, what)
                yield self.map()[g.off + a - g.start:g.off + b - g.start]

    def read_into(self, s: WarmSession, st: Stream, start: int, end: int, out: np.ndarray,
                  what: str = "") -> None:
        """Copy stream bytes [start, end) (all within the warm part) into ``out``."""
        k = 0
        for piece in self.segments(s, st, start, end, what):
            out[k:k + len(piece)] = piece
            k += len(piece)

    def truncate(self, s: WarmSession, kind: int, layer: int, length: int) -> int:
        """Cut the warm part of a stream to ``length`` (everything when length <= base).
        Returns the bytes released. The cut segment's seal is stored first: a load that
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
            used = length - g.start
            self.check(s, g, used // BLOCK * BLOCK, used, seal=True)  # the new tail is resealed
            g.used = used
            self.tbl["seal"][g.idx] = seal_of(self.map(), g.off, g.cap, used)
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
    def put_meta(self, s: WarmSession, raw: bytes) -> int:
        """Store meta.json bytes in a new extent, then retire the old one (never torn)."""
        old = s.meta
        s.meta_seq += 1
        s.meta = self._new_extent(s.uid, K_META, 0, s.meta_seq, np.frombuffer(raw, np.uint8),
                                  max(len(raw), 1))
        if old is not None:
            self._release([old])
        delta = len(raw) - (old.used if old else 0)
        tokens = tokens_claimed(raw)
        self.total_tokens += tokens - s.tokens
        s.tokens = tokens
        self.total_bytes += delta
        s.gen += 1
        self._write_header()
        return delta

    def meta_bytes(self, s: WarmSession) -> bytes | None:
        if s.meta is None:
            return None
        self.check(s, s.meta, 0, s.meta.used, META)
        return self.map()[s.meta.off:s.meta.off + s.meta.used].tobytes()

"""The engine's read path: ``Store.read`` and the caches behind it (``Store`` holds one
``ReadPath`` and delegates its reads, ``extents``, ``publish`` and cuts to it).

A read looks its extents up under the store's state lock (short: memory, or the session's
tree pages), then reads, checks and decodes the blocks it needs with no lock held, so reads
run beside reads and beside an append's compression and writes. If the tail passed one of
its entries meanwhile, that space may have been written over: the read looks up again
(the tail only grows, and moves before the head may write there). Block tables and the
last, partly read block of each read are kept for the next reads.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_right
from collections import OrderedDict
from typing import TYPE_CHECKING

from .blocks import Table, decode_payload
from .catalog import Catalog
from .catalog import encode as encode_session
from .direct import FileExtents
from .errors import BadRange, Corrupt, KVFSError
from .format import T_DATA, Header
from .published import Published
from .records import FileRec, check_name

if TYPE_CHECKING:
    from collections.abc import Callable

    from .index import Index
    from .records import Session
    from .ring import Ring
    from .types import Observer
    from .volume import VolumeFile

log = logging.getLogger(__name__)

DECODED_CACHE = 32 << 20  # bytes of decoded blocks kept for sequential small reads
TABLE_CACHE = 4096  # block tables kept: a read of a known entry reads just its blocks
READ_AHEAD = 4 << 20  # bytes advised ahead of a sequential reader
READ_GAP = 64 << 10  # a file's next entry this close after the last is "sequential" on disk
PUBLISH_DELAY_S = 0.02  # a changed session's catalog record is rebuilt this long after
PUBLISH_RETRY_S = 0.2  # records behind (or waiting for the ring's buffer) retried this often
READ_RETRIES = 64  # lookups a read may redo because reclaim moved its entries meanwhile
EXTENTS_MAX = 4096  # extents of one file per ``extents`` answer (a range beyond: ask again)


class ReadPath:
    """A store's reads: its lookups come from the store (``session_of``, ``file_of``,
    called under ``lock``, the store's state lock); the caches are this path's own."""

    def __init__(self, lock: threading.RLock, ring: Ring, vol: VolumeFile, idx: Index,
                 counters: dict[str, int], observer: Observer,
                 session_of: Callable[[str], Session],
                 file_of: Callable[[str, str], tuple[Session, FileRec]]) -> None:
        self._lock, self.ring, self.vol, self.idx = lock, ring, vol, idx
        self.counters, self.observer = counters, observer
        self._session, self._file = session_of, file_of
        self._decoded: OrderedDict[tuple[int, int], bytes | memoryview] = OrderedDict()
        self._decoded_bytes = 0
        self._tables: OrderedDict[int, tuple[Header, Table]] = OrderedDict()
        self.published: Published | None = None
        self.catalog: Catalog | None = None
        self.on_cut: Callable[[int], None] | None = None  # told of every cut (must not wait)
        self._pending: dict[str, None] = {}  # sessions whose catalog record is behind
        self._later: dict[str, int] = {}  # ... and the first position not yet on the volume
        self.changed = threading.Event()  # set when ``_pending`` gains a session
        self._keeper: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------ reads by other processes
    def publish(self) -> Published:
        """The blocks readers in other processes map (``published``, ``catalog``): made on
        first call, then kept current by checkpoints (the durable tail), cuts and
        ``publish_changes`` (the catalog's records of changed sessions)."""
        with self._lock:
            if self.published is None:
                r = self.ring
                self.published = Published(r.offset, r.size, r.durable_tail)
                self.catalog = Catalog()
                self.idx.on_change = self._changed
                self._keeper = threading.Thread(target=self._keep_current, name="kvfs-catalog",
                                                daemon=True)
                self._keeper.start()
            return self.published

    def _keep_current(self) -> None:
        """The catalog's thread: each changed session's record rebuilt ``PUBLISH_DELAY_S``
        after the change (a burst of appends costs one rebuild)."""
        behind = 0
        while not self._stopping:
            self.changed.wait(PUBLISH_RETRY_S if behind else 1.0)
            if self._stopping:
                return
            time.sleep(PUBLISH_DELAY_S)
            try:
                behind = self.publish_changes()
            except Exception:  # the catalog is a shortcut: readers ask the mount meanwhile
                log.exception("publishing the catalog failed")
                behind = 1

    def stop_publishing(self) -> None:
        """Stop the catalog's thread (the store is closing; no state lock held)."""
        self._stopping = True
        self.changed.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
            self._keeper = None

    def _changed(self, session: str) -> None:
        """Under the state lock: ``session`` changed; its record is rebuilt soon."""
        self._pending[session] = None
        if not self.changed.is_set():
            self.changed.set()

    def publish_changes(self, limit: int = 256) -> int:
        """Rebuild the catalog records of up to ``limit`` changed sessions, the state lock
        taken once per session (a writer waits for one record at most); returns how many
        are still behind."""
        if self.catalog is None:
            return 0
        with self._lock:
            if self._later and self.catalog.fd >= 0:  # records wait for the write buffer
                self.ring.flush()  # (a read asking the mount would flush it too)
            for name, pos in list(self._later.items()):  # written out since: again
                if self.ring.on_disk(pos):
                    del self._later[name]
                    self._pending[name] = None
        for _ in range(limit):
            with self._lock:
                if not self._pending or self.catalog.fd < 0:  # none, or the store closed
                    self.changed.clear()
                    break
                name = next(iter(self._pending))
                del self._pending[name]
                self._publish_one(name)
        with self._lock:
            return len(self._pending) + len(self._later)

    def _publish_one(self, name: str) -> None:
        """Under the state lock: ``name``'s record as the session is now, holding only
        extents already on the volume (the rest follows once they are written)."""
        assert self.catalog is not None and self.published is not None
        try:
            s = self._session(name)
        except KVFSError:  # deleted, or unreadable: readers ask the mount
            self.catalog.withdraw(name)
            return
        files = []
        for f in s.files.values():
            k = len(f.ext)
            for i, e in enumerate(f.ext):
                if not self.ring.on_disk(e[0]):
                    k = i
                    self._later[name] = min(self._later.get(name, e[0]), e[0])
                    break
            files.append((f.name, f.fno, (f.mode, f.uid, f.gid), f.off[:k], f.ext[:k]))
        self.catalog.put(name, encode_session(name, s.sno, self.published.cuts(s.sno),
                                              (s.mode, s.uid, s.gid), files))

    def withdraw(self, session: str) -> None:
        """Under the state lock: the catalog holds ``session`` no more until it is
        published again (its permissions changed: readers must ask)."""
        if self.catalog is not None:
            self.catalog.withdraw(session)
            self._changed(session)

    def mark_cut(self, sno: int) -> None:
        """Under the state lock: session ``sno`` lost bytes (truncate, delete, drop)."""
        if self.published is not None:
            self.published.cut(sno)
        if self.on_cut is not None:
            self.on_cut(sno)

    def extents(self, session: str, files: list[tuple[str, int, int]]
                ) -> tuple[tuple[int, int, int], list[FileExtents | None]]:
        """Where the bytes of some files of a session lie, for a reader in another process
        (``direct.DirectReader``): the session's (mode, uid, gid), and per (name, offset,
        length) its ``FileExtents``: the whole file's when it has at most ``EXTENTS_MAX``,
        else from ``offset`` (length < 0: to the end; at most ``EXTENTS_MAX``), None for a
        missing file. Every extent is on the volume
        when this returns (the ring's write buffer is written first if it holds one); the
        read counts as a use of the session, as ``read`` does (retention, the hot index)."""
        with self._lock:
            s = self._session(session)
            out: list[FileExtents | None] = []
            flush = False
            for name, offset, length in files:
                f = s.file(name) if type(name) is str else None
                if f is None:
                    check_name(name)
                    out.append(None)
                    continue
                size = f.size
                lo = min(max(offset, 0), size)
                hi = size if length < 0 else min(size, lo + length)
                if len(f.ext) <= EXTENTS_MAX:  # all of it: a reader keeps it for the next reads
                    i, j = 0, len(f.ext)
                else:
                    i = max(f.find(lo), 0)
                    j = min(bisect_right(f.off, hi - 1), i + EXTENTS_MAX) if hi > lo else i
                fe = FileExtents(s.sno, f.fno, size, self.published.cuts(s.sno) if self.published else 0,
                                 lo, lo, f.off[i:j], f.ext[i:j], f.mode, f.uid, f.gid)
                if j > i:
                    fe.lo = f.off[i]
                    fe.hi = f.off[j - 1] + f.ext[j - 1][2]
                    flush = flush or any(not self.ring.on_disk(e[0]) for e in fe.ext)
                f.atime = time.time_ns()
                out.append(fe)
            if flush:
                self.ring.flush()
            if self.catalog is not None and s.name not in self.catalog:
                self._changed(s.name)  # asked for: published for the next readers
            s.atime = time.time_ns()
            self.idx.touched(s)
            return (s.mode, s.uid, s.gid), out

    def read(self, session: str, name: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise BadRange(f"read at {offset} of {length} bytes")
        t0 = time.perf_counter()
        for _ in range(READ_RETRIES):
            with self._lock:
                jobs, sequential = self._plan_read(session, name, offset, length)
            if not jobs:
                return b""
            try:
                out, learned = self._read_jobs(jobs, not sequential)
            except Corrupt:
                if not self._reclaimed(jobs):
                    with self._lock:
                        self.counters["corrupt_reads"] += 1
                    self.observer.cold_error()
                    raise
                learned = None
            if learned is None or self._reclaimed(jobs):  # its space may hold other bytes now
                with self._lock:
                    self.counters["read_retries"] += 1
                continue
            with self._lock:
                self._learn(learned)
                self.counters["reads"] += 1
            self.observer.cold_read((time.perf_counter() - t0) * 1e3)
            return b"".join(out)
        raise Corrupt(f"{session}/{name}: reclaim moved the data {READ_RETRIES} times during one read")

    def _plan_read(self, session: str, name: str, offset: int, length: int) -> tuple[list[list], bool]:
        """Under the state lock: per extent in [offset, offset+length), what to read —
        [pos, esize, a, b, raw_hint, buffered copy, known table, pieces if all cached] —
        and whether the read goes on where the file's last read ended."""
        s, f = self._file(session, name)
        end = min(f.size, offset + length)
        if offset >= end:
            return [], False
        sequential = offset == f.seq_end
        if sequential:  # let the disk work ahead of us
            self._read_ahead(f, end)
        f.seq_end = end
        jobs = []
        i = f.find(offset)
        while i < len(f.ext) and f.off[i] < end:
            pos, skip, n, esize = f.ext[i]
            o = f.off[i]
            a, b = max(offset, o) - o + skip, min(end, o + n) - o + skip
            known = self._tables.get(pos)
            pieces = None
            if known is not None:
                self._tables.move_to_end(pos)
                pieces = self._cached_range(pos, known[1], a, b)
            src = None if pieces is not None else self.ring.locate(pos, esize)
            jobs.append([pos, esize, a, b, skip + n, src, known, pieces])
            i += 1
        s.atime = f.atime = time.time_ns()
        self.idx.touched(s)
        return jobs, sequential

    def _cached_range(self, pos: int, t: Table, a: int, b: int) -> list | None:
        pieces = []
        for i in t.blocks(a, b):
            raw = self._decoded.get((pos, i))
            if raw is None:
                return None
            self._decoded.move_to_end((pos, i))
            r0 = t.raw_off[i]
            pieces.append(raw[max(a, r0) - r0: min(b, t.raw_off[i + 1]) - r0])
        return pieces

    def _read_jobs(self, jobs: list[list], advise: bool = True) -> tuple[list, list]:
        """No lock: read, check and decode what ``_plan_read`` planned.

        A random read that needs more than one volume read with a jump on disk between
        them (a range deep in a large entry: its table, then its blocks) asks for those
        after the jump first, so the disk has them in flight at once. Never for ranges
        that follow each other on disk, nor for a sequential reader: the kernel's
        readahead and ``_read_ahead`` serve those, and an advice call costs about as
        much as the read it announces."""
        if advise and (len(jobs) > 1 or (jobs[0][6] is None and self.ring.second_read(jobs[0][2]))):
            ranges = [r for pos, esize, a, b, hint, src, known, pieces in jobs
                      if pieces is None and src is None
                      for r in self.ring.read_plan(pos, esize, a, b, known, hint)]
            for (p0, n0), (off, n) in zip(ranges, ranges[1:], strict=False):
                if not 0 <= off - (p0 + n0) < READ_GAP:  # a jump: the first is read right away
                    self.vol.willneed(off, n)
        out: list[bytes | memoryview] = []
        learned = []
        for pos, esize, a, b, hint, src, known, pieces in jobs:
            if pieces is None:
                pieces, decoded, known = self.ring.read_data(pos, esize, a, b, src, known, hint)
                learned.append((pos, known, decoded))
            out += pieces
        return out, learned

    def _reclaimed(self, jobs: list[list]) -> bool:
        """Whether the tail passed an entry read from the volume: its space may have been
        written over while it was read (the tail only grows, and moves first)."""
        tail = self.ring.tail
        return any(j[0] < tail and j[5] is None and j[7] is None for j in jobs)

    def _learn(self, learned: list) -> None:
        """Under the state lock: keep tables and decoded blocks for the next reads."""
        for pos, known, decoded in learned:
            self._tables[pos] = known
            while len(self._tables) > TABLE_CACHE:
                self._tables.popitem(last=False)
            for i, raw in decoded.items():
                if (pos, i) not in self._decoded:
                    self._decoded[(pos, i)] = raw
                    self._decoded_bytes += len(raw)
        while self._decoded_bytes > DECODED_CACHE and len(self._decoded) > 1:
            self._decoded_bytes -= len(self._decoded.popitem(last=False)[1])

    def _read_ahead(self, f: FileRec, end: int) -> None:
        """POSIX_FADV_WILLNEED on the entries holding the next READ_AHEAD bytes, where
        they do not follow on disk from the entry before them: the kernel's own readahead
        serves a physically sequential run better than advice does (an advice call costs
        about as much as reading what it advises), so only the jumps are advised, each run
        after a jump in one call (small records between a file's entries are no jump)."""
        if f.advised_to >= end + READ_AHEAD // 2:
            return
        # from the entry read now or last advised: it only says where the disk is
        first = i = max(f.find(max(end, f.advised_to) - 1), 0)
        stop = end + READ_AHEAD
        prev = -1  # physical end of the entry before, when it is on disk
        run: list[int] = []  # [start, end) of the advised run being built
        while i < len(f.ext) and f.off[i] < stop:
            pos, _, n, esize = f.ext[i]
            if self.ring.on_disk(pos):
                phys = self.ring.phys(pos)
                if run and 0 <= phys - run[1] < READ_GAP:
                    run[1] = phys + esize
                elif i != first and not 0 <= phys - prev < READ_GAP:
                    if run:
                        self.vol.willneed(run[0], run[1] - run[0])
                    run = [phys, phys + esize]
                prev = phys + esize
            else:
                prev = -1
            f.advised_to = max(f.advised_to, f.off[i] + n)
            i += 1
        if run:
            self.vol.willneed(run[0], run[1] - run[0])

    def entry_bytes(self, pos: int, esize: int) -> bytes:
        """Every decoded byte of the data entry at ``pos``, each block checked (fsck)."""
        try:
            with self._lock:
                h, payload = self.ring.read_entry(pos, esize)
            if h.type != T_DATA:
                raise Corrupt(f"entry at {pos} is not a data entry")
            return decode_payload(h, payload)
        except Corrupt:
            self.counters["corrupt_reads"] += 1
            self.observer.cold_error()
            raise

    def drop_caches(self) -> None:
        """Forget every decoded block and block table: the next reads go to the volume."""
        with self._lock:
            self._decoded.clear()
            self._decoded_bytes = 0
            self._tables.clear()


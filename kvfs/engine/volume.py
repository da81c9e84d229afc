"""The volume file: geometry, the two superblock slots, raw positioned I/O.

Owns the file descriptor and the advisory lock that keeps a volume opened by one process.
Knows nothing of sessions or entries. All I/O is os.pread/os.pwrite on one fd (the ring
and the B+ tree both go through it, so a test volume sees every write); reads of cold data
are followed by POSIX_FADV_DONTNEED so the page cache does not fill with KV the agent will
not read again soon (or push out what the machine does re-read, such as model weights).
The read path only notes the ranges it read; a thread of the volume gives the advice for a
batch of them at a time, ranges that touch merged into one call (a call costs about a
fifth of a 96 KiB read). Only what was read is advised, never the pages the kernel read
ahead of a sequential reader.

Writes start their own write-out: once ``writeback`` bytes have been written in one run,
the same thread asks the kernel to begin writing them to the disk (``sync_file_range``
with SYNC_FILE_RANGE_WRITE, RocksDB's ``bytes_per_sync``), so the disk works while the
engine encodes the next entries and an fsync waits only for the last run. It promises
nothing: durability is still the fsync's alone.

A new volume file can be *filled*: zeros written over all of it once at creation. A
file's ``posix_fallocate``d space is unwritten (on ext4 and XFS): the first write to each
part of it makes the filesystem record the part as written, so until the ring's first lap
ends every fsync also commits that to the filesystem's journal. Filled, an fsync flushes
only the data, as PostgreSQL's zero-filled WAL segments do.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import queue
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from .btree_page import TreeRoot
from .errors import BadSuperblock, FormatError, VolumeBusy
from .format import MIN_VOLUME, PAGE, RING_ALIGN, SB_CLEAN, SB_SLOT, VOLUME_MAGIC, Superblock

Buffer = bytes | bytearray | memoryview  # what the volume writes
log = logging.getLogger(__name__)

DROP_BATCH = 64  # ranges read before their advice is given ...
DROP_BYTES = 32 << 20  # ... or bytes
SYNC_FILE_RANGE_WRITE = 2  # start write-out of the range's dirty pages, wait for nothing
SYNC_FILE_RANGE_WAIT = 1 | 2 | 4  # write the range out and wait until it is on the disk
FILL_CHUNK = 8 << 20  # zeros written per call when a volume is filled
FILL_REPORT_S = 5.0  # how often a long fill logs its progress


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (os has none); None where there is none (not Linux)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    out: Callable[[int, int, int, int], int] = fn
    return out


_SYNC_FILE_RANGE = _sync_file_range()


def fill_zeros(fd: int, size: int, path: str = "",
               progress: Callable[[int, int], None] | None = None) -> None:
    """Write zeros over ``[0, size)`` of ``fd`` and fsync. Each chunk's write-out starts as
    it is written; once the one before is on the disk its pages leave the page cache, so a
    fill of any size holds about two chunks of it. ``progress(done, size)`` after each
    chunk (a bar for the operator: a large fill takes minutes)."""
    zeros = memoryview(bytes(FILL_CHUNK))
    t0 = last = time.monotonic()
    prev: tuple[int, int] | None = None
    for off in range(0, size, FILL_CHUNK):
        n = min(FILL_CHUNK, size - off)
        pwrite_all(fd, zeros[:n], off)
        if _SYNC_FILE_RANGE is not None:
            _SYNC_FILE_RANGE(fd, off, n, SYNC_FILE_RANGE_WRITE)
            if prev is not None and not _SYNC_FILE_RANGE(fd, *prev, SYNC_FILE_RANGE_WAIT):
                _drop(fd, *prev)
        prev = (off, n)
        if progress is not None:
            progress(off + n, size)
        if time.monotonic() - last >= FILL_REPORT_S:
            last = time.monotonic()
            log.info("%s: filled %d of %d MiB with zeros (%.0f MiB/s)", path, (off + n) >> 20,
                     size >> 20, (off + n) / (last - t0) / (1 << 20))
    os.fsync(fd)
    _drop(fd, 0, size)
    log.info("%s: %d MiB filled with zeros in %.1f s", path, size >> 20, time.monotonic() - t0)


def _drop(fd: int, off: int, n: int) -> None:
    try:
        os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
    except OSError as e:  # advice only: the fill is done either way
        log.debug("DONTNEED [%d, +%d): %r", off, n, e)


def pwrite_all(fd: int, data: Buffer, off: int) -> None:
    """os.pwrite until every byte is written (a short write is legal)."""
    mv = memoryview(data).cast("B")
    while mv:
        n = os.pwrite(fd, mv, off)
        mv, off = mv[n:], off + n


def geometry(size: int, tree_fraction: float = 1 / 32) -> tuple[int, int, int, int]:
    """(tree_offset, tree_pages, ring_offset, ring_size) for a volume of ``size`` bytes."""
    if size < MIN_VOLUME:
        raise FormatError(f"volume of {size} bytes is too small: at least {MIN_VOLUME} needed")
    tree_offset = 2 * SB_SLOT
    tree_pages = max(256, int(size * tree_fraction) // PAGE)
    tree_pages -= tree_pages % 2  # two equal halves
    ring_offset = -(-(tree_offset + tree_pages * PAGE) // RING_ALIGN) * RING_ALIGN
    ring_size = (size - ring_offset) // RING_ALIGN * RING_ALIGN
    if ring_size < MIN_VOLUME // 2:
        raise FormatError(f"volume of {size} bytes leaves no room for the ring")
    return tree_offset, tree_pages, ring_offset, ring_size


class VolumeFile:
    """An open volume: fd, lock, superblock slots, positioned I/O."""

    def __init__(self, path: str, fd: int, size: int, readonly: bool) -> None:
        self.path, self.fd, self.size, self.readonly = path, fd, size, readonly
        self.fadvise = True
        self.writeback = 4 << 20  # bytes written in one run before their write-out starts
        self._run = (0, 0)  # [start, end) written since the last write-out started
        # writes completed, and how many of them the last finished fsync covers: a sync
        # with nothing new to cover skips the fsync (``sync_written``)
        self._writes = 0
        self._synced = 0
        self._written_bytes = 0  # bytes written, and how many of them the last fsync covers
        self._synced_bytes = 0
        self._count_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._touched: list[tuple[int, int]] = []  # ranges read since the last batch
        self._touched_bytes = 0
        # the advice thread's work: ("dontneed", ranges) or ("write", ranges)
        self._advice: queue.SimpleQueue[tuple[str, list[tuple[int, int]]] | None] | None = None
        self._adviser: threading.Thread | None = None

    # ----------------------------------------------------------- open / create
    @classmethod
    def create(cls, path: str, size: int, fill: bool = False,
               progress: Callable[[int, int], None] | None = None) -> VolumeFile:
        """Create (file) or take over (block device) a volume; the caller formats it.
        ``fill`` writes zeros over a new file whose space ``posix_fallocate`` reserved (not
        a block device, not a filesystem without fallocate: neither has unwritten space)."""
        is_blk = os.path.exists(path) and stat.S_ISBLK(os.stat(path).st_mode)
        if is_blk:
            fd = os.open(path, os.O_RDWR)
            dev_size = os.lseek(fd, 0, os.SEEK_END)
            size = min(size, dev_size) if size else dev_size
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        vol = cls(path, fd, size, False)
        try:
            vol.lock()
            if not is_blk:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:  # tmpfs/overlay without fallocate: sparse is still correct
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    os.ftruncate(fd, size)
                else:
                    if fill:
                        fill_zeros(fd, size, path, progress)
        except BaseException:
            os.close(fd)
            if not is_blk:
                os.unlink(path)
            raise
        return vol

    @classmethod
    def format(cls, path: str, size: int, fill: bool = False,
               progress: Callable[[int, int], None] | None = None) -> None:
        """Create a volume (``create``) and write the superblocks of an empty one, both
        slots; too small a ``size`` is refused (FormatError) before anything is created."""
        tree_off, tree_pages, ring_off, ring_size = geometry(size)
        vol = cls.create(path, size, fill, progress)
        try:
            now = time.time_ns()
            sb = Superblock(1, SB_CLEAN, vol.size, ring_off, ring_size, tree_off, tree_pages, 0, 0,
                            0, 1, now, now, TreeRoot.empty().pack(), uuid.uuid4().bytes)
            vol.write_superblock(sb)
            vol.write_superblock(Superblock(**{**sb.__dict__, "seq": 2}))
        finally:
            vol.close()

    @classmethod
    def open(cls, path: str, readonly: bool = False) -> VolumeFile:
        try:
            fd = os.open(path, os.O_RDONLY if readonly else os.O_RDWR)
        except FileNotFoundError:
            raise FormatError(f"{path}: no such volume") from None
        size = os.lseek(fd, 0, os.SEEK_END)
        vol = cls(path, fd, size, readonly)
        try:
            if not readonly:
                vol.lock()
            head = os.pread(fd, 8, 0)
            if head != VOLUME_MAGIC and os.pread(fd, 8, SB_SLOT) != VOLUME_MAGIC:
                raise FormatError(f"{path}: not a kvfs volume (no kvfs superblock magic)")
        except BaseException:
            os.close(fd)
            raise
        return vol

    def lock(self, shared: bool = False) -> None:
        """The writer's exclusive lock; ``shared`` for a reader that must not run beside a
        writer (fsck). VolumeBusy when a mount holds the volume."""
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise VolumeBusy(f"{self.path}: volume is in use (mounted or opened by another process)") from None

    def close(self) -> None:
        if self._adviser is not None and self._advice is not None:
            with self._count_lock:
                batch, self._touched, self._touched_bytes = self._touched, [], 0
            self._advice.put(("dontneed", batch))
            self._advice.put(None)  # the advice queued so far is given first
            self._adviser.join()
            self._adviser = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ------------------------------------------------------------- superblock
    def read_slots(self) -> list[Superblock | BadSuperblock]:
        """Both slots, in slot order: the superblock, or why it does not decode."""
        out: list[Superblock | BadSuperblock] = []
        for slot in (0, 1):
            try:
                sb = Superblock.unpack(os.pread(self.fd, SB_SLOT, slot * SB_SLOT))
                sb.check_layout(self.size)
                out.append(sb)
            except BadSuperblock as e:
                out.append(e)
        return out

    def newest_superblock(self) -> Superblock:
        """The valid superblock with the higher seq; FormatError says why there is none."""
        slots = self.read_slots()
        good = [s for s in slots if isinstance(s, Superblock)]
        if good:
            for i, e in enumerate(slots):  # the other slot is used: say why (no volume
                if isinstance(e, BadSuperblock):  # at all says it in its one line)
                    log.warning("%s: superblock slot %d: %s", self.path, i, e)
            return max(good, key=lambda s: s.seq)
        bad = [e for e in slots if isinstance(e, BadSuperblock)]
        version = [e for e in bad if e.kind == "version"]
        if version:
            raise FormatError(f"{self.path}: {version[0]}")
        if all(e.kind == "magic" for e in bad):
            raise FormatError(f"{self.path}: not a kvfs volume (no kvfs superblock)")
        if all(e.kind == "layout" for e in bad):
            raise FormatError(f"{self.path}: no superblock describes a volume that fits this "
                              f"{self.size}-byte file ({bad[0]}); not repairable by kvfs-fsck")
        why = "; ".join(f"slot {i}: {e}" for i, e in enumerate(bad))
        raise FormatError(f"{self.path}: both superblocks are corrupt ({why}); "
                          f"run kvfs-fsck {self.path}")

    def write_superblock(self, sb: Superblock) -> None:
        """Write ``sb`` to the slot its sequence number selects, then fsync.

        Alternating slots means a torn superblock write leaves the previous one intact.
        """
        self.pwrite(sb.pack(), (sb.seq % 2) * SB_SLOT)
        self.sync()

    # -------------------------------------------------------------------- I/O
    def pread(self, n: int, off: int) -> bytes:
        out = os.pread(self.fd, n, off)
        if len(out) != n:
            raise OSError(errno.EIO, f"short read at {off}: {len(out)} of {n}")
        return out

    def _wrote(self, n: int) -> None:
        # counted once the write returned (or failed part way): an fsync that began before
        # it must not be taken as covering it
        with self._count_lock:
            self._writes += 1
            self._written_bytes += n

    @property
    def dirty(self) -> bool:
        """Written since the last fsync began."""
        return self._writes != self._synced

    @property
    def unsynced(self) -> int:
        """Bytes written since the last fsync began: about what the next one waits for."""
        return self._written_bytes - self._synced_bytes

    def pwrite(self, data: Buffer, off: int) -> None:
        try:
            pwrite_all(self.fd, data, off)
        finally:
            self._wrote(len(data))
        self._written(off, len(data))

    def pwritev(self, bufs: Sequence[Buffer], off: int) -> None:
        total = sum(len(b) for b in bufs)
        try:
            n = os.pwritev(self.fd, bufs, off)
            if n != total:  # a short gathered write: finish the rest plainly
                pwrite_all(self.fd, b"".join(bytes(b) for b in bufs)[n:], off + n)
        finally:
            self._wrote(total)
        self._written(off, total)

    def _written(self, off: int, n: int) -> None:
        """Count ``[off, off + n)`` into the current run of writes; start the run's
        write-out once it holds ``writeback`` bytes. A write elsewhere (a tree page, a
        superblock) starts a new run: what the old one held the next fsync writes. A write
        that starts inside the run's last page (the ring's writes overlap by that page's
        zeros) continues it."""
        if not self.writeback or _SYNC_FILE_RANGE is None:
            return
        with self._count_lock:
            a, b = self._run
            if b - PAGE <= off <= b:
                b = max(b, off + n)
            else:
                a, b = off, off + n
            if b - a < self.writeback:
                self._run = (a, b)
                return
            self._run = (b, b)
        self._give("write", [(a, b - a)])

    def dontneed(self, off: int, n: int) -> None:
        """Note that ``[off, off + n)`` was read: it is advised DONTNEED with the next batch
        (``DROP_BATCH`` ranges or ``DROP_BYTES``), on the dropper thread."""
        if not self.fadvise or n <= 0:
            return
        with self._count_lock:
            self._touched.append((off, n))
            self._touched_bytes += n
            if len(self._touched) < DROP_BATCH and self._touched_bytes < DROP_BYTES:
                return
            batch, self._touched, self._touched_bytes = self._touched, [], 0
        self._give("dontneed", batch)

    def _give(self, kind: str, ranges: list[tuple[int, int]]) -> None:
        """Queue advice for the advice thread (started on first use)."""
        with self._count_lock:
            if self._adviser is None:
                self._advice = queue.SimpleQueue()
                self._adviser = threading.Thread(target=self._advice_loop, args=(self._advice,),
                                                 name="kvfs-advice", daemon=True)
                self._adviser.start()
        assert self._advice is not None
        self._advice.put((kind, ranges))

    def _advice_loop(self, q: queue.SimpleQueue[tuple[str, list[tuple[int, int]]] | None]) -> None:
        fd = self.fd
        while (item := q.get()) is not None:
            kind, batch = item
            runs: list[list[int]] = []
            for off, n in sorted(batch):  # one call per run of touching ranges
                if runs and off <= runs[-1][1]:
                    runs[-1][1] = max(runs[-1][1], off + n)
                else:
                    runs.append([off, off + n])
            for a, b in runs:
                if kind == "write":
                    # Without a WAIT flag it neither waits nor consumes a write-back error:
                    # the next fsync still reports it.
                    if _SYNC_FILE_RANGE is not None and _SYNC_FILE_RANGE(fd, a, b - a, SYNC_FILE_RANGE_WRITE):
                        log.debug("%s: sync_file_range [%d, %d): errno %d", self.path, a, b, ctypes.get_errno())
                    continue
                try:
                    os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
                except OSError as e:  # advice only
                    log.debug("%s: DONTNEED [%d, %d): %r", self.path, a, b, e)

    def willneed(self, off: int, n: int) -> None:
        try:
            os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_WILLNEED)
        except OSError as e:  # advice only: a read never fails for it
            log.debug("%s: WILLNEED [%d, +%d): %r", self.path, off, n, e)

    def sync(self) -> None:
        """fsync: every write completed before this call is durable when it returns."""
        with self._count_lock:
            upto, upto_bytes = self._writes, self._written_bytes
        os.fsync(self.fd)
        with self._count_lock:
            self._synced = max(self._synced, upto)
            self._synced_bytes = max(self._synced_bytes, upto_bytes)

    def sync_written(self) -> bool:
        """``sync`` unless every completed write is durable already; returns whether it
        synced. Concurrent callers take turns: one that arrives while an fsync runs waits
        for it, then syncs only if a write completed after that fsync began (a write that
        lands during an fsync is not covered by it)."""
        with self._sync_lock:
            if not self.dirty:
                return False
            self.sync()
            return True


def now_ns() -> int:
    return time.time_ns()

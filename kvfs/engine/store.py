"""The storage engine's public face: ``Store``.

Owns one volume: sessions (directories) holding append-only files (``layer_<n>``,
``meta.json``...). Every change is a ring entry first; the in-memory index follows; the B+
tree checkpoint is a shortcut for recovery, never the only truth. Never imports pyfuse3 or
torch.

Threads: every method is safe to call from any thread, concurrently. Changes (create_*,
delete_*, set_*_attrs, append, truncate, flush, sync, checkpoint, maybe_checkpoint, cleanup,
close) run one at a time under a writer lock, in the order they get it. ``read`` runs in
parallel with other reads and with a change's slow parts: it looks its extents up under the
state lock (memory, or the session's tree pages), then reads, checks and decodes with no
lock; a read whose entry was reclaimed meanwhile looks up again. An append holds the state
lock only to reserve ring space and to publish each written entry (a concurrent read sees
a prefix of it, never unwritten bytes); sync holds it only to flush, not to fsync. Lookups
(list_*, *_stat, usage, stats, drop_caches) hold the state lock briefly.

Contract (the FUSE layer, tools and tests rely on it):
  Store.create(path, size, config=None, *, volume=VolumeFile, observer=None, fill=False) -> Store
                                           # FormatError if too small / exists as other
  Store.open(path, config=None, clock=time.time, readonly=False, *, volume=VolumeFile,
             observer=None, force=False) -> Store   # FormatError / VolumeBusy / NeedsFsck
  close()                                  # flush, checkpoint, clean flag, release lock
  mark_needs_fsck(reason)                  # an error was seen: mounts refuse until fsck
  list_sessions() -> list[str]             # sorted names
  create_session(name, mode=0o700, uid=0, gid=0)      # Exists / BadName / NameTooLong
  delete_session(name)                     # whole session, durable after sync()
  session_stat(name) -> SessionStat        # NotFound
  set_session_attrs(name, mode=None, uid=None, gid=None, atime=None, mtime=None)
  list_files(session) -> list[str]
  create_file(session, name, mode=0o600, uid=0, gid=0)  # Exists / BadName / NotFound
  delete_file(session, name)
  file_stat(session, name) -> FileStat
  set_file_attrs(session, name, mode=None, uid=None, gid=None, atime=None, mtime=None)
  append(session, name, offset, data)      # offset must equal size else NotAppend
  read(session, name, offset, length) -> bytes   # short at EOF; Corrupt on checksum failure
  extents(session, [(name, offset, length)]) -> ((mode, uid, gid), [FileExtents | None])
                                           # for readers in other processes (direct.py)
  publish() -> Published                   # the block those readers map (published.py)
  truncate(session, name, length)          # shorter or equal only, else BadRange
  flush()                                  # write buffered entries to the volume (no fsync)
  sync()                                   # flush + fsync: durability point
  durable() -> bool                        # sync() would do nothing (no lock needed)
  unsynced() -> int                        # about the bytes sync() would wait for (no lock)
  try_writer() -> bool, release_writer()   # the writer lock, only if no change holds it
  checkpoint()                             # write the B+ tree checkpoint + superblock
  maybe_checkpoint()                       # checkpoint if interval elapsed or replay is long
  cleanup() -> int                         # drop sessions idle > retention; returns count
  usage() -> Usage
  stats() -> dict                          # JSON-able counters for /.kvfs/stats
  drop_caches()                            # forget decoded entries (cold-read benchmarks)
Times in the API are float seconds; on disk they are integer nanoseconds. ``volume`` is the
volume class (``faults.FaultyVolume`` in tests); ``observer`` gets latencies and errors.

Parts: the read path (``reads.ReadPath``) and the append path (``appends.AppendPath``) are
objects the store holds and delegates to; the checkpoint, recovery, reclaim, the fail-safe
guard and reporting are functions over the store's ``state.StoreState``. None imports this
module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .appends import AppendPath
from .btree import BTree, TreeRoot
from .catalog import Catalog
from .checkpoint import checkpoint_due, write_checkpoint
from .codec import Codec
from .direct import FileExtents
from .errors import (
    BadRange,
    Exists,
    FormatError,
    NeedsFsck,
    NoSpace,
    NotFound,
)
from .failsafe import guarded
from .format import (
    MAX_ENTRY_RAW,
    NO_CKPT,
    SB_NEEDS_FSCK,
    T_DELF,
    T_DELS,
    T_FMETA,
    T_SMETA,
    T_TRUNC,
    Superblock,
    entry_size,
)
from .fsck_mark import FsckMark
from .index import Index
from .published import Published
from .quota import (
    Ledger,
    Limits,
    file_base,
    file_use,
    session_base,
    session_use,
)
from .reads import ReadPath
from .reclaim import reclaim
from .records import (
    MAX_FNO,
    MAX_RECORD,
    FileRec,
    Session,
    check_attrs,
    check_name,
    fmeta_payload,
    name_hash,
    smeta_payload,
)
from .recovery import recover
from .reporting import stats_of, usage_of
from .ring import Ring, ScanReport
from .types import FileStat, FullRing, NullObserver, Observer, SessionStat, StoreConfig, Usage
from .volume import VolumeFile

log = logging.getLogger(__name__)



class Store:
    """An open volume (module doc); its parts get its state as a ``StoreState``."""

    def __init__(self, vol: VolumeFile, sb: Superblock, config: StoreConfig,
                 clock: Callable[[], float], observer: Observer | None = None) -> None:
        self.vol, self.sb, self.cfg, self.clock = vol, sb, config, clock
        self.observer = observer or NullObserver()
        vol.fadvise, vol.writeback = config.fadvise, config.writeback
        self.ring = Ring(vol, sb.ring_offset, sb.ring_size, sb.head, sb.tail, config.write_buffer)
        tree = BTree(vol, sb.tree_offset, sb.tree_pages, TreeRoot.unpack(sb.tree_root))
        self.idx = Index(tree, config.hot_sessions)
        self.quota = Ledger(Limits.resolve(config.quota_sessions, config.quota_bytes,
                                           config.quota_index_share, config.shared,
                                           config.index_fill, sb.tree_pages // 2, sb.ring_size))
        self.full_at: int | None = None  # index estimate when the tree last could not take it
        self.ring_full: FullRing | None = None  # a reclaim that found nothing to free (reclaim.py)
        self.codec = Codec(config.compression, config.zstd_level, config.min_ratio, config.plane_split)
        self.append_codec = Codec("none") if config.compress_on_copy else self.codec
        self.next_sno = sb.next_sno
        self.writer_lock = threading.RLock()  # one change at a time, for its whole length
        self.state_lock = threading.RLock()  # what readers look at: index, ring state, caches
        self.last_ckpt = time.monotonic()
        self.last_cleanup = 0.0
        self.readonly = vol.readonly
        # Entries are bounded so that the reserve kept for copying forward stays a small
        # part of the ring: the tail can always copy its oldest live entry and move on.
        self.max_entry_raw = min(MAX_ENTRY_RAW, max(64 << 10, sb.ring_size // 32))
        self.reserve = 2 * entry_size(self.max_entry_raw + (self.max_entry_raw >> 6) + 64) + (64 << 10)
        self.open_report: ScanReport | None = None
        self.full_scan_why = ""  # why the last recovery scanned the whole ring ("": it did not)
        self.fsck_mark = FsckMark(sb.flags)
        self.counters = dict(appends=0, reads=0, raw_written=0, stored_written=0, copied_forward=0,
                             reclaims=0, checkpoints=0, corrupt_reads=0, dropped_sessions=0,
                             evicted_sessions=0, full_scans=0, read_retries=0, cuts=0,
                             full_refusals=0)
        self.appends = AppendPath(self.state_lock, self.ring, self.append_codec, self.max_entry_raw,
                                  self.counters, self.quota, self.idx, self.observer,
                                  self._admit, self._ensure_room)
        self.reads = ReadPath(self.state_lock, self.ring, vol, self.idx, self.counters,
                              self.observer, self._session, self._file)

    # ================================================================ lifecycle
    @classmethod
    def create(cls, path: str, size: int, config: StoreConfig | None = None,
               clock: Callable[[], float] = time.time, *, volume: type[VolumeFile] = VolumeFile,
               observer: Observer | None = None, fill: bool = False,
               progress: Callable[[int, int], None] | None = None) -> Store:
        """Format a new volume at ``path`` (a new file, or a block device) and open it;
        ``fill``: write zeros over a new file first (``VolumeFile.create``), calling
        ``progress(done, total)`` as it goes."""
        volume.format(path, size, fill, progress)
        return cls.open(path, config, clock, volume=volume, observer=observer)

    @classmethod
    def open(cls, path: str, config: StoreConfig | None = None,
             clock: Callable[[], float] = time.time, readonly: bool = False, *,
             volume: type[VolumeFile] = VolumeFile, observer: Observer | None = None,
             force: bool = False) -> Store:
        """Open: newest valid superblock -> B+ tree checkpoint -> replay the ring after it.

        A volume marked as needing fsck is refused (NeedsFsck, before anything is written)
        unless ``force`` or ``readonly``; a forced open keeps the mark."""
        vol = volume.open(path, readonly)
        try:
            sb = vol.newest_superblock()
            if sb.volume_size > vol.size:
                raise FormatError(f"{path}: volume is {vol.size} bytes, superblock says {sb.volume_size}")
            if sb.flags & SB_NEEDS_FSCK and not (force or readonly):
                raise NeedsFsck(f"{path}: an error was seen while it was in use; "
                                f"run kvfs-fsck {path}")
            store = cls(vol, sb, config or StoreConfig(), clock, observer)
            recover(store)
        except BaseException:
            vol.close()
            raise
        return store

    def close(self) -> None:
        self.reads.stop_publishing()  # before the locks: its thread may be waiting for them
        with self.writer_lock, self.state_lock:
            if self.vol.fd < 0:
                return
            try:
                if not self.readonly:
                    self.checkpoint(clean=True)
            finally:
                self.vol.close()
                if self.published is not None:  # readers keep their own mapping of it
                    self.published.close()
                if self.catalog is not None:
                    self.catalog.close()

    def crash(self) -> None:
        """Drop the fd as a killed process would: unflushed entries are lost. For tests."""
        self.reads.stop_publishing()
        self.vol.close()

    # ================================================================ lookups
    @property
    def tree(self) -> BTree:
        return self.idx.tree

    def _session(self, name: str) -> Session:
        # A name the index holds is valid by construction: check only the others.
        s = self.idx.find(name) if type(name) is str and name in self.idx.names else None
        if s is None:
            check_name(name)
            s = self.idx.find(name)
            if s is None:
                raise NotFound(f"no session {name!r}")
        return s

    def _file(self, session: str, name: str) -> tuple[Session, FileRec]:
        s = self._session(session)
        f = s.file(name) if type(name) is str else None
        if f is None:
            check_name(name)
            raise NotFound(f"no file {name!r} in session {session!r}")
        return s, f

    # ================================================================ reads (reads.ReadPath)
    def read(self, session: str, name: str, offset: int, length: int) -> bytes:
        return self.reads.read(session, name, offset, length)

    def extents(self, session: str, files: list[tuple[str, int, int]]
                ) -> tuple[tuple[int, int, int], list[FileExtents | None]]:
        return self.reads.extents(session, files)

    def publish(self) -> Published:
        return self.reads.publish()

    @property
    def published(self) -> Published | None:
        return self.reads.published

    @property
    def catalog(self) -> Catalog | None:
        return self.reads.catalog

    def mark_cut(self, sno: int) -> None:
        self.counters["cuts"] += 1  # ring space may be free again (types.FullRing)
        self.reads.mark_cut(sno)

    def drop_caches(self) -> None:
        self.reads.drop_caches()

    # ================================================================ reporting
    def usage(self) -> Usage:
        with self.state_lock:
            return usage_of(self)

    def stats(self) -> dict:
        with self.state_lock:
            return stats_of(self)

    @property
    def volume_id(self) -> str:
        """The volume's uuid (hex): stable for its life, distinct between volumes."""
        return self.sb.uuid.hex()

    # ================================================================ writing entries
    def _emit(self, type_: int, s: Session, fno: int = 0, file_off: int = 0, payload: bytes = b"",
              flags: int = 0, raw_len: int = 0) -> tuple[int, int]:
        self._ensure_room(self.ring.cost(len(payload)), s)
        return self.ring.append(type_, flags, s.name_hash, s.sno, fno, file_off, raw_len, payload)

    def _ensure_room(self, need: int, keep: Session | None = None) -> None:
        if self.readonly:
            raise NoSpace("volume is open read-only")
        if self.ring.room() >= need + self.reserve:
            return
        reclaim(self, need + self.reserve, keep)  # never evicts ``keep``: it is being written

    def emit_smeta(self, s: Session) -> None:
        s.meta_pos, _ = self._emit(T_SMETA, s, payload=smeta_payload(s))
        self.idx.dirty(s)

    def emit_fmeta(self, s: Session, f: FileRec) -> None:
        f.meta_pos, _ = self._emit(T_FMETA, s, f.fno, payload=fmeta_payload(f))
        self.idx.dirty(s)

    # ================================================================ sessions
    def list_sessions(self) -> list[str]:
        return self.idx.list_names()

    def create_session(self, name: str, mode: int = 0o700, uid: int = 0, gid: int = 0) -> None:
        check_name(name)
        check_attrs(mode, uid, gid, None, None, None, None)
        if self.idx.find(name) is not None:
            raise Exists(f"session {name!r} exists")
        self._admit(uid, sessions=1, index=session_base(name))
        now = time.time_ns()
        s = Session(self.next_sno, name, name_hash(name), mode & 0o7777, uid, gid, now, now, now, -1)
        self.emit_smeta(s)
        self.next_sno += 1
        self.idx.set_live(s.sno, True)
        self.quota.add(uid, session_use(s))

    def delete_session(self, name: str) -> None:
        self._drop_session(self._session(name))

    def _drop_session(self, s: Session) -> None:
        self._emit(T_DELS, s)
        self.idx.drop(s)
        self.mark_cut(s.sno)
        self.quota.sub(s.uid, session_use(s))

    max_record = MAX_RECORD  # bytes of one session's checkpoint record (tests lower it)

    def _admit(self, uid: int, session: Session | None = None, **more: int) -> None:
        """Quotas and the index budget before a change grows the index, the bitmap chunks
        the tree holds counted too (``quota.Ledger.admit_change``)."""
        self.quota.bitmap_chunks = len(self.idx.chunks)
        self.quota.admit_change(uid, session, self.max_record, **more)

    def quota_room(self, session: str) -> int | None:
        """Data bytes the owner of ``session`` may still add (None: no byte quota)."""
        return self.quota.room(self._session(session).uid)

    def session_stat(self, name: str) -> SessionStat:
        return self._session(name).stat()

    def set_session_attrs(self, name: str, mode: int | None = None, uid: int | None = None,
                          gid: int | None = None, atime: float | None = None,
                          mtime: float | None = None, *, atime_ns: int | None = None,
                          mtime_ns: int | None = None) -> None:
        """Change what is not None; times in float seconds or exact ``*_ns``."""
        s = self._session(name)
        mode, uid, gid, a, m = check_attrs(mode, uid, gid, atime, mtime, atime_ns, mtime_ns)
        s.atime = s.atime if a is None else a  # 0 is a time, not "unset"
        s.mtime = s.mtime if m is None else m
        if (mode, uid, gid) != (None, None, None):
            s.mode = s.mode if mode is None else mode & 0o7777
            old = s.uid
            s.uid, s.gid = s.uid if uid is None else uid, s.gid if gid is None else gid
            self.emit_smeta(s)
            self.quota.move(old, s.uid, session_use(s))
            self.reads.withdraw(name)  # readers elsewhere ask until it is published again
        self.idx.dirty(s)

    # ================================================================ files
    def list_files(self, session: str) -> list[str]:
        return sorted(self._session(session).by_name)

    def create_file(self, session: str, name: str, mode: int = 0o600, uid: int = 0, gid: int = 0) -> None:
        s = self._session(session)
        check_name(name)
        if s.file(name) is not None:
            raise Exists(f"file {name!r} exists in session {session!r}")
        check_attrs(mode, uid, gid, None, None, None, None)
        self._admit(s.uid, s, files=1, index=file_base(name))
        if s.next_fno >= MAX_FNO:  # numbers are never reused: 2^32 - 1 files made in it
            raise NoSpace(f"session {session!r} has used every file number")
        now = time.time_ns()
        f = FileRec(s.next_fno, name, mode & 0o7777, uid, gid, now, now, now, -1)
        s.add_file(f)
        s.mtime = now
        self.emit_fmeta(s, f)
        self.quota.add(s.uid, file_use(f))

    def delete_file(self, session: str, name: str) -> None:
        s, f = self._file(session, name)
        self._emit(T_DELF, s, f.fno)
        self.quota.sub(s.uid, file_use(f))
        s.drop_file(f.fno)
        self.mark_cut(s.sno)
        s.mtime = time.time_ns()
        self.idx.dirty(s)

    def file_stat(self, session: str, name: str) -> FileStat:
        return self._file(session, name)[1].stat()

    def set_file_attrs(self, session: str, name: str, mode: int | None = None, uid: int | None = None,
                       gid: int | None = None, atime: float | None = None,
                       mtime: float | None = None, *, atime_ns: int | None = None,
                       mtime_ns: int | None = None) -> None:
        """Change what is not None; times in float seconds or exact ``*_ns``."""
        s, f = self._file(session, name)
        mode, uid, gid, a, m = check_attrs(mode, uid, gid, atime, mtime, atime_ns, mtime_ns)
        f.atime = f.atime if a is None else a  # 0 is a time, not "unset"
        f.mtime = f.mtime if m is None else m
        if (mode, uid, gid) != (None, None, None):
            f.mode = f.mode if mode is None else mode & 0o7777
            f.uid, f.gid = f.uid if uid is None else uid, f.gid if gid is None else gid
            self.emit_fmeta(s, f)
            self.reads.withdraw(session)
        self.idx.dirty(s)

    # ================================================================ data
    def append(self, session: str, name: str, offset: int, data: bytes | memoryview) -> None:
        with self.state_lock:
            s, f = self._file(session, name)
        self.appends.append(s, f, offset, data)

    def truncate(self, session: str, name: str, length: int) -> None:
        s, f = self._file(session, name)
        if length < 0 or length > f.size:
            raise BadRange(f"{session}/{name}: truncate to {length}, size is {f.size} (only shorter)")
        if length == f.size:
            return
        self._emit(T_TRUNC, s, f.fno, length)
        before = file_use(f)
        f.truncate(length)
        self.mark_cut(s.sno)
        self.quota.sub(s.uid, before)
        self.quota.add(s.uid, file_use(f))
        f.mtime = s.mtime = time.time_ns()
        self.idx.dirty(s)

    # ================================================================ durability
    def flush(self) -> None:
        self.ring.flush()

    def sync(self) -> bool:
        """Flush, then fsync (readers keep running); nothing to do when nothing was
        written since the last sync, so syncing N files after one batch is one flush.
        Returns whether the device was flushed."""
        with self.state_lock:
            self.ring.flush()
        return self.vol.sync_written()

    def durable(self) -> bool:
        """Whether ``sync()`` would do nothing; no lock needed: the ring's buffer empties only
        once its write completed and was counted, and a covered write stays covered."""
        return not self.ring.unwritten and not self.vol.dirty

    def unsynced(self) -> int:
        """About how many bytes ``sync()`` would write and wait for: the ring's write
        buffer and the volume's writes since its last fsync (no lock, like ``durable``)."""
        return self.ring.unwritten + self.vol.unsynced

    def try_writer(self) -> bool:
        """Take the writer lock if no change holds it now (``release_writer`` gives it back):
        a caller that must not wait behind a long change runs its own under it, or hands
        them to a thread that may wait."""
        return self.writer_lock.acquire(blocking=False)

    def release_writer(self) -> None:
        self.writer_lock.release()

    def checkpoint(self, clean: bool = False) -> None:
        """Persist the index (dirty sessions, purges, bitmap, usage) and a superblock
        pointing at it; an index too large for the tree region stays in the ring
        (``checkpoint.write_checkpoint``)."""
        if not self.readonly:
            write_checkpoint(self, clean)

    @property
    def ring_only(self) -> bool:
        """The index is not checkpointed (it did not fit the tree region): opens scan the ring."""
        return self.sb.ckpt_pos == NO_CKPT

    def maybe_checkpoint(self) -> bool:
        """Checkpoint when the interval passed, replay would be long, or many sessions are pinned."""
        if self.readonly:
            return False
        u = self.ring.used() / self.ring.size
        if u > self.cfg.cleanup_threshold and time.monotonic() - self.last_cleanup > 60:
            self.cleanup()
        if checkpoint_due(self):
            self.checkpoint()
            return True
        return False

    def cleanup(self) -> int:
        """Delete sessions idle longer than the retention (tombstones; space returns on wrap)."""
        self.last_cleanup = time.monotonic()
        cutoff = int((self.clock() - self.cfg.retention_s) * 1e9)
        n = 0
        for name in self.list_sessions():
            s = self.idx.find(name)
            if s is not None and s.last_use_ns() < cutoff:
                self._drop_session(s)
                n += 1
        if n:
            log.info("cleanup: dropped %d sessions idle over %.0f s", n, self.cfg.retention_s)
            self.counters["dropped_sessions"] += n
        return n

    # ================================================================ needs fsck
    @property
    def needs_fsck(self) -> bool:
        return self.fsck_mark.needed

    def mark_needs_fsck(self, reason: str) -> None:
        """Record that the volume needs fsck: corruption or an internal error was seen.

        Safe from any thread: it only sets the mark, and the next engine call writes it to
        the superblock, where it stays until ``kvfs-fsck --repair`` clears it."""
        if self.fsck_mark.set(reason):
            log.error("%s: volume needs fsck: %s", self.vol.path, reason)

    def clear_needs_fsck(self) -> None:
        """fsck repaired the volume: the next superblock written goes without the mark."""
        self.fsck_mark.clear()


for _mode, _names in (
        ("write", ("create_session", "delete_session", "set_session_attrs", "create_file",
                   "delete_file", "set_file_attrs", "truncate", "flush", "checkpoint",
                   "maybe_checkpoint", "cleanup")),
        ("writer", ("append", "sync")),
        ("lookup", ("list_sessions", "session_stat", "list_files", "file_stat", "quota_room")),
        ("read", ("read", "extents"))):
    for _name in _names:
        setattr(Store, _name, guarded(getattr(Store, _name), _mode))

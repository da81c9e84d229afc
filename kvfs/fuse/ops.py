"""The FUSE filesystem: one ``pyfuse3.Operations`` class over a ``kvfs.engine.Store``.

Owns the translation between the kernel's view (inodes, file handles, byte offsets,
errno) and the engine's (session and file names, appends, engine exceptions), and the
per-file write buffers that turn many small kernel writes into one engine append (one
ring entry). It never touches the volume: every byte goes through the ``Store``, and
every ``Store`` call runs on the engine worker (``call``, ``worker.Worker``; one call at a
time, the engine is not thread-safe), so the trio thread never blocks on disk I/O or zstd.

Namespace::

    /sessions/<session>/<file>   a Store session (directory) and its files
    /.kvfs/stats, /.kvfs/metrics generated at open (read-only, direct I/O)

Handlers are thin: validate, translate, delegate, translate the error (``@handler``,
in ``errnos``). An engine error becomes its errno (``errnos.ERRNO``); any other exception
is logged with its traceback, answered with EIO and sets ``needs_fsck`` -- it never
escapes, since an exception other than ``FUSEError`` leaving a handler ends the mount.

A handle is bound to its inode, and an inode to one incarnation of a name (inode numbers
are never reused within a mount): once the file is unlinked or its session removed, the
handle answers ESTALE to reads, writes and truncates -- it never reaches a new file of
the same name -- and fstat shows the file as it was, with no links (docs/mount.md).

With the page cache (``direct_io=False``) files are opened with ``keep_cache``: files only
grow and the mount is their only writer, so cached pages stay right across opens. A file
cut since its last open is opened without it (the kernel drops its pages), and the pages
of an unlinked or replaced file are dropped at once (``drop_pages``), so an old handle
still gets ESTALE rather than cached bytes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, TypeVar

import pyfuse3
import trio
from pyfuse3 import EntryAttributes, FileInfo, FUSEError, RequestContext, SetattrFields

from kvfs.engine import errors
from kvfs.engine.store import Store
from kvfs.engine.types import FileStat, SessionStat
from kvfs.ops import metrics

from .buffers import MAX_PENDING, WriteBuffers, on_live
from .counters import Counters
from .dirs import Directories
from .errnos import Stale, handler
from .files import (
    FIXED_TIMEOUT,
    AttrChange,
    KernelPages,
    agent_totals,
    drop_kernel_pages,
    file_attr,
    make_attr,
    metrics_body,
    negative,
    session_attr,
    set_gauges,
    stats_body,
)
from .hooks import Local
from .namespace import Namespace
from .nodes import (
    FIXED,
    FIXED_CHILDREN,
    GENERATED,
    KVFS_DIR,
    ROOT,
    SESSIONS,
    STATS,
    Handle,
    InodeTable,
    Key,
    Node,
    check_name,
    shown,
)
from .ops_state import NativeChannel
from .read_path import FileReader
from .worker import Worker

ENGINE_THREADS = 4  # engine calls in flight at once (reads overlap; changes take turns)
log = logging.getLogger("kvfs.fs")

T = TypeVar("T")

LEASE_XATTR = b"user.kvfs.lease"
CHANNEL_XATTR = b"user.kvfs.channel"  # on the root: the native channel's socket (one small answer)
MOUNT_XATTR = b"user.kvfs.mount"  # on the root: what an agent takes from /.kvfs/stats at open
FLUSH_AT = 1 << 20  # a file's write buffer is handed to the engine at this size
ENTRY_MAX = 256 << 10  # cut into ring entries of at most this size (docs/mount.md)


def _is_write(flags: int) -> bool:
    return (flags & os.O_ACCMODE) != os.O_RDONLY


class Operations(pyfuse3.Operations):
    """The kvfs filesystem over one open ``Store`` (see the module docstring)."""

    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, store: Store, *, direct_io: bool = True, allow_other: bool = False,
                 flush_at: int = FLUSH_AT, entry_max: int = ENTRY_MAX,
                 max_pending: int = MAX_PENDING, alerts_state: Callable[[], Any] | None = None,
                 profile: dict[str, Any] | None = None, inline_reads: bool = True,
                 inline_syncs: bool = True) -> None:
        super().__init__()
        self.profile = profile  # published in /.kvfs/stats: agents take it from there
        self.store = store
        self.direct_io = direct_io
        self.notify_kernel = False  # set once mounted: cache invalidations go to the kernel
        self.alerts_state = alerts_state
        self.needs_fsck = False
        self.counters = Counters()
        self.inodes = InodeTable()
        # changes run on engine threads, in parallel with each other and with reads (the
        # Store locks its own state; a file's writes are ordered by its buffer's lock);
        # reads and small fsyncs run on the trio thread unless offloaded (worker.py says why)
        self.worker = Worker(store, threads=ENGINE_THREADS, serialise=False,
                             inline_reads=inline_reads, inline_syncs=inline_syncs)
        self._handles: dict[int, Handle] = {}
        self.buffers = WriteBuffers(store, self.call, self.counters, flush_at, entry_max,
                                    max_pending)
        self.reader = FileReader(store, self.call, self.buffers, self.counters)  # mount.py sets its nursery
        self._next_fh = 1
        self._uid, self._gid = os.getuid(), os.getgid()
        self._t0 = time.time()
        # with allow_other anyone may create a session; the sticky bit keeps them apart
        self._sessions_mode = stat.S_IFDIR | (0o1777 if allow_other else 0o755)
        self.shared: Local = Local()  # the shared tier's hooks (``remote.Remote`` with --shared)
        self.channel: NativeChannel | None = None  # the native channel's server (``channel.py``), if serving
        # cached pages of files the engine cuts behind the kernel's back are dropped
        self.pages = KernelPages(self.inodes) if not direct_io else None
        if self.pages is not None:
            store.reads.on_cut = self.pages.cut
        self.namespace = Namespace(self)  # mkdir, rmdir, unlink, create, mknod
        self.dirs = Directories(self)  # listings, fsyncdir, statfs

    def use_shared(self, shared: Local) -> None:
        """Replicate to and read through from the shared tier (``remote.Remote``)."""
        self.shared = self.buffers.shared = self.reader.shared = shared

    # ------------------------------------------------------------------ plumbing
    async def call(self, fn: Callable[..., T], *args: Any, changes: bool = True,
                   here: bool = False) -> T:
        """Run one blocking ``Store`` call on the engine worker; ``changes=False`` for calls
        that only look, ``here`` for a small fsync (see ``Worker.call``)."""
        return await self.worker.call(fn, *args, changes=changes, here=here)

    def _internal_error(self, where: str, e: BaseException) -> None:
        log.error("internal error in %s; answering EIO, volume needs fsck", where,
                  exc_info=(type(e), e, e.__traceback__))
        self.counters.errors += 1
        self.needs_fsck = True
        metrics.cold_errors.inc()
        # thread-safe: only sets the mark; the next engine call writes it to the superblock
        self.store.mark_needs_fsck(f"internal error in {where}: {type(e).__name__}: {e}")

    def new_fh(self, handle: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = handle
        return fh

    def close_fh(self, fh: int) -> None:
        self._handles.pop(fh, None)

    def _node(self, ino: int) -> Node:
        node = self.inodes.get(ino)
        if node is None:
            raise FUSEError(errno.ENOENT)
        return node

    def key_of(self, ino: int) -> Key:
        """What a directory or file inode names; ENOENT once removed (names looked up in
        a removed session are not those of a new session of the same name)."""
        node = self._node(ino)
        if node.unlinked:
            raise FUSEError(errno.ENOENT)
        return node.key

    def _file(self, ino: int) -> Node:
        """The file behind a handle; ESTALE once it was unlinked or replaced."""
        node = self._node(ino)
        if len(node.key) != 2:
            raise FUSEError(errno.EISDIR)
        if node.unlinked:
            raise Stale(shown(node.key))
        return node

    def session_of(self, parent: int) -> str:
        """The session a new file goes into; EROFS in /.kvfs, EPERM elsewhere outside one."""
        if parent == KVFS_DIR:
            raise FUSEError(errno.EROFS)
        if parent in FIXED:
            raise FUSEError(errno.EPERM)
        key = self.key_of(parent)
        if len(key) != 1:
            raise FUSEError(errno.ENOTDIR)
        return key[0]

    @staticmethod
    def only_sessions(parent: int) -> None:
        """mkdir/rmdir happen in /sessions only."""
        if parent != SESSIONS:
            raise FUSEError(errno.EROFS if parent == KVFS_DIR else errno.EPERM)

    # ------------------------------------------------------------------ attributes
    async def _fixed_attr(self, ino: int) -> EntryAttributes:
        mode = self._sessions_mode if ino == SESSIONS else FIXED[ino][2]
        if ino in GENERATED:
            now = time.time()
            size = len(await self._generate(ino))
            return make_attr(ino, mode, self._uid, self._gid, (now, now, now), size, timeout=0)
        times = (self._t0, self._t0, self._t0)
        return make_attr(ino, mode, self._uid, self._gid, times,
                         nlink=1 if ino == SESSIONS else 2, timeout=FIXED_TIMEOUT)

    def dyn_attr(self, ino: int, key: Key, st: SessionStat | FileStat) -> EntryAttributes:
        if len(key) == 1:
            return session_attr(ino, st)
        return file_attr(ino, self.shared.size_of(key, st), self.buffers.get(ino))

    def stat_sync(self, key: Key) -> SessionStat | FileStat:
        return self.store.session_stat(*key) if len(key) == 1 else self.store.file_stat(*key)

    async def attr_of(self, ino: int) -> EntryAttributes:
        if ino in FIXED:
            return await self._fixed_attr(ino)
        node = self._node(ino)
        if node.unlinked and node.last is not None:  # fstat of an open, unlinked file
            return file_attr(ino, node.last, None, nlink=0)
        key = self.key_of(ino)
        st = await self.call(on_live, node, self.stat_sync, key, changes=False)
        return self.dyn_attr(ino, key, st)

    def refresh_gauges(self) -> None:
        """The gauges of tiers and figures the registry does not follow by itself (cold
        usage, live agents); run before every scrape (``metrics.on_scrape``). Thread-safe."""
        set_gauges(self.store.usage(), agent_totals(self.profile, self.store.volume_id))

    async def _generate(self, ino: int, private: bool = False) -> bytes:
        """The body of a generated file; ``private``: for the mount's owner or root (with
        session names and paths, see ``stats_body``)."""
        def body() -> bytes:
            if ino != STATS:
                self.shared.refresh_metrics()
                return metrics_body(self.store.usage(),
                                    agent_totals(self.profile, self.store.volume_id))
            fs = {**asdict(self.counters), "open_files": len(self._handles),
                  "inodes": len(self.inodes), "direct_io": self.direct_io,
                  "pending_bytes": self.buffers.pending_bytes,
                  "max_pending": self.buffers.max_pending, "device_syncs": self.worker.syncs,
                  "channel": self.channel.info() if self.channel is not None else None}
            return stats_body(self.store.stats(), self.store.usage(), fs, self.needs_fsck,
                              self.alerts_state, self.shared.stats(), self.profile, private)

        return await self.call(body, changes=False)

    # ------------------------------------------------------------------ lookups
    @handler
    async def lookup(self, parent_inode: int, name: bytes, ctx: RequestContext) -> EntryAttributes:
        if name in (b".", b".."):
            ino = parent_inode if name == b"." else self.parent_of(parent_inode)
        elif parent_inode in FIXED_CHILDREN:
            ino = dict(FIXED_CHILDREN[parent_inode]).get(os.fsdecode(name), 0)
            if not ino:
                return negative()
        elif parent_inode in GENERATED:
            raise FUSEError(errno.ENOTDIR)
        else:
            sname = check_name(name)
            if parent_inode == SESSIONS:
                key: Key = (sname,)
            else:
                parent = self.key_of(parent_inode)
                if len(parent) != 1:
                    raise FUSEError(errno.ENOTDIR)
                key = (parent[0], sname)
            try:
                st = await self.call(self.stat_sync, key, changes=False)
            except errors.NotFound:  # maybe another node's session: read it through
                made = (self.shared.import_session(key[0], ctx.uid, ctx.gid) if len(key) == 1
                        else self.shared.import_file(key, ctx.uid, ctx.gid))
                if not await made:
                    return negative()
                st = await self.call(self.stat_sync, key, changes=False)
            if isinstance(st, SessionStat):
                self.bind_session(key[0], st.sno)
                await self.drop_pages()
            return self.dyn_attr(self.inodes.looked_up(key), key, st)
        attr = await self.attr_of(ino)
        if ino not in FIXED:
            self.inodes.looked_up(self.key_of(ino))
        return attr

    def bind_session(self, name: str, sno: int) -> None:
        """Tie ``name``'s inode to the engine's session ``sno``: if the inode stood for an
        earlier session of that name (dropped by the engine, made anew), detach it and
        its files first, so the new session gets new inodes."""
        node = self.inodes.get(self.inodes.ino_of((name,)))
        assert node is not None
        if node.sno not in (-1, sno):
            self.inodes.unlink_session(name)
            node = self.inodes.get(self.inodes.ino_of((name,)))
            assert node is not None
        node.sno = sno

    def parent_of(self, ino: int) -> int:
        if ino in FIXED:
            return FIXED[ino][0]
        key = self.key_of(ino)
        return SESSIONS if len(key) == 1 else self.inodes.ino_of(key[:1])

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            self.inodes.forget(ino, n)

    @handler
    async def getattr(self, inode: int, ctx: RequestContext) -> EntryAttributes:
        return await self.attr_of(inode)

    @handler
    async def setattr(self, inode: int, attr: EntryAttributes, fields: SetattrFields,
                      fh: int | None, ctx: RequestContext) -> EntryAttributes:
        if inode in FIXED:
            raise FUSEError(errno.EROFS if inode in (KVFS_DIR, *GENERATED) else errno.EPERM)
        node = self._node(inode)
        if node.unlinked and len(node.key) == 2:
            raise Stale(shown(node.key))  # ftruncate, fchmod, futimens of an unlinked file
        key = self.key_of(inode)
        change = AttrChange.asked(attr, fields)  # EOVERFLOW first, before the size changes
        if fields.update_size:
            if len(key) == 1:
                raise FUSEError(errno.EISDIR)
            await self.shared.begin(key[0])
            try:
                await self.shared.complete(node)
                await self.buffers.truncate(node, attr.st_size)
            finally:
                await self.shared.end(key[0])
            self._cut(node)
        elif len(key) == 2:  # written bytes land first, so e.g. tar's futimens sticks
            await self.buffers.flush(node)
        if change.any():
            await self.call(on_live, node, change.apply, self.store, key)
            if len(key) == 1 and change.owner():
                self.shared.owner_changed(key[0])  # the owner record travels with the session
        return await self.attr_of(inode)

    # ------------------------------------------------------------------ open files
    def open_file(self, ino: int, flags: int, writer: bool = False) -> FileInfo:
        """A handle on ``ino``; ``writer``: it holds the session's writer count (``begin``),
        ended by ``release``."""
        # O_APPEND writes land at the end even when the kernel's idea of the size is stale
        # (bytes read through from the shared tier grew the file behind its back)
        fh = self.new_fh(Handle(ino, writable=writer, append=bool(flags & os.O_APPEND)))
        node = self.inodes.get(ino)
        keep = node is not None and not node.truncated and not flags & os.O_TRUNC
        if node is not None:
            node.truncated = False
        self.inodes.opened(ino)
        return FileInfo(fh=fh, direct_io=self.direct_io, keep_cache=keep and not self.direct_io)

    def _cut(self, node: Node) -> None:
        """``node``'s file was truncated: bytes read before are not served from now on."""
        node.truncated = True
        node.cuts += 1
        self.reader.policy.forget(node.ino)

    def cut(self, node: Node) -> None:
        """``node``'s file was truncated from outside the kernel (the native channel)."""
        self._cut(node)

    async def drop_pages(self) -> None:
        """Drop the kernel's pages of the file inodes just detached (page-cache mode)."""
        inos, self.inodes.detached = self.inodes.detached, []
        if inos and self.notify_kernel and not self.direct_io:
            await trio.to_thread.run_sync(drop_kernel_pages, inos)

    @handler
    async def open(self, inode: int, flags: int, ctx: RequestContext) -> FileInfo:
        if inode in GENERATED:
            if _is_write(flags) or flags & os.O_TRUNC:
                raise FUSEError(errno.EROFS)
            # made once per open: size and reads agree; names only for the mount's owner
            body = await self._generate(inode, private=ctx.uid in (0, self._uid))
            return FileInfo(fh=self.new_fh(Handle(inode, content=body)), direct_io=True)
        if inode in FIXED:
            raise FUSEError(errno.EISDIR)
        node = self._file(inode)
        session = node.key[0]
        if not _is_write(flags):
            await self.replaced(await self.shared.refresh(session))
            return self.open_file(inode, flags)
        await self.shared.begin(session)  # the lease: EBUSY while another node writes
        try:
            await self.replaced(await self.shared.complete(node))  # whole before any append
            if flags & os.O_TRUNC:
                await self.buffers.truncate(node, 0)
                self._cut(node)
            return self.open_file(inode, flags, writer=True)
        except BaseException:
            await self.shared.end(session)
            raise

    async def replaced(self, keys: list[Key]) -> None:
        """Files the shared tier's newer copy grew or replaced: bytes read before are not
        served, and the kernel drops its pages and attributes (its size is stale)."""
        inos = []
        for key in keys:
            node = self.inodes.find(key)
            if node is not None:
                self._cut(node)
                inos.append(node.ino)
        if inos and self.notify_kernel:
            await trio.to_thread.run_sync(drop_kernel_pages, inos)

    @handler
    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self._handles[fh]
        if h.content is not None:
            return h.content[off:off + size]
        node = self._file(h.ino)
        self.counters.read_req_max = max(self.counters.read_req_max, size)
        data = await self.reader.read(fh, node, off, size)  # read_path.py: the whole path
        if len(data) > size:  # FUSE refuses a reply larger than the request: a bug here
            self._internal_error("read", AssertionError(
                f"{len(data)} bytes read for a request of {size} at {off}"))
            data = data[:size]
        self.counters.reads += 1
        self.counters.read_bytes += len(data)
        return data

    @handler
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handles[fh]
        if h.content is not None:
            raise FUSEError(errno.EROFS)
        self.counters.write_req_max = max(self.counters.write_req_max, len(buf))
        return await self.buffers.write(self._file(h.ino), None if h.append else off, buf)

    @handler
    async def flush(self, fh: int) -> None:
        h = self._handles[fh]
        node = self.inodes.get(h.ino)
        if h.content is None and node is not None and not node.unlinked:
            await self.buffers.flush(node)  # close of an unlinked file: nothing left to store

    @handler
    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self._handles[fh]
        if h.content is None:
            node = self._file(h.ino)
            if not await self.buffers.flush_for_sync(node, self.worker.sync_now,
                                                     self.worker.sync_here):
                await self.worker.sync()  # no device flush when nothing changed since the last
            if h.writable:  # and replicated: pushed, and held by a replica (docs/scale-out.md)
                await self.shared.fsync(node.key[0])

    @handler
    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh)
        self.reader.policy.closed(fh)
        if h.content is not None:
            return
        node = self.inodes.get(h.ino)
        try:
            if node is not None and not node.unlinked:
                await self.buffers.flush(node)
        finally:
            if h.writable and node is not None:
                await self.shared.end(node.key[0])
            if node is None or node.opens <= 1:
                lost = self.buffers.drop(h.ino)
                if lost:
                    log.error("%s (inode %d) closed with %d bytes that could not be stored: "
                              "lost", shown(node.key) if node else "?", h.ino, lost)
            self.inodes.closed(h.ino)

    # ------------------------------------------------------------------ namespace (namespace.py)
    @handler
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: RequestContext) -> EntryAttributes:
        return await self.namespace.mkdir(parent_inode, name, mode, ctx)

    @handler
    async def rmdir(self, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        await self.namespace.rmdir(parent_inode, name, ctx)

    @handler
    async def unlink(self, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        await self.namespace.unlink(parent_inode, name, ctx)

    @handler
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        return await self.namespace.create(parent_inode, name, mode, flags, ctx)

    @handler
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: RequestContext) -> EntryAttributes:
        return await self.namespace.mknod(parent_inode, name, mode, rdev, ctx)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: RequestContext) -> EntryAttributes:
        return await self.namespace.symlink(parent_inode, name, target, ctx)

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: RequestContext) -> EntryAttributes:
        return await self.namespace.link(inode, new_parent_inode, new_name, ctx)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: RequestContext) -> None:
        await self.namespace.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                                    flags, ctx)

    # ------------------------------------------------------------------ directories (dirs.py)
    @handler
    async def opendir(self, inode: int, ctx: RequestContext) -> int:
        return await self.dirs.opendir(inode, ctx)

    @handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        await self.dirs.readdir(fh, start_id, token)

    async def releasedir(self, fh: int) -> None:
        await self.dirs.releasedir(fh)

    @handler
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.dirs.fsyncdir(fh, datasync)

    @handler
    async def statfs(self, ctx: RequestContext) -> pyfuse3.StatvfsData:
        return await self.dirs.statfs(ctx)

    # ------------------------------------------------------------------ extended attributes
    @handler
    async def getxattr(self, inode: int, name: bytes, ctx: RequestContext) -> bytes:
        """``user.kvfs.lease`` of a session directory: the node that holds the session's
        lease in the shared tier (what an agent refused with EBUSY names); ``user.kvfs.channel``
        of the root: the native channel's socket and version, so a client finds it without
        the mount rendering ``/.kvfs/stats``; ``user.kvfs.mount`` of the root: the part of
        ``/.kvfs/stats`` an agent reads when it opens the mount (profile, volume identity,
        direct I/O, whether a shared tier is on), in the same shape, without the counters."""
        if inode == ROOT and name == CHANNEL_XATTR and self.channel is not None:
            info = self.channel.info()
            return json.dumps({"socket": info["socket"], "version": info["version"]}).encode()
        if inode == ROOT and name == MOUNT_XATTR:
            return json.dumps({"profile": self.profile, "store": {"volume": {"uuid": self.store.volume_id}},
                               "fs": {"direct_io": self.direct_io},
                               "shared": {} if self.shared.enabled else None}, default=str).encode()
        if inode in FIXED or name != LEASE_XATTR:
            raise FUSEError(errno.ENODATA)
        key = self.key_of(inode)
        owner = await self.shared.lease_owner(key[0]) if len(key) == 1 else None
        if owner is None:
            raise FUSEError(errno.ENODATA)
        return owner.encode()

    @handler
    async def listxattr(self, inode: int, ctx: RequestContext) -> list[bytes]:
        if inode in FIXED or not self.shared.enabled or len(self.key_of(inode)) != 1:
            return []
        return [LEASE_XATTR]

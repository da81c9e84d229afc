"""Changes to the namespace: mkdir, rmdir, unlink, create, mknod (and the refused link kinds).

A part of ``ops.Operations``, which delegates those handlers here and translates what
escapes them (``errnos.handler``). It reaches the mount through ``ops_state.FsCore``: the
inode table, the engine worker (``call``), the write buffers and the shared-tier hooks
(``shared``: ``remote.Remote`` or ``hooks.Local``). A change inside a session takes the
session's lease first when the mount replicates (EBUSY while another node writes it).
"""

from __future__ import annotations

import errno
import logging
import stat
from typing import Any

from pyfuse3 import EntryAttributes, FileInfo, FUSEError, RequestContext

from kvfs.engine import errors

from .files import file_attr, session_attr
from .nodes import check_name, shown
from .ops_state import FsCore

log = logging.getLogger("kvfs.fs")

PRIVATE = 0o077  # group/other bits dropped from modes asked at creation: KV bytes are private


class Namespace:
    """``mkdir``/``rmdir``/``unlink``/``create``/``mknod`` (and the refused link kinds)."""

    def __init__(self, fs: FsCore) -> None:
        self.fs = fs

    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: RequestContext) -> EntryAttributes:
        self.fs.only_sessions(parent_inode)
        key = (check_name(name),)
        self.fs.shared.check_new_name(key[0])  # EINVAL for a name the shared tier cannot hold

        def make() -> Any:
            self.fs.store.create_session(key[0], mode & 0o7777 & ~PRIVATE, ctx.uid, ctx.gid)
            return self.fs.store.session_stat(key[0])

        st = await self.fs.call(make)
        self.fs.inodes.unlink_session(key[0])  # inodes of an earlier session of this name
        self.fs.bind_session(key[0], st.sno)
        await self.fs.drop_pages()
        return session_attr(self.fs.inodes.looked_up(key), st)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        self.fs.only_sessions(parent_inode)
        sname = check_name(name)
        if await self.fs.call(self.fs.store.list_files, sname, changes=False):
            raise errors.NotEmpty(sname)
        await self.fs.shared.removed_session(sname)  # EBUSY while another node writes it

        def remove() -> None:  # one worker call: no file can appear in between
            if self.fs.store.list_files(sname):
                raise errors.NotEmpty(sname)
            self.fs.store.delete_session(sname)

        await self.fs.call(remove)
        self.fs.inodes.unlink_session(sname)
        await self.fs.drop_pages()

    async def unlink(self, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        key = (self.fs.session_of(parent_inode), check_name(name))

        def delete() -> Any:  # the last stat answers fstat on a handle still open
            last = self.fs.store.file_stat(*key)
            self.fs.store.delete_file(*key)
            return last

        await self.fs.shared.begin(key[0])
        try:
            last = await self.fs.call(delete)
            self.fs.shared.removed(key)
        finally:
            await self.fs.shared.end(key[0])
        ino = self.fs.inodes.ino_of(key)
        dropped = self.fs.buffers.drop(ino)
        if dropped:
            log.warning("unlink %s: %d unflushed bytes of an open file dropped", shown(key),
                        dropped)
        last.size += dropped  # the size its readers saw
        self.fs.inodes.unlink(key, last)
        await self.fs.drop_pages()

    async def _new_file(self, parent: int, name: bytes, mode: int,
                        ctx: RequestContext) -> tuple[int, EntryAttributes]:
        key = (self.fs.session_of(parent), check_name(name))
        self.fs.shared.check_new_name(key[1])

        def make() -> Any:
            self.fs.store.create_file(*key, mode & 0o7777 & ~PRIVATE, ctx.uid, ctx.gid)
            return self.fs.store.file_stat(*key)

        st = await self.fs.call(make)
        self.fs.inodes.unlink(key)  # an inode of an earlier file of this name stays its own
        await self.fs.drop_pages()
        ino = self.fs.inodes.looked_up(key)
        return ino, file_attr(ino, st, None)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        session = self.fs.session_of(parent_inode)
        await self.fs.shared.begin(session)  # the handle is a writer: ``release`` ends it
        try:
            ino, attr = await self._new_file(parent_inode, name, mode, ctx)
            return self.fs.open_file(ino, flags, writer=True), attr
        except BaseException:
            await self.fs.shared.end(session)
            raise

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: RequestContext) -> EntryAttributes:
        if not stat.S_ISREG(mode):
            raise FUSEError(errno.EPERM)  # regular files only: no devices, fifos, sockets
        session = self.fs.session_of(parent_inode)
        await self.fs.shared.begin(session)
        try:
            return (await self._new_file(parent_inode, name, mode, ctx))[1]
        finally:
            await self.fs.shared.end(session)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.EPERM)

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.EPERM)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: RequestContext) -> None:
        raise FUSEError(errno.EXDEV)  # no rename in the engine; mv(1) falls back to copying

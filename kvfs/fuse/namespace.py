"""The namespace handlers of ``ops.Operations``: mkdir, rmdir, unlink, create, mknod.

Kept apart only for size (``self`` is an ``ops_state.OpsState``): it uses the
``Operations``' inode table, worker (``call``), write buffers and shared-tier hooks
(``shared``: ``remote.Remote`` or ``hooks.Local``), and owns nothing of its own. A change inside a session takes the
session's lease first when the mount replicates (EBUSY while another node writes it).
"""

from __future__ import annotations

import errno
import logging
import stat
from typing import Any

from pyfuse3 import EntryAttributes, FileInfo, FUSEError, RequestContext

from kvfs.engine import errors

from .errnos import handler
from .files import file_attr, session_attr
from .nodes import check_name, shown
from .ops_state import OpsState

log = logging.getLogger("kvfs.fs")

PRIVATE = 0o077  # group/other bits dropped from modes asked at creation: KV bytes are private


class Namespace:
    """``mkdir``/``rmdir``/``unlink``/``create``/``mknod`` (and the refused link kinds)."""

    @handler
    async def mkdir(self: OpsState, parent_inode: int, name: bytes, mode: int,
                    ctx: RequestContext) -> EntryAttributes:
        self._only_sessions(parent_inode)
        key = (check_name(name),)
        self.shared.check_new_name(key[0])  # EINVAL for a name the shared tier cannot hold

        def make() -> Any:
            self.store.create_session(key[0], mode & 0o7777 & ~PRIVATE, ctx.uid, ctx.gid)
            return self.store.session_stat(key[0])

        st = await self.call(make)
        self.inodes.unlink_session(key[0])  # inodes of an earlier session of this name
        self._bind_session(key[0], st.sno)
        await self._drop_pages()
        return session_attr(self.inodes.looked_up(key), st)

    @handler
    async def rmdir(self: OpsState, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        self._only_sessions(parent_inode)
        sname = check_name(name)
        if await self.call(self.store.list_files, sname, changes=False):
            raise errors.NotEmpty(sname)
        await self.shared.removed_session(sname)  # EBUSY while another node writes it

        def remove() -> None:  # one worker call: no file can appear in between
            if self.store.list_files(sname):
                raise errors.NotEmpty(sname)
            self.store.delete_session(sname)

        await self.call(remove)
        self.inodes.unlink_session(sname)
        self.buffers.space_freed()
        await self._drop_pages()

    @handler
    async def unlink(self: OpsState, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        key = (self._session_of(parent_inode), check_name(name))

        def delete() -> Any:  # the last stat answers fstat on a handle still open
            last = self.store.file_stat(*key)
            self.store.delete_file(*key)
            return last

        await self.shared.begin(key[0])
        try:
            last = await self.call(delete)
            self.shared.removed(key)
        finally:
            await self.shared.end(key[0])
        ino = self.inodes.ino_of(key)
        dropped = self.buffers.drop(ino)
        if dropped:
            log.warning("unlink %s: %d unflushed bytes of an open file dropped", shown(key),
                        dropped)
        last.size += dropped  # the size its readers saw
        self.buffers.space_freed()
        self.inodes.unlink(key, last)
        await self._drop_pages()

    async def _new_file(self: OpsState, parent: int, name: bytes, mode: int,
                        ctx: RequestContext) -> tuple[int, EntryAttributes]:
        key = (self._session_of(parent), check_name(name))
        self.shared.check_new_name(key[1])

        def make() -> Any:
            self.store.create_file(*key, mode & 0o7777 & ~PRIVATE, ctx.uid, ctx.gid)
            return self.store.file_stat(*key)

        st = await self.call(make)
        self.inodes.unlink(key)  # an inode of an earlier file of this name stays its own
        await self._drop_pages()
        ino = self.inodes.looked_up(key)
        return ino, file_attr(ino, st, None)

    @handler
    async def create(self: OpsState, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        session = self._session_of(parent_inode)
        await self.shared.begin(session)  # the handle is a writer: ``release`` ends it
        try:
            ino, attr = await self._new_file(parent_inode, name, mode, ctx)
            return self._open_file(ino, flags, writer=True), attr
        except BaseException:
            await self.shared.end(session)
            raise

    @handler
    async def mknod(self: OpsState, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: RequestContext) -> EntryAttributes:
        if not stat.S_ISREG(mode):
            raise FUSEError(errno.EPERM)  # regular files only: no devices, fifos, sockets
        session = self._session_of(parent_inode)
        await self.shared.begin(session)
        try:
            return (await self._new_file(parent_inode, name, mode, ctx))[1]
        finally:
            await self.shared.end(session)

    async def symlink(self: OpsState, parent_inode: int, name: bytes, target: bytes,
                      ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.EPERM)

    async def link(self: OpsState, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.EPERM)

    async def rename(self: OpsState, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: RequestContext) -> None:
        raise FUSEError(errno.EXDEV)  # no rename in the engine; mv(1) falls back to copying

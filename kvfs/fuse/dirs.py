"""The directory handlers of ``ops.Operations``: listings, ``fsyncdir``, ``statfs``.

Kept apart only for size (``self`` is an ``ops_state.OpsState``): it uses the
``Operations``' inode table, worker (``call``), handles and attribute helpers, and owns
nothing of its own but the listing snapshots taken at ``opendir``.
"""

from __future__ import annotations

import errno
import os

import pyfuse3
from pyfuse3 import EntryAttributes, FUSEError, RequestContext

from kvfs.engine import errors
from kvfs.engine.types import FileStat, SessionStat

from .errnos import handler
from .nodes import FIXED, FIXED_CHILDREN, SESSIONS, Handle, Key
from .ops_state import OpsState

READDIR_BATCH = 64


class Directories:
    """``opendir``/``readdir``/``releasedir``/``fsyncdir``/``statfs`` of ``Operations``."""

    @handler
    async def opendir(self: OpsState, inode: int, ctx: RequestContext) -> int:
        entries: list[tuple[str, Key | int]] = [(".", inode), ("..", self._parent_of(inode))]
        if inode in FIXED_CHILDREN:
            entries += FIXED_CHILDREN[inode]
        elif inode == SESSIONS:
            entries += [(n, (n,)) for n in await self.call(self.store.list_sessions, changes=False)]
        elif inode in FIXED:
            raise FUSEError(errno.ENOTDIR)
        else:
            key = self._key(inode)
            if len(key) != 1:
                raise FUSEError(errno.ENOTDIR)
            await self._replaced(await self.shared.refresh(key[0]))  # files made on another node
            names = await self.call(self.store.list_files, key[0], changes=False)
            entries += [(n, (key[0], n)) for n in names]
        fh = self._new_fh(Handle(inode))
        self._dirs[fh] = entries  # a snapshot: offsets stay valid while entries change
        return fh

    @handler
    async def readdir(self: OpsState, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self._dirs[fh]
        i = start_id
        while i < len(entries):
            batch = entries[i:i + READDIR_BATCH]
            attrs = await self._batch_attrs(batch)
            for name, ref in batch:
                i += 1
                attr = attrs.get(name)
                if attr is None:  # removed since opendir
                    continue
                if not pyfuse3.readdir_reply(token, os.fsencode(name), attr, i):
                    for a in attrs.values():  # drop numbers the kernel never saw
                        self.inodes.forget(a.st_ino, 0)
                    return
                if isinstance(ref, tuple):
                    self.inodes.looked_up(ref)

    async def _batch_attrs(self: OpsState, batch: list[tuple[str, Key | int]]) -> dict[str, EntryAttributes]:
        """Attributes of a slice of a listing, with one worker call for the dynamic ones."""
        keys = [ref for _, ref in batch if isinstance(ref, tuple)]

        def stats() -> list[SessionStat | FileStat | None]:
            out: list[SessionStat | FileStat | None] = []
            for key in keys:
                try:
                    out.append(self._stat_sync(key))
                except errors.NotFound:
                    out.append(None)
            return out

        found = await self.call(stats, changes=False) if keys else []
        attrs = {key[-1]: self._dyn_attr(self.inodes.ino_of(key), key, st)
                 for key, st in zip(keys, found, strict=True) if st is not None}
        for name, ref in batch:
            if isinstance(ref, int):  # ".", ".." and the fixed tree: never counted
                attrs[name] = await self._attr_of(ref)
        return attrs

    async def releasedir(self: OpsState, fh: int) -> None:
        self._dirs.pop(fh, None)
        self._handles.pop(fh, None)

    @handler
    async def fsyncdir(self: OpsState, fh: int, datasync: bool) -> None:
        await self.worker.sync()

    @handler
    async def statfs(self: OpsState, ctx: RequestContext) -> pyfuse3.StatvfsData:
        u = await self.call(self.store.usage, changes=False)
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = u.capacity // 4096
        s.f_bfree = s.f_bavail = max(0, u.capacity - u.used) // 4096
        s.f_files = u.sessions + len(FIXED)
        s.f_ffree = s.f_favail = 1 << 20
        s.f_namemax = 255
        return s


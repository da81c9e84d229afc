"""Directory listings, ``fsyncdir`` and ``statfs``.

A part of ``ops.Operations``, which delegates those handlers here and translates what
escapes them (``errnos.handler``). It reaches the mount through ``ops_state.FsCore`` (the
inode table, the engine worker, handles and attributes) and owns the listing snapshots
taken at ``opendir``.
"""

from __future__ import annotations

import errno
import os

import pyfuse3
from pyfuse3 import EntryAttributes, FUSEError, RequestContext

from kvfs.engine import errors
from kvfs.engine.types import FileStat, SessionStat

from .nodes import FIXED, FIXED_CHILDREN, SESSIONS, Handle, Key
from .ops_state import FsCore

READDIR_BATCH = 64


class Directories:
    """``opendir``/``readdir``/``releasedir``/``fsyncdir``/``statfs`` of ``Operations``."""

    def __init__(self, fs: FsCore) -> None:
        self.fs = fs
        self._dirs: dict[int, list[tuple[str, Key | int]]] = {}  # fh -> listing snapshot

    async def opendir(self, inode: int, ctx: RequestContext) -> int:
        entries: list[tuple[str, Key | int]] = [(".", inode), ("..", self.fs.parent_of(inode))]
        if inode in FIXED_CHILDREN:
            entries += FIXED_CHILDREN[inode]
        elif inode == SESSIONS:
            entries += [(n, (n,)) for n in await self.fs.call(self.fs.store.list_sessions, changes=False)]
        elif inode in FIXED:
            raise FUSEError(errno.ENOTDIR)
        else:
            key = self.fs.key_of(inode)
            if len(key) != 1:
                raise FUSEError(errno.ENOTDIR)
            await self.fs.replaced(await self.fs.shared.refresh(key[0]))  # files made on another node
            names = await self.fs.call(self.fs.store.list_files, key[0], changes=False)
            entries += [(n, (key[0], n)) for n in names]
        fh = self.fs.new_fh(Handle(inode))
        self._dirs[fh] = entries  # a snapshot: offsets stay valid while entries change
        return fh

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
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
                        self.fs.inodes.forget(a.st_ino, 0)
                    return
                if isinstance(ref, tuple):
                    self.fs.inodes.looked_up(ref)

    async def _batch_attrs(self, batch: list[tuple[str, Key | int]]) -> dict[str, EntryAttributes]:
        """Attributes of a slice of a listing, with one worker call for the dynamic ones."""
        keys = [ref for _, ref in batch if isinstance(ref, tuple)]

        def stats() -> list[SessionStat | FileStat | None]:
            out: list[SessionStat | FileStat | None] = []
            for key in keys:
                try:
                    out.append(self.fs.stat_sync(key))
                except errors.NotFound:
                    out.append(None)
            return out

        found = await self.fs.call(stats, changes=False) if keys else []
        attrs = {key[-1]: self.fs.dyn_attr(self.fs.inodes.ino_of(key), key, st)
                 for key, st in zip(keys, found, strict=True) if st is not None}
        for name, ref in batch:
            if isinstance(ref, int):  # ".", ".." and the fixed tree: never counted
                attrs[name] = await self.fs.attr_of(ref)
        return attrs

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)
        self.fs.close_fh(fh)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.fs.worker.sync()

    async def statfs(self, ctx: RequestContext) -> pyfuse3.StatvfsData:
        u = await self.fs.call(self.fs.store.usage, changes=False)
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = u.capacity // 4096
        s.f_bfree = s.f_bavail = max(0, u.capacity - u.used) // 4096
        s.f_files = u.sessions + len(FIXED)
        s.f_ffree = s.f_favail = 1 << 20
        s.f_namemax = 255
        return s


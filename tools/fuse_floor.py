#!/usr/bin/env python3
"""The floor of a pyfuse3 filesystem on this machine: a passthrough over a directory.

The least a pyfuse3 server can do per request: every handler makes the plain system call
on the backing directory (``os.pread``, ``os.write``, ``os.fsync``...) on the trio thread,
with no engine, no worker thread, no buffering, no checksums. Files are opened with
``direct_io`` like kvfs layer files, so every read and write is a FUSE request. What the
kernel round trip, pyfuse3 and trio cost is what this mount loses to the directory it
passes through; ``tools/bench_mount.py`` measures it beside kvfs, in the same run, to
show how much of kvfs's ratio to ext4 is the FUSE stack and how much is kvfs's own.

Only what the benchmarks use: lookup, getattr, setattr, mkdir, rmdir, create, open, read,
write, fsync, fsyncdir, flush, release, opendir/readdir, unlink, rename (the warm tier's
group migration uses the last few). A failed system call answers its errno. Not a
filesystem to use for anything else.

``python tools/fuse_floor.py BACKING_DIR MOUNTPOINT`` (foreground; unmount with
``fusermount3 -u``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import sys
from typing import Any

import pyfuse3
import trio

log = logging.getLogger("bench.fuse_floor")


def _errno(fn: Any) -> Any:
    """A handler whose failed system call answers its errno (an OSError leaving a pyfuse3
    handler would end the mount)."""
    @functools.wraps(fn)
    async def run(*args: Any) -> Any:
        try:
            return await fn(*args)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from e
    return run


class Passthrough(pyfuse3.Operations):
    """Inodes are numbered as they are looked up; each maps to a backing path."""

    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, root: str) -> None:
        super().__init__()
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: root}
        self.inos: dict[str, int] = {root: pyfuse3.ROOT_INODE}
        self.fds: dict[int, int] = {}

    def _ino(self, path: str) -> int:
        ino = self.inos.get(path)
        if ino is None:
            ino = self.inos[path] = len(self.paths) + 1
            self.paths[ino] = path
        return ino

    def _attr(self, path: str, ino: int) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from e
        a = pyfuse3.EntryAttributes()
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                     "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(a, name, getattr(st, name))
        a.st_ino, a.generation = ino, 0
        a.st_blksize, a.st_blocks = 1 << 20, st.st_blocks
        a.entry_timeout = a.attr_timeout = 1.0
        return a

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        path = os.path.join(self.paths[parent_inode], os.fsdecode(name))
        return self._attr(path, self._ino(path))

    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._attr(self.paths[inode], inode)

    @_errno
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        path = os.path.join(self.paths[parent_inode], os.fsdecode(name))
        os.mkdir(path, mode & 0o7777)
        return self._attr(path, self._ino(path))

    @_errno
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        os.unlink(os.path.join(self.paths[parent_inode], os.fsdecode(name)))

    @_errno
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        os.rmdir(os.path.join(self.paths[parent_inode], os.fsdecode(name)))

    @_errno
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx: Any) -> None:
        old = os.path.join(self.paths[parent_old], os.fsdecode(name_old))
        new = os.path.join(self.paths[parent_new], os.fsdecode(name_new))
        os.rename(old, new)
        ino = self.inos.pop(old, None)
        if ino is not None:  # the inode follows its file to the new name
            self.inos[new] = ino
            self.paths[ino] = new

    @_errno
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: Any,
                      fh: int | None, ctx: Any) -> pyfuse3.EntryAttributes:
        path = self.paths[inode]
        if fields.update_size:
            os.truncate(path, attr.st_size)
        if fields.update_mode:
            os.chmod(path, stat.S_IMODE(attr.st_mode))
        if fields.update_atime or fields.update_mtime:
            st = os.lstat(path)
            os.utime(path, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                               attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
        return self._attr(path, inode)

    async def opendir(self, inode: int, ctx: Any) -> int:
        return inode

    @_errno
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        fd = os.open(self.paths[fh], os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        names = sorted(os.listdir(self.paths[fh]))
        for i, n in enumerate(names[start_id:], start_id + 1):
            path = os.path.join(self.paths[fh], n)
            if not pyfuse3.readdir_reply(token, os.fsencode(n), self._attr(path, self._ino(path)), i):
                return

    def _opened(self, fd: int) -> pyfuse3.FileInfo:
        self.fds[fd] = fd
        return pyfuse3.FileInfo(fh=fd, direct_io=True)

    @_errno
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        return self._opened(os.open(self.paths[inode], flags & ~os.O_CREAT))

    @_errno
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = os.path.join(self.paths[parent_inode], os.fsdecode(name))
        fd = os.open(path, flags | os.O_CREAT, stat.S_IMODE(mode))
        return self._opened(fd), self._attr(path, self._ino(path))

    @_errno
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return os.pread(fh, size, off)

    @_errno
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return os.pwrite(fh, buf, off)

    @_errno
    async def fsync(self, fh: int, datasync: bool) -> None:
        os.fsync(fh)

    async def flush(self, fh: int) -> None:
        pass

    async def release(self, fh: int) -> None:
        os.close(self.fds.pop(fh))

    async def releasedir(self, fh: int) -> None:
        pass


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    backing, mountpoint = (os.path.abspath(p) for p in argv)
    ops = Passthrough(backing)
    pyfuse3.init(ops, mountpoint, {"fsname=fuse_floor", "default_permissions"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The FUSE layer's bookkeeping: fixed inodes, the inode table, names, errno, pending writes.

Pure Python with no pyfuse3, trio or engine import, so it is tested without a kernel.
``kvfs.fs`` builds its handlers on these pieces; nothing here touches the volume.

Inode numbers: 1 to 5 are the fixed tree (``/``, ``/sessions``, ``/.kvfs`` and its two
generated files); sessions and their files get numbers from ``FIRST_DYNAMIC`` up, handed
out on first sight and dropped when the kernel forgets them (lookup count 0, not open).
They need not survive a remount.
"""

from __future__ import annotations

import errno
import stat
from dataclasses import dataclass

from kvfs.engine import errors

ROOT = 1  # pyfuse3.ROOT_INODE
SESSIONS = 2
KVFS_DIR = 3
STATS = 4
METRICS = 5
FIRST_DYNAMIC = 16

NAME_MAX = 255

#: the fixed tree: inode -> (parent, name, mode)
FIXED: dict[int, tuple[int, str, int]] = {
    ROOT: (ROOT, "", stat.S_IFDIR | 0o755),
    SESSIONS: (ROOT, "sessions", stat.S_IFDIR | 0o755),
    KVFS_DIR: (ROOT, ".kvfs", stat.S_IFDIR | 0o555),
    STATS: (KVFS_DIR, "stats", stat.S_IFREG | 0o444),
    METRICS: (KVFS_DIR, "metrics", stat.S_IFREG | 0o444),
}
#: children of the fixed directories, in listing order
FIXED_CHILDREN: dict[int, list[tuple[str, int]]] = {
    ROOT: [("sessions", SESSIONS), (".kvfs", KVFS_DIR)],
    KVFS_DIR: [("metrics", METRICS), ("stats", STATS)],
}
GENERATED = (STATS, METRICS)

#: engine exception -> errno; subclasses before their base (NameTooLong is a BadName)
ERRNO: list[tuple[type[errors.KVFSError], int]] = [
    (errors.NotFound, errno.ENOENT),
    (errors.Exists, errno.EEXIST),
    (errors.NameTooLong, errno.ENAMETOOLONG),
    (errors.BadName, errno.EINVAL),
    (errors.NotAppend, errno.EPERM),
    (errors.BadRange, errno.EINVAL),
    (errors.NotEmpty, errno.ENOTEMPTY),
    (errors.NoSpace, errno.ENOSPC),
    (errors.Corrupt, errno.EIO),
]


def errno_of(exc: errors.KVFSError) -> int:
    """The errno a client sees for an engine error (EIO for anything unexpected)."""
    for cls, code in ERRNO:
        if isinstance(exc, cls):
            return code
    return errno.EIO


class NameError_(Exception):
    """A name the kernel passed that kvfs refuses; ``errno`` says how."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.errno = code


def check_name(raw: bytes) -> str:
    """The engine's ``str`` for a directory entry name, or ``NameError_``.

    Over 255 bytes -> ENAMETOOLONG (FUSE lets names up to 1024 bytes through); empty,
    ``.``, ``..``, or containing ``/`` or NUL -> EINVAL. Bytes that are not UTF-8 pass
    as surrogate escapes (like ``os.fsdecode``), which the engine stores byte for byte.
    The engine checks again.
    """
    if len(raw) > NAME_MAX:
        raise NameError_(errno.ENAMETOOLONG, f"name of {len(raw)} bytes (max {NAME_MAX})")
    if raw in (b"", b".", b"..") or b"/" in raw or b"\0" in raw:
        raise NameError_(errno.EINVAL, f"name {raw!r} not allowed")
    return raw.decode("utf-8", "surrogateescape")


Key = tuple[str, ...]  # (session,) for a session directory, (session, file) for a file


@dataclass(slots=True)
class Node:
    """A dynamic inode: what it names, how often the kernel looked it up, open handles."""

    ino: int
    key: Key
    lookups: int = 0
    opens: int = 0
    unlinked: bool = False

    @property
    def is_dir(self) -> bool:
        return len(self.key) == 1


class InodeTable:
    """Stable (session[, file]) <-> inode mapping with kernel lookup counts.

    An entry lives while the kernel knows the inode (lookups > 0) or a handle is open.
    ``unlink`` detaches the name at once (a new file of that name gets a new inode); the
    number itself is dropped by ``forget``/``close`` when nothing refers to it any more.
    """

    def __init__(self) -> None:
        self._by_ino: dict[int, Node] = {}
        self._by_key: dict[Key, int] = {}
        self._next = FIRST_DYNAMIC

    def __len__(self) -> int:
        return len(self._by_ino)

    def get(self, ino: int) -> Node | None:
        return self._by_ino.get(ino)

    def ino_of(self, key: Key) -> int:
        """The inode of ``key``, allocating one if new (no lookup counted)."""
        ino = self._by_key.get(key)
        if ino is None:
            ino = self._next
            self._next += 1
            self._by_key[key] = ino
            self._by_ino[ino] = Node(ino, key)
        return ino

    def looked_up(self, key: Key) -> int:
        """``key``'s inode with one more kernel reference (lookup, mkdir, create, readdir)."""
        ino = self.ino_of(key)
        self._by_ino[ino].lookups += 1
        return ino

    def forget(self, ino: int, n: int) -> None:
        node = self._by_ino.get(ino)
        if node is None:
            return
        node.lookups = max(0, node.lookups - n)
        self._maybe_drop(node)

    def opened(self, ino: int) -> None:
        node = self._by_ino.get(ino)
        if node is not None:
            node.opens += 1

    def closed(self, ino: int) -> None:
        node = self._by_ino.get(ino)
        if node is not None:
            node.opens = max(0, node.opens - 1)
            self._maybe_drop(node)

    def unlink(self, key: Key) -> None:
        """``key`` is gone from its directory; its inode lingers while referenced."""
        ino = self._by_key.pop(key, None)
        if ino is not None:
            node = self._by_ino[ino]
            node.unlinked = True
            self._maybe_drop(node)

    def unlink_session(self, session: str) -> None:
        """A whole session vanished (rmdir, eviction): detach it and all its files."""
        for key in [k for k in self._by_key if k[0] == session]:
            self.unlink(key)

    def _maybe_drop(self, node: Node) -> None:
        if node.lookups == 0 and node.opens == 0:
            del self._by_ino[node.ino]
            if self._by_key.get(node.key) == node.ino:
                del self._by_key[node.key]


@dataclass(slots=True)
class Handle:
    """An open file: its inode and, for the generated files, the bytes made at open."""

    ino: int
    content: bytes | None = None
    writable: bool = False
    seq_end: int = 0  # where the last read ended: the next one there is sequential
    ahead: object = None  # a read-ahead in flight or done (``fsfiles.Ahead``)

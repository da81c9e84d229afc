"""The FUSE layer's bookkeeping: fixed inodes, the inode table, names, open handles.

Pure Python with no trio or engine call, so it is tested without a kernel. ``ops`` builds
its handlers on these pieces; nothing here touches the volume.

Inode numbers: 1 to 5 are the fixed tree (``/``, ``/sessions``, ``/.kvfs`` and its two
generated files); sessions and their files get numbers from ``FIRST_DYNAMIC`` up, handed
out on first sight and dropped when the kernel forgets them (lookup count 0, not open).
They need not survive a remount.

A dynamic inode stands for one incarnation of a name, never for the name: once the name
is unlinked or created anew, the old inode is ``unlinked`` and every handle on it answers
ESTALE (``ops``), so an old descriptor never reaches a new file of the same name.
"""

from __future__ import annotations

import errno
import stat
from dataclasses import dataclass
from typing import Any

from .errnos import Refused

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

def check_name(raw: bytes) -> str:
    """The engine's ``str`` for a directory entry name, or ``Refused``.

    Over 255 bytes -> ENAMETOOLONG (FUSE lets names up to 1024 bytes through); empty,
    ``.``, ``..``, or containing ``/`` or NUL -> EINVAL. Bytes that are not UTF-8 pass
    as surrogate escapes (like ``os.fsdecode``), which the engine stores byte for byte.
    The engine checks again.
    """
    if len(raw) > NAME_MAX:
        raise Refused(errno.ENAMETOOLONG, f"name of {len(raw)} bytes (max {NAME_MAX})")
    if raw in (b"", b".", b"..") or b"/" in raw or b"\0" in raw:
        raise Refused(errno.EINVAL, f"name {raw!r} not allowed")
    return raw.decode("utf-8", "surrogateescape")


Key = tuple[str, ...]  # (session,) for a session directory, (session, file) for a file


def shown(key: Key | str) -> str:
    """A name for a log line: quoted, with newlines and other control characters escaped,
    so a name cannot forge or split lines."""
    return repr(key if isinstance(key, str) else "/".join(key))


@dataclass(slots=True)
class Node:
    """A dynamic inode: what it names, how often the kernel looked it up, open handles.

    ``unlinked``: the name now belongs to another incarnation (or none); ``last`` is the
    file's stat at unlink, answered (nlink 0) to fstat on a handle still open; ``sno``
    the engine's never-reused number of a session, to notice one replaced behind us;
    ``truncated``: cut since its last open, so the next open drops the kernel's pages;
    ``cuts``: how often it was cut (bytes read before a cut are not served after it).
    """

    ino: int
    key: Key
    lookups: int = 0
    opens: int = 0
    unlinked: bool = False
    last: Any = None
    sno: int = -1
    truncated: bool = False
    cuts: int = 0

    @property
    def is_dir(self) -> bool:
        return len(self.key) == 1


class InodeTable:
    """Stable (session[, file]) <-> inode mapping with kernel lookup counts.

    An entry lives while the kernel knows the inode (lookups > 0) or a handle is open.
    ``unlink`` detaches the name at once (a new file of that name gets a new inode); the
    number itself is dropped by ``forget``/``close`` when nothing refers to it any more.
    Detached file inodes are listed in ``detached`` until ``ops`` drops their cached pages.
    """

    def __init__(self) -> None:
        self._by_ino: dict[int, Node] = {}
        self._by_key: dict[Key, int] = {}
        self._next = FIRST_DYNAMIC
        self.detached: list[int] = []

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

    def files_of(self, sno: int) -> list[int]:
        """File inodes of the session the engine numbers ``sno``: a snapshot, safe to take
        from another thread (the dicts are copied whole, under the interpreter's lock)."""
        items = list(self._by_key.items())
        nodes = self._by_ino.copy()
        names = {k[0] for k, ino in items if len(k) == 1 and ino in nodes and nodes[ino].sno == sno}
        return [ino for k, ino in items if len(k) == 2 and k[0] in names]

    def find(self, key: Key) -> Node | None:
        """The node of ``key`` if the table holds one (allocates nothing)."""
        ino = self._by_key.get(key)
        return None if ino is None else self._by_ino.get(ino)

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

    def unlink(self, key: Key, last: Any = None) -> None:
        """``key`` is gone from its directory (or names a new file now); its inode lingers
        while referenced, detached: handles on it answer ESTALE."""
        ino = self._by_key.pop(key, None)
        if ino is not None:
            node = self._by_ino[ino]
            node.unlinked = True
            node.last = last
            if len(key) == 2:
                self.detached.append(ino)
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
    """An open file: its inode (one incarnation) and, for the generated files, the bytes
    made at open."""

    ino: int
    content: bytes | None = None
    writable: bool = False  # a writer of its session (counted for the shared tier's lease)
    append: bool = False  # O_APPEND: each write goes at the file's end, whatever the offset

"""The seams of ``ops.Operations``: what its namespace and directory parts use of it
(``FsCore``), and the native channel's server as it holds it (``NativeChannel``).

``namespace.Namespace`` and ``dirs.Directories`` are parts ``Operations`` holds and
delegates its handlers to; they reach it only through ``FsCore``, so neither imports
``ops`` nor touches its private state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import trio
    from pyfuse3 import EntryAttributes, FileInfo

    from kvfs.engine.store import Store
    from kvfs.engine.types import FileStat, SessionStat

    from .buffers import WriteBuffers
    from .hooks import Local
    from .nodes import Handle, InodeTable, Key
    from .worker import Worker

T = TypeVar("T")


class NativeChannel(Protocol):
    """The native channel's server (``channel.ChannelServer``), as the mount runs it and
    the stats show it."""

    def bind(self) -> None: ...

    def start(self, token: trio.lowlevel.TrioToken) -> None: ...

    def info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class FsCore(Protocol):
    """What the namespace and directory parts (``namespace.Namespace``,
    ``dirs.Directories``) use of the ``Operations`` that holds them: its inode table,
    engine worker, write buffers and shared-tier hooks, and the translations between
    inodes and names. All of it public; each part keeps its own state."""

    store: Store
    inodes: InodeTable
    buffers: WriteBuffers
    worker: Worker
    shared: Local

    async def call(self, fn: Callable[..., T], *args: Any, changes: bool = True,
                   here: bool = False) -> T: ...

    def new_fh(self, handle: Handle) -> int: ...

    def close_fh(self, fh: int) -> None: ...

    def key_of(self, ino: int) -> Key: ...

    def session_of(self, parent: int) -> str: ...

    def only_sessions(self, parent: int) -> None: ...

    def parent_of(self, ino: int) -> int: ...

    def bind_session(self, name: str, sno: int) -> None: ...

    def stat_sync(self, key: Key) -> SessionStat | FileStat: ...

    def dyn_attr(self, ino: int, key: Key, st: SessionStat | FileStat) -> EntryAttributes: ...

    async def attr_of(self, ino: int) -> EntryAttributes: ...

    def open_file(self, ino: int, flags: int, writer: bool = False) -> FileInfo: ...

    async def drop_pages(self) -> None: ...

    async def replaced(self, keys: list[Key]) -> None: ...

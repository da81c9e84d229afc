"""What the namespace and directory handlers use of the ``Operations`` they belong to,
and the native channel's server as ``Operations`` holds it (``NativeChannel``).

``namespace.Namespace`` and ``dirs.Directories`` hold handlers of ``ops.Operations``, kept
in files of their own for size. Their ``self`` is typed as ``OpsState``, so the state and
helpers they share with ``ops`` are named here, in one place, and checked; neither module
imports ``ops``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import trio
    from pyfuse3 import EntryAttributes, FileInfo, RequestContext

    from kvfs.engine.store import Store
    from kvfs.engine.types import FileStat, SessionStat

    from .buffers import WriteBuffers
    from .counters import Counters
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


class OpsState(Protocol):
    counters: Counters
    store: Store
    inodes: InodeTable
    buffers: WriteBuffers
    worker: Worker
    shared: Local
    _handles: dict[int, Handle]
    _dirs: dict[int, list[tuple[str, Key | int]]]

    async def call(self, fn: Callable[..., T], *args: Any, changes: bool = True,
                   here: bool = False) -> T: ...

    def _internal_error(self, where: str, e: BaseException) -> None: ...

    def _new_fh(self, handle: Handle) -> int: ...

    def _key(self, ino: int) -> Key: ...

    def _session_of(self, parent: int) -> str: ...

    def _only_sessions(self, parent: int) -> None: ...

    def _parent_of(self, ino: int) -> int: ...

    def _bind_session(self, name: str, sno: int) -> None: ...

    def _stat_sync(self, key: Key) -> SessionStat | FileStat: ...

    def _dyn_attr(self, ino: int, key: Key, st: SessionStat | FileStat) -> EntryAttributes: ...

    async def _attr_of(self, ino: int) -> EntryAttributes: ...

    def _open_file(self, ino: int, flags: int, writer: bool = False) -> FileInfo: ...

    async def _drop_pages(self) -> None: ...

    async def _replaced(self, keys: list[Key]) -> None: ...

    async def _new_file(self, parent: int, name: bytes, mode: int,
                        ctx: RequestContext) -> tuple[int, EntryAttributes]: ...

    async def _batch_attrs(self, batch: list[tuple[str, Key | int]]
                           ) -> dict[str, EntryAttributes]: ...

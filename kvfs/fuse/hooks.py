"""What the FUSE layer tells the shared tier, and ``Local``: the same hooks doing nothing.

``ops``, ``dirs``, ``namespace`` and ``buffers`` call these at fixed points (a lookup that
missed, an open, a read, what reached the engine, fsync, release); ``remote.Remote``
implements them with ``--shared``. This module imports nothing of the shared tier, so a
mount without it never loads the cluster client.
"""

from __future__ import annotations

from typing import Any

from .nodes import Key, Node


class Local:
    """No shared tier: every hook does nothing."""

    enabled = False

    def check_new_name(self, name: str) -> None:
        return None

    async def lease_owner(self, session: str) -> str | None:
        return None

    def owner_changed(self, session: str) -> None:
        return None

    async def import_session(self, name: str, uid: int, gid: int) -> bool:
        return False

    async def import_file(self, key: Key, uid: int, gid: int) -> bool:
        return False

    async def refresh(self, session: str, force: bool = False) -> list[Key]:
        return []

    def size_of(self, key: Key, st: Any) -> Any:
        return st

    async def fill(self, node: Node, end: int | None) -> None:
        return None

    async def begin(self, session: str) -> None:
        return None

    async def end(self, session: str) -> None:
        return None

    async def complete(self, node: Node) -> list[Key]:
        return []

    def stored(self, key: Key, offset: int, data: bytes) -> None:
        return None

    def cut(self, key: Key, size: int) -> None:
        return None

    def removed(self, key: Key) -> None:
        return None

    async def removed_session(self, session: str) -> None:
        return None

    async def fsync(self, session: str) -> None:
        return None

    def stats(self) -> dict[str, Any] | None:
        return None

    def refresh_metrics(self) -> None:
        return None

    async def close(self) -> None:
        return None

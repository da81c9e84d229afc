"""Content versions of the shared tier's files (docs/format.md, "Shared tier: content
versions"): a sealed token per file, made by the node whose write makes or rewrites the
file (16 random bytes and its node id), kept while the file is only appended to. Readers
compare versions, never sizes alone, to tell a copy is stale. ``Stamps`` makes and checks
tokens and remembers the versions this node's own writes left (for ``remote``'s copies)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from .chunks import VERSION_TOKEN, ChunkError, Codec
from .stats import Stats

log = logging.getLogger("kvfs.shared.tier")


class Stamps:
    """One node's view of content versions (thread-safe)."""

    def __init__(self, codec: Codec, node_id: str, stats: Stats) -> None:
        self.codec, self.node_id, self.stats = codec, node_id, stats
        self._lock = threading.Lock()
        self._left: dict[tuple[str, str], str | None] = {}  # versions our writes left

    def new(self, session: str, file: str) -> bytes:
        """A fresh sealed token for a write that may make or rewrite ``file``."""
        return self.codec.encode_version(session, file,
                                         os.urandom(VERSION_TOKEN) + self.node_id.encode())

    def made_here(self, version: str | None) -> bool:
        """Whether ``version`` was made by this node (its id is stable across remounts)."""
        return version is not None and version[2 * VERSION_TOKEN + 1:] == self.node_id

    def decode(self, session: str, file: str, raw: Any) -> str | None:
        """A stored version as text; None when there is none (a file stored before versions
        were kept) or it does not verify (counted, logged): either way the reader cannot
        trust its own copy by it and fetches the file again."""
        if raw is None:
            return None
        try:
            return self.codec.decode_version(session, file, bytes(raw))
        except ChunkError as e:
            self.stats.add("corrupt")
            log.error("%s/%s: content version does not verify (%s): the file is fetched again",
                      session, file, e)
            return None

    def left(self, session: str, file: str, version: str | None) -> None:
        """This node's append or cut left ``version`` (None: the file was removed)."""
        with self._lock:
            self._left[(session, file)] = version

    def take(self, session: str, file: str) -> str | None:
        with self._lock:
            return self._left.pop((session, file), None)

    def forget(self, session: str) -> None:
        with self._lock:
            for key in [key for key in self._left if key[0] == session]:
                del self._left[key]

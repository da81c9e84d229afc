"""Which sessions leave RAM first: the ``EvictionPolicy`` seam and its default, LRU groups.

The tier tells the policy of every use (``touch``) and every session that left RAM
(``remove``); when usage passes the threshold it asks for ``victims``: the ``n`` sessions
to write to the cold tier (if dirty) and drop, least recently used first, never those
in ``exclude`` (the session being written). The tier takes a group at a time (the
article's LRU groups of 10 sessions; LMCache's ``cache_policy`` has the same shape).
Thread-safe; knows nothing of shards, bytes or the cold tier.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Container
from typing import Protocol


class EvictionPolicy(Protocol):
    def touch(self, sid: str) -> None: ...
    def remove(self, sid: str) -> None: ...
    def victims(self, n: int, exclude: Container[str] = ()) -> list[str]: ...
    def names(self) -> list[str]: ...
    def __contains__(self, sid: object) -> bool: ...
    def __len__(self) -> int: ...


class LRUGroups:
    """Least recently used first (the default ``EvictionPolicy``)."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def touch(self, sid: str) -> None:
        with self._lock:
            self._order[sid] = None
            self._order.move_to_end(sid)

    def remove(self, sid: str) -> None:
        with self._lock:
            self._order.pop(sid, None)

    def victims(self, n: int, exclude: Container[str] = ()) -> list[str]:
        with self._lock:
            out: list[str] = []
            for sid in self._order:
                if len(out) >= n:
                    break
                if sid not in exclude:
                    out.append(sid)
            return out

    def names(self) -> list[str]:
        with self._lock:
            return list(self._order)

    def __contains__(self, sid: object) -> bool:
        return sid in self._order

    def __len__(self) -> int:
        return len(self._order)

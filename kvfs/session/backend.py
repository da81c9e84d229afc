"""``ColdBackend``: the seam between a session's files and where they are kept.

A backend stores, per session id, named byte files that are only appended to, cut
shorter, or (small ones) replaced: the cold tier's ``sessions/<sid>/`` on a mounted kvfs
volume, through plain files or the mount's native channel (``kvfs.warm.coldopen`` picks
one). This module names no implementation: the backends import it, never the other way.

Writes come in ``Changes`` (one session's appends, replacements and truncations, applied
in order by ``write``), durable only after ``sync`` of what ``write`` returned (or at once
with ``durable=True``), so a pass over many sessions writes them all, then makes them
durable together (on the mount, one device flush). Every failure is a ``SessionError``
naming the path (the warm tier's ``WarmError``); another node's lease on a shared mount is
its ``WarmBusy``. Which file is written in which order is ``kvfs.session.commit``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

APPEND, REPLACE, TRUNCATE = 1, 2, 3  # kinds of a change (the channel's WRITE items too)
HOLD_WAIT_S = 1.0  # a hold refused with EBUSY is retried this long: a clean hand-over ends in it

#: bytes-like pieces of an append (numpy views of RAM copies, bytes, memoryviews)
Piece = bytes | bytearray | memoryview | np.ndarray
#: (stream, file offset, uint8 out buffer) of a batched read
Range = tuple[int, int, np.ndarray]
#: a session's cold state: {stream: size} and its incarnation id (None: none)
ColdState = tuple[dict[int, int], int | None]


@dataclass
class Change:
    kind: int
    name: str
    arg: int = 0  # APPEND: the file's size before; TRUNCATE: the new length
    pieces: list[Piece] = field(default_factory=list)  # APPEND / REPLACE: bytes-like pieces


class Changes:
    """One session's changes, applied in order by ``ColdBackend.write``. ``make_dir``:
    make the session's directory first (``Written.made_dir`` says whether it was made)."""

    def __init__(self, make_dir: bool = False) -> None:
        self.items: list[Change] = []
        self.make_dir = make_dir

    def __bool__(self) -> bool:
        return bool(self.items)

    def append(self, name: str, expect: int, pieces: Iterable[Piece]) -> None:
        """Append ``pieces`` to ``name`` (made if missing), whose size must be ``expect``."""
        self.items.append(Change(APPEND, name, expect, list(pieces)))

    def replace(self, name: str, raw: bytes) -> None:
        """Replace a small file's bytes (made if missing): a cut to zero, then one write."""
        self.items.append(Change(REPLACE, name, 0, [raw]))

    def truncate(self, name: str, length: int) -> None:
        self.items.append(Change(TRUNCATE, name, length))

    def rewrite(self, name: str, new: bytes, old: bytes) -> bool:
        """Make an append-only file holding ``old`` hold ``new``: cut back to the common
        prefix, append the rest (usually just the new rounds). False when equal."""
        if new == old:
            return False
        limit = min(len(old), len(new))
        diff = np.nonzero(np.frombuffer(old, np.uint8, limit) != np.frombuffer(new, np.uint8, limit))[0]
        p = int(diff[0]) if len(diff) else limit
        if len(old) > p:
            self.truncate(name, p)
        if len(new) > p:
            self.append(name, p, [np.frombuffer(new, np.uint8)[p:]])
        return True


@dataclass
class Written:
    """What ``write`` did to one session: each file's size after it, the names to make
    durable (a caller may add names written by earlier passes), whether the session's
    directory was made, and descriptors a plain backend keeps for the fsyncs (``forget``
    lets them go when no ``sync`` follows)."""

    sid: str
    sizes: dict[str, int] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)
    made_dir: bool = False
    fds: dict[str, int] = field(default_factory=dict)
    error: BaseException | None = None  # set by ``sync`` when this session's part failed
    release: Callable[[Written], None] | None = None  # the backend's, for ``forget``

    def forget(self) -> None:
        """Let go of what the backend keeps for a ``sync`` that will not run."""
        if self.release is not None:
            self.release(self)


def byte_view(piece: Piece) -> memoryview:
    """The bytes of a piece (an ndarray's buffer, or any other bytes-like one)."""
    return (piece.data if isinstance(piece, np.ndarray) else memoryview(piece)).cast("B")


class Hold(Protocol):
    """A session's lease kept by this process on a shared mount, until ``release``."""

    def release(self) -> None: ...


class ColdBackend(Protocol):
    """Where sessions' files are kept (module doc): twelve methods."""

    root: str  # what it was opened at (a mountpoint)
    dir: str  # where the sessions are (``<root>/sessions``), for messages
    shared: bool  # a mount with a shared tier: sessions are held (``hold``)
    kind: str  # "files" or "channel"

    # names and the session's lease
    def hold(self, sid: str, wait_s: float = HOLD_WAIT_S) -> Hold | None:
        """Keep the session's lease (None: no shared tier, or no directory yet);
        WarmBusy when another node keeps it past ``wait_s``."""
    def list(self) -> list[str]: ...
    def reachable(self) -> None:
        """An error unless the store is there (an unmounted volume is not an empty one)."""
    def exists(self, sid: str) -> bool:
        """Whether the session is there; an error when the store itself is unreachable."""
    def delete(self, sid: str) -> bool: ...

    # sizes and reads
    def state(self, sid: str, incarnation: bool = True,
              streams: Sequence[int] | None = None) -> ColdState | None:
        """Every stream's size (or only of ``streams``, when a backend can look them up
        apart: absent ones left out) and the incarnation id (None without
        ``incarnation``); None when the session is not there (an error when the store is
        unreachable)."""
    def read_ranges(self, sid: str, ranges: Sequence[Range], missing_is_empty: bool = False) -> None:
        """Fill each out buffer from its stream at its offset (ValueError past the end)."""
    def read_small(self, sid: str, name: str) -> bytes | None:
        """A small file's bytes (None: absent), bounded by ``names.small_limit``."""
    def prefetch(self, sid: str, streams: Iterable[int], start: int, end: int) -> int:
        """Advise reads of ``[start, end)`` of these streams soon; returns files advised."""

    # writes
    def write(self, sid: str, changes: Changes, w: Written | None = None,
              durable: bool = False) -> Written:
        """Apply ``changes`` in order into ``w`` (sizes of what was done, also when one
        fails); durable at once with ``durable``, else after ``sync``."""
    def sync(self, written: Sequence[Written]) -> None:
        """Make what these writes touched durable; a session whose part fails gets its
        ``error``, the others are durable."""
    def close(self) -> None: ...

"""The FUSE read path of a file, top to bottom in one place, and its read-ahead policy.

    Operations.read(fh, off, size)         ops.py: the handle's file, then here
      FileReader.read(fh, node, off, size)
        shared.fill                        bytes only the shared tier holds yet, first
        ReadAhead.window_hit / take_ahead  what was read ahead for this handle, if it covers it
        FileReader._window                 or a window for a small sequential reader
        FileReader._file_bytes             or the engine's bytes, then the buffered tail
        ReadAhead.next_ranges              the ranges to read ahead now, started on the nursery
          FileReader._engine               every engine read: Worker.call(on_live, Store.read)

Direct I/O gets no read-ahead from the kernel; ``ReadAhead`` is the one policy that gives
it one, per handle. A read where the handle's last read ended is sequential: below
``SMALL`` bytes it fetches a ``WINDOW`` whose next small reads are answered at once, with
no engine call and no worker hand-off (a 4 KiB reader costs one engine call per window,
not per 4 KiB); from ``MIN`` bytes up, the next ``DEPTH`` ranges of its size are read on
the worker while this one travels back to the reader, so disk, decoding and the FUSE
round trip overlap. Only bytes the engine already holds are read ahead. Engine bytes
never change but by a truncate, which drops what was read ahead (``forget``) and which a
window checks (``Node.cuts``). Without a nursery (``nursery`` None) nothing is read ahead
in the background.

Every engine read goes through the layer's worker and only while the inode still names its
file (``on_live``): bytes of an unlinked or replaced file never reach a new file's reader.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from kvfs.engine.store import Store

from .buffers import Call, WriteBuffers, on_live
from .hooks import Local
from .nodes import Node

if TYPE_CHECKING:
    from .counters import Counters

log = logging.getLogger("kvfs.fs")


@dataclass
class Ahead:
    """The next range of a sequential reader, being read (``done`` not set) or read."""

    off: int
    size: int
    done: trio.Event = field(default_factory=trio.Event)
    data: bytes | None = None


@dataclass
class Window:
    """Engine bytes of one handle from ``off``, fetched for its small sequential reads;
    valid while the file's ``cuts`` (truncations) are what they were at the fetch."""

    off: int
    data: bytes
    cuts: int


@dataclass
class Stream:
    """One handle's reading: where its last read ended and what was read ahead for it."""

    ino: int
    seq_end: int = 0  # where the last read ended: the next one there is sequential
    ahead: list[Ahead] | None = None  # read-aheads in flight or done, in file order
    window: Window | None = None  # engine bytes kept for small sequential reads


class ReadAhead:
    """The read-ahead policy (module doc): decides, per handle, what was read ahead for a
    read and what to read ahead next. Does no I/O: ``FileReader`` reads what it says."""

    MIN = 128 << 10
    DEPTH = 1  # ranges read ahead (3 measured no faster on two cores: docs/mount.md)
    SMALL = 64 << 10
    WINDOW = 256 << 10

    def __init__(self) -> None:
        self._streams: dict[int, Stream] = {}  # by file handle

    def stream(self, fh: int, ino: int) -> Stream:
        s = self._streams.get(fh)
        if s is None:
            s = self._streams[fh] = Stream(ino)
        return s

    def closed(self, fh: int) -> None:
        self._streams.pop(fh, None)

    def forget(self, ino: int) -> None:
        """Drop read-ahead and window bytes of ``ino`` (its tail was truncated)."""
        for s in self._streams.values():
            if s.ino == ino:
                s.ahead = s.window = None

    def window_hit(self, s: Stream, node: Node, off: int, size: int) -> bytes | None:
        """The bytes from the handle's window when it holds all of them, not cut since."""
        w = s.window
        if (w is not None and w.cuts == node.cuts and w.off <= off
                and off + size <= w.off + len(w.data)):
            s.seq_end = off + size
            return w.data[off - w.off:off + size - w.off]
        return None

    def take_ahead(self, s: Stream, off: int, size: int) -> Ahead | None:
        """The range read ahead that starts here and covers ``size``; what was read ahead
        elsewhere is dropped (the reader went another way), the rest kept for next time."""
        aheads = s.ahead or []
        if aheads and aheads[0].off == off and aheads[0].size >= size:
            s.ahead = aheads[1:]
            return aheads[0]
        s.ahead = None
        return None

    def window_size(self, s: Stream, off: int, size: int, stored: int | None) -> int:
        """Bytes of a new window for this read (0: none): a small sequential read of bytes
        the engine holds (``stored``: how far it holds the file; None: all of it)."""
        if size < self.SMALL and off == s.seq_end and (stored is None or off + size <= stored):
            return self.WINDOW if stored is None else min(self.WINDOW, stored - off)
        return 0

    def next_ranges(self, s: Stream, off: int, size: int, got: int, stored: int | None,
                    background: bool) -> list[Ahead]:
        """After a read of ``size`` at ``off`` that returned ``got`` bytes: the ranges to
        read ahead now (``background``: there is a nursery to read them on)."""
        aheads = s.ahead or []
        s.ahead = None
        nxt = off + got
        new: list[Ahead] = []
        if background and off == s.seq_end and got == size >= self.MIN:
            if aheads and (aheads[0].off != nxt or aheads[0].size != size):
                aheads = []
            at = aheads[-1].off + size if aheads else nxt
            while len(aheads) < self.DEPTH and (stored is None or at + size <= stored):
                a = Ahead(at, size)
                aheads.append(a)
                new.append(a)
                at += size
            s.ahead = aheads or None
        s.seq_end = nxt
        return new


class FileReader:
    """What a FUSE read of a file returns (module doc). ``mount.py`` sets ``nursery``
    while the mount runs; ``Operations.use_shared`` sets ``shared``."""

    def __init__(self, store: Store, call: Call, buffers: WriteBuffers, counters: Counters) -> None:
        self.store, self.call, self.buffers, self.counters = store, call, buffers, counters
        self.shared: Local = Local()
        self.policy = ReadAhead()
        self.nursery: trio.Nursery | None = None

    async def read(self, fh: int, node: Node, off: int, size: int) -> bytes:
        """At most ``size`` bytes of the file at ``off`` as this mount sees it."""
        await self.shared.fill(node, off + size)
        s = self.policy.stream(fh, node.ino)
        data = self.policy.window_hit(s, node, off, size)
        if data is not None:
            self.counters.window_hits += 1
            return data
        p = self.buffers.get(node.ino)
        stored = p.base if p is not None else None  # how far the engine holds the file
        a = self.policy.take_ahead(s, off, size)
        if a is not None:
            await a.done.wait()
            if a.data is not None and len(a.data) >= size:  # short: the file grew since
                data = a.data[:size]
                self.counters.readahead_hits += 1
            else:
                s.ahead = None
        n = self.policy.window_size(s, off, size, stored) if data is None else 0
        if n:
            data = await self._window(s, node, off, size, n)
        if data is None:
            data = await self._file_bytes(node, off, size)
        for a in self.policy.next_ranges(s, off, size, len(data), stored, self.nursery is not None):
            assert self.nursery is not None
            self.nursery.start_soon(self._fetch_ahead, a, node)
        return data

    async def _window(self, s: Stream, node: Node, off: int, size: int, n: int) -> bytes | None:
        """The first ``size`` bytes of a new ``n``-byte window at ``off``; None when the
        engine holds fewer (the rest may be buffered: the caller reads the usual way)."""
        cuts = node.cuts
        got = await self._engine(node, off, n)
        if len(got) < size:
            return None
        if cuts == node.cuts:  # not cut while it was read
            s.window = Window(off, got, cuts)
        return got[:size]

    async def _file_bytes(self, node: Node, off: int, size: int) -> bytes:
        """The engine's bytes, then the buffered tail; never more than ``size``. Whether the
        range reaches the buffer is decided under the file's lock: a flush in between moves
        bytes from the buffer into the engine."""
        p = self.buffers.get(node.ino)
        if p is None or off + size <= p.base:  # the engine's part only: it never shrinks
            return await self._engine(node, off, size)
        async with p.lock:
            if off + size <= p.base or not p.buf:
                return await self._engine(node, off, size)
            head = b""
            if off < p.base:
                want = p.base - off
                head = await self._engine(node, off, want)
                if len(head) < want:  # the engine holds less than it said: no splice
                    return head
            start = off + len(head) - p.base
            return head + p.buf.slice(start, start + size - len(head))

    async def _fetch_ahead(self, a: Ahead, node: Node) -> None:
        try:
            a.data = await self._engine(node, a.off, a.size)
        except Exception as e:  # the reader will ask again and get the error itself
            log.debug("read-ahead of %s at %d failed: %r", node.key, a.off, e)
        finally:
            a.done.set()

    async def _engine(self, node: Node, off: int, n: int) -> bytes:
        data: bytes = await self.call(on_live, node, self.store.read, *node.key, off, n,
                                      changes=False)
        return data

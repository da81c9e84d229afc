"""What the FUSE layer keeps and builds around the engine calls of its handlers.

The per-file write buffers (``WriteBuffers``: appends gathered into one ``Store.append``
per flush, reads of a buffered tail, truncates across it), the layer's counters,
``EntryAttributes`` built from the engine's stat values, and the bodies of the generated
``/.kvfs`` files. Used by ``kvfs.fs`` only. The buffers reach the ``Store`` solely
through the ``call`` they are given (the FUSE layer's single worker); the other pieces
only format values ``kvfs.fs`` fetched.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import stat
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import trio
from pyfuse3 import EntryAttributes, FUSEError

from kvfs.engine import errors
from kvfs.ops import metrics

from .nodes import NameError_, errno_of

log = logging.getLogger("kvfs.fs")

Call = Callable[..., Awaitable[Any]]
T = TypeVar("T")

BLKSIZE = 1 << 20  # st_blksize: tools read and write in 1 MiB pieces
ATTR_TIMEOUT = 1.0  # the kernel may cache attributes/entries this long (we are the only writer)
FIXED_TIMEOUT = 300.0


@dataclass
class Pending:
    """Bytes appended to one file through the mount, not yet handed to the engine.

    The engine holds ``base`` bytes; the file's visible size is ``base + len(buf)``. The
    lock orders writes, flushes, truncates and reads of the buffered tail of this file.
    """

    base: int
    buf: bytearray = field(default_factory=bytearray)
    lock: trio.Lock = field(default_factory=trio.Lock)

    @property
    def size(self) -> int:
        return self.base + len(self.buf)


class WriteBuffers:
    """The write buffers of the open files, by inode.

    A write must land at the file's visible end (EPERM and a log line otherwise, nothing
    changed); it is buffered, and the buffer becomes one ``Store.append`` -- one ring
    entry -- when it reaches ``flush_at`` or on ``flush`` (close, fsync). A failed append
    keeps the bytes buffered and reports the engine's error (e.g. ENOSPC); the last
    handle's release drops what still cannot be stored, with a log line.
    """

    def __init__(self, store: Any, call: Call, counters: Counters, flush_at: int,
                 entry_max: int) -> None:
        self.store, self.call, self.counters = store, call, counters
        self.flush_at, self.entry_max = flush_at, entry_max
        self._by_ino: dict[int, Pending] = {}

    def get(self, ino: int) -> Pending | None:
        return self._by_ino.get(ino)

    def drop(self, ino: int) -> int:
        """Forget a file's buffer (unlinked, last handle closed); returns bytes dropped."""
        p = self._by_ino.pop(ino, None)
        return len(p.buf) if p is not None else 0

    def inodes(self) -> list[int]:
        return list(self._by_ino)

    @property
    def pending_bytes(self) -> int:
        return sum(len(p.buf) for p in self._by_ino.values())

    async def write(self, ino: int, key: tuple[str, ...], off: int, buf: bytes) -> int:
        """Accept ``buf`` at ``off``: the bytes accepted, or raise; never drop silently.

        The buffer is flushed before it would pass ``flush_at`` and when this write fills
        it. If that append fails (ENOSPC), the part of this write that did not reach the
        engine is taken back: a short write when some of it did, the error when none did.
        So what the kernel is told was written is always exactly buffered or stored.
        """
        p = self._by_ino.get(ino)
        if p is None:
            st = await self.call(self.store.file_stat, *key)
            p = self._by_ino.setdefault(ino, Pending(st.size))
        async with p.lock:
            if off != p.size:
                self.counters.refused_writes += 1
                log.warning("write to %s/%s at offset %d refused with EPERM: the file ends at "
                            "%d and only appends are allowed", *key, off, p.size)
                raise FUSEError(errno.EPERM)
            if p.buf and len(p.buf) + len(buf) > self.flush_at:
                await self._flush_locked(key, p)
            p.buf += buf
            accepted = len(buf)
            if len(p.buf) >= self.flush_at:
                try:
                    await self._flush_locked(key, p)
                except errors.KVFSError:
                    unstored = min(len(buf), len(p.buf))  # this write's tail left in the buffer
                    del p.buf[len(p.buf) - unstored:]
                    accepted = len(buf) - unstored
                    if not accepted:
                        raise
            self.counters.writes += 1
            self.counters.write_bytes += accepted
            return accepted

    async def flush(self, ino: int, key: tuple[str, ...]) -> None:
        """Append the buffer to the engine; on failure it stays buffered and the error rises."""
        p = self._by_ino.get(ino)
        if p is not None and p.buf:
            async with p.lock:
                await self._flush_locked(key, p)

    async def _flush_locked(self, key: tuple[str, ...], p: Pending) -> None:
        if not p.buf:
            return
        data = bytes(p.buf)
        done, err = await self.call(self._append_pieces, key, p.base, data)
        del p.buf[:done]  # what was stored leaves the buffer; the rest stays for a retry
        p.base += done
        if err is not None:
            log.error("append of %d bytes to %s/%s at %d failed after %d, rest kept "
                      "buffered: %r", len(data), *key, p.base - done, done, err)
            raise err

    def _append_pieces(self, key: tuple[str, ...], base: int,
                       data: bytes) -> tuple[int, BaseException | None]:
        """(bytes stored, error) of appending ``data`` as entries of at most ``entry_max``
        bytes; stops at the first failure (on the worker thread)."""
        mv = memoryview(data)
        done = 0
        try:
            while done < len(data):
                n = min(self.entry_max, len(data) - done)
                self.store.append(*key, base + done, mv[done:done + n])
                done += n
                self.counters.appends += 1
        except Exception as e:
            return done, e
        return done, None

    async def truncate(self, ino: int, key: tuple[str, ...], length: int) -> None:
        """Drop the tail of a file (an agent retrying a turn); longer -> EINVAL."""
        p = self._by_ino.get(ino)
        if p is None:
            await self.call(self.store.truncate, *key, length)
            return
        async with p.lock:
            if length > p.size:
                raise FUSEError(errno.EINVAL)
            if length >= p.base:  # the cut is in the unflushed tail: the engine never saw it
                del p.buf[length - p.base:]
                return
            p.buf.clear()
            await self.call(self.store.truncate, *key, length)
            p.base = length

    async def read(self, ino: int, key: tuple[str, ...], off: int, size: int) -> bytes:
        """Bytes of the file as this mount sees it: the engine's, then the buffered tail."""
        p = self._by_ino.get(ino)
        if p is None or not p.buf or off + size <= p.base:
            return await self.call(self.store.read, *key, off, size)
        async with p.lock:
            head = b""
            if off < p.base:
                head = await self.call(self.store.read, *key, off, p.base - off)
            start = max(off, p.base) - p.base
            return head + bytes(p.buf[start:start + size - len(head)])


@dataclass
class Ahead:
    """The next range of a sequential reader, being read (``done`` not set) or read."""

    off: int
    size: int
    done: trio.Event = field(default_factory=trio.Event)
    data: bytes | None = None


class ReadAhead:
    """Read-ahead for direct I/O, which gets none from the kernel.

    When a handle reads at least ``MIN`` bytes right where its last read ended, the next
    range of the same size is read on the worker while this one travels back to the
    reader, so disk, decoding and the FUSE round trip overlap. Only bytes the engine
    already holds are read ahead; a truncate drops what was read ahead (``forget``).
    Without a nursery (``nursery`` None) it does nothing.
    """

    MIN = 128 << 10

    def __init__(self, store: Any, call: Call, counters: Counters) -> None:
        self.store, self.call, self.counters = store, call, counters
        self.nursery: trio.Nursery | None = None

    async def read(self, h: Any, key: tuple[str, ...], off: int, size: int,
                   fetch: Callable[[], Awaitable[bytes]], stored: int | None) -> bytes:
        """``fetch()``'s bytes, or the read-ahead's when it covers them; maybe start the
        next. ``stored``: how far the engine holds the file (None: all of it)."""
        a, h.ahead = h.ahead, None
        data = None
        if isinstance(a, Ahead) and a.off == off and a.size >= size:
            await a.done.wait()
            if a.data is not None and len(a.data) >= size:  # short: the file grew since
                data = a.data[:size]
                self.counters.readahead_hits += 1
        if data is None:
            data = await fetch()
        nxt = off + len(data)
        if (self.nursery is not None and off == h.seq_end and len(data) == size >= self.MIN
                and (stored is None or nxt + size <= stored)):
            h.ahead = Ahead(nxt, size)
            self.nursery.start_soon(self._fetch, h.ahead, key)
        h.seq_end = nxt
        return data

    async def _fetch(self, a: Ahead, key: tuple[str, ...]) -> None:
        try:
            a.data = await self.call(self.store.read, *key, a.off, a.size)
        except Exception as e:  # the reader will ask again and get the error itself
            log.debug("read-ahead of %s at %d failed: %r", key, a.off, e)
        finally:
            a.done.set()

    @staticmethod
    def forget(handles: Any, ino: int) -> None:
        """Drop read-ahead bytes of ``ino`` (its tail was truncated)."""
        for h in handles:
            if h.ino == ino:
                h.ahead = None


@dataclass
class Counters:
    """The FUSE layer's own counts, shown under ``fs`` in ``/.kvfs/stats``."""

    reads: int = 0
    read_bytes: int = 0
    writes: int = 0
    write_bytes: int = 0
    appends: int = 0  # engine appends, i.e. ring entries written by flushes
    refused_writes: int = 0  # writes that were not appends (EPERM)
    errors: int = 0  # unexpected exceptions answered with EIO
    corrupt_reads: int = 0
    readahead_hits: int = 0


def handler(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Translate what escapes a handler: engine error -> errno, anything else -> EIO."""

    @functools.wraps(fn)
    async def wrapper(self: Any, *args: Any) -> T:
        try:
            return await fn(self, *args)
        except FUSEError:
            raise
        except NameError_ as e:
            raise FUSEError(e.errno) from None
        except errors.KVFSError as e:
            code = errno_of(e)
            if isinstance(e, errors.Corrupt):
                log.error("%s: corrupt data, answering EIO: %s", fn.__name__, e)
                self.counters.corrupt_reads += 1
            elif code == errno.EIO:
                self._internal_error(fn.__name__, e)
            raise FUSEError(code) from None
        except Exception as e:
            self._internal_error(fn.__name__, e)
            raise FUSEError(errno.EIO) from None

    return wrapper


def _ns(t: float) -> int:
    return int(t * 1e9)


def make_attr(ino: int, mode: int, uid: int, gid: int, times: tuple[float, float, float],
              size: int = 0, stored: int = 0, nlink: int = 1,
              timeout: float = ATTR_TIMEOUT) -> EntryAttributes:
    """Attributes of one inode; ``st_blocks`` counts stored (compressed) bytes for du."""
    a = EntryAttributes()
    a.st_ino = ino
    a.generation = 0
    a.entry_timeout = a.attr_timeout = timeout
    a.st_mode = mode
    a.st_nlink = nlink
    a.st_uid, a.st_gid = uid, gid
    a.st_rdev = 0
    a.st_size = size
    a.st_blksize = BLKSIZE
    a.st_blocks = -(-stored // 512)
    a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = (_ns(t) for t in times)
    return a


def session_attr(ino: int, st: Any) -> EntryAttributes:
    """A session directory from a ``SessionStat``."""
    return make_attr(ino, stat.S_IFDIR | (st.mode & 0o7777), st.uid, st.gid,
                     (st.atime, st.mtime, st.ctime), nlink=2)


def file_attr(ino: int, st: Any, pending: Pending | None) -> EntryAttributes:
    """A file from a ``FileStat``; its size includes the bytes still buffered."""
    size = pending.size if pending is not None else st.size
    return make_attr(ino, stat.S_IFREG | (st.mode & 0o7777), st.uid, st.gid,
                     (st.atime, st.mtime, st.ctime), size, st.stored)


def negative() -> EntryAttributes:
    """A cached "no such entry" answer to a lookup."""
    a = EntryAttributes()
    a.st_ino = 0
    a.entry_timeout = ATTR_TIMEOUT
    return a


def stats_body(store_stats: dict, usage: Any, fs: dict, needs_fsck: bool,
               alerts_state: Callable[[], Any] | None) -> bytes:
    """``/.kvfs/stats``: the engine's stats, its usage, the FUSE layer's counts, alerts."""
    doc = {
        "store": store_stats,
        "usage": asdict(usage),
        "fs": fs,
        "needs_fsck": needs_fsck,
        "alerts": alerts_state() if alerts_state else None,
    }
    return (json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n").encode()


def metrics_body(usage: Any) -> bytes:
    """``/.kvfs/metrics``: the process registry, cold-tier gauges refreshed first."""
    refresh_cold_gauges(usage)
    return metrics.text()


def refresh_cold_gauges(u: Any) -> None:
    """Set the cold-tier gauges of ``kvfs.metrics`` from a ``Store.usage()``."""
    metrics.cold_bytes.set(u.used)
    metrics.cold_capacity.set(u.capacity)
    metrics.cold_sessions.set(u.sessions)
    metrics.cold_checkpoint_age.set(u.checkpoint_age_s)
    if u.stored_bytes_written:
        metrics.cold_compression.set(u.raw_bytes_written / u.stored_bytes_written)

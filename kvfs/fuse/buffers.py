"""The write buffers of the open files: many small kernel writes -> one engine append.

Owns every byte the mount has acknowledged but the engine does not hold yet, and the
bounds on them:

- per file: a buffer becomes one ``Store.append`` (ring entries of at most ``entry_max``)
  when it reaches ``flush_at``, and on flush, fsync and close; an fsync flushes every
  file's buffer before the device flush (``flush_for_sync``);
- per mount: the unflushed bytes of all files stay under ``max_pending`` (memory) and under
  the ring space the engine is known to have free (``headroom``), so a write that cannot
  be stored fails at write() with ENOSPC, not later at close. Past either bound the other
  files' buffers are flushed first (largest first), then this file's; if the bound still
  does not hold, this write goes straight through to the engine: stored before it is
  acknowledged, or taken back and answered with the engine's error. On a full volume the
  engine itself answers at once what its last trip round the ring could not place
  (``kvfs.engine.reclaim``), whichever face asks.

The buffers reach the ``Store`` solely through ``call`` (the layer's single worker), and
only while the inode still names its file (``on_live``): bytes of an unlinked or replaced
file never reach a new file of the same name.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio
from pyfuse3 import FUSEError

from kvfs.engine import errors
from kvfs.engine.store import Store

from .counters import Counters
from .errnos import Stale
from .hooks import Local
from .nodes import Node, shown

log = logging.getLogger("kvfs.fs")

Call = Callable[..., Awaitable[Any]]
T = TypeVar("T")

MAX_PENDING = 256 << 20  # default bound on the mount's unflushed bytes
ENTRY_OVERHEAD = 1024  # ring bytes an entry may take beyond its payload (header, alignment)


def default_max_pending() -> int:
    """``MAX_PENDING``, or an eighth of the machine's RAM where that is less."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return MAX_PENDING
    return max(1 << 20, min(MAX_PENDING, ram // 8))


def on_live(node: Node, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (on the worker), only while ``node`` still names its file.

    Checked on the worker right before the engine call, so an unlink and a new file of
    the same name queued in between cannot slip under it."""
    if node.unlinked:
        raise Stale(f"{shown(node.key)} was unlinked or replaced")
    return fn(*args)


class Tail:
    """A file's buffered bytes, kept as the chunks the kernel wrote: a write is not copied
    (the engine gets them joined once, or the one chunk as it is). Its length is also
    counted in the mount-wide ``total``, so the bound is checked without a walk over every
    open file."""

    __slots__ = ("chunks", "n", "total")

    def __init__(self, total: list[int]) -> None:
        self.chunks: list[bytes] = []
        self.n = 0
        self.total = total  # [bytes buffered by every file]

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def _grow(self, d: int) -> None:
        self.n += d
        self.total[0] += d

    def add(self, b: bytes) -> None:
        chunk = b if type(b) is bytes else bytes(b)
        if chunk:
            self.chunks.append(chunk)
            self._grow(len(chunk))

    def data(self) -> bytes:
        """Every buffered byte as one object (joined once; later calls are free)."""
        if len(self.chunks) > 1:
            self.chunks = [b"".join(self.chunks)]
        return self.chunks[0] if self.chunks else b""

    def keep(self, k: int) -> None:
        """Only the first ``k`` bytes stay (a truncate, a write taken back)."""
        if k < self.n:
            head = self.data()[:max(k, 0)]
            self.chunks = [head] if head else []
            self._grow(len(head) - self.n)

    def drop_front(self, k: int) -> None:
        """The first ``k`` bytes were stored: they leave."""
        if k > 0:
            rest = self.data()[k:]
            self.chunks = [rest] if rest else []
            self._grow(len(rest) - self.n)

    def clear(self) -> None:
        self.chunks = []
        self._grow(-self.n)

    def slice(self, a: int, b: int) -> bytes:
        return self.data()[a:b]


@dataclass(eq=False)
class Pending:
    """Bytes appended to one file (one inode) through the mount, not yet in the engine.

    The engine holds ``base`` bytes; the file's visible size is ``base + len(buf)``. The
    lock orders writes, flushes, truncates and reads of the buffered tail of this file.
    """

    node: Node
    base: int
    buf: Tail
    lock: trio.Lock = field(default_factory=trio.Lock)
    quota: int | None = None  # bytes its session's owner may still add (None: no quota)

    @property
    def size(self) -> int:
        return self.base + len(self.buf)


class WriteBuffers:
    """The write buffers of the open files, by inode (see the module docstring).

    A write must land at the file's visible end (EPERM and a log line otherwise, nothing
    changed). A failed append keeps the bytes buffered and reports the engine's error; the
    last handle's release drops what still cannot be stored, with a log line.
    """

    def __init__(self, store: Store, call: Call, counters: Counters, flush_at: int, entry_max: int,
                 max_pending: int = MAX_PENDING) -> None:
        self.store, self.call, self.counters = store, call, counters
        self.flush_at, self.entry_max, self.max_pending = flush_at, entry_max, max_pending
        self._by_ino: dict[int, Pending] = {}
        self._total = [0]  # bytes buffered over every file (each Tail keeps it)
        self._headroom: int | None = None  # free ring bytes at the last look, less the reserve
        self.shared: Local | None = None  # told what reached the engine (``remote.Remote``), if set

    def get(self, ino: int) -> Pending | None:
        return self._by_ino.get(ino)

    def drop(self, ino: int) -> int:
        """Forget a file's buffer (unlinked, last handle closed); returns bytes dropped."""
        p = self._by_ino.pop(ino, None)
        if p is None:
            return 0
        n = len(p.buf)
        p.buf.clear()
        return n

    def pending(self) -> list[Pending]:
        return list(self._by_ino.values())

    @property
    def pending_bytes(self) -> int:
        return self._total[0]

    # ------------------------------------------------------------------ the global bound
    def _need(self, n: int) -> int:
        """Ring bytes, conservatively, that storing all buffers plus ``n`` bytes takes."""
        total = self.pending_bytes + n
        entries = total // self.entry_max + len(self._by_ino) + 1
        return total + entries * ENTRY_OVERHEAD + self.entry_max  # + one pad at the lap end

    def _fits(self, n: int) -> bool:
        return (self.pending_bytes + n <= self.max_pending and self._headroom is not None
                and self._need(n) <= self._headroom)

    def _headroom_now(self) -> int:
        u = self.store.usage()
        return u.capacity - u.used - int(getattr(self.store, "reserve", 0))

    async def _make_room(self, mine: Pending, n: int) -> None:
        """Flush other files' buffers, largest first, until ``n`` more bytes fit the bounds.

        Holds no lock of ``mine`` and one other lock at a time, so two writers making room
        cannot wait on each other. Stops at the first engine refusal (a full volume refuses
        the others too); those bytes stay buffered and are retried later."""
        self._headroom = await self.call(self._headroom_now, changes=False)
        if self._fits(n):
            return
        for q in sorted(self._by_ino.values(), key=lambda q: len(q.buf), reverse=True):
            if q is mine or not q.buf:
                continue
            async with q.lock:
                try:
                    await self._flush_locked(q)
                except Stale:
                    continue
                except errors.KVFSError:
                    return
            if self._fits(n):
                return

    # ------------------------------------------------------------------ writes
    async def write(self, node: Node, off: int | None, buf: bytes) -> int:
        """Accept ``buf`` at ``off`` (None: at the end, an O_APPEND handle): the bytes
        accepted, or raise; never drop silently.

        The buffer is flushed before it would pass ``flush_at`` or the mount's bound, and
        when this write fills it. If that append fails (ENOSPC), the part of this write
        that did not reach the engine is taken back: a short write when some of it did,
        the error when none did. So what the kernel is told was written is always exactly
        buffered (within the bounds) or stored.
        """
        n = len(buf)
        p = self._by_ino.get(node.ino)
        if p is None:
            st, room = await self.call(on_live, node, self._stat_and_room, node,
                                       changes=False)
            p = self._by_ino.get(node.ino)  # another write may have made it meanwhile
            if p is None:
                p = self._by_ino[node.ino] = Pending(node, st.size, Tail(self._total), quota=room)
        if not self._fits(n):
            await self._make_room(p, n)
        async with p.lock:
            if node.unlinked:
                raise Stale(shown(node.key))
            if off is None:
                off = p.size
            if off != p.size:
                self.counters.refused_writes += 1
                log.warning("write to %s at offset %d refused with EPERM: the file ends at "
                            "%d and only appends are allowed", shown(node.key), off, p.size)
                raise FUSEError(errno.EPERM)
            if p.buf and (len(p.buf) + n > self.flush_at or not self._fits(n)):
                await self._flush_locked(p)
            # no room to promise (the volume's, or the owner's quota): store it before
            # saying yes, so EDQUOT/ENOSPC is this write's answer, not a later close's
            through = not self._fits(n) or (p.quota is not None and len(p.buf) + n > p.quota)
            p.buf.add(buf)
            accepted = n
            if through or len(p.buf) >= self.flush_at:
                try:
                    await self._flush_locked(p)
                except errors.KVFSError:
                    unstored = min(n, len(p.buf))  # this write's tail left in the buffer
                    p.buf.keep(len(p.buf) - unstored)
                    accepted = n - unstored
                    if not accepted:
                        raise
            self.counters.writes += 1
            self.counters.write_bytes += accepted
            return accepted

    async def flush(self, node: Node) -> None:
        """Append the buffer to the engine; on failure it stays buffered and the error rises."""
        p = self._by_ino.get(node.ino)
        if p is not None and p.buf:
            async with p.lock:
                await self._flush_locked(p)

    async def flush_for_sync(self, node: Node, sync: Callable[[], bool],
                             here: Callable[[int], bool] | None = None) -> bool:
        """Before a device flush: this file's buffer and every other buffer free right now
        go to the engine in one worker job, which ends with the device flush ``sync`` (a
        worker-side call). So the one flush makes the other files durable too, their own
        fsyncs find nothing left to do, and a batch costs one hand-off to the worker, not
        one per file (N files written, then fsync'd one by one, cost one job and one
        device flush). Returns whether ``sync`` ran (this file had bytes buffered).

        This file's lock is taken first and the others only when free (never waited for
        while holding one: two fsyncs cannot wait on each other); a busy buffer is being
        written or flushed by its own request and left to it. Another file's failure
        leaves its bytes buffered for its own flush or fsync to report; this file's rises.
        ``here(nbytes)`` says whether the job may run on the calling thread (``Worker.sync_here``)."""
        p = self._by_ino.get(node.ino)
        if p is None or not p.buf:
            await self._flush_others(p)
            return False
        async with p.lock:
            if not p.buf:  # flushed while this waited for the lock
                return False
            held = self._take_free(p)
            batch = [*held, p]
            try:
                await self._store(batch, then=sync,
                                  here=here is not None and here(sum(len(q.buf) for q in batch)))
            finally:
                for q in held:
                    q.lock.release()
            return True

    def _take_free(self, mine: Pending | None) -> list[Pending]:
        """The other files' buffers holding bytes whose lock is free, their locks taken
        (no waiting: see ``flush_for_sync``)."""
        held = []
        for q in list(self._by_ino.values()):
            if q is mine or not q.buf or q.node.unlinked:
                continue
            try:
                q.lock.acquire_nowait()
            except trio.WouldBlock:
                continue
            held.append(q)
        return held

    async def _flush_others(self, mine: Pending | None) -> None:
        """The buffers of every file but ``mine`` whose lock is free, in one worker job."""
        held = self._take_free(mine)
        try:
            if held:
                await self._store(held, own=False)
        finally:
            for q in held:
                q.lock.release()

    async def _flush_locked(self, p: Pending) -> None:
        if p.buf:
            await self._store([p])

    async def _store(self, batch: list[Pending], then: Callable[[], Any] | None = None,
                     own: bool = True, here: bool = False) -> None:
        """Hand the buffers of ``batch`` (their locks held) to the engine in one worker call,
        then ``then`` there (after the last one's complete append). What was stored leaves
        each buffer; the rest stays for a retry. The last buffer's error (or ``then``'s)
        rises when ``own``; the others' are logged."""
        items = [(q.node, q.base, q.buf.data()) for q in batch]
        results, headroom, room = await self.call(self._append_batch, items, then, here=here)
        self._headroom = headroom
        if batch[-1].quota is not None:  # the owner's room after this store
            batch[-1].quota = room
        failure: BaseException | None = None
        for k, (q, (node, base, data), (done, err)) in enumerate(zip(batch, items, results, strict=True)):
            q.buf.drop_front(done)
            q.base += done
            if done and self.shared is not None:  # stored: now it may be replicated
                self.shared.stored(node.key, base, data if done == len(data) else data[:done])
            if err is None:
                continue
            if not isinstance(err, Stale):
                log.error("storing %d bytes of %s at %d failed after %d (the rest, if any, "
                          "kept buffered): %r", len(data), shown(node.key), base, done, err)
            if own and k == len(batch) - 1:
                failure = err
        if failure is not None:
            raise failure

    def _append_batch(self, items: list[tuple[Node, int, bytes]],
                      then: Callable[[], Any] | None = None
                      ) -> tuple[list[tuple[int, BaseException | None]], int | None, int | None]:
        """On the worker (or the trio thread, ``Worker.sync_here``): ``_append_pieces`` of each
        (node, base, data), then ``then`` if the last one was stored whole (its error is
        reported as the last one's); with the headroom after, and the last file's owner's
        quota room."""
        results = [self._append_pieces(*item) for item in items]
        done, err = results[-1]
        if then is not None and err is None:
            try:
                then()
            except Exception as e:
                results[-1] = (done, e)
        try:
            headroom: int | None = self._headroom_now()
        except Exception:  # the next write looks again
            headroom = None
        return results, headroom, self._room(items[-1][0])

    def _stat_and_room(self, node: Node) -> tuple[Any, int | None]:
        """A file's stat and its session owner's byte quota room (on the worker)."""
        return self.store.file_stat(*node.key), self._room(node)

    def _room(self, node: Node) -> int | None:
        room = getattr(self.store, "quota_room", None)
        try:
            return room(node.key[0]) if room is not None else None
        except errors.KVFSError:
            return None

    def _append_pieces(self, node: Node, base: int, data: bytes) -> tuple[int, BaseException | None]:
        """(bytes stored, error) of appending ``data`` as entries of at most ``entry_max``
        bytes; stops at the first failure (on the worker thread)."""
        mv = memoryview(data)
        done = 0
        try:
            while done < len(data):
                n = min(self.entry_max, len(data) - done)
                on_live(node, self.store.append, *node.key, base + done, mv[done:done + n])
                done += n
                self.counters.appends += 1
        except Exception as e:
            return done, e
        return done, None

    async def flush_all(self) -> None:
        """Hand every buffered byte to the engine (at unmount; failures are logged)."""
        for p in self.pending():
            try:
                await self.flush(p.node)
            except (errors.KVFSError, Stale) as e:
                log.error("flush at unmount failed for %s: %r", shown(p.node.key), e)

    async def truncate(self, node: Node, length: int) -> None:
        """Drop the tail of a file (an agent retrying a turn); longer -> EINVAL."""
        p = self._by_ino.get(node.ino)
        if p is None:
            await self.call(on_live, node, self.store.truncate, *node.key, length)
            self._cut(node, length)
            return
        async with p.lock:
            if node.unlinked:
                raise Stale(shown(node.key))
            if length > p.size:
                raise FUSEError(errno.EINVAL)
            if length >= p.base:  # the cut is in the unflushed tail: the engine never saw it
                p.buf.keep(length - p.base)
                return
            p.buf.clear()
            await self.call(on_live, node, self.store.truncate, *node.key, length)
            p.base = length
            self._cut(node, length)

    def _cut(self, node: Node, length: int) -> None:
        if self.shared is not None:
            self.shared.cut(node.key, length)

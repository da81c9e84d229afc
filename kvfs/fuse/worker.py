"""The FUSE layer's engine worker: where the ``Store`` calls of the handlers run.

Every ``Store`` call of the layer goes through ``Worker.call``. A call that changes the
volume (``changes=True``, the default: appends, truncates, creates, deletes, syncs) goes on
a queue to persistent worker threads, which run it and wake the waiting trio task directly
(``TrioToken.run_sync_soon`` + ``reschedule``): no limiter, no per-call thread start, one
checkpoint less than ``trio.to_thread.run_sync`` and one wake-up of the trio thread for all
the jobs that finished while it slept. A device flush is such a call, except a small
one (below).

The ``Store`` is thread-safe (changes take turns under its writer lock; reads run beside
them and each other), so the mount runs ``Worker(threads=N, serialise=False)``: N engine
calls in flight. ``serialise=True`` puts every call under ``engine_lock`` again.

Calls that only look (``changes=False``: reads, stats, listings) run on the trio thread
itself unless ``inline_reads`` is off: on a two-core machine a thread hand-off each way
cost more than the overlap it bought (docs/mount.md, Threads). The trio thread then waits
while such a call reads the disk.

``sync`` skips the device flush when nothing was written since the last one: the volume
counts its completed writes against those its last fsync covered (``VolumeFile``), so N
files fsync'd after one batch cost one flush; when ``Store.durable`` already says so on the
trio thread, it skips the hand-off too.

A small fsync runs on the trio thread as well (``inline_syncs``, ``sync_here``): when it
stores and flushes little and the device's flushes are quick, the two hand-offs cost more
than the flush keeps the loop waiting (docs/mount.md, Threads). A large one, or any while
the device's flushes are slow (their moving average), goes to the worker threads, so a
slow disk never holds up the other requests for long.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from kvfs.engine.store import Store

log = logging.getLogger("kvfs.fs")

T = TypeVar("T")

INLINE_SYNC_BYTES = 1 << 20  # an fsync that stores and flushes at most this much ...
INLINE_SYNC_S = 0.002  # ... while device flushes take less than this may skip the hand-off


class Worker:
    """Runs engine calls on ``threads`` persistent threads (see the module docstring)."""

    def __init__(self, store: Store, threads: int = 1, serialise: bool = True,
                 inline_reads: bool = False, inline_syncs: bool = False) -> None:
        self.store = store
        self.engine_lock = threading.Lock() if serialise else None
        self.inline_reads = inline_reads
        self.inline_syncs = inline_syncs
        self.syncs = 0  # device flushes done (``sync`` calls that were not skipped)
        self.flush_s = 0.0  # moving average of a device flush's duration, in seconds
        self._threads = threads
        self._count_lock = threading.Lock()
        self._q: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._started: list[threading.Thread] = []
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------------ calls
    async def call(self, fn: Callable[..., T], *args: Any, changes: bool = True,
                   here: bool = False) -> T:
        """``fn(*args)`` on a worker thread; its result or its exception.

        ``changes=False`` for calls that only look (reads, stats, listings): a forgotten
        flag costs a hand-off, never a blocked loop. Not cancellable once queued (like
        ``trio.to_thread.run_sync``): the engine call runs to its end and its result is
        delivered. With ``inline_reads``, a call with ``changes=False`` runs here, on the
        calling (trio) thread; so does one with ``here`` (see ``sync_here``) when no change
        holds the store's writer lock, under that lock for its whole length: it never waits
        behind a long change (a checkpoint, a reclaim), it goes to a worker instead."""
        if here and self.engine_lock is None and self.store.try_writer():
            try:
                return fn(*args)
            finally:
                self.store.release_writer()
        if self.inline_reads and not changes:
            if self.engine_lock is None:
                return fn(*args)
            with self.engine_lock:
                return fn(*args)
        if not self._started:
            self._start()
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
        self._q.put((fn, args, task, token))
        # the worker reschedules this task with the call's outcome: its value, or it raises
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    async def sync(self) -> bool:
        """Make every change durable (``store.sync``, on a worker thread); no device flush
        when nothing was written since the last, and no hand-off either when the store says
        so from here (``durable``: the second and later fsyncs of a batch). Returns whether
        the device was flushed."""
        if self.store.durable():
            return False
        return await self.call(self.sync_now)

    def sync_here(self, nbytes: int) -> bool:
        """Whether a job that stores ``nbytes`` and ends in a device flush may run on the
        trio thread: with ``inline_syncs``, when it and what the volume has not flushed yet
        come to at most INLINE_SYNC_BYTES and the device's flushes take under INLINE_SYNC_S."""
        return (self.inline_syncs and self.flush_s < INLINE_SYNC_S
                and nbytes + self.store.unsynced() <= INLINE_SYNC_BYTES)

    def sync_now(self) -> bool:
        """``sync`` on the calling thread (a worker, or the trio thread for ``sync_here``)."""
        t0 = time.perf_counter()
        flushed = self.store.sync() is not False  # the volume may find all durable already
        dt = time.perf_counter() - t0
        with self._count_lock:
            self.syncs += flushed
            if flushed:  # a quarter of the way to this flush's time: one of 4x INLINE_SYNC_S tips it
                self.flush_s += (dt - self.flush_s) / 4
        return flushed

    # ------------------------------------------------------------------ threads
    def _start(self) -> None:
        with self._start_lock:
            while len(self._started) < self._threads:
                t = threading.Thread(target=self._run, name=f"kvfs-engine-{len(self._started)}",
                                     daemon=True)
                t.start()
                self._started.append(t)

    def _run(self) -> None:
        lock = self.engine_lock
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, args, task, token = job
            if lock is not None:
                lock.acquire()
            try:
                result = outcome.capture(fn, *args)
            finally:
                if lock is not None:
                    lock.release()
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:  # the loop that asked is gone (process exit)
                log.debug("engine call finished after its trio loop ended")

    def close(self) -> None:
        """Stop the threads once the queued jobs are done (idempotent)."""
        with self._start_lock:
            for _ in self._started:
                self._q.put(None)
            for t in self._started:
                t.join()
            self._started.clear()

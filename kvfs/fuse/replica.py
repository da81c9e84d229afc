"""The replicator: session files pushed to the shared tier behind the mount's own writes.

After a flush has stored bytes on the local volume, ``ops`` (through ``remote.Remote``)
queues them here: ``(session, file, offset, bytes)``, a truncate, a removal, or "meta.json
changed". One daemon thread (``kvfs-shared-repl``) takes each session's queued jobs as a
batch and applies them to the cluster in order -- the layer files' bytes first, then
meta.json (``put_meta``, read from the local volume at that moment), then the ``sync``
calls fsync is waiting for, then the lease's release once the last writer closed. meta.json
goes with the session's owner (uid, gid, mode of its directory here), so another node's
read-through makes its copy the same owner's. It never runs on the trio thread and never
holds a FUSE request, except fsync, which waits for its ``Sync`` job. What is pushed and
how (reading the local volume) is ``push.Pusher``'s.

Bounds and faults:

- The queued bytes of all sessions stay under ``queue_max``. Past it, a session's new bytes
  are not queued: the session is marked ``repush`` and, once the cluster answers, is
  reconciled from the local volume (its files read back past the cluster's sizes).
- ``SharedUnavailable`` puts the batch back, marks the replicator ``down`` and answers the
  waiting syncs at once; the thread then checks ``healthy()`` every ``RETRY_S`` and resumes.
- ``SharedLost`` (a failover lost acknowledged bytes), ``NotAppend`` or a bad range: the
  session is reconciled from the local volume, then synced again.
- ``LeaseLost``/``SessionBusy``: another node writes the session now; its queue is
  dropped and every fsync of it reports the error until this node takes the lease again
  (``remote.Remote`` then replaces its local copy with the cluster's: ``keep``).
- A session that keeps failing (``MAX_FAILURES`` reconciles in a row) is given up the same
  way, with a log line: a loop of retries would only hide it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfs.engine import errors
from kvfs.shared import (
    BadRange,
    LeaseLost,
    NotAppend,
    NotFoundShared,
    SessionBusy,
    SharedError,
    SharedLost,
    SharedUnavailable,
)

from .push import META, Append, Pusher, Remove, Truncate

if TYPE_CHECKING:
    from kvfs.engine.store import Store
    from kvfs.shared.tier import SharedTier

log = logging.getLogger("kvfs.shared.mount")

RETRY_S = 1.0  # while the cluster is down, how often it is asked whether it is back
MAX_FAILURES = 3


@dataclass
class SessionQueue:
    """What is waiting for one session (see the module docstring)."""

    jobs: list[Any] = field(default_factory=list)  # Append / Truncate / Remove, in order
    nbytes: int = 0  # bytes of the queued appends
    meta: bool = False  # meta.json changed: put_meta after the jobs
    syncs: list[Future] = field(default_factory=list)
    repush: bool = False  # bytes were not queued (bound, loss): reconcile from the volume
    release: bool = False  # the last writer closed: release the lease after the jobs
    releasing: bool = False  # the thread is giving the lease back now (``hold`` waits)
    error: str | None = None  # another node owns it now: fsync fails until re-acquired
    busy: bool = False  # the thread is applying a batch of this session
    failures: int = 0  # reconciles in a row that did not end in a pushed batch


class Replicator:
    """Pushes queued session changes to a ``SharedTier`` from one thread."""

    def __init__(self, tier: SharedTier, store: Store, engine_lock: threading.Lock | None,
                 queue_max: int, versions: dict[tuple[str, ...], str | None] | None = None
                 ) -> None:
        self.tier, self.store, self.queue_max = tier, store, queue_max
        self.pusher = Pusher(tier, store, engine_lock or threading.Lock(), versions)
        self._next_probe = 0.0
        self._cv = threading.Condition()
        self._q: dict[str, SessionQueue] = {}
        self.queued_bytes = 0
        self.down: str | None = None  # why the cluster is taken as unreachable, or None
        self.repushes = 0
        self.overflows = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvfs-shared-repl", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producers (trio)
    def _sq(self, session: str) -> SessionQueue:
        return self._q.setdefault(session, SessionQueue())

    def append(self, session: str, file: str, offset: int, data: bytes) -> None:
        """Bytes stored locally at ``offset`` of ``session/file``: push them."""
        if not data:
            return
        with self._cv:
            q = self._sq(session)
            if q.error is not None:
                pass  # another node owns it: nothing of it is pushed
            elif file == META:
                q.meta = True
            elif q.repush:
                pass  # the reconcile reads them from the volume
            elif self.queued_bytes + len(data) > self.queue_max:
                self.overflows += 1
                if not q.repush:
                    log.warning("replication queue over %d bytes: %r will be re-pushed from "
                                "the local volume", self.queue_max, session)
                self._drop_jobs(q)
                q.repush = True
            else:
                q.jobs.append(Append(file, offset, data))
                q.nbytes += len(data)
                self.queued_bytes += len(data)
            self._cv.notify()

    def meta_changed(self, session: str) -> None:
        """meta.json or the session's owner changed here: push them after the queued jobs."""
        with self._cv:
            q = self._sq(session)
            if q.error is None:
                q.meta = True
            self._cv.notify()

    def truncate(self, session: str, file: str, size: int) -> None:
        with self._cv:
            q = self._sq(session)
            if q.error is not None:
                pass
            elif file == META:
                if size:
                    q.meta = True  # a cut to 0 is the first half of a rewrite: wait for it
            elif not q.repush:
                q.jobs.append(Truncate(file, size))
            self._cv.notify()

    def remove(self, session: str, file: str) -> None:
        with self._cv:
            q = self._sq(session)
            if file != META and not q.repush and q.error is None:
                q.jobs.append(Remove(file))
            self._cv.notify()

    def release_when_done(self, session: str) -> None:
        """The last writer closed: give the lease back once the queue is pushed."""
        with self._cv:
            self._sq(session).release = True
            self._cv.notify()

    def hold(self, session: str) -> None:
        """A writer is about to take the lease: a pending release is off, and one the
        thread is making now has finished when this returns (else it could give back the
        lease the writer takes meanwhile). Blocks: call it off the trio thread."""
        with self._cv:
            q = self._sq(session)
            q.release = False
            while q.releasing:
                self._cv.wait()

    def keep(self, session: str) -> bool:
        """A writer opened (this node holds the lease): a pending release is off. True if
        the session had been given up (another node wrote it meanwhile): the caller
        replaces the local copy with the cluster's before writing."""
        with self._cv:
            q = self._sq(session)
            q.release = False
            lost, q.error, q.failures = q.error is not None, None, 0
            return lost

    def sync(self, session: str) -> Future:
        """A future: None once every change queued for ``session`` so far is pushed and
        ``SharedTier.sync`` returned, or the exception that stopped it."""
        fut: Future = Future()
        with self._cv:
            q = self._q.get(session)
            if q is not None and q.error is not None:
                fut.set_exception(SharedError(q.error))
            elif self.down is not None:
                fut.set_exception(SharedUnavailable(self.down))
            else:
                self._sq(session).syncs.append(fut)
                self._cv.notify()
        return fut

    def pending(self, session: str) -> bool:
        """Changes of ``session`` made here are not all in the cluster yet."""
        with self._cv:
            q = self._q.get(session)
            return q is not None and bool(q.jobs or q.meta or q.repush or q.busy)

    def forget(self, session: str) -> None:
        """The session was removed here: drop what is queued for it."""
        with self._cv:
            q = self._q.get(session)
            if q is not None:
                self._drop_jobs(q)
                q.meta = q.repush = q.release = False
                q.error = None

    def taken(self, session: str) -> bool:
        """Another node took the session's lease while this node wrote it."""
        with self._cv:
            q = self._q.get(session)
            return q is not None and q.error is not None and q.error.startswith("lease")

    def overflowed(self, session: str) -> bool:
        """Bytes of ``session`` are not queued (bound passed, or a loss): fsync may not
        acknowledge them while the cluster is down."""
        with self._cv:
            q = self._q.get(session)
            return q is not None and q.repush

    # ------------------------------------------------------------------ the thread
    def _drop_jobs(self, q: SessionQueue) -> None:
        self.queued_bytes -= q.nbytes
        q.jobs, q.nbytes = [], 0

    def _ready(self) -> str | None:
        for s, q in self._q.items():
            if not q.busy and (q.jobs or q.meta or q.syncs or q.repush or q.release) \
                    and q.error is None:
                return s
        return None

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self.down is not None:  # wait for the next probe, whatever arrives
                        if self._stop:
                            return
                        left = self._next_probe - time.monotonic()
                        if left <= 0:
                            session = None
                            break
                        self._cv.wait(left)
                        continue
                    session = self._ready()
                    if session is not None:
                        break
                    if self._stop:
                        return
                    self._cv.wait()
            if session is None:
                self._probe()
            else:
                self._batch(session)

    def _probe(self) -> None:
        """While down: is the cluster back?"""
        ok = self.tier.healthy()
        with self._cv:
            if ok:
                log.warning("shared tier reachable again: resuming replication (%d bytes "
                            "queued)", self.queued_bytes)
                self.down = None
            else:
                self._next_probe = time.monotonic() + RETRY_S

    def _take(self, session: str) -> tuple[SessionQueue, list[Any], bool, bool, list[Future]]:
        with self._cv:
            q = self._q[session]
            q.busy = True
            jobs, meta, repush, syncs = q.jobs, q.meta, q.repush, q.syncs
            q.jobs, q.nbytes, q.meta, q.repush, q.syncs = [], 0, False, False, []
            return q, jobs, meta, repush, syncs

    def _batch(self, session: str) -> None:
        q, jobs, meta, repush, syncs = self._take(session)
        nbytes = sum(len(j.data) for j in jobs if isinstance(j, Append))
        self.pusher.progress = 0
        try:
            if jobs or meta or repush:  # ours already: one renewal; another node's: busy
                self.tier.acquire(session)
            if repush:
                self.pusher.reconcile(session)
                meta = True
            else:
                self.pusher.apply(session, jobs)
            if meta:
                self.pusher.push_meta(session)
            for attempt in (0, 1):
                if not syncs:
                    break
                try:
                    self.tier.sync(session)
                    break
                except SharedLost as e:  # a failover lost acknowledged bytes: send again
                    if attempt:
                        raise
                    log.warning("%s; re-pushing from the local volume", e)
                    self.repushes += 1
                    self.pusher.reconcile(session)
                    self.pusher.push_meta(session)
            for f in syncs:
                f.set_result(None)
            syncs = []
            q.failures = 0
            with self._cv:
                release = q.release and not q.jobs and not q.meta and not q.repush
                if release:
                    q.release, q.releasing = False, True
            if release:
                try:
                    self.tier.release(session)
                finally:
                    with self._cv:
                        q.releasing = False
                        self._cv.notify_all()
        except SharedUnavailable as e:
            self._put_back(q, jobs[self.pusher.progress:], meta, repush, syncs, e)
            with self._cv:
                if self.down is None:
                    log.warning("shared tier unavailable, replication paused (local reads "
                                "and writes go on): %s", e)
                self.down = str(e)
                self._next_probe = time.monotonic() + RETRY_S
        except (LeaseLost, SessionBusy) as e:
            log.error("session %r is written by another node now; its changes here are not "
                      "replicated: %s", session, e)
            with self._cv:
                self._drop_jobs(q)
                q.error = f"lease: {e}"
                q.meta = q.repush = q.release = False
            for f in syncs:
                f.set_exception(e)
        except (SharedLost, NotAppend, BadRange, NotFoundShared, errors.NotFound) as e:
            q.failures += 1
            if q.failures >= MAX_FAILURES:
                log.error("session %r: replication given up after %d attempts: %s", session,
                          q.failures, e)
                with self._cv:
                    self._drop_jobs(q)
                    q.error = f"replication failed: {type(e).__name__}: {e}"
                    q.meta = q.repush = q.release = False
                for f in syncs:
                    f.set_exception(e)
            else:
                log.warning("session %r: %s; reconciling from the local volume", session, e)
                self.repushes += 1
                self._put_back(q, [], True, True, syncs, None)
        except Exception as e:  # a bug or a refusal: fsync reports it, the mount goes on
            log.exception("replication of session %r failed", session)
            for f in syncs:
                f.set_exception(e)
            with self._cv:
                self._drop_jobs(q)
                q.error = f"replication failed: {type(e).__name__}: {e}"
                q.meta = q.repush = q.release = False
        finally:
            with self._cv:
                self.queued_bytes -= nbytes
                q.busy = False
                self._q.pop(session, None)  # back in at the end: sessions take turns
                if q.jobs or q.meta or q.syncs or q.repush or q.release or q.error:
                    self._q[session] = q
                self._cv.notify_all()

    def _put_back(self, q: SessionQueue, jobs: list[Any], meta: bool, repush: bool,
                  syncs: list[Future], err: BaseException | None) -> None:
        with self._cv:
            n = sum(len(j.data) for j in jobs if isinstance(j, Append))
            q.jobs = jobs + q.jobs
            q.nbytes += n
            self.queued_bytes += n  # the finally takes the batch's bytes off again
            q.meta = q.meta or meta
            q.repush = q.repush or repush
            if q.repush:
                self._drop_jobs(q)
            if err is None:
                q.syncs = syncs + q.syncs
        if err is not None:
            for f in syncs:
                f.set_exception(err)

    # ------------------------------------------------------------------ life cycle
    def drain(self, timeout: float) -> bool:
        """Wait until nothing is queued (or ``timeout``); True when all was pushed."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._q and self.down is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.1))
            return not any(q.jobs or q.meta or q.repush for q in self._q.values())

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {"queued_bytes": self.queued_bytes, "queued_sessions": len(self._q),
                    "queue_max": self.queue_max, "pushed_bytes": self.pusher.pushed_bytes,
                    "repushes": self.repushes, "overflows": self.overflows,
                    "down": self.down,
                    "sessions_lost": sorted(s for s, q in self._q.items() if q.error)}

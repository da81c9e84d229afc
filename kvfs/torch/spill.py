"""The spill thread: hands K/V that fell out of the hot window to the warm tier.

Owns one background thread per router (or per standalone cache) and an ordered queue of
jobs. The forward pass only *submits*: on CPU it makes the token-major copy of the few tokens
that fell out (so no job keeps a whole window's storage alive); on CUDA it starts a
``non_blocking`` device-to-host copy into a pinned staging buffer and records an event,
and the spill thread waits on that event. The forward pass never waits for disk; the
queue is bounded in bytes (``max_pending_bytes``) and a full queue blocks the submitter
(back-pressure) instead of growing memory.

Jobs run in submission order per file, so appends to a (session, layer) file stay in
token order, and a "call" job (``meta.json``, a round summary) runs after every append
submitted before it. The thread lingers a little (``linger_s``, or until
``linger_bytes`` are pending, or someone waits) and then writes each file's pending tokens
as one append: one decode step hands over one token per layer, and per-token appends
would cost the forward pass more in GIL and CPU time than the bytes are worth. ``wait(ticket)`` blocks until a given job (default: all) is done.
A failed write is that session's error: kept, logged and re-raised as :class:`SpillError` by
the session's next ``submit`` or a ``wait(sid=...)`` for it, never by another session's
call (the router serves many sessions through one spiller); after a failure no further
jobs of that session run (its file would get a hole) until ``forget(sid)`` (the session
was resumed from the mount or deleted). A job that names no session (``sid`` "") fails
the whole spiller. A spiller of one session (a standalone cache's, ``isolate=False``)
raises its session's failure from every ``wait``. A call job's session is its ``sid=`` or its first ``str`` argument
(every call the cache queues is ``fn(sid, ...)`` or ``fn(warm, sid, ...)``).

Never imports transformers; never decides *what* to spill (``kvfs.torch.cache`` does).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvfs.ops import metrics
from kvfs.torch.fingerprint import kv_to_token_major, token_major_bytes

if TYPE_CHECKING:
    from kvfs.torch.seams import WarmStore

log = logging.getLogger("kvfs.torch.spill")
_cache_log = logging.getLogger("kvfs.torch.cache")  # a session's discard notice is its cache's


class SpillError(RuntimeError):
    """A background append to the warm tier failed; the session's stored KV is incomplete."""


class PinnedPool:
    """Reusable pinned host buffers for device-to-host staging (CUDA only).

    Buffers are bucketed by power-of-two size; at most ``keep`` bytes stay cached.
    """

    def __init__(self, keep: int = 64 << 20) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._cached = 0
        self._keep = keep
        self._lock = threading.Lock()
        self.allocations = 0

    def get(self, nbytes: int) -> torch.Tensor:
        size = 1 << max(12, (nbytes - 1).bit_length())
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                self._cached -= size
                return bucket.pop()
        self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def put(self, buf: torch.Tensor) -> None:
        size = buf.numel()
        with self._lock:
            if self._cached + size <= self._keep:
                self._free.setdefault(size, []).append(buf)
                self._cached += size


class _Job:
    """One queued append (CPU tensors or a staged pinned buffer) or one call."""

    __slots__ = ("ticket", "nbytes", "sid", "layer", "start_byte", "k", "v", "staged", "event",
                 "fn", "args")

    def __init__(self, nbytes: int, sid: str = "", layer: int = -1, start_byte: int = 0,
                 k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                 staged: torch.Tensor | None = None, event: torch.cuda.Event | None = None,
                 fn: Callable[..., Any] | None = None, args: tuple = ()) -> None:
        self.ticket = 0
        self.nbytes, self.sid, self.layer, self.start_byte = nbytes, sid, layer, start_byte
        self.k, self.v, self.staged, self.event = k, v, staged, event
        self.fn, self.args = fn, args


class Spiller:
    """Ordered background writer of token-major KV bytes into a warm tier."""

    def __init__(self, warm: WarmStore, *, max_pending_bytes: int = 64 << 20, name: str = "kvfs-spill",
                 linger_s: float = 0.25, linger_bytes: int = 1 << 20, isolate: bool = False) -> None:
        self.warm = warm
        self.isolate = isolate  # many sessions (a router's): a wait raises only its own
        self.max_pending_bytes = int(max_pending_bytes)
        self.linger_s = linger_s
        self.linger_bytes = min(int(linger_bytes), self.max_pending_bytes // 2)
        self._waiters = 0
        self._q: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._next_ticket = 0
        self._done_ticket = -1
        self._pending_bytes = 0
        self._error: BaseException | None = None  # a failure no session owns: every call's
        self._failed: dict[str, BaseException] = {}  # sid -> its failure: only its calls'
        self._closing = False
        self._pool: PinnedPool | None = None
        # statistics
        self.submitted_bytes = 0
        self.written_bytes = 0
        self.appends = 0
        self.stalls = 0  # submits that waited for room (back-pressure)
        self.stall_s = 0.0
        self.peak_pending_bytes = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- submitting (forward-pass side) ----------------------------------------------------
    def submit_kv(self, sid: str, layer: int, start_byte: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Queue K/V ``[1,H,T,D]`` for appending at ``start_byte`` of (sid, layer); returns a ticket.

        The tensors must not be modified in place afterwards (the cache never does).
        """
        nbytes = 2 * k.numel() * k.element_size()
        if nbytes == 0:
            return self._done_ticket
        if k.is_cuda:
            tm = kv_to_token_major(k, v)  # a small device tensor, freed stream-ordered
            if self._pool is None:
                self._pool = PinnedPool()
            staged = self._pool.get(nbytes)
            staged[:nbytes].view(tm.dtype).view(tm.shape).copy_(tm, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(k.device))
            job = _Job(nbytes, sid, layer, start_byte, staged=staged, event=ev)
        else:  # a token-major copy now: the job must not keep the window's storage alive
            job = _Job(nbytes, sid, layer, start_byte, k=kv_to_token_major(k, v))
        return self._put(job)

    def submit_call(self, fn: Callable[..., Any], *args: Any, sid: str | None = None) -> int:
        """Queue ``fn(*args)`` to run after every job submitted so far; returns a ticket."""
        if sid is None:
            sid = next((a for a in args[:2] if isinstance(a, str)), "")
        return self._put(_Job(0, sid=sid, fn=fn, args=args))

    def _put(self, job: _Job) -> int:
        with self._cv:
            self._raise_if_failed(job.sid)
            if self._closing:
                raise SpillError("spill thread is closed")
            if self._pending_bytes and self._pending_bytes + job.nbytes > self.max_pending_bytes:
                self.stalls += 1
                t0 = time.perf_counter()
                self._waiters += 1
                self._cv.notify_all()
                try:
                    while (self._pending_bytes and self._error is None
                           and self._pending_bytes + job.nbytes > self.max_pending_bytes):
                        self._cv.wait(0.5)
                finally:
                    self._waiters -= 1
                self.stall_s += time.perf_counter() - t0
                self._raise_if_failed(job.sid)
            job.ticket = self._next_ticket
            self._next_ticket += 1
            self._q.append(job)
            self._pending_bytes += job.nbytes
            self.submitted_bytes += job.nbytes
            self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)
            if len(self._q) == 1 or self._pending_bytes >= self.linger_bytes:
                self._cv.notify_all()  # wake the thread only when it has something new to do
            return job.ticket

    def wait(self, ticket: int | None = None, timeout: float | None = None,
             sid: str | None = None) -> None:
        """Block until job ``ticket`` (default: every job submitted so far) has run; then
        raise a failure of session ``sid`` (given) or one no session owns, never another
        session's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            target = self._next_ticket - 1 if ticket is None else ticket
            self._waiters += 1  # the thread stops lingering while anyone waits
            self._cv.notify_all()
            try:
                while self._done_ticket < target and self._error is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"spill queue did not drain in {timeout} s")
                    self._cv.wait(0.5 if left is None else min(left, 0.5))
            finally:
                self._waiters -= 1
            self._raise_if_failed(sid)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def _raise_if_failed(self, sid: str | None = None) -> None:
        err = self._error
        if err is None and not self.isolate and self._failed:  # one session's spiller: any
            err = next(iter(self._failed.values()))
        elif err is None:
            err = self._failed.get(sid or "")
        if err is not None:
            raise SpillError(f"background spill to the warm tier failed: {err}") from err

    def failed(self) -> dict[str, BaseException]:
        """The sessions whose spill failed, each with its error."""
        with self._cv:
            return dict(self._failed)

    def forget(self, sid: str) -> BaseException | None:
        """Clear ``sid``'s failure (it is resumed from the mount, or deleted); returns it."""
        with self._cv:
            return self._failed.pop(sid, None)

    def close(self, timeout: float = 60.0) -> None:
        """Drain the queue and stop the thread (idempotent). Raises a pending failure."""
        with self._cv:
            if self._closing:
                return
        try:
            self.wait(timeout=timeout)
        finally:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            self._thread.join(timeout)

    # --- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closing:
                    self._cv.wait()
                if not self._q and self._closing:
                    return
                deadline = time.monotonic() + self.linger_s
                while (not self._waiters and not self._closing
                       and self._pending_bytes < self.linger_bytes):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                jobs = list(self._q)
                self._q.clear()
            if self._error is None:
                try:
                    self._execute(jobs)
                except BaseException as e:  # noqa: BLE001 - kept and re-raised to the caller
                    log.exception("spill job failed")
                    with self._cv:
                        self._error = e
            with self._cv:
                for j in jobs:
                    self._pending_bytes -= j.nbytes
                self._done_ticket = jobs[-1].ticket
                self._cv.notify_all()

    def _execute(self, jobs: list[_Job]) -> None:
        """Run ``jobs``: appends grouped per file (order kept), call jobs as barriers. A
        session's failure stops only that session's jobs."""
        groups: dict[tuple[str, int], list[_Job]] = {}
        for j in jobs:
            if j.fn is not None:
                self._write_groups(groups)
                groups = {}
                if j.sid:
                    self._guarded(j.sid, j.fn, *j.args)
                else:
                    j.fn(*j.args)
            else:
                groups.setdefault((j.sid, j.layer), []).append(j)
        self._write_groups(groups)

    def _guarded(self, sid: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run one job of session ``sid`` unless it failed before; a failure is kept as its."""
        if sid in self._failed:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - kept and re-raised to that session's calls
            log.error("session %r: background spill to the warm tier failed: %s; its later "
                      "writes are dropped until it is resumed from the mount", sid, e)
            with self._cv:
                self._failed[sid] = e

    def _write_groups(self, groups: dict[tuple[str, int], list[_Job]]) -> None:
        for (sid, layer), js in groups.items():
            self._guarded(sid, self._write_file, sid, layer, js)

    def _write_file(self, sid: str, layer: int, js: list[_Job]) -> None:
        try:
            self._write_runs(sid, layer, js)
        finally:  # staged buffers go back to the pool whether or not the bytes were written
            for x in js:
                if x.staged is not None and self._pool is not None:
                    self._pool.put(x.staged)
                x.k = x.v = x.staged = None

    def _write_runs(self, sid: str, layer: int, js: list[_Job]) -> None:
        i = 0
        while i < len(js):  # runs of jobs that continue each other
            n = i + 1
            end = js[i].start_byte + js[i].nbytes
            while n < len(js) and js[n].start_byte == end:
                end += js[n].nbytes
                n += 1
            data = self._bytes_of_run(js[i:n])
            new_size = self.warm.append(sid, layer, data)
            if new_size != end:
                raise SpillError(
                    f"session {sid!r} layer {layer}: warm file is {new_size} bytes after an "
                    f"append that should end at {end} (another writer, or a stale session?)")
            self.appends += 1
            self.written_bytes += data.nbytes
            metrics.hot_spills.inc(data.nbytes)
            i = n

    def _bytes_of_run(self, run: list[_Job]) -> np.ndarray:
        parts = [self._bytes_of(j) for j in run]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    @staticmethod
    def _bytes_of(j: _Job) -> np.ndarray:
        if j.staged is not None:
            assert j.event is not None  # staged with its copy's event
            j.event.synchronize()
            return j.staged[: j.nbytes].numpy()  # returned to the pool only after the append
        assert j.k is not None  # CPU: already token-major
        return token_major_bytes(j.k)

    def stats(self) -> dict[str, Any]:
        return {
            "submitted_bytes": self.submitted_bytes, "written_bytes": self.written_bytes,
            "pending_bytes": self._pending_bytes, "peak_pending_bytes": self.peak_pending_bytes,
            "appends": self.appends, "stalls": self.stalls, "stall_s": round(self.stall_s, 4),
            "pinned_allocations": self._pool.allocations if self._pool else 0,
        }


class SessionSpill:
    """One session's way down: its K/V hand-downs, summaries and meta.json snapshots, in
    order on a :class:`Spiller` (a router's, shared, or one of its own). Without a warm tier
    what leaves the window is discarded (one log line)."""

    def __init__(self, sid: str, warm: WarmStore | None, spiller: Spiller | None,
                 token_bytes: int) -> None:
        self.sid = sid
        self.warm = warm
        self.own = spiller is None and warm is not None  # closed with the cache
        self.spiller = spiller if spiller is not None else (Spiller(warm) if warm is not None else None)
        self.token_bytes = token_bytes
        self.spilled_tokens = 0  # layer-0 tokens handed down
        self._warned = False

    def kv(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue tokens ``[start, start + T)`` of ``layer`` (K/V ``[1, H, T, D]``)."""
        if layer == 0:
            self.spilled_tokens += k.shape[-2]
        if self.spiller is None:
            if not self._warned:
                _cache_log.info("session %r has no warm tier: tokens leaving the window are discarded",
                         self.sid)
                self._warned = True
            return
        self.spiller.submit_kv(self.sid, layer, start * self.token_bytes, k, v)

    def summary(self, idx: int, vec: np.ndarray) -> None:
        if self.spiller is not None and self.warm is not None:
            self.spiller.submit_call(self.warm.put_summary, self.sid, idx, vec)

    def meta(self, meta: dict) -> int | None:
        """Queue a meta.json snapshot (after everything queued so far); its ticket."""
        if self.spiller is None or self.warm is None:
            return None
        return self.spiller.submit_call(self.warm.put_meta, self.sid, meta)

    def flush(self, wait: bool) -> None:
        """Queue the warm tier's flush of the session; with ``wait``, return once it ran."""
        if self.spiller is None or self.warm is None:
            return
        self.spiller.submit_call(self.warm.flush, self.sid)
        if wait:
            self.spiller.wait()

    def wait(self) -> None:
        """Return once everything queued so far is in the warm tier."""
        if self.spiller is not None:
            self.spiller.wait()

    def close(self) -> None:
        """Stop the spill thread if it is this session's own (after draining it)."""
        if self.own and self.spiller is not None:
            self.spiller.close()

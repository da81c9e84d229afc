"""Applying a session's queued changes to the shared tier, reading the local volume.

``Pusher`` is the replicator thread's hands (``replica.Replicator`` decides what and when):
it applies queued appends (contiguous ones joined up to ``PUSH_MAX``), truncates and
removals in order, pushes meta.json with the session's owner, and reconciles a session
from the volume (bytes past the cluster's size appended, longer files cut, files gone
removed). Local bytes are read with the engine worker's lock held: the ``Store`` is not
thread-safe, and this thread is the only one besides the worker that calls it.

After each append or cut it records the content version the cluster's file has now in
``versions`` (shared with ``remote.Remote``): the local copy, which the pushed bytes came
from, is of that version.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfs.engine import errors
from kvfs.ops import metrics
from kvfs.session.names import META, is_claim
from kvfs.shared import NotAppend, NotFoundShared, Owner

if TYPE_CHECKING:
    from kvfs.engine.store import Store
    from kvfs.shared.tier import SharedTier

log = logging.getLogger("kvfs.shared.mount")

PUSH_MAX = 8 << 20  # contiguous queued appends are joined into pushes of at most this
READ_STEP = 4 << 20  # a reconcile reads the local volume this much at a time


@dataclass
class Append:
    file: str
    offset: int
    data: bytes


@dataclass
class Truncate:
    file: str
    size: int


@dataclass
class Remove:
    file: str


class Pusher:
    """Pushes one session's changes at a time from the replicator thread."""

    def __init__(self, tier: SharedTier, store: Store, engine_lock: threading.Lock,
                 versions: dict[tuple[str, ...], str | None] | None = None) -> None:
        self.tier, self.store, self._engine_lock = tier, store, engine_lock
        self.versions = {} if versions is None else versions
        self.progress = 0  # jobs of the current batch applied
        self.pushed_bytes = 0

    def apply(self, session: str, jobs: list[Any]) -> None:
        """Apply ``jobs`` in order; ``progress`` counts those done (if one raises, the
        caller puts the rest back)."""
        i = 0
        while i < len(jobs):
            j = jobs[i]
            if isinstance(j, Append):
                n = i + 1  # join contiguous appends to the same file
                parts, end = [j.data], j.offset + len(j.data)
                while (n < len(jobs) and isinstance(jobs[n], Append) and jobs[n].file == j.file
                       and jobs[n].offset == end and end - j.offset < PUSH_MAX):
                    parts.append(jobs[n].data)
                    end += len(jobs[n].data)
                    n += 1
                self.push(session, j.file, j.offset,
                           b"".join(parts) if len(parts) > 1 else parts[0])
                i = self.progress = n
                continue
            if isinstance(j, Truncate):
                self.tier.truncate(session, j.file, j.size)
                self._noted(session, j.file)
            else:
                try:
                    self.tier.remove_file(session, j.file)
                except NotFoundShared:
                    pass
                self.versions.pop((session, j.file), None)
            i = self.progress = i + 1

    def push(self, session: str, file: str, offset: int, data: bytes) -> None:
        try:
            self.tier.append(session, file, offset, data)
        except NotAppend as e:
            if e.size >= offset + len(data):
                return  # already there (a reconcile sent it)
            if e.size < offset:
                raise  # a gap: the caller reconciles
            self.tier.append(session, file, e.size, data[e.size - offset:])
        self._noted(session, file)
        self.pushed_bytes += len(data)
        metrics.shared_pushed.inc(len(data))

    def _noted(self, session: str, file: str) -> None:
        """The cluster's file is of the version this node's write left: so is the local copy."""
        version = self.tier.take_version(session, file)
        if version is not None:
            self.versions[(session, file)] = version

    def _local(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._engine_lock:
            return fn(*args)

    def reconcile(self, session: str) -> None:
        """Make the cluster's files of ``session`` what the local volume holds: bytes past
        the cluster's size appended, longer files cut, files gone removed."""
        try:
            names = self._local(self.store.list_files, session)
        except errors.NotFound:
            return
        remote = self.tier.list_files(session)
        for name in names:
            if is_claim(name):  # pushed with the owner record (``push_meta``)
                continue
            try:
                size = self._local(self.store.file_stat, session, name).size
            except errors.NotFound:
                continue
            have = remote.get(name, 0)
            if have > size:
                self.tier.truncate(session, name, size)
                self._noted(session, name)
                have = size
            while have < size:
                data = self._local(self.store.read, session, name, have, min(READ_STEP, size - have))
                if not data:
                    break
                self.push(session, name, have, data)
                have += len(data)
        for name in set(remote) - set(names):
            self.tier.remove_file(session, name)
            self.versions.pop((session, name), None)
        log.info("session %r reconciled with the shared tier", session)

    def push_meta(self, session: str) -> None:
        try:
            st = self._local(self.store.session_stat, session)
            size = self._local(self.store.file_stat, session, META).size
            data = self._local(self.store.read, session, META, 0, size) if size else b""
        except errors.NotFound:
            return
        if data:
            self.tier.put_meta(session, data, Owner(st.uid, st.gid, st.mode & 0o7777))

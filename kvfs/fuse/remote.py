"""The mount's side of the shared tier: read-through, session leases, fsync's wait.

``Remote`` is what ``ops`` calls (on the trio thread; every cluster call runs on a trio
worker thread, never on the loop); ``Local`` is the same interface doing nothing, for a
mount without ``--shared``. The pushing itself is the ``replica.Replicator``'s.

- **Read-through.** A lookup of ``/sessions/X`` (or of a file in it) that misses the local
  volume asks the cluster; a session there (its meta.json is stored) is created locally
  with its files empty and meta.json whole, owned as on the node that wrote it (the owner
  record travels with the session: whoever looked it up, the kernel then checks the
  owner's permissions), and the cluster's sizes are remembered (``remote``). Attributes show those sizes; a read past the local bytes
  fetches the missing chunks (in order, up to the chunk boundary past the read) and
  appends them to the local file, so later reads are local. A session not being written
  here is re-checked on open (at most every ``REFRESH_S``): files the cluster holds longer
  than the local copy are fetched on, and a changed meta.json replaces the local one.
- **Freshness by content version.** The cluster keeps a version per file, new whenever the
  file is made or rewritten (cut, or removed and made again), kept while it is appended to.
  ``versions`` holds the version each local copy is of (learned when it is read through,
  or when this node's own write is pushed); a refresh empties and reads through again a
  local copy whose version is not the cluster's -- a file rewritten elsewhere at the same
  size, or, after a remount (a crash included: the volume does not keep versions), any
  copy whose version another node made. A version names the node that made it: one made
  by this node's own writes is its volume's, trusted by size as before (bytes a lost
  queue did not push stay, and are re-pushed at the next write). A cluster file without
  a version (stored before they were kept) or with one that does not verify is read
  through once and then compared by size. ``fill`` checks every fetch's version, so bytes
  of two versions never mix.
- **Leases.** A file opened for writing (or created, cut, removed) takes the session's
  lease first; another node's live lease answers EBUSY with a log line naming it. The
  local copy is then completed from the cluster before the first write (appends go at the
  end). The lease is released once the last writer closed and its bytes are pushed.
- **fsync** returns once the replicator pushed the session's queued bytes and
  ``SharedTier.sync`` returned. While the cluster is unreachable it retries for
  ``fsync_wait_s``, then acknowledges locally only -- unless the session's bytes passed
  the queue's bound, which is EIO (docs/scale-out.md).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import trio
from pyfuse3 import FUSEError

from kvfs.engine import errors
from kvfs.ops import metrics
from kvfs.shared import (
    NotFoundShared,
    Owner,
    SessionBusy,
    SharedCorrupt,
    SharedError,
    SharedUnavailable,
    check_name,
)

from .buffers import on_live
from .hooks import Local
from .nodes import Key, Node, shown
from .replica import META, Replicator

if TYPE_CHECKING:
    from kvfs.engine.store import Store
    from kvfs.shared.tier import SharedTier

log = logging.getLogger("kvfs.shared.mount")

REFRESH_S = 1.0  # a session read here but written elsewhere is re-checked this often
_UNKNOWN = object()  # no version recorded for a local copy: it is not trusted
FETCH_CHUNKS = 16  # a read-through fetch takes at most this many cluster chunks at once
SYNC_WAIT_S = 120.0  # fsync gives up on a replicator that does not answer (EIO)


class Remote(Local):
    """The shared tier as the mount uses it (see the module docstring)."""

    enabled = True

    def __init__(self, tier: SharedTier, store: Store, call: Callable[..., Any], engine_lock: threading.Lock | None,
                 queue_max: int, fsync_wait_s: float, entry_max: int) -> None:
        self.tier, self.store, self.call = tier, store, call
        self.fsync_wait_s, self.entry_max = fsync_wait_s, entry_max
        # (session, file) -> the cluster's content version the local copy is of (None: the
        # cluster's file has none); a key missing: unknown, the copy is not trusted
        self.versions: dict[Key, str | None] = {}
        self.repl = Replicator(tier, store, engine_lock, queue_max, self.versions)
        self.remote: dict[Key, int] = {}  # files the cluster holds longer than the volume
        self.writers: dict[str, int] = {}  # session -> writing handles here (lease held)
        self.written: set[str] = set()  # sessions written through this mount
        self.deleted: set[str] = set()  # removed here: never read through again
        self._checked: dict[str, float] = {}  # session -> when it was last refreshed
        self._locks: dict[Key, trio.Lock] = {}
        self.counts = {"hits": 0, "misses": 0, "fetched_bytes": 0, "busy_refusals": 0,
                       "local_only_fsyncs": 0, "fsync_errors": 0}
        self._takeovers_seen = 0
        self._stale: set[str] = set()  # given up here, written elsewhere: adopt on write

    # ------------------------------------------------------------------ plumbing
    async def _t(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(functools.partial(fn, *args))

    def _hit(self) -> None:
        self.counts["hits"] += 1
        metrics.shared_hits.inc()

    def _miss(self) -> None:
        self.counts["misses"] += 1
        metrics.shared_misses.inc()

    def _append_local(self, session: str, file: str, off: int, data: bytes) -> None:
        """On the worker: ``data`` appended at ``off`` as entries of at most entry_max."""
        mv = memoryview(data)
        for i in range(0, len(data), self.entry_max):
            self.store.append(session, file, off + i, mv[i:i + self.entry_max])

    def _reachable(self, session: str) -> bool:
        return self.repl.down is None and session not in self.deleted

    # ------------------------------------------------------------------ names
    def check_new_name(self, name: str) -> None:
        """A session or file name the cluster cannot hold is refused when it is made
        (EINVAL), never accepted here and then lost."""
        try:
            check_name(name)
        except ValueError as e:
            log.warning("name %s refused with EINVAL: the shared tier cannot replicate it (%s)",
                        shown(name), e)
            raise FUSEError(errno.EINVAL) from None

    async def lease_owner(self, session: str) -> str | None:
        """The node holding ``session``'s lease (this one included); None if nobody does or
        the cluster cannot say."""
        if self.repl.down is not None:
            return None
        try:
            return await self._t(self.tier.lease_owner, session)
        except (SharedError, ValueError) as e:
            log.debug("lease owner of %s: %s", shown(session), e)
            return None

    def owner_changed(self, session: str) -> None:
        """chmod/chown of a session here: the cluster's owner record follows."""
        self.repl.meta_changed(session)  # meta.json is pushed with the owner record

    # ------------------------------------------------------------------ read-through
    async def import_session(self, name: str, uid: int, gid: int) -> bool:
        """A session missing locally: made here from the cluster if it holds it, owned by
        the owner it had where it was written (``uid``/``gid``, who looked it up, are not
        used: a lookup never hands a session to whoever made it). A session written before
        owners were recorded is made root's, 0700."""
        if not self._reachable(name):
            return False
        try:
            info = await self._t(self.tier.open_session, name)
        except (SharedError, ValueError) as e:
            log.warning("read-through of session %s failed, answering from the volume: %s",
                        shown(name), e)
            return False
        if info is None:
            self._miss()
            return False
        files, meta, owner = info.files, info.meta, info.owner
        if owner is None:
            log.warning("session %s in the shared tier has no owner record: made root's, 0700",
                        shown(name))
            owner = Owner(0, 0, 0o700)

        def make() -> None:
            try:
                self.store.create_session(name, owner.mode & 0o7777, owner.uid, owner.gid)
            except errors.Exists:
                pass
            have = set(self.store.list_files(name))
            for f in files:
                if f not in have:
                    self.store.create_file(name, f, 0o600, owner.uid, owner.gid)
                    self.versions[(name, f)] = info.versions.get(f)  # empty: of any version
            if meta and META not in have:
                self.store.create_file(name, META, 0o600, owner.uid, owner.gid)
                self._append_local(name, META, 0, meta)

        await self.call(make)
        for f, size in files.items():
            self.remote[(name, f)] = size
        self._checked[name] = time.monotonic()
        self._hit()
        log.info("session %s read through from the shared tier: %d files, %d bytes",
                 shown(name), len(files), sum(files.values()))
        return True

    async def import_file(self, key: Key, uid: int, gid: int) -> bool:
        """A file missing from a local session: made here if the cluster holds it, owned by
        the session's owner (not by ``uid``/``gid``, who looked it up)."""
        session, name = key
        if self.writers.get(session) or not self._reachable(session):
            return False  # being written here: the volume is the truth
        try:
            if name == META:
                meta = await self._t(self.tier.get_meta, session)
                size = None if meta is None else len(meta)
            else:
                size = await self._t(self.tier.size, session, name)
        except NotFoundShared:
            size = None
        except (SharedError, ValueError) as e:
            log.debug("read-through of %s: %s", shown(key), e)
            return False
        if size is None:
            self._miss()
            return False

        def make() -> None:
            st = self.store.session_stat(session)
            try:
                self.store.create_file(session, name, 0o600, st.uid, st.gid)
            except errors.Exists:
                return
            if name == META and meta:
                self._append_local(session, name, 0, meta)

        await self.call(make)
        if name != META:
            self.remote[key] = size
        self._hit()
        return True

    async def refresh(self, session: str, force: bool = False) -> list[Key]:
        """Bring a session written elsewhere up to the cluster's copy (files longer there
        are fetched on read; new files made; a copy of another content version emptied and
        read through again; a changed meta.json replaced). Returns the keys that grew or
        were replaced (the kernel's size and pages of them are stale)."""
        now = time.monotonic()
        if (not force and (self.writers.get(session) or now - self._checked.get(session, -1e9)
                           < REFRESH_S)) or not self._reachable(session) \
                or self.repl.pending(session):
            return []
        self._checked[session] = now
        try:
            files = await self._t(self.tier.file_versions, session)
            if not files:
                return []
            local = await self.call(self._local_sizes, session, changes=False)
            stale = {f: n for f, (n, v) in files.items()
                     if local.get(f, 0) > 0 and not self._trusted((session, f), v)}
            ahead = {f: n for f, (n, _) in files.items() if n > local.get(f, -1) or f in stale}
            meta = None
            if ahead or session not in self.written:
                meta = await self._t(self.tier.get_meta, session)
        except (SharedError, ValueError, errors.NotFound) as e:
            log.debug("refresh of session %s: %s", shown(session), e)
            return []

        def apply() -> bool:
            st = self.store.session_stat(session)  # files made here are the session owner's
            for f in ahead:
                if f not in local:
                    self.store.create_file(session, f, 0o600, st.uid, st.gid)
                elif f in stale:
                    self.store.truncate(session, f, 0)
            for f, (_, v) in files.items():  # every local copy is of the cluster's version
                if local.get(f, 0) == 0 or f in stale or (session, f) not in self.versions:
                    self.versions[(session, f)] = v
            if meta is None:
                return False
            old = self.store.read(session, META, 0, local[META]) if META in local else None
            if old == meta:
                return False
            if old is None:
                self.store.create_file(session, META, 0o600, st.uid, st.gid)
            else:
                self.store.truncate(session, META, 0)
            self._append_local(session, META, 0, meta)
            return True

        replaced = await self.call(apply)
        for f, n in ahead.items():
            self.remote[(session, f)] = n
        if stale:
            log.warning("session %s: %s of another content version than the shared tier's "
                        "(rewritten elsewhere, or not seen made by this mount): read through "
                        "again (%d local bytes dropped)", shown(session),
                        ", ".join(shown((session, f)) for f in sorted(stale)),
                        sum(local[f] for f in stale))
        if ahead or replaced:
            self._hit()
            log.info("session %s: newer bytes in the shared tier (%d files)", shown(session),
                     len(ahead))
        keys: list[Key] = [(session, f) for f in ahead]
        return keys + ([(session, META)] if replaced else [])

    def _trusted(self, key: Key, version: str | None) -> bool:
        """Whether the local copy of ``key`` is of the cluster's ``version``: recorded so,
        or, with nothing recorded (a remount), a version this node's own writes made (the
        volume holds what they pushed, and what a lost queue did not push yet)."""
        have = self.versions.get(key, _UNKNOWN)
        if have is _UNKNOWN:
            return bool(self.tier.made_here(version))
        return have == version

    def _local_sizes(self, session: str) -> dict[str, int]:
        return {f: self.store.file_stat(session, f).size for f in self.store.list_files(session)}

    def size_of(self, key: Key, st: Any) -> Any:
        """``st`` with the cluster's size while the local copy is still shorter."""
        n = self.remote.get(key)
        return dataclasses.replace(st, size=n) if n is not None and n > st.size else st

    async def fill(self, node: Node, end: int | None) -> None:
        """Fetch the file's missing bytes up to ``end`` (None: all) into the volume."""
        key = node.key
        if key not in self.remote:
            return
        async with self._locks.setdefault(key, trio.Lock()):
            want = self.remote.get(key)
            if want is None:
                return
            st = await self.call(on_live, node, self.store.file_stat, *key, changes=False)
            have, stop = st.size, want if end is None else min(want, end)
            c = self.tier.chunk_bytes
            restarts = 0
            while have < stop:
                n = min(want, -(-stop // c) * c, have - have % c + FETCH_CHUNKS * c) - have
                try:
                    data, version = await self._t(self.tier.read_versioned, key[0], key[1],
                                                  have, n)
                    if have and self.versions.get(key, _UNKNOWN) != version:
                        # rewritten in the cluster since the local bytes came: start over
                        restarts += 1
                        if restarts > 3:
                            raise SharedUnavailable("rewritten during every fetch")
                        log.warning("%s was rewritten in the shared tier while it was read "
                                    "through: fetched again from its start", shown(key))
                        want = await self._t(self.tier.size, *key)
                        self.remote[key] = want
                        await self.call(on_live, node, self.store.truncate, *key, 0)
                        have, stop = 0, want if end is None else min(want, end)
                        continue
                except SharedCorrupt:
                    raise  # an engine Corrupt: EIO, counted, never served
                except SharedError as e:
                    log.error("read of %s at %d needs bytes only the shared tier holds: %s",
                              shown(key), have, e)
                    raise FUSEError(errno.EIO) from None
                self.versions[key] = version
                if not data:  # the cluster holds less than it said: serve what is here
                    want = have
                    break
                await self.call(on_live, node, self._append_local, *key, have, data)
                have += len(data)
                self.counts["fetched_bytes"] += len(data)
                metrics.shared_fetched.inc(len(data))
            if have >= want:
                self.remote.pop(key, None)
                self._locks.pop(key, None)

    # ------------------------------------------------------------------ writers
    async def begin(self, session: str) -> None:
        """A writer of ``session`` starts here: take the lease (EBUSY if another node
        holds it). With the cluster away the write goes on locally and the replicator
        takes the lease when it is back."""
        if self.writers.get(session):
            if self.repl.taken(session) or self.tier.taken(session):
                # its writers must let go; the next first writer adopts the other node's copy
                log.warning("write to session %s refused with EBUSY: another node took its "
                            "lease while it was open for writing here", shown(session))
                raise FUSEError(errno.EBUSY)
            self.writers[session] += 1
            return
        # the last writer's release of the lease, pending or in flight, must not come after
        # this acquire (another node could then take the session from under this writer)
        await self._t(self.repl.hold, session)
        if self.repl.down is None:
            try:
                await self._t(self.tier.acquire, session)
            except SessionBusy as e:
                self.counts["busy_refusals"] += 1
                log.warning("write to session %s refused with EBUSY: %s", shown(session), e)
                raise FUSEError(errno.EBUSY) from None
            except (SharedError, ValueError) as e:
                log.warning("session %s: lease not taken (%s); writing locally", shown(session), e)
        self.writers[session] = self.writers.get(session, 0) + 1
        self.written.add(session)
        self.deleted.discard(session)
        if self.repl.keep(session):
            self._stale.add(session)  # ``complete`` adopts the cluster's copy first

    async def end(self, session: str) -> None:
        n = self.writers.get(session, 0) - 1
        if n > 0:
            self.writers[session] = n
            return
        self.writers.pop(session, None)
        self.repl.release_when_done(session)

    async def complete(self, node: Node) -> list[Key]:
        """Before the first write: the local copy made whole from the cluster."""
        session = node.key[0]
        changed = await self._adopt(session) if session in self._stale else []
        changed += await self.refresh(session, force=True)
        self.written.add(session)
        await self.fill(node, None)
        return changed

    async def _adopt(self, session: str) -> list[Key]:
        """This node lost the session's lease and another node wrote it: its local files
        are emptied and read through again from the cluster (bytes not replicated from
        here are dropped, with a log line); meta.json follows in ``refresh``."""
        try:
            files = await self._t(self.tier.list_files, session)
        except (SharedError, ValueError) as e:
            log.warning("session %s: cannot adopt the cluster's copy yet: %s", shown(session), e)
            return []

        def empty() -> list[str]:
            done = []
            for f in self.store.list_files(session):
                if f in files and self.store.file_stat(session, f).size:
                    self.store.truncate(session, f, 0)
                    done.append(f)
            return done

        emptied = await self.call(empty)
        self._stale.discard(session)
        self.written.discard(session)  # so ``refresh`` takes the cluster's meta.json too
        for f in emptied:
            self.remote[(session, f)] = files[f]
            self.versions.pop((session, f), None)  # recorded again by ``refresh``
        log.warning("session %s was written by another node: local copy replaced by the "
                    "shared tier's (%d files)", shown(session), len(emptied))
        return [(session, f) for f in emptied]

    # ------------------------------------------------------------------ what was stored
    def stored(self, key: Key, offset: int, data: bytes) -> None:
        self.repl.append(key[0], key[1], offset, data)

    def cut(self, key: Key, size: int) -> None:
        self.remote.pop(key, None)
        self.repl.truncate(key[0], key[1], size)

    def removed(self, key: Key) -> None:
        self.remote.pop(key, None)
        self.versions.pop(key, None)
        self.repl.remove(key[0], key[1])

    async def removed_session(self, session: str) -> None:
        """rmdir: the session leaves the cluster too (EBUSY while another node holds it)."""
        self.deleted.add(session)
        self.repl.forget(session)
        for key in [k for k in self.remote if k[0] == session]:
            del self.remote[key]
        for key in [k for k in self.versions if k[0] == session]:
            del self.versions[key]
        try:
            await self._t(self.tier.delete_session, session)
        except SessionBusy as e:
            log.warning("rmdir of session %s refused with EBUSY: %s", shown(session), e)
            raise FUSEError(errno.EBUSY) from None
        except (SharedError, ValueError) as e:
            log.warning("session %s removed locally only: %s", shown(session), e)

    # ------------------------------------------------------------------ fsync
    async def _wait(self, fut: Future, timeout: float) -> Any:
        if not fut.done():
            token, ev = trio.lowlevel.current_trio_token(), trio.Event()

            def wake(_: Future) -> None:
                try:
                    token.run_sync_soon(ev.set)
                except trio.RunFinishedError:
                    pass

            fut.add_done_callback(wake)
            with trio.move_on_after(timeout):
                await ev.wait()
        if not fut.done():
            raise TimeoutError(f"no answer from the replicator in {timeout:g} s")
        return fut.result()

    async def fsync(self, session: str) -> None:
        """Wait until the session's bytes are pushed and replicated (module docstring)."""
        deadline = trio.current_time() + self.fsync_wait_s
        while True:
            try:
                await self._wait(self.repl.sync(session), SYNC_WAIT_S)
                return
            except SharedUnavailable as e:
                if trio.current_time() < deadline:
                    await trio.sleep(0.2)
                    continue
                if self.repl.overflowed(session):
                    self.counts["fsync_errors"] += 1
                    log.error("fsync of session %s: EIO, the shared tier is unreachable and "
                              "its bytes passed the replication queue's bound: %s",
                              shown(session), e)
                    raise FUSEError(errno.EIO) from None
                self.counts["local_only_fsyncs"] += 1
                log.warning("fsync of session %s acknowledged locally only (replication "
                            "queued): %s", shown(session), e)
                return
            except Exception as e:
                self.counts["fsync_errors"] += 1
                log.error("fsync of session %s: EIO, not replicated: %s", shown(session), e)
                raise FUSEError(errno.EIO) from None

    # ------------------------------------------------------------------ stats, shutdown
    def stats(self) -> dict[str, Any]:
        t = self.tier.stats()
        return {"node": self.tier.node_id, **{f"tier_{k}": v for k, v in t.items()},
                **self.counts, **self.repl.stats(), "writing_sessions": len(self.writers),
                "incomplete_files": len(self.remote)}

    def refresh_metrics(self) -> None:
        t = self.tier.stats()
        n = int(t.get("lease_takeovers", 0))
        if n > self._takeovers_seen:
            metrics.shared_takeovers.inc(n - self._takeovers_seen)
            self._takeovers_seen = n
        metrics.shared_queue.set(self.repl.queued_bytes)
        metrics.shared_up.set(0 if self.repl.down else 1)
        for op in ("read", "append", "sync"):
            metrics.shared_p99.labels(op=op).set(t.get(f"{op}_ms_p99", 0.0))

    async def close(self, timeout: float = 10.0) -> None:
        """Push what is queued (bounded), stop the replicator, hand the leases back."""
        for s in list(self.writers):
            self.writers.pop(s)
            self.repl.release_when_done(s)
        if not await trio.to_thread.run_sync(self.repl.drain, timeout):
            log.error("unmount: replication incomplete (%s); those bytes are on the local "
                      "volume only", self.repl.stats())
        self.repl.close()
        await trio.to_thread.run_sync(self.tier.close)

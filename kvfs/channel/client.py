"""The native channel's client: a mount's own clients read and append beside FUSE.

``Channel.open(mount)`` finds the channel the mount serves (``/.kvfs/stats``: ``fs`` ->
``channel`` -> ``socket``), connects, checks that the server is the mount (its uid is
the mount's owner or root, ``SO_PEERCRED``) and opens the volume read-only; it returns
None -- the caller uses the files -- when any of that fails: no channel (an older kvfs,
``--no-channel``, a shared mount), another machine or namespace, a user that may not read
the volume. The volume is never opened writable here: appends go to the mount.

Reads find a file's extents without a request where they can (``extents.Locator``: the
extents kept from earlier answers, then the mount's catalog), else ask the mount (one
request for every file a read needs), and read the volume with
``kvfs.engine.direct.DirectReader``; a read the published state says may be stale is
retried with fresh extents from the mount. After each read the mount's process must still
run (a pidfd). Writes send a round's changes of every file as one
request, with one durability point when asked. Thread-safe: a few connections are kept
and taken one per request. Errors are ``OSError`` with the mount's errno.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kvfs.channel.protocol as P
from kvfs.channel.extents import Check, ExtentCache, Locator
from kvfs.engine.catalog import CatalogView
from kvfs.engine.direct import DirectReader, FileExtents, Stale
from kvfs.engine.errors import BadSuperblock
from kvfs.engine.format import SB_SLOT, Superblock
from kvfs.engine.published import PublishedView

log = logging.getLogger("kvfs.channel")

MAX_CONNS = 4  # requests in flight at once from one process
READ_RETRIES = 32  # reads redone with fresh extents before giving up
WRITE_MAX = P.WRITE_MAX  # bytes of data per WRITE request (a bigger round is cut)


CHANNEL_XATTR = "user.kvfs.channel"


def channel_of(mount: str) -> dict[str, Any] | None:
    """What the mount publishes about its channel (None: it serves none): the root's
    ``user.kvfs.channel`` (one small answer), else ``/.kvfs/stats`` (a kvfs before it;
    rendering every counter costs the mount milliseconds)."""
    try:
        ch = json.loads(os.getxattr(mount, CHANNEL_XATTR))
        if isinstance(ch, dict) and isinstance(ch.get("socket"), str):
            return ch
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(mount, ".kvfs", "stats"), "rb") as f:
            stats = json.loads(f.read())
    except (OSError, ValueError):
        return None
    fs = stats.get("fs") if isinstance(stats, dict) else None
    ch = fs.get("channel") if isinstance(fs, dict) else None
    return ch if isinstance(ch, dict) and isinstance(ch.get("socket"), str) else None


class Channel:
    """One process's connections to a mount's native channel (see the module doc)."""

    def __init__(self, mount: str, name: str) -> None:
        self.mount, self.name = mount, name
        # called with (session, its (mode, uid, gid), [(name, FileExtents | None)]) on every
        # fresh answer, before it is used: a caller's rules on whose files it may read
        self.check: Check | None = None
        self._idle: list[tuple[socket.socket, float]] = []  # with when it was last used
        self._all: weakref.WeakSet[socket.socket] = weakref.WeakSet()  # idle or in use
        self._conns = 0
        self._cv = threading.Condition()
        self._closed = False
        self.reader: DirectReader | None = None
        self.hello: dict[str, Any] = {}
        self._catalog: CatalogView | None = None  # handed over by the first hello
        self._pidfd = -1  # the mount process (its exit ends every extent it published)
        first = self._connect()
        try:
            self._setup(first)
        except BaseException:
            first.close()
            self.close()
            raise
        self._idle.append((first, time.monotonic()))
        self._conns = 1  # connections open, idle or in use
        self.locator = Locator(self.view, self._catalog)
        self.entry_max = int(self.hello.get("entry_max") or 256 << 10)
        # a kept connection idle for half the mount's timeout is closed here, before it is
        self.keep_idle_s = float(self.hello.get("idle_s") or P.IDLE_TIMEOUT_S) / 2

    @property
    def cache(self) -> ExtentCache:
        """The extents this client kept (the locator's)."""
        return self.locator.cache

    @classmethod
    def open(cls, mount: str, info: dict[str, Any] | None = None) -> Channel | None:
        """The mount's channel, or None (with the reason logged) when this process cannot
        use it: then the files are the way."""
        info = info if info is not None else channel_of(mount)
        if not info:
            log.debug("%s serves no native channel", mount)
            return None
        try:
            return cls(mount, info["socket"].removeprefix("@"))
        except (OSError, ValueError, P.ProtocolError, ConnectionError) as e:
            log.info("native channel of %s not usable (%s): using its files", mount, e)
            return None

    # ------------------------------------------------------------------ connections
    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.connect("\0" + self.name)
            pid, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            owner = os.stat(self.mount).st_uid
            if uid not in (owner, 0):  # another user's socket squatting the name
                raise PermissionError(f"the channel's server runs as uid {uid}, the mount's "
                                      f"owner is uid {owner}")
            try:
                P.send_frame(s, P.REQ.pack(4, P.HELLO), struct.pack("<I", P.VERSION))
            except (BrokenPipeError, ConnectionResetError):
                pass  # turned away at once: its answer (the errno) is waiting to be read
            head, fds = P.recv_fds(s, P.REP.size)
            n, code = P.REP.unpack(head)
            body = P.recv_exact(s, n)
        except BaseException:
            s.close()
            raise
        try:
            if code:
                raise OSError(code, f"the mount refused the channel: {os.strerror(code)}")
            hello = json.loads(bytes(body))
            if hello.get("version") != P.VERSION or len(fds) not in (1, 2):
                raise P.ProtocolError(f"channel version {hello.get('version')}, expected {P.VERSION}")
            if not self.hello:  # the first connection keeps the published blocks
                self.hello, self.view = hello, PublishedView(fds[0])
                self._catalog = _catalog(fds[1]) if len(fds) > 1 else None
                self._pidfd = _pidfd(pid)
        except BaseException:
            s.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        self._all.add(s)
        return s

    def _setup(self, _s: socket.socket) -> None:
        """Open the volume read-only and check that it is the mount's (its uuid)."""
        path = self.hello["volume"]
        reader = DirectReader(path, self.view)
        try:
            uuids = set()
            for slot in (0, 1):
                try:
                    uuids.add(Superblock.unpack(os.pread(reader.fd, SB_SLOT, slot * SB_SLOT)).uuid.hex())
                except BadSuperblock:
                    continue
            if self.hello.get("uuid") not in uuids:
                raise ValueError(f"{path} is not the mounted volume here")
            if (self.view.ring_offset, self.view.ring_size) == (0, 0):
                raise ValueError("the published block names no ring")
        except BaseException:
            reader.close()
            raise
        self.reader = reader

    def _take_idle(self) -> socket.socket | None:
        """Under the lock: a kept connection the mount has not closed, or None."""
        now = time.monotonic()
        while self._idle:
            s, since = self._idle.pop()
            if now - since < self.keep_idle_s and _open(s):
                return s
            s.close()
            self._conns -= 1
        return None

    @contextmanager
    def _conn(self) -> Iterator[socket.socket]:
        limit = MAX_CONNS
        while True:
            with self._cv:
                while True:
                    if self._closed:
                        raise OSError(errno.ESHUTDOWN, "channel closed")
                    s = self._take_idle()
                    if s is not None or self._conns < limit:
                        break
                    self._cv.wait()
                if s is None:
                    self._conns += 1
            if s is not None:
                break
            try:
                s = self._connect()
                break
            except OSError as e:
                with self._cv:
                    self._conns -= 1
                    busy = self._conns > 0
                    self._cv.notify()
                # the mount's connection limit for this uid: wait for one of ours instead
                if e.errno != errno.EUSERS or not busy:
                    raise
                limit = max(1, self._conns)
            except BaseException:
                with self._cv:
                    self._conns -= 1
                    self._cv.notify()
                raise
        ok = False
        try:
            yield s
            ok = True
        finally:
            with self._cv:
                if ok and not self._closed:
                    self._idle.append((s, time.monotonic()))
                else:
                    s.close()
                    self._conns -= 1
                self._cv.notify()

    def _call(self, op: int, parts: list[bytes | memoryview]) -> memoryview:
        n = sum(len(p) for p in parts)
        if n > P.MAX_FRAME:
            raise OSError(errno.EFBIG, "request too large for the channel")
        with self._conn() as s:
            P.send_frame(s, P.REQ.pack(n, op), *parts)
            k, code = P.REP.unpack(P.recv_exact(s, P.REP.size))
            body = P.recv_exact(s, k) if k else memoryview(b"")
        if code:
            raise OSError(code, os.strerror(code))
        return body

    def close(self) -> None:
        self.hang_up()
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if getattr(self, "view", None) is not None:
            self.view.close()
        if getattr(self, "locator", None) is not None:
            self.locator.close()
        elif self._catalog is not None:  # the set-up failed before the locator
            self._catalog.close()
        self._catalog = None
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def hang_up(self) -> None:
        """Close the connections (the mount went away) and take no more; the reader stays
        open for reads other threads are in the middle of (``close`` closes it)."""
        with self._cv:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cv.notify_all()
        for s, _ in idle:
            s.close()

    def abandon(self) -> None:
        """In a forked child: close this process's copies of the descriptors -- the
        connections idle or in use by the parent's threads at the fork -- without taking
        a lock (one of those threads may have held it) and without shutting a socket down
        (the parent still uses the connections). The reader's threads did not come along:
        it is not used again."""
        self._closed = True
        for s in list(self._all):
            s.close()
        self._idle = []
        if self.reader is not None:
            for fd in (self.reader.fd, self.reader.dfd):
                if fd >= 0:
                    os.close(fd)
            self.reader = None
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    # ------------------------------------------------------------------ requests
    def stat(self, sid: str, small: tuple[str, ...] | list[str] = ()) -> P.SessionInfo | None:
        """The session's attributes, files and the bytes of ``small`` files; None when
        there is no such session."""
        small = list(dict.fromkeys(small))  # the mount takes each name once
        info = None
        for k in range(0, max(len(small), 1), P.NAMES_MAX):
            part = small[k:k + P.NAMES_MAX]
            try:
                body = self._call(P.STAT, [P.stat_request(sid, part)])
            except FileNotFoundError:
                return None
            got = P.parse_stat_reply(body, part)
            if info is not None:
                got.small = {**info.small, **got.small}
            info = got
        return info

    def extents(self, sid: str, files: list[tuple[str, int, int]], check: Check | None = None
                ) -> tuple[tuple[int, int, int], list[FileExtents | None]]:
        """Fresh extents of (name, offset, length) (length < 0: to the end), kept in the
        cache; FileNotFoundError when there is no such session. ``check``: the caller's
        rules on the answer (else ``self.check``)."""
        if len(files) > P.NAMES_MAX:  # the mount's limit per request
            out = []
            for k in range(0, len(files), P.NAMES_MAX):
                attrs, got = self.extents(sid, files[k:k + P.NAMES_MAX], check)
                out += got
            return attrs, out
        attrs, out = P.parse_extents_reply(
            self._call(P.EXTENTS, [P.extents_request(sid, files)]), len(files))
        check = check if check is not None else self.check
        if check is not None:
            check(sid, attrs, [(name, fe) for (name, _, _), fe in zip(files, out, strict=True)])
        for (name, _, _), fe in zip(files, out, strict=True):
            if fe is not None:
                self.cache.put(sid, name, fe)
            else:
                self.cache.drop(sid, name)
        return attrs, out

    def read(self, sid: str, jobs: list[tuple[str, int, memoryview]],
             check: Check | None = None) -> None:
        """Fill each ``out`` with bytes ``[off, off + len(out))`` of file ``name`` of the
        session: checked bytes or an error, never other bytes. FileNotFoundError for a
        missing session or file, ValueError for a range past the file's end."""
        jobs = [(n, o, memoryview(b).cast("B")) for n, o, b in jobs if len(b)]
        if not jobs:
            return
        reader = self.reader
        if reader is None:
            raise OSError(errno.ENOTCONN, "the native channel's client is closed")
        ask = False  # the cache and the catalog were looked at already: ask the mount
        if len(jobs) == 1:  # the common read: extents kept or published, one entry
            name, off, out = jobs[0]
            fe = self.locator.find(sid, name, off, off + len(out), check or self.check)
            if fe is not None:
                try:
                    reader.read([(fe, off, out)])
                    self._mount_alive()
                    return
                except Stale:
                    pass
            ask = True
        for attempt in range(READ_RETRIES):
            try:
                reader.read(self._plan(sid, jobs, fresh=ask or attempt > 0, check=check))
                self._mount_alive()
                return
            except Stale:
                continue
        raise OSError(errno.EIO, f"{sid}: the ring moved under {READ_RETRIES} reads in a row")

    def _mount_alive(self) -> None:
        """After a read: the mount that published its extents was still running, so no
        other mount of the volume can have cut or rewritten what was read (a killed
        mount's blocks are never marked ended). ConnectionResetError otherwise."""
        if self._pidfd >= 0:
            try:
                signal.pidfd_send_signal(self._pidfd, 0)
            except ProcessLookupError:
                raise ConnectionResetError(errno.ECONNRESET, "the mount exited") from None
            except PermissionError:  # alive, another user's: no signal for us to send
                pass

    def _plan(self, sid: str, jobs: list[tuple[str, int, memoryview]], fresh: bool,
              check: Check | None = None) -> list[tuple[FileExtents, int, memoryview]]:
        """Each job with extents that cover it: from the cache, else asked for (one request
        per round for every file missing; a range longer than one answer holds is split
        and the rest asked for in the next round)."""
        plan: list[tuple[FileExtents, int, memoryview]] = []
        todo = list(jobs)
        while todo:
            need: list[tuple[str, int, memoryview]] = []
            found = ([None] * len(todo) if fresh else self.locator.find_many(
                sid, [(name, off, off + len(out)) for name, off, out in todo], check or self.check))
            for (name, off, out), fe in zip(todo, found, strict=True):
                if fe is None:
                    need.append((name, off, out))
                else:
                    plan.append((fe, off, out))
            fresh = False
            if not need:
                break
            span: dict[str, list[int]] = {}
            for name, off, out in need:
                lo_hi = span.setdefault(name, [off, off + len(out)])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], off), max(lo_hi[1], off + len(out))
            want = sorted(span)
            _, got = self.extents(sid, [(n, span[n][0], span[n][1] - span[n][0]) for n in want],
                                  check)
            by = dict(zip(want, got, strict=True))
            todo = []
            for name, off, out in need:
                fe = by[name]
                if fe is None:
                    raise FileNotFoundError(errno.ENOENT, f"no file {sid}/{name}")
                end = off + len(out)
                if end > fe.size:
                    raise ValueError(f"read [{off}, {end}) past the end ({fe.size}) of {sid}/{name}")
                if fe.covers(off, end):
                    plan.append((fe, off, out))
                elif fe.lo <= off < fe.hi:  # the answer ends inside the range: the rest later
                    k = fe.hi - off
                    plan.append((fe, off, out[:k]))
                    todo.append((name, fe.hi, out[k:]))
                else:
                    raise OSError(errno.EIO, f"{sid}/{name}: the mount answered extents "
                                             f"[{fe.lo}, {fe.hi}) for a read at {off}")
        return plan

    def write(self, sid: str, items: list[P.Item], sync: bool = False,
              create: bool = True) -> list[int]:
        """Apply ``items`` in order as one request (several when they carry more than
        ``WRITE_MAX`` bytes); returns each file's size after its item. ``sync``: one
        durability point after the last. The first failing item raises its ``OSError``;
        the ones before it stay done."""
        parts: list[tuple[int, P.Item]] = []  # (index of the item it belongs to, part)
        for k, it in enumerate(items):
            pieces = _cut(it, WRITE_MAX) if it.kind == P.APPEND and len(it.data) > WRITE_MAX else [it]
            parts += [(k, x) for x in pieces]
        groups: list[list[tuple[int, P.Item]]] = [[]]
        n = 0
        for k, it in parts:
            if groups[-1] and (n + len(it.data) > WRITE_MAX or len(groups[-1]) >= P.WRITE_ITEMS_MAX):
                groups.append([])
                n = 0
            groups[-1].append((k, it))
            n += len(it.data)
        sizes = [0] * len(items)
        for g, group in enumerate(groups):
            last = g == len(groups) - 1
            flags = (P.W_CREATE if create else 0) | (P.W_SYNC if sync and last else 0)
            if not group:
                if sync:
                    self.sync()
                continue
            try:
                got = self._write(sid, flags, [it for _, it in group])
            except OSError as e:  # what was done: the items before this group, and in it
                ok = getattr(e, "done", [])
                finished = {k: size for (k, _), size in zip(group, ok, strict=False)}
                unfinished = {k for k, _ in group[len(ok):]}
                e.done = sizes[:group[0][0]] + [  # type: ignore[attr-defined]
                    finished[k] for k in sorted(finished) if k not in unfinished]
                raise
            for (k, _), size in zip(group, got, strict=True):
                sizes[k] = size
        return sizes

    def _write(self, sid: str, flags: int, items: list[P.Item]) -> list[int]:
        body = self._call(P.WRITE, P.write_request(sid, flags, items))
        results, sync_errno = P.parse_write_reply(body, len(items))
        for k, (it, (code, _)) in enumerate(zip(items, results, strict=True)):
            if code:
                err = OSError(code, f"{sid}/{it.name}: {os.strerror(code)}")
                err.done = [size for _, size in results[:k]]  # type: ignore[attr-defined]
                err.size = results[k][1]  # type: ignore[attr-defined]  # the file's size now
                raise err
        if sync_errno:
            err = OSError(sync_errno, f"{sid}: sync: {os.strerror(sync_errno)}")
            err.done = [size for _, size in results]  # type: ignore[attr-defined]
            raise err
        return [size for _, size in results]

    def sync(self) -> None:
        self._call(P.SYNC, [])


def _catalog(fd: int) -> CatalogView | None:
    try:
        return CatalogView(fd)
    except (OSError, ValueError) as e:  # another layout, or a machine that reorders stores
        log.info("the mount's catalog is not usable here (%s): extents are asked for", e)
        return None


def _pidfd(pid: int) -> int:
    """A descriptor of the mount's process (-1 where the kernel has none: no check)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return -1


def _open(s: socket.socket) -> bool:
    """Whether the mount still holds this connection (it closes idle ones)."""
    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _cut(it: P.Item, step: int) -> list[P.Item]:
    data = memoryview(it.data)
    return [P.Item(P.APPEND, it.name, it.arg + k, data[k:k + step]) for k in range(0, len(data), step)]

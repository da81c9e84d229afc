"""The channel a process keeps: one client per (process, mount), shared by its callers.

Opening a ``Channel`` costs milliseconds (finding the socket, a hello with the published
block, opening the volume); every caller of a process -- the warm tier's native backend,
the vLLM store, the tools -- opening its own paid that each time and held its own
connections. ``kept(mount)`` hands out one ``KeptChannel`` per mount path for the whole
process; it opens the ``Channel`` behind it once and keeps it:

- threads: the ``Channel`` is thread-safe (a few connections, one per request in flight);
- ``fork()``: the child closes its copies of the parent's descriptors (the parent's
  connections and reader threads are not its own) and opens its own on first use;
- a restarted mount (its socket gone: connection refused, or an answer cut off): the
  ``Channel`` is dropped and opened again from the socket name the mount publishes now,
  once. A request that may have reached the old mount is retried only when it is a read;
  a write or sync raises (the next call uses the new mount);
- exit: closed (``atexit``), so no connection outlives the process in the mount's
  per-uid count.

The extent cache is shared by the callers of the process: they check answers against the
same rules (the process's uid), each passing its own ``check``.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import kvfs.channel.protocol as P
from kvfs.channel.client import Channel, channel_of
from kvfs.channel.extents import Check, ExtentCache
from kvfs.engine.direct import DirectReader, FileExtents

log = logging.getLogger("kvfs.channel")
T = TypeVar("T")

_lock = threading.Lock()
_kept: dict[str, KeptChannel] = {}  # absolute mount path -> its handle in this process


def kept(mount: str) -> KeptChannel | None:
    """This process's channel to ``mount``, opened on the first call; None (the reason
    logged) when the mount serves none this process may use: then the files are the way."""
    key = os.path.abspath(mount)
    with _lock:
        h = _kept.get(key)
        if h is None:
            h = KeptChannel(key)
            try:
                h.channel()
            except OSError as e:
                log.info("native channel of %s not usable (%s): using its files", mount, e)
                return None
            _kept[key] = h
    return h


class KeptChannel:
    """One mount's channel for every caller and thread of this process (module doc).
    Requests as ``Channel``'s; ``close`` is a caller letting go (the channel stays)."""

    def __init__(self, mount: str) -> None:
        self.mount = mount
        self._ch: Channel | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._retired: list[Channel] = []  # dropped after their mount went away
        self.opened = 0  # Channels opened: the first, then one per fork or restarted mount

    def channel(self) -> Channel:
        """The open ``Channel``, opening one when there is none (OSError when it cannot)."""
        with self._lock:
            if self._pid != os.getpid():  # forked without the hook (none runs in a vfork)
                self._forked()
            ch = self._ch
            if ch is None:
                ch = self._ch = _open(self.mount)
                self.opened += 1
            return ch

    def _forked(self) -> None:
        for c in [*self._retired, *([self._ch] if self._ch is not None else [])]:
            c.abandon()
        self._ch, self._retired, self._pid = None, [], os.getpid()

    def _drop(self, broken: Channel) -> None:
        """Stop using a channel whose mount went away. Its reader is closed only with the
        handle (``forget``): another thread may be reading the volume with it right now."""
        with self._lock:
            if self._ch is broken:
                self._ch = None
                self._retired.append(broken)
        broken.hang_up()

    def _run(self, call: Callable[[Channel], T], read_only: bool) -> T:
        ch = self.channel()
        try:
            return call(ch)
        except OSError as e:
            if not _mount_gone(e):
                raise
            self._drop(ch)
            if not (read_only or isinstance(e, ConnectionRefusedError)):
                raise  # it may have reached the old mount: not done twice
            log.info("native channel of %s: the mount went away (%s): opening it again",
                     self.mount, e)
        return call(self.channel())

    def close(self) -> None:
        """A caller is done with it: the process keeps the channel (``forget`` closes it)."""

    def forget(self) -> None:
        """Close the channel now (at exit; a test); the next request opens one again."""
        with self._lock:
            ch, self._ch = self._ch, None
            gone, self._retired = self._retired, []
        for c in [*gone, *([ch] if ch is not None else [])]:
            c.close()

    # ------------------------------------------------------------------ Channel's face
    @property
    def cache(self) -> ExtentCache:
        return self.channel().cache

    @property
    def reader(self) -> DirectReader | None:
        return self.channel().reader

    @property
    def hello(self) -> dict[str, Any]:
        return self.channel().hello

    def drop_extents(self, sid: str) -> None:
        """Forget a session's kept extents (it is being removed); opens nothing."""
        ch = self._ch
        if ch is not None:
            ch.cache.drop(sid)

    def stat(self, sid: str, small: tuple[str, ...] | list[str] = ()) -> P.SessionInfo | None:
        return self._run(lambda ch: ch.stat(sid, small), read_only=True)

    def extents(self, sid: str, files: list[tuple[str, int, int]], check: Check | None = None
                ) -> tuple[tuple[int, int, int], list[FileExtents | None]]:
        return self._run(lambda ch: ch.extents(sid, files, check), read_only=True)

    def read(self, sid: str, jobs: list[tuple[str, int, memoryview]],
             check: Check | None = None) -> None:
        self._run(lambda ch: ch.read(sid, jobs, check), read_only=True)

    def write(self, sid: str, items: list[P.Item], sync: bool = False,
              create: bool = True) -> list[int]:
        return self._run(lambda ch: ch.write(sid, items, sync, create), read_only=False)

    def sync(self) -> None:
        self._run(lambda ch: ch.sync(), read_only=False)


def _open(mount: str) -> Channel:
    info = channel_of(mount)
    if not info:
        raise OSError(errno.ENOTCONN, f"{mount} serves no native channel")
    try:
        return Channel(mount, info["socket"].removeprefix("@"))
    except (ValueError, P.ProtocolError) as e:
        raise OSError(errno.EPROTO, f"native channel of {mount}: {e}") from e


def _mount_gone(e: OSError) -> bool:
    """The mount that served the channel is gone (restarted, unmounted): its socket name
    refuses connections, or a connection ended before its answer."""
    return isinstance(e, ConnectionError) or e.errno in (errno.ESHUTDOWN, errno.ENOTCONN)


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    for h in _kept.values():
        h._lock = threading.Lock()
        h._forked()


def _at_exit() -> None:
    for h in list(_kept.values()):
        try:
            h.forget()
        except OSError as e:
            log.debug("closing the native channel of %s: %r", h.mount, e)


os.register_at_fork(after_in_child=_after_fork)
atexit.register(_at_exit)

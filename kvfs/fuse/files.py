"""What the FUSE layer keeps and builds around the engine calls of its handlers.

``EntryAttributes`` built from the engine's stat values, the
kernel's page cache of files the engine cuts (``KernelPages``), and the bodies of the
generated ``/.kvfs`` files. Used by ``ops`` only; these pieces only format values ``ops``
fetched. The write buffers live in ``buffers``, the read path in ``read_path``.
"""

from __future__ import annotations

import json
import logging
import queue
import stat
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import pyfuse3
from pyfuse3 import EntryAttributes, SetattrFields

from kvfs.engine.records import check_time
from kvfs.engine.store import Store
from kvfs.ops import agents, metrics

from .buffers import Pending
from .nodes import InodeTable, Key

log = logging.getLogger("kvfs.fs")

BLKSIZE = 1 << 20  # st_blksize: tools read and write in 1 MiB pieces
ATTR_TIMEOUT = 1.0  # the kernel may cache attributes/entries this long (we are the only writer)
FIXED_TIMEOUT = 300.0


def drop_kernel_pages(inos: list[int]) -> None:
    """Drop the kernel's cached pages (and attributes) of these inodes; not on the FUSE
    loop's thread: an invalidation waits for pages locked by reads the loop must answer."""
    for ino in inos:
        try:
            pyfuse3.invalidate_inode(ino)
        except OSError as e:  # ENOENT: the kernel no longer holds the inode, nor its pages
            log.debug("invalidate inode %d: %r", ino, e)


class KernelPages:
    """With the page cache: the kernel's pages of a session's files are dropped when the
    engine cuts the session behind the kernel's back -- reclaim drops an idle session,
    retention cleanup, a truncate through the native channel -- so a handle never reads
    cached bytes of a file that lost them. The engine calls ``cut`` under its lock, so it
    only queues; a thread of its own drops the pages (an invalidation waits for pages
    locked by reads that the FUSE loop answers)."""

    def __init__(self, inodes: InodeTable) -> None:
        self.inodes = inodes
        self._q: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="kvfs-kernel-pages", daemon=True)
        self._t.start()
        self.dropped = 0

    def cut(self, sno: int) -> None:
        self._q.put(sno)

    def _run(self) -> None:
        while (sno := self._q.get()) is not None:
            inos = self.inodes.files_of(sno)
            drop_kernel_pages(inos)
            self.dropped += len(inos)

    def close(self) -> None:
        self._q.put(None)
        self._t.join(timeout=10)


def _ns(t: float | int) -> int:
    return t if isinstance(t, int) else int(t * 1e9)  # int: exact nanoseconds


def _times(st: Any) -> tuple[float | int, float | int, float | int]:
    """(atime, mtime, ctime) of a stat, exact nanoseconds where it has them."""
    if getattr(st, "mtime_ns", None) is not None:
        return st.atime_ns, st.mtime_ns, st.ctime_ns
    return st.atime, st.mtime, st.ctime


def make_attr(ino: int, mode: int, uid: int, gid: int,
              times: tuple[float | int, float | int, float | int],
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
                     _times(st), nlink=2)


def file_attr(ino: int, st: Any, pending: Pending | None, nlink: int = 1) -> EntryAttributes:
    """A file from a ``FileStat``; its size includes the bytes still buffered."""
    size = pending.size if pending is not None else st.size
    return make_attr(ino, stat.S_IFREG | (st.mode & 0o7777), st.uid, st.gid,
                     _times(st), size, st.stored, nlink=nlink)


@dataclass(frozen=True)
class AttrChange:
    """What a ``setattr`` asks of the engine besides the size (None: unchanged)."""

    mode: int | None
    uid: int | None
    gid: int | None
    atime_ns: int | None
    mtime_ns: int | None

    @classmethod
    def asked(cls, attr: EntryAttributes, fields: SetattrFields) -> AttrChange:
        """The change the kernel asked for; EOVERFLOW (``TimeRange``) for a time no record
        holds, before anything changes."""
        c = cls(attr.st_mode & 0o7777 if fields.update_mode else None,
                attr.st_uid if fields.update_uid else None,
                attr.st_gid if fields.update_gid else None,
                attr.st_atime_ns if fields.update_atime else None,
                attr.st_mtime_ns if fields.update_mtime else None)
        check_time(c.atime_ns, "atime")
        check_time(c.mtime_ns, "mtime")
        return c

    def any(self) -> bool:
        return (self.mode, self.uid, self.gid, self.atime_ns, self.mtime_ns) != (None,) * 5

    def owner(self) -> bool:
        """Whether the mode or the owner change (the shared tier's owner record follows)."""
        return (self.mode, self.uid, self.gid) != (None, None, None)

    def apply(self, store: Store, key: Key) -> None:
        """Make the change (an engine call: on the worker)."""
        if len(key) == 1:
            store.set_session_attrs(key[0], self.mode, self.uid, self.gid,
                                    atime_ns=self.atime_ns, mtime_ns=self.mtime_ns)
        else:
            store.set_file_attrs(key[0], key[1], self.mode, self.uid, self.gid,
                                 atime_ns=self.atime_ns, mtime_ns=self.mtime_ns)


def agent_totals(profile: dict[str, Any] | None, volume_id: str) -> dict[str, dict[str, Any]]:
    """What the volume's live agents publish (``kvfs.ops.agents``), summed."""
    warm_root = (profile or {}).get("warm_root")
    return agents.totals(agents.read(warm_root, volume_id) if warm_root else [])


def negative() -> EntryAttributes:
    """A cached "no such entry" answer to a lookup."""
    a = EntryAttributes()
    a.st_ino = 0
    a.entry_timeout = ATTR_TIMEOUT
    return a


def stats_body(store_stats: dict, usage: Any, fs: dict, needs_fsck: bool,
               alerts_state: Callable[[], Any] | None, shared: dict | None = None,
               profile: dict | None = None, private: bool = True) -> bytes:
    """``/.kvfs/stats``: the engine's stats, its usage, the FUSE layer's counts, alerts,
    the shared tier's figures (None without ``--shared``) and the mount's profile. Unless
    ``private`` (the reader is the mount's owner or root), without session names and
    paths: the volume's path, the reason it needs fsck, the sessions replication gave up."""
    if not private:
        store_stats = {**store_stats, "volume": {
            **store_stats.get("volume", {}), "path": None,
            "needs_fsck_reason": "(shown to the mount's owner)"
            if store_stats.get("volume", {}).get("needs_fsck_reason") else None}}
        if shared is not None:
            shared = {**shared, "sessions_lost": len(shared.get("sessions_lost") or [])}
    doc = {
        "profile": profile,
        "store": store_stats,
        "usage": asdict(usage),
        "fs": fs,
        # the store's mark (corruption met anywhere) as well as this layer's internal errors
        "needs_fsck": needs_fsck or bool(store_stats.get("volume", {}).get("needs_fsck")),
        "alerts": alerts_state() if alerts_state else None,
        "shared": shared,
    }
    return (json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n").encode()


def metrics_body(usage: Any, agent_totals: dict[str, dict[str, Any]] | None = None) -> bytes:
    """``/.kvfs/metrics``: the process registry, cold-tier gauges refreshed first, and the
    hot and RAM-tier gauges set to what the volume's live agent processes publish (the
    mount holds neither tier itself; zero when no agent is live)."""
    set_gauges(usage, agent_totals)
    return metrics.text()


def set_gauges(usage: Any, agent_totals: dict[str, dict[str, Any]] | None = None) -> None:
    """The cold-tier gauges from a ``Store.usage()``, the hot and RAM-tier ones from the
    live agents' totals (zero without any)."""
    refresh_cold_gauges(usage)
    metrics.set_agent_gauges(agent_totals or {})


def refresh_cold_gauges(u: Any) -> None:
    """Set the cold-tier gauges of ``kvfs.metrics`` from a ``Store.usage()``."""
    metrics.cold_bytes.set(u.used)
    metrics.cold_capacity.set(u.capacity)
    metrics.cold_sessions.set(u.sessions)
    metrics.cold_checkpoint_age.set(u.checkpoint_age_s)
    if u.stored_bytes_written:
        metrics.cold_compression.set(u.raw_bytes_written / u.stored_bytes_written)

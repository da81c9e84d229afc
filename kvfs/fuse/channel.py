"""The native channel's server: the mount answers its own clients beside the FUSE face.

kvfs's clients (the warm tier's write-behind and migration, recall, resume, the tools)
reach the mount through FUSE like any program, and also through this Unix socket
(abstract name ``kvfs-<volume uuid>-<pid>``, shown in ``/.kvfs/stats`` under
``channel``): they ask for a session's extents and read the blocks from the volume
themselves (``kvfs.engine.direct``), and send a round's appends for every layer as one
request with one durability point. The mount stays the only authority on names, extents
and the ring, and the only writer of the volume. Protocol: ``kvfs.channel.protocol`` and
docs/mount.md.

Who may use it is decided as the kernel would decide for the files: the peer's uid, gid
and groups (``SO_PEERCRED``, ``SO_PEERGROUPS``) against the mount (without
``--allow-other`` only its owner reaches it), the session directory (search; read to
list it; write to create a file in it) and the file (read, write), root passing the
checks as with ``default_permissions``. The volume's path goes only to a peer that may
read the volume file; any other gets EACCES and uses the files.

One thread per connection serves its requests, calling the ``Store`` directly (it is
thread-safe), so the FUSE loop never waits for a client. Where the FUSE layer holds state
for a file -- bytes a handle wrote and has not flushed, its read-ahead -- the request
goes through the FUSE loop (``trio.from_thread``), so both faces always show the same
bytes: a read first flushes the file's buffered tail, an append to a file open for
writing through the mount goes through its buffer, a truncate drops read-ahead. After a
direct append the kernel is told to forget the file's cached attributes (and pages, with
``--page-cache``). Not served on a mount with a shared tier: its clients use the files.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyfuse3
import trio

from kvfs.channel import protocol as P
from kvfs.engine import errors

from .errnos import Stale, errno_of
from .files import drop_kernel_pages
from .nodes import Node

log = logging.getLogger("kvfs.channel")

MAX_CLIENTS = 64  # connections served at once (a client over it uses the files)
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
R, W, X = 4, 2, 1


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]

    def may(self, mode: int, uid: int, gid: int, want: int, is_dir: bool = False) -> bool:
        """Whether the kernel's ``generic_permission`` would grant ``want`` (R|W|X bits)."""
        if self.uid == 0:  # CAP_DAC_OVERRIDE: all but executing a file no one may execute
            return is_dir or not want & X or bool(mode & 0o111)
        if self.uid == uid:
            bits = mode >> 6
        elif gid == self.gid or gid in self.groups:
            bits = mode >> 3
        else:
            bits = mode
        return bits & want == want


def peer_of(conn: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    groups: frozenset[int] = frozenset()
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 1024)
        groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError as e:  # an older kernel: the primary group only
        log.debug("SO_PEERGROUPS: %r", e)
    return Peer(pid, uid, gid, groups)


class Refused(Exception):
    def __init__(self, code: int, why: str = "") -> None:
        super().__init__(why)
        self.errno = code


class ChannelServer:
    """The listening socket, its accept thread and one thread per client (module doc)."""

    def __init__(self, ops: Any, store: Any, volume: str, *, allow_other: bool = False) -> None:
        self.ops, self.store, self.volume = ops, store, volume
        self.allow_other = allow_other
        self.owner = (os.getuid(), os.getgid())
        self.name = f"kvfs-{store.volume_id}-{os.getpid()}"
        self.token: trio.lowlevel.TrioToken | None = None
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stop = False
        self.counts = {"clients": 0, "refused": 0, "requests": 0, "extents": 0, "writes": 0,
                       "write_bytes": 0, "via_fuse": 0}

    # ------------------------------------------------------------------ lifecycle
    def start(self, token: trio.lowlevel.TrioToken) -> None:
        self.token = token
        self.published = self.store.publish()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.bind("\0" + self.name)
        s.listen(MAX_CLIENTS)
        self._sock = s
        t = threading.Thread(target=self._accept, name="kvfs-channel", daemon=True)
        t.start()
        self._threads.append(t)
        log.info("native channel on @%s", self.name)

    def info(self) -> dict[str, Any]:
        return {"socket": "@" + self.name, "version": P.VERSION, **self.counts}

    def close(self) -> None:
        self._stop = True
        with self._lock:
            socks = [*self._conns] + ([self._sock] if self._sock is not None else [])
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        for s in socks:
            s.close()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # shut down
            with self._lock:
                if self._stop or len(self._conns) >= MAX_CLIENTS:
                    self.counts["refused"] += 1
                    conn.close()
                    continue
                self._conns.add(conn)
                self.counts["clients"] += 1
            t = threading.Thread(target=self._serve, args=(conn,), name="kvfs-channel-client",
                                 daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            peer = peer_of(conn)
            while not self._stop:
                n, op = P.REQ.unpack(P.recv_exact(conn, P.REQ.size))
                if n > P.MAX_FRAME:
                    raise P.ProtocolError(f"frame of {n} bytes")
                body = P.recv_exact(conn, n) if n else memoryview(b"")
                fds: list[int] = []
                try:
                    reply, fds = self._dispatch(peer, op, body)
                    code = 0
                except Refused as e:
                    reply, code = [], e.errno
                except errors.KVFSError as e:
                    reply, code = [], errno_of(e)
                except (P.ProtocolError, ConnectionError):
                    raise
                except Exception as e:
                    log.exception("channel %s request failed", P.OPS.get(op, op))
                    self.ops.store.mark_needs_fsck(f"internal error in the channel: {e!r}")
                    reply, code = [], errno.EIO
                self.counts["requests"] += 1
                try:
                    P.send_frame(conn, P.REP.pack(sum(len(x) for x in reply), code), *reply, fds=fds)
                finally:
                    for fd in fds:
                        os.close(fd)
        except (ConnectionError, OSError, P.ProtocolError) as e:
            if not self._stop and not isinstance(e, ConnectionError):
                log.info("channel client dropped: %r", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    # ------------------------------------------------------------------ requests
    def _dispatch(self, peer: Peer, op: int, body: memoryview) -> tuple[list, list[int]]:
        if not self.allow_other and (peer.uid, peer.gid) != self.owner:
            raise Refused(errno.EACCES, "not the mount's owner (no --allow-other)")
        if op == P.HELLO:
            return self._hello(peer)
        if op == P.STAT:
            return [self._stat(peer, *P.parse_stat_request(body))], []
        if op == P.EXTENTS:
            return [self._extents(peer, *P.parse_extents_request(body))], []
        if op == P.WRITE:
            return [self._write(peer, *P.parse_write_request(body))], []
        if op == P.SYNC:
            self.store.sync()
            return [], []
        raise P.ProtocolError(f"unknown operation {op}")

    def _hello(self, peer: Peer) -> tuple[list, list[int]]:
        st = os.stat(self.volume)
        if not peer.may(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, R):
            raise Refused(errno.EACCES, "may not read the volume")
        pub = self.published
        doc = {"version": P.VERSION, "volume": self.volume, "uuid": self.store.volume_id,
               "generation": pub.generation, "entry_max": self.ops.buffers.entry_max}
        return [json.dumps(doc).encode()], [pub.reader_fd()]

    def _session_ok(self, peer: Peer, attrs: tuple[int, int, int], want: int) -> None:
        if not peer.may(attrs[0], attrs[1], attrs[2], want, is_dir=True):
            raise Refused(errno.EACCES, "session directory")

    def _stat(self, peer: Peer, session: str, small: list[str]) -> bytes:
        self._settle(session, None)
        st = self.store.session_stat(session)
        self._session_ok(peer, (st.mode, st.uid, st.gid), R | X)
        files = {}
        got: dict[str, bytes | None] = {}
        for name in self.store.list_files(session):
            try:
                f = self.store.file_stat(session, name)
            except errors.NotFound:  # removed meanwhile
                continue
            files[name] = (f.size, f.mode, f.uid, f.gid)
        for name in small:
            f = files.get(name)
            if f is None or f[0] > P.SMALL_MAX or not peer.may(f[1], f[2], f[3], R):
                got[name] = None
                continue
            try:
                got[name] = self.store.read(session, name, 0, f[0])
            except errors.NotFound:
                got[name] = None
        return P.stat_reply(P.SessionInfo(st.mode, st.uid, st.gid, files, got), small)

    def _extents(self, peer: Peer, session: str, files: list[tuple[str, int, int]]) -> bytes:
        self.counts["extents"] += 1
        self._settle(session, [name for name, _, _ in files])
        attrs, out = self.store.extents(session, files)
        self._session_ok(peer, attrs, X)
        for fe in out:
            if fe is not None and not peer.may(fe.mode, fe.uid, fe.gid, R):
                raise Refused(errno.EACCES, "file")
        return P.extents_reply(attrs, out)

    # ------------------------------------------------------------------ writes
    def _write(self, peer: Peer, session: str, flags: int, items: list[tuple[P.Item, int]]) -> bytes:
        self.counts["writes"] += 1
        st = self.store.session_stat(session)
        self._session_ok(peer, (st.mode, st.uid, st.gid), X)
        results: list[tuple[int, int]] = []
        failed = False
        for it, k in items:  # k: items of the request this one stands for (joined appends)
            if failed:
                results += [(errno.ECANCELED, 0)] * k
                continue
            try:
                size = self._item(peer, session, st, it, bool(flags & P.W_CREATE))
                self.counts["write_bytes"] += len(it.data)
                results += [(0, size)] * k
            except (Refused, errors.KVFSError, pyfuse3.FUSEError, Stale) as e:
                results += [(e.errno if isinstance(e, Refused) else errno_of(e), 0)] * k
                failed = True
        sync_errno = 0
        if flags & P.W_SYNC and not failed:
            try:
                self.store.sync()
            except errors.KVFSError as e:
                sync_errno = errno_of(e)
            except OSError as e:
                sync_errno = e.errno or errno.EIO
        return P.write_reply(results, sync_errno)

    def _item(self, peer: Peer, session: str, st: Any, it: P.Item, create: bool) -> int:
        key = (session, it.name)
        try:
            f = self.store.file_stat(session, it.name)
        except errors.NotFound:
            if not create or it.kind == P.TRUNCATE:
                raise
            if not peer.may(st.mode, st.uid, st.gid, W | X, is_dir=True):
                raise Refused(errno.EACCES, "create in the session directory") from None
            self.store.create_file(session, it.name, 0o600, peer.uid, peer.gid)
            self._new_name(session, it.name)
            f = self.store.file_stat(session, it.name)
        if not peer.may(f.mode, f.uid, f.gid, W):
            raise Refused(errno.EACCES, "file")
        node = self.ops.inodes.find(key)
        if node is not None and (it.kind != P.APPEND or self.ops.buffers.get(node.ino) is not None):
            self.counts["via_fuse"] += 1
            size = self._on_loop(self._fuse_item, node, it)
        else:
            size = self._direct_item(session, f.size, it)
        if node is not None:
            self._forget_attrs(node)
        return size

    def _direct_item(self, session: str, size: int, it: P.Item) -> int:
        s, name = self.store, it.name
        if it.kind == P.TRUNCATE:
            s.truncate(session, name, it.arg)
            self.ops.buffers.space_freed()
            return it.arg
        if it.kind == P.REPLACE:
            if size:
                s.truncate(session, name, 0)
                self.ops.buffers.space_freed()
            size = 0
        elif it.arg != size:
            raise errors.NotAppend(f"{session}/{name}: append expected size {it.arg}, it is {size}")
        step = self.ops.buffers.entry_max  # ring entries as the FUSE face cuts them
        data = it.data
        for k in range(0, len(data), step):
            s.append(session, name, size, data[k:k + step])
            size += len(data[k:k + step])
        return size

    async def _fuse_item(self, node: Node, it: P.Item) -> int:
        """On the FUSE loop: a change of a file the FUSE layer holds state for."""
        ops, buffers = self.ops, self.ops.buffers
        if it.kind in (P.TRUNCATE, P.REPLACE):
            await buffers.truncate(node, it.arg if it.kind == P.TRUNCATE else 0)
            ops.cut(node)
            buffers.space_freed()
            if it.kind == P.TRUNCATE:
                return it.arg
        else:
            p = buffers.get(node.ino)
            size = p.size if p is not None else (await ops.call(
                self.store.file_stat, *node.key, changes=False)).size
            if size != it.arg:
                raise errors.NotAppend(f"append expected size {it.arg}, it is {size}")
        done = 0
        while done < len(it.data):
            done += await buffers.write(node, None, bytes(it.data[done:]))
        await buffers.flush(node)
        p = buffers.get(node.ino)
        return p.size if p is not None else (await ops.call(
            self.store.file_stat, *node.key, changes=False)).size

    def _settle(self, session: str, names: list[str] | None) -> None:
        """Bytes written through the mount and still buffered go to the engine first."""
        buffers = self.ops.buffers
        nodes = [p.node for p in buffers.pending() if p.buf and p.node.key[0] == session
                 and (names is None or p.node.key[1] in names)]
        if nodes:
            self.counts["via_fuse"] += 1
            self._on_loop(self._flush, nodes)

    async def _flush(self, nodes: list[Node]) -> None:
        for node in nodes:
            if not node.unlinked:
                await self.ops.buffers.flush(node)

    def _on_loop(self, afn: Callable[..., Any], *args: Any) -> Any:
        try:
            return trio.from_thread.run(afn, *args, trio_token=self.token)
        except trio.RunFinishedError:
            raise Refused(errno.ESHUTDOWN, "the mount is stopping") from None

    # ------------------------------------------------------------------ the kernel's caches
    def _forget_attrs(self, node: Node) -> None:
        """The kernel cached this file's size (and pages with --page-cache): it changed."""
        if not self.ops.notify_kernel:
            return
        if self.ops.direct_io:
            try:
                pyfuse3.invalidate_inode(node.ino, attr_only=True)
            except OSError as e:
                log.debug("invalidate inode %d: %r", node.ino, e)
        else:
            drop_kernel_pages([node.ino])

    def _new_name(self, session: str, name: str) -> None:
        """A file made here: the kernel may hold a "no such file" answer for its name."""
        parent = self.ops.inodes.find((session,))
        if parent is None or not self.ops.notify_kernel:
            return
        try:
            pyfuse3.invalidate_entry(parent.ino, os.fsencode(name))
        except OSError as e:
            log.debug("invalidate entry %r: %r", name, e)

"""The native channel's server: the mount answers its own clients beside the FUSE face.

kvfs's clients (the warm tier's write-behind and migration, recall, resume, the tools)
reach the mount through FUSE like any program, and also through this Unix socket
(abstract name ``kvfs-<volume uuid>-<128 random bits>``, bound before the kernel mount so
nobody can take it first, shown in ``/.kvfs/stats`` under ``channel``): they ask for a session's extents and read the blocks from the volume
themselves (``kvfs.engine.direct``), and send a round's appends for every layer as one
request with one durability point. The mount stays the only authority on names, extents
and the ring, and the only writer of the volume. Beside the published block, the hello hands
over the catalog (``kvfs.engine.catalog``): the sessions' extents, kept current by the
store a few milliseconds after each change, so a client reads most files without
asking at all. Protocol: ``kvfs.channel.protocol`` and
docs/mount.md.

Who may use it is decided as the kernel would decide for the files: the peer's uid, gid
and groups against the mount, the session directory (search; read to list it; write to
create a file in it) and the file (read, write), root passing the checks as with
``default_permissions``. The volume's path goes only to a peer that may read the volume
file; any other gets EACCES and uses the files. Who gets a connection at all, and how
much a request may carry, is the admission policy (``admission.Admission``: the peer
check, per-uid connection limits, reserved slots, the idle timeout, body limits).

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
import secrets
import socket
import stat
import threading
from collections.abc import Callable
from typing import Any

import pyfuse3
import trio

from kvfs.channel import protocol as P
from kvfs.engine import errors
from kvfs.engine.store import Store
from kvfs.engine.types import SessionStat

from .admission import FRAME_TIMEOUT_S, MAX_CLIENTS, Admission, Peer, R, W, X, peer_of, recv_body
from .errnos import Refused, Stale, errno_of
from .files import drop_kernel_pages
from .nodes import Node
from .ops import Operations

log = logging.getLogger("kvfs.channel")

BIND_TRIES = 8  # random socket names tried before the mount gives up serving

class ChannelServer:
    """The listening socket, its accept thread and one thread per client (module doc)."""

    def __init__(self, ops: Operations, store: Store, volume: str, *, allow_other: bool = False,
                 idle_s: float = P.IDLE_TIMEOUT_S) -> None:
        self.ops, self.store, self.volume = ops, store, volume
        self.policy = Admission((os.getuid(), os.getgid()), allow_other=allow_other,
                                idle_s=idle_s)
        self.name = ""
        self.token: trio.lowlevel.TrioToken | None = None
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stop = False
        self.counts = {"clients": 0, "refused": 0, "requests": 0, "extents": 0, "writes": 0,
                       "write_bytes": 0, "via_fuse": 0, "errors": 0, "idle_closed": 0}

    # ------------------------------------------------------------------ lifecycle
    def bind(self) -> None:
        """Take the socket's name before the mount is offered to anyone: an abstract name
        nobody can guess (128 random bits), so no local user can take it first; a taken
        one is retried. OSError when none could be bound: the mount then refuses to start
        (a mount whose clients cannot find it must not look healthy)."""
        last: OSError | None = None
        for _ in range(BIND_TRIES):
            name = f"kvfs-{self.store.volume_id}-{secrets.token_hex(16)}"
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                s.bind("\0" + name)
                s.listen(MAX_CLIENTS)
            except OSError as e:
                s.close()
                last = e
                log.debug("native channel name @%s not usable: %s", name, e)
                continue
            self._sock, self.name = s, name
            return
        raise OSError(last.errno if last else errno.EADDRINUSE,
                      f"cannot serve the native channel: none of {BIND_TRIES} socket names "
                      f"could be bound ({last.strerror if last else 'no name'})")

    def start(self, token: trio.lowlevel.TrioToken) -> None:
        self.token = token
        self.published = self.store.publish()
        if self._sock is None:
            self.bind()
        t = threading.Thread(target=self._accept, name="kvfs-channel", daemon=True)
        t.start()
        self._threads.append(t)
        log.info("native channel on @%s", self.name)

    def info(self) -> dict[str, Any]:
        return {"socket": "@" + self.name, "version": P.VERSION, **self.counts,
                "connections": self.policy.admitted()}

    def close(self) -> None:
        self._stop = True
        socks = self.policy.stop() + ([self._sock] if self._sock is not None else [])
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
            try:  # who it is, before anything is read or allocated for it
                peer = peer_of(conn)
            except OSError as e:
                log.info("channel peer without credentials: %r", e)
                conn.close()
                continue
            code = self.policy.admit(conn, peer)
            if code:
                self._turn_away(conn, code)
                continue
            self.counts["clients"] += 1
            t = threading.Thread(target=self._serve, args=(conn, peer),
                                 name="kvfs-channel-client", daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _turn_away(self, conn: socket.socket, code: int) -> None:
        """One reply header with the errno, then closed: the accept thread never waits."""
        self.counts["refused"] += 1
        try:
            conn.setblocking(False)
            conn.send(P.REP.pack(0, code))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket, peer: Peer) -> None:
        try:
            while not self._stop:
                conn.settimeout(self.policy.idle_s)
                try:
                    head = conn.recv(P.REQ.size)
                except TimeoutError:
                    self.counts["idle_closed"] += 1
                    return
                if not head:
                    return  # closed by the client
                conn.settimeout(FRAME_TIMEOUT_S)
                if len(head) < P.REQ.size:
                    head += bytes(P.recv_exact(conn, P.REQ.size - len(head)))
                n, op = P.REQ.unpack(head)
                refused = self.policy.body_refusal(op, n)
                if refused is not None:  # the body is never read: the stream ends here
                    log.info("channel: uid %d: %s; closing its connection", peer.uid, refused[1])
                    self._reply(conn, refused[0], [], [])
                    return
                body = recv_body(conn, n)
                fds: list[int] = []
                fatal = False
                try:
                    reply, fds = self._dispatch(peer, op, body)
                    code = 0
                except Refused as e:
                    reply, code = [], e.errno
                except errors.KVFSError as e:
                    reply, code = [], errno_of(e)
                except P.Invalid as e:
                    log.info("channel: uid %d: %s", peer.uid, e)
                    reply, code = [], errno.EINVAL
                except P.ProtocolError as e:
                    log.info("channel: uid %d: malformed %s request: %s", peer.uid,
                             P.OPS.get(op, op), e)
                    reply, code, fatal = [], errno.EPROTO, True
                except ConnectionError:
                    raise
                except MemoryError:
                    log.error("channel %s request of uid %d: out of memory", P.OPS.get(op, op),
                              peer.uid)
                    reply, code = [], errno.ENOMEM
                except Exception:  # a bug here is this request's error, not the volume's
                    log.exception("channel %s request failed", P.OPS.get(op, op))
                    self.counts["errors"] += 1
                    reply, code = [], errno.EIO
                del body
                self.counts["requests"] += 1
                try:
                    self._reply(conn, code, reply, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
                if fatal:
                    return
        except (ConnectionError, OSError) as e:
            if not self._stop and not isinstance(e, ConnectionError):
                log.info("channel client dropped: %r", e)
        finally:
            self.policy.release(conn)
            conn.close()

    @staticmethod
    def _reply(conn: socket.socket, code: int, reply: list, fds: list[int]) -> None:
        P.send_frame(conn, P.REP.pack(sum(len(x) for x in reply), code), *reply, fds=fds)

    # ------------------------------------------------------------------ requests
    def _dispatch(self, peer: Peer, op: int, body: memoryview) -> tuple[list, list[int]]:
        if not self.policy.may_use(peer):
            raise Refused(errno.EACCES, "not the mount's owner (no --allow-other)")
        if op == P.HELLO:
            if len(body) != 4:
                raise P.ProtocolError(f"a hello of {len(body)} bytes, not 4")
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
               "generation": pub.generation, "entry_max": self.ops.buffers.entry_max,
               "idle_s": self.policy.idle_s}
        fds = [pub.reader_fd()]
        if self.store.catalog is not None:
            fds.append(self.store.catalog.reader_fd())
        return [json.dumps(doc).encode()], fds

    def _session_ok(self, peer: Peer, attrs: tuple[int, int, int], want: int) -> None:
        if not peer.may(attrs[0], attrs[1], attrs[2], want, is_dir=True):
            raise Refused(errno.EACCES, "session directory")

    def _stat(self, peer: Peer, session: str, small: list[str]) -> bytes:
        st = self.store.session_stat(session)
        self._session_ok(peer, (st.mode, st.uid, st.gid), R | X)
        self._settle(session, None)
        st = self.store.session_stat(session)
        files = {}
        got: dict[str, bytes | None] = {}
        for name in self.store.list_files(session):
            try:
                f = self.store.file_stat(session, name)
            except errors.NotFound:  # removed meanwhile
                continue
            files[name] = (f.size, f.mode, f.uid, f.gid)
        budget = P.SMALL_TOTAL  # bounds the reply: past it, small files answer None
        for name in small:
            seen = files.get(name)
            if seen is None or seen[0] > min(P.SMALL_MAX, budget) or not peer.may(
                    seen[1], seen[2], seen[3], R):
                got[name] = None
                continue
            try:
                got[name] = b = self.store.read(session, name, 0, seen[0])
                budget -= len(b)
            except errors.NotFound:
                got[name] = None
        return P.stat_reply(P.SessionInfo(st.mode, st.uid, st.gid, files, got), small)

    def _extents(self, peer: Peer, session: str, files: list[tuple[str, int, int]]) -> bytes:
        self.counts["extents"] += 1
        # permissions first: the engine counts an answered request as a use (atime), and a
        # refused one must change nothing; the answer's attributes are checked again below
        st = self.store.session_stat(session)
        self._session_ok(peer, (st.mode, st.uid, st.gid), X)
        for name, _, _ in files:
            try:
                f = self.store.file_stat(session, name)
            except errors.NotFound:
                continue
            if not peer.may(f.mode, f.uid, f.gid, R):
                raise Refused(errno.EACCES, "file")
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
                code = e.errno if isinstance(e, Refused) else errno_of(e)
                # the size it has now: a failed item tells what of it was stored
                results += [(code, self._size_now(session, it.name))] * k
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

    def _item(self, peer: Peer, session: str, st: SessionStat, it: P.Item, create: bool) -> int:
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
        held = self.ops.buffers.get(node.ino) if node is not None else None
        self._fits(session, it, f.size, held.size - f.size if held is not None else 0)
        try:
            if node is not None and (it.kind != P.APPEND or held is not None):
                self.counts["via_fuse"] += 1
                return self._on_loop(self._fuse_item, node, it)
            return self._direct_item(session, f.size, it)
        finally:  # failed too: what was cut or stored must not hide behind cached attributes
            if node is not None:
                self._forget_attrs(node)

    def _fits(self, session: str, it: P.Item, stored: int, buffered: int) -> None:
        """All or nothing: an append or replace the session owner's byte quota cannot take
        whole is refused before any byte of it is stored (``buffered``: bytes of the file a
        FUSE handle holds, not yet charged)."""
        if it.kind == P.TRUNCATE:
            return
        room = self.store.quota_room(session)
        if room is None:
            return
        need = len(it.data) - stored if it.kind == P.REPLACE else len(it.data) + buffered
        if need > room:
            raise errors.QuotaExceeded(f"{session}/{it.name}: {len(it.data)} bytes do not fit "
                                       f"the owner's quota ({room} bytes left)")

    def _size_now(self, session: str, name: str) -> int:
        node = self.ops.inodes.find((session, name))
        held = self.ops.buffers.get(node.ino) if node is not None else None
        if held is not None:
            return held.size
        try:
            return self.store.file_stat(session, name).size
        except errors.KVFSError:
            return 0

    def _direct_item(self, session: str, size: int, it: P.Item) -> int:
        s, name = self.store, it.name
        if it.kind == P.TRUNCATE:
            s.truncate(session, name, it.arg)
            return it.arg
        if it.kind == P.REPLACE:
            if size:
                s.truncate(session, name, 0)
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

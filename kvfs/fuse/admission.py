"""Who may use the native channel, and how much: its admission policy, in one object.

The peer is known at accept (``SO_PEERCRED``, ``SO_PEERGROUPS``), before anything is read
or allocated for it. Without ``--allow-other`` only the mount's owner gets in (FUSE lets no
one else in either); of ``MAX_CLIENTS`` connections ``OWNER_SLOTS`` are kept for the owner
and root, and any other uid holds at most ``PER_UID``; a connection idle for ``idle_s``
is closed, a frame begun must keep arriving (``FRAME_TIMEOUT_S``), and a body larger
than its operation allows (``kvfs.channel.protocol.BODY_MAX``) is never read. A limit is
an errno that changes nothing, never the mount's or the volume's trouble
(docs/reliability.md, "The native channel's limits"). Permissions on sessions and files
are the kernel's rules (``Peer.may``). Never imports pyfuse3 or trio.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
from dataclasses import dataclass

from kvfs.channel import protocol as P

log = logging.getLogger("kvfs.channel")

# Connection limits: no local user can fill the channel. A connection over a limit is
# answered EUSERS and closed.
MAX_CLIENTS = 64  # connections served at once
OWNER_SLOTS = 8  # of them only the mount's owner and root may take: they always get in
PER_UID = 16  # connections of any one other uid
FRAME_TIMEOUT_S = 10.0  # a frame begun must keep arriving: no recv or send waits longer
BODY_CHUNK = 1 << 20  # a body is allocated as it arrives, this much at a time, not as announced
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
R, W, X = P.R, P.W, P.X


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]

    def may(self, mode: int, uid: int, gid: int, want: int, is_dir: bool = False) -> bool:
        """Whether the kernel's ``generic_permission`` would grant ``want`` (R|W|X bits)."""
        return P.permits(self.uid, self.gid, self.groups, mode, uid, gid, want, is_dir)


def recv_body(conn: socket.socket, n: int) -> memoryview:
    """``n`` bytes, allocated as they arrive: ``BODY_CHUNK`` first, then doubled each time
    the bytes so far filled it, so a header announcing a large body costs nothing until
    its bytes come, and never more than twice what came."""
    if n <= BODY_CHUNK:
        return P.recv_exact(conn, n) if n else memoryview(b"")
    buf = bytearray()
    while len(buf) < n:
        got = len(buf)
        buf.extend(bytes(min(max(got, BODY_CHUNK), n - got)))
        with memoryview(buf) as mv:
            P.recv_exact(conn, len(buf) - got, mv[got:])
    return memoryview(buf)


def peer_of(conn: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    groups: frozenset[int] = frozenset()
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 1024)
        groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError as e:  # an older kernel: the primary group only
        log.debug("SO_PEERGROUPS: %r", e)
    return Peer(pid, uid, gid, groups)


class Admission:
    """The channel's admission policy: who gets a connection, which bodies are read, how
    long a connection may idle. Counts the connections it admitted until ``release``;
    thread-safe (the accept thread admits, each client's thread releases)."""

    def __init__(self, owner: tuple[int, int], *, allow_other: bool = False,
                 idle_s: float = P.IDLE_TIMEOUT_S) -> None:
        self.owner, self.allow_other, self.idle_s = owner, allow_other, idle_s
        self._conns: dict[socket.socket, int] = {}  # -> the peer's uid
        self._lock = threading.Lock()
        self._stopping = False

    def may_use(self, peer: Peer) -> bool:
        """Whether ``peer`` may use the channel at all (checked again on every request)."""
        return self.allow_other or (peer.uid, peer.gid) == self.owner

    def admit(self, conn: socket.socket, peer: Peer) -> int:
        """0 with the connection counted, or the errno it is turned away with."""
        if not self.may_use(peer):
            return errno.EACCES  # FUSE lets no one else in either
        with self._lock:
            if self._stopping:
                return errno.ESHUTDOWN
            n = len(self._conns)
            mine = sum(1 for uid in self._conns.values() if uid == peer.uid)
            if n >= MAX_CLIENTS or peer.uid not in (0, self.owner[0]) and (
                    n >= MAX_CLIENTS - OWNER_SLOTS or mine >= PER_UID):
                return errno.EUSERS
            self._conns[conn] = peer.uid
        return 0

    def admitted(self) -> int:
        """Connections admitted and not yet released."""
        with self._lock:
            return len(self._conns)

    def release(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.pop(conn, None)

    def stop(self) -> list[socket.socket]:
        """Admit no one from now on; the connections admitted and not yet released."""
        with self._lock:
            self._stopping = True
            return [*self._conns]

    @staticmethod
    def body_refusal(op: int, n: int) -> tuple[int, str] | None:
        """Why a request of ``op`` announcing an ``n``-byte body is not read (its errno and
        the reason), or None: its body may be read."""
        limit = P.BODY_MAX.get(op)
        if limit is None:
            return errno.EPROTO, f"unknown operation {op}"
        if n > limit:
            return errno.EMSGSIZE, f"{P.OPS[op]} request of {n} bytes, at most {limit}"
        return None

"""The native channel's wire format: frames on a Unix stream socket (docs/mount.md).

A request is ``<IB`` (body length, operation) then the body; a reply is ``<Ii`` (body
length, errno: 0 for success) then the body. Integers are little-endian; a name is a u16
length and its UTF-8 bytes (``surrogateescape``: any bytes the mount takes). One request
at a time per connection. The encoders and decoders of both sides live here, so client
and server cannot disagree; nothing here touches a socket but ``send_frame`` /
``recv_exact`` / ``recv_frame``.
"""

from __future__ import annotations

import array
import socket
import struct
from dataclasses import dataclass

from kvfs.engine.direct import FileExtents

VERSION = 1
HELLO, STAT, EXTENTS, WRITE, SYNC = 1, 2, 3, 4, 5
OPS = {HELLO: "hello", STAT: "stat", EXTENTS: "extents", WRITE: "write", SYNC: "sync"}
APPEND, REPLACE, TRUNCATE = 1, 2, 3  # WRITE items
W_SYNC, W_CREATE = 1, 2  # WRITE flags: one durability point at the end; create missing files
SMALL_MAX = 1 << 20  # a small file STAT returns the bytes of

# Limits on one request, checked before the mount allocates for it (docs/reliability.md,
# "The native channel's limits"). A request over one is answered with the errno named and
# changes nothing; the client keeps below them (it cuts rounds and name lists).
R, W, X = 4, 2, 1  # permission bits asked for (``permits``)
NAME_MAX = 255  # bytes of a session or file name (the engine's MAX_NAME)
NAMES_MAX = 256  # files a STAT or EXTENTS request names, each at most once (EINVAL beyond)
WRITE_MAX = 256 << 20  # data bytes of one WRITE (EMSGSIZE beyond)
WRITE_ITEMS_MAX = 4096  # items of one WRITE (EINVAL beyond)
IDLE_TIMEOUT_S = 60.0  # the mount closes a connection idle this long (profile: channel_idle_s)
SMALL_TOTAL = 16 << 20  # bytes of small files one STAT reply carries; later ones answer None
_NAMES_BODY = 2 + NAME_MAX + 2 + NAMES_MAX * (2 + NAME_MAX + 16)
BODY_MAX = {  # operation -> the largest body it may announce (EMSGSIZE beyond)
    HELLO: 4, SYNC: 0, STAT: _NAMES_BODY, EXTENTS: _NAMES_BODY,
    WRITE: WRITE_MAX + 2 + NAME_MAX + 3 + WRITE_ITEMS_MAX * (17 + 2 + NAME_MAX)}
MAX_FRAME = max(BODY_MAX.values())  # no request is larger

REQ = struct.Struct("<IB")
REP = struct.Struct("<Ii")
_U16 = struct.Struct("<H")
_ATTRS = struct.Struct("<III")  # mode, uid, gid
_FILE = struct.Struct("<QIII")  # size, mode, uid, gid
_FE = struct.Struct("<QIQQQQIIII")  # sno, fno, size, cuts, lo, hi, mode, uid, gid, extents
_EXT = struct.Struct("<QQIII")  # file offset, pos, skip, length, esize
_REQ_EXT = struct.Struct("<Qq")  # offset, length (< 0: to the end)
_ITEM = struct.Struct("<BQQ")  # kind, argument (expected size / length), data bytes
_RESULT = struct.Struct("<iQ")  # errno, size after


class ProtocolError(Exception):
    """A frame that does not decode: answered EPROTO, then the connection is closed."""


class Invalid(ValueError):
    """A frame that decodes but breaks a per-request limit: answered EINVAL, nothing done."""


# ----------------------------------------------------------------------- sockets
def recv_exact(sock: socket.socket, n: int, into: bytearray | memoryview | None = None) -> memoryview:
    buf = memoryview(into if into is not None else bytearray(n))[:n]
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionError("channel closed")
        got += k
    return buf


def send_frame(sock: socket.socket, head: bytes, *parts: bytes | memoryview,
               fds: list[int] | None = None) -> None:
    """One frame: ``head`` (``REQ`` or ``REP`` packed by the caller) and its body parts,
    with ``fds`` passed alongside (SCM_RIGHTS)."""
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sock.sendmsg([head], anc)
    else:
        sock.sendall(head)
    for p in parts:
        if len(p):
            sock.sendall(p)


def recv_fds(sock: socket.socket, n: int, maxfds: int = 4) -> tuple[memoryview, list[int]]:
    """``n`` bytes (the first of them with any descriptors that came along)."""
    size = socket.CMSG_SPACE(maxfds * 4)
    data, anc, _, _ = sock.recvmsg(n, size)
    if not data:
        raise ConnectionError("channel closed")
    fds: list[int] = []
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(raw[: len(raw) - len(raw) % 4])
            fds += list(a)
    rest = recv_exact(sock, n - len(data)) if len(data) < n else memoryview(b"")
    return memoryview(bytes(data) + bytes(rest)), fds


# ----------------------------------------------------------------------- pieces
class Writer:
    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []

    def name(self, s: str) -> None:
        b = s.encode("utf-8", "surrogateescape")
        if len(b) > 0xFFFF:
            raise ValueError("name too long")
        self.parts += [_U16.pack(len(b)), b]

    def raw(self, b: bytes | memoryview) -> None:
        self.parts.append(b)

    def body(self) -> bytes:
        return b"".join(self.parts)


class Reader:
    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf, self.p = memoryview(buf), 0

    def take(self, st: struct.Struct) -> tuple:
        if self.p + st.size > len(self.buf):
            raise ProtocolError("frame cut short")
        v = st.unpack_from(self.buf, self.p)
        self.p += st.size
        return v

    def name(self) -> str:
        (n,) = self.take(_U16)
        if self.p + n > len(self.buf):
            raise ProtocolError("frame cut short")
        s = bytes(self.buf[self.p:self.p + n]).decode("utf-8", "surrogateescape")
        self.p += n
        return s

    def bytes(self, n: int) -> memoryview:
        if self.p + n > len(self.buf):
            raise ProtocolError("frame cut short")
        v = self.buf[self.p:self.p + n]
        self.p += n
        return v

    def u16(self) -> int:
        return self.take(_U16)[0]

    def end(self, what: str) -> None:
        if self.p != len(self.buf):
            raise ProtocolError(f"{len(self.buf) - self.p} trailing bytes in a {what} request")


def _names_allowed(n: int) -> None:
    if n > NAMES_MAX:
        raise Invalid(f"{n} names in one request, at most {NAMES_MAX}")


def _distinct(names: list[str]) -> None:
    if len(set(names)) != len(names):
        raise Invalid("a request names a file more than once")


# ----------------------------------------------------------------------- STAT
def stat_request(session: str, small: list[str]) -> bytes:
    w = Writer()
    w.name(session)
    w.raw(_U16.pack(len(small)))
    for n in small:
        w.name(n)
    return w.body()


def parse_stat_request(body: memoryview) -> tuple[str, list[str]]:
    r = Reader(body)
    session = r.name()
    n = r.u16()
    _names_allowed(n)
    small = [r.name() for _ in range(n)]
    r.end("stat")
    _distinct(small)
    return session, small


@dataclass
class SessionInfo:
    """A session as STAT describes it: its attributes, files (name -> (size, mode, uid,
    gid)) and the bytes of the small files asked for (None: missing or too big)."""

    mode: int
    uid: int
    gid: int
    files: dict[str, tuple[int, int, int, int]]
    small: dict[str, bytes | None]


def stat_reply(info: SessionInfo, small: list[str]) -> bytes:
    w = Writer()
    w.raw(_ATTRS.pack(info.mode, info.uid, info.gid))
    w.raw(struct.pack("<I", len(info.files)))
    for name, st in info.files.items():
        w.name(name)
        w.raw(_FILE.pack(*st))
    for n in small:
        b = info.small.get(n)
        w.raw(struct.pack("<i", -1 if b is None else len(b)))
        if b is not None:
            w.raw(b)
    return w.body()


def parse_stat_reply(body: memoryview, small: list[str]) -> SessionInfo:
    r = Reader(body)
    mode, uid, gid = r.take(_ATTRS)
    (n,) = r.take(struct.Struct("<I"))
    files = {}
    for _ in range(n):
        name = r.name()
        files[name] = r.take(_FILE)
    got: dict[str, bytes | None] = {}
    for s in small:
        (k,) = r.take(struct.Struct("<i"))
        got[s] = None if k < 0 else bytes(r.bytes(k))
    return SessionInfo(mode, uid, gid, files, got)


# ----------------------------------------------------------------------- EXTENTS
def extents_request(session: str, files: list[tuple[str, int, int]]) -> bytes:
    w = Writer()
    w.name(session)
    w.raw(_U16.pack(len(files)))
    for name, off, length in files:
        w.name(name)
        w.raw(_REQ_EXT.pack(off, length))
    return w.body()


def parse_extents_request(body: memoryview) -> tuple[str, list[tuple[str, int, int]]]:
    r = Reader(body)
    session = r.name()
    n = r.u16()
    _names_allowed(n)
    out = []
    for _ in range(n):
        name = r.name()
        out.append((name, *r.take(_REQ_EXT)))
    r.end("extents")
    _distinct([name for name, _, _ in out])
    return session, out


def extents_reply(attrs: tuple[int, int, int], files: list[FileExtents | None]) -> bytes:
    w = Writer()
    w.raw(_ATTRS.pack(*attrs))
    for fe in files:
        if fe is None:
            w.raw(b"\0")
            continue
        w.raw(b"\1")
        w.raw(_FE.pack(fe.sno, fe.fno, fe.size, fe.cuts, fe.lo, fe.hi, fe.mode, fe.uid, fe.gid,
                       len(fe.ext)))
        w.raw(b"".join(_EXT.pack(o, *e) for o, e in zip(fe.off, fe.ext, strict=True)))
    return w.body()


def parse_extents_reply(body: memoryview, n: int) -> tuple[tuple[int, int, int], list[FileExtents | None]]:
    r = Reader(body)
    attrs = r.take(_ATTRS)
    out: list[FileExtents | None] = []
    for _ in range(n):
        if r.bytes(1)[0] == 0:
            out.append(None)
            continue
        sno, fno, size, cuts, lo, hi, mode, uid, gid, k = r.take(_FE)
        raw = r.bytes(k * _EXT.size)
        offs, exts = [], []
        for o, pos, skip, length, esize in _EXT.iter_unpack(raw):
            offs.append(o)
            exts.append((pos, skip, length, esize))
        out.append(FileExtents(sno, fno, size, cuts, lo, hi, offs, exts, mode, uid, gid))
    return attrs, out


# ----------------------------------------------------------------------- WRITE
@dataclass
class Item:
    """One change of a WRITE: append ``data`` to ``name`` whose size must be ``arg``,
    replace its bytes with ``data``, or truncate it to ``arg`` bytes."""

    kind: int
    name: str
    arg: int = 0
    data: bytes | memoryview = b""


def write_request(session: str, flags: int, items: list[Item]) -> list[bytes | memoryview]:
    """The body as parts (the data is sent as it is, not copied into one buffer)."""
    w = Writer()
    w.name(session)
    w.raw(bytes([flags]))
    w.raw(_U16.pack(len(items)))
    for it in items:
        w.raw(_ITEM.pack(it.kind, it.arg, len(it.data)))
        w.name(it.name)
    return [w.body(), *(it.data for it in items)]


def parse_write_request(body: memoryview) -> tuple[str, int, list[tuple[Item, int]]]:
    """(session, flags, [(item, how many items of the request it stands for)]): appends
    that continue each other (the pieces of one file's tail) come as one item, their
    bytes one view of the body, so they become one append, not one per piece."""
    r = Reader(body)
    session = r.name()
    flags = r.bytes(1)[0]
    heads = []
    count = r.u16()
    if count > WRITE_ITEMS_MAX:
        raise Invalid(f"{count} items in one write, at most {WRITE_ITEMS_MAX}")
    for _ in range(count):
        kind, arg, n = r.take(_ITEM)
        heads.append((kind, r.name(), arg, n))
    data = sum(h[3] for h in heads)
    if data > WRITE_MAX:
        raise Invalid(f"{data} data bytes in one write, at most {WRITE_MAX}")
    items: list[tuple[Item, int]] = []
    start = r.p
    for kind, name, arg, n in heads:
        if kind not in (APPEND, REPLACE, TRUNCATE):
            raise ProtocolError(f"unknown write kind {kind}")
        r.bytes(n)
        if items and kind == APPEND:
            last, k = items[-1]
            if last.kind == APPEND and last.name == name and last.arg + len(last.data) == arg:
                items[-1] = (Item(APPEND, name, last.arg, body[start - len(last.data):r.p]), k + 1)
                start = r.p
                continue
        items.append((Item(kind, name, arg, body[start:r.p]), 1))
        start = r.p
    r.end("write")
    return session, flags, items


def write_reply(results: list[tuple[int, int]], sync_errno: int) -> bytes:
    return b"".join(_RESULT.pack(*x) for x in results) + struct.pack("<i", sync_errno)


def parse_write_reply(body: memoryview, n: int) -> tuple[list[tuple[int, int]], int]:
    r = Reader(body)
    res = [r.take(_RESULT) for _ in range(n)]
    (sync_errno,) = r.take(struct.Struct("<i"))
    return res, sync_errno


def permits(uid: int, gid: int, groups: frozenset[int] | set[int], mode: int, owner: int,
            group: int, want: int, is_dir: bool = False) -> bool:
    """Whether the kernel's ``generic_permission`` grants ``want`` (R|W|X bits) of a file
    or directory of ``mode``, ``owner``, ``group`` to ``uid`` (primary ``gid``, ``groups``):
    the mount's rule for its clients, and a client's for what the catalog shows it."""
    if uid == 0:  # CAP_DAC_OVERRIDE: all but executing a file no one may execute
        return is_dir or not want & X or bool(mode & 0o111)
    if uid == owner:
        bits = mode >> 6
    elif group == gid or group in groups:
        bits = mode >> 3
    else:
        bits = mode
    return bits & want == want

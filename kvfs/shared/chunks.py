"""Key names and the chunk format of the shared tier (no I/O here).

A session file is cut at fixed file offsets into chunks of ``chunk_bytes``; chunk ``n`` of
file ``f`` of session ``s`` is the Redis string ``kvfs:{s}:f:n``. The ``{s}`` hash tag puts
every key of a session in one slot, so one shard holds the whole session and a Lua script
can change its keys atomically. A chunk value is a run of *pieces*, one per append that
touched the chunk (an append only ever adds a piece at the end)::

    piece  = header(16 bytes) + sealed body
    header = <HBBQI: magic, version (2), flags (1: encrypted), file offset of the payload,
                     payload length>
    body   = MAC(16) + payload                      (seal.Sealer, MAC mode)
           | nonce(12) + ciphertext + tag(16)       (AEAD mode)

The seal covers the session and file names and the header, so a flipped bit anywhere in a
piece, a piece from another session, file or place, a gap, or a piece made up by someone
without the cluster's secret is caught. ``Codec.decode`` checks every piece and that they
tile the chunk from its first byte with no gap; it returns the chunk's bytes or raises
``ChunkError``. The per-session keys besides the chunks: ``files`` (hash: file -> size),
``vers`` (hash: file -> its content version, one piece holding a random token, new when the
file is made or rewritten; docs/format.md), ``meta`` (one piece holding meta.json), ``owner`` (one piece holding the session's uid, gid
and mode), ``lease`` (a sealed owner node id), ``holder`` (the last lease value, to tell a
takeover from a first use), ``sync`` (a marker written by ``sync``) and ``tmp`` (the scratch
key of a trim, see ``scripts``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from kvfs.session.names import META

from .errors import BadName
from .seal import Sealer, SealError

MAGIC = 0x4B43  # "CK"
VERSION = 2
ENCRYPTED = 1  # header flag: the body is nonce + ciphertext + tag
HEADER = struct.Struct("<HBBQI")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 16
META_FILE = META  # the claim's place: the ``meta`` key, not a chunk (kvfs.session.names)
OWNER_FILE = "\0owner"  # the owner record's place: no file name holds a NUL
VERSION_PLACE = "\0version/"  # + file name: where a version token is sealed
VERSION_TOKEN = 16  # random bytes of a version token; the writing node's id follows
MAX_NAME = 255
# names may not contain these: "/" and NUL (path components), "{" "}" (the hash tag)
FORBIDDEN = frozenset("/\0{}")
# the capacity bookkeeping lives in its own slot; "/" can never be part of a session name
CAP_TAG = "kvfs:{/capacity}:"


class ChunkError(Exception):
    """A chunk value does not decode to the bytes it must hold (reason in the message)."""


def check_name(name: object, what: str = "name") -> str:
    """A session or file name: a non-empty str of at most 255 UTF-8 bytes, not "." or "..",
    without "/", NUL, "{" or "}". Raises ``BadName`` (a ``ValueError``)."""
    if not isinstance(name, str):
        raise BadName(f"{what} must be a str, not {type(name).__name__}")
    if not name or name in (".", ".."):
        raise BadName(f"{what} {name!r} is not allowed")
    bad = FORBIDDEN.intersection(name)
    if bad:
        raise BadName(f"{what} {name!r} contains {''.join(sorted(bad))!r}")
    try:
        n = len(name.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise BadName(f"{what} {name!r} is not valid UTF-8") from e
    if n > MAX_NAME:
        raise BadName(f"{what} is {n} bytes long (at most {MAX_NAME})")
    return name


class SessionKeys:
    """The key names of one session (all in the session's hash slot)."""

    __slots__ = ("session", "prefix", "files", "vers", "meta", "owner", "lease", "holder", "sync")

    def __init__(self, session: str) -> None:
        self.session = session
        self.prefix = f"kvfs:{{{session}}}:"
        self.files = self.prefix + "files"
        self.vers = self.prefix + "vers"
        self.meta = self.prefix + "meta"
        self.owner = self.prefix + "owner"
        self.lease = self.prefix + "lease"
        self.holder = self.prefix + "holder"
        self.sync = self.prefix + "sync"

    def chunk(self, file: str, n: int) -> str:
        return f"{self.prefix}{file}:{n}"


@dataclass(frozen=True)
class Owner:
    """Who a session belongs to, as its directory on the writing node says."""

    uid: int
    gid: int
    mode: int


@dataclass(frozen=True)
class SessionInfo:
    """A session as the cluster holds it at one instant (``SharedTier.open_session``)."""

    files: dict[str, int]          # file -> size (meta.json aside)
    meta: bytes | None             # meta.json, checked; None: the session is not visible
    owner: Owner | None            # uid, gid and mode of the writing node's copy; None: not recorded
    versions: dict[str, str | None] = field(default_factory=dict)  # file -> content version


@dataclass(frozen=True)
class Codec:
    """Encodes and checks the sealed values of the cluster (chunk pieces, meta, owner)."""

    sealer: Sealer

    @property
    def overhead(self) -> int:
        """Bytes one piece adds to its payload."""
        return HEADER_SIZE + self.sealer.overhead

    def encode_piece(self, session: str, file: str, offset: int,
                     payload: bytes | memoryview) -> bytes:
        flags = ENCRYPTED if self.sealer.encrypted else 0
        head = HEADER.pack(MAGIC, VERSION, flags, offset, len(payload))
        return head + self.sealer.seal(session, file, head, payload)

    def decode_pieces(self, session: str, file: str, value: bytes, start: int) -> tuple[bytes, int]:
        """Check the pieces of one chunk value whose first byte is file offset ``start``;
        return (the chunk's bytes, number of pieces)."""
        parts: list[bytes] = []
        pos, have = 0, 0
        mv = memoryview(value)
        extra = self.sealer.overhead
        flags = ENCRYPTED if self.sealer.encrypted else 0
        while pos < len(value):
            if len(value) - pos < HEADER_SIZE:
                raise ChunkError(f"torn piece header at byte {pos}")
            magic, version, fl, off, length = HEADER.unpack_from(value, pos)
            if magic != MAGIC or version != VERSION:
                raise ChunkError(f"bad piece magic/version at byte {pos} (a value of another "
                                 f"format: clear the cluster after an upgrade)")
            if fl != flags:
                raise ChunkError(f"piece at byte {pos} is {'' if fl & ENCRYPTED else 'not '}"
                                 f"encrypted, this node is {'' if flags else 'not '}configured so")
            end = pos + HEADER_SIZE + extra + length
            if end > len(value):
                raise ChunkError(f"piece at byte {pos} runs past the value ({length} bytes)")
            head = bytes(mv[pos:pos + HEADER_SIZE])
            try:
                payload = self.sealer.open(session, file, head, mv[pos + HEADER_SIZE:end])
            except SealError as e:
                raise ChunkError(f"piece at file offset {off}: {e}") from None
            if off != start + have:
                raise ChunkError(f"piece at file offset {off} where {start + have} was expected")
            parts.append(payload)
            pos, have = end, have + length
        return (parts[0] if len(parts) == 1 else b"".join(parts)), len(parts)

    def split_append(self, session: str, file: str, offset: int, data: bytes | bytearray | memoryview,
                     chunk_bytes: int) -> list[tuple[int, bytes]]:
        """Cut an append at chunk boundaries: [(chunk number, encoded piece), ...]."""
        mv = memoryview(data)
        out: list[tuple[int, bytes]] = []
        pos = 0
        while pos < len(mv):
            at = offset + pos
            n = at // chunk_bytes
            take = min(len(mv) - pos, (n + 1) * chunk_bytes - at)
            out.append((n, self.encode_piece(session, file, at, mv[pos:pos + take])))
            pos += take
        return out

    def encode_meta(self, session: str, data: bytes | memoryview) -> bytes:
        return self.encode_piece(session, META_FILE, 0, data)

    def decode_meta(self, session: str, value: bytes) -> bytes:
        return self.decode_pieces(session, META_FILE, value, 0)[0]

    def encode_version(self, session: str, file: str, token: bytes) -> bytes:
        """A file's content version as stored (sealed: bound to the session and file)."""
        return self.encode_piece(session, VERSION_PLACE + file, 0, token)

    def decode_version(self, session: str, file: str, value: bytes) -> str:
        """The version of ``file`` as text, ``<32 hex digits>@<node id>`` (the node that
        made this version); ``ChunkError`` if it does not verify."""
        token = self.decode_pieces(session, VERSION_PLACE + file, value, 0)[0]
        if len(token) <= VERSION_TOKEN:
            raise ChunkError(f"version token of {len(token)} bytes")
        try:
            node = token[VERSION_TOKEN:].decode()
        except UnicodeDecodeError:
            raise ChunkError("version token's node id is not UTF-8") from None
        return f"{token[:VERSION_TOKEN].hex()}@{node}"

    def encode_owner(self, session: str, owner: Owner) -> bytes:
        body = json.dumps({"uid": owner.uid, "gid": owner.gid, "mode": owner.mode}).encode()
        return self.encode_piece(session, OWNER_FILE, 0, body)

    def decode_owner(self, session: str, value: bytes) -> Owner:
        raw = self.decode_pieces(session, OWNER_FILE, value, 0)[0]
        try:
            d = json.loads(raw)
            owner = Owner(int(d["uid"]), int(d["gid"]), int(d["mode"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ChunkError(f"owner record does not parse: {e}") from None
        if not (0 <= owner.uid < 1 << 32 and 0 <= owner.gid < 1 << 32
                and 0 <= owner.mode <= 0o7777):
            raise ChunkError(f"owner record out of range: {owner}")
        return owner


def chunks_of(size: int, chunk_bytes: int) -> int:
    """How many chunks hold a file of ``size`` bytes."""
    return (size + chunk_bytes - 1) // chunk_bytes

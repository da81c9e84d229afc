"""Key names and the chunk format of the shared tier (no I/O here).

A session file is cut at fixed file offsets into chunks of ``chunk_bytes``; chunk ``n`` of
file ``f`` of session ``s`` is the Redis string ``kvfs:{s}:f:n``. The ``{s}`` hash tag puts
every key of a session in one slot, so one shard holds the whole session and a Lua script
can change its keys atomically. A chunk value is a run of *pieces*, one per append that
touched the chunk (an append only ever adds a piece at the end)::

    piece = header(20 bytes) + payload
    header = <HHQII: magic, version, file offset of the payload, payload length,
                      crc32c(header[:16] + payload)>

The checksum covers the offset and length too, so a flipped bit anywhere in a piece, a
piece from another place, or a gap is caught. ``decode_chunk`` checks every piece and that
they tile the chunk from its first byte with no gap; it returns the chunk's bytes or raises
``ChunkError``. The per-session keys besides the chunks: ``files`` (hash: file -> size),
``meta`` (one piece holding meta.json), ``lease`` (owner node id), ``holder`` (last owner,
to tell a takeover from a first use), ``sync`` (a marker written by ``sync``) and ``tmp``
(the scratch key of a trim, see ``scripts``).
"""

from __future__ import annotations

import struct

import crc32c

from .errors import BadName

MAGIC = 0x4B43  # "CK"
VERSION = 1
HEADER = struct.Struct("<HHQII")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 20
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

    __slots__ = ("session", "prefix", "files", "meta", "lease", "holder", "sync")

    def __init__(self, session: str) -> None:
        self.session = session
        self.prefix = f"kvfs:{{{session}}}:"
        self.files = self.prefix + "files"
        self.meta = self.prefix + "meta"
        self.lease = self.prefix + "lease"
        self.holder = self.prefix + "holder"
        self.sync = self.prefix + "sync"

    def chunk(self, file: str, n: int) -> str:
        return f"{self.prefix}{file}:{n}"


def encode_piece(offset: int, payload: bytes | memoryview) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, offset, len(payload), 0)[:16]
    crc = crc32c.crc32c(payload, crc32c.crc32c(head))
    return head + struct.pack("<I", crc) + bytes(payload)


def decode_pieces(value: bytes, start: int) -> tuple[bytes, int]:
    """Check the pieces of one chunk value whose first byte is file offset ``start``;
    return (the chunk's bytes, number of pieces)."""
    parts: list[memoryview] = []
    pos, have = 0, 0
    mv = memoryview(value)
    while pos < len(value):
        if len(value) - pos < HEADER_SIZE:
            raise ChunkError(f"torn piece header at byte {pos}")
        magic, version, off, length, crc = HEADER.unpack_from(value, pos)
        if magic != MAGIC or version != VERSION:
            raise ChunkError(f"bad piece magic/version at byte {pos}")
        end = pos + HEADER_SIZE + length
        if end > len(value):
            raise ChunkError(f"piece at byte {pos} runs past the value ({length} bytes)")
        payload = mv[pos + HEADER_SIZE:end]
        if crc32c.crc32c(payload, crc32c.crc32c(mv[pos:pos + 16])) != crc:
            raise ChunkError(f"checksum mismatch in the piece at file offset {off}")
        if off != start + have:
            raise ChunkError(f"piece at file offset {off} where {start + have} was expected")
        parts.append(payload)
        pos, have = end, have + length
    return (bytes(parts[0]) if len(parts) == 1 else b"".join(parts)), len(parts)


def decode_meta(value: bytes) -> bytes:
    data, _ = decode_pieces(value, 0)
    return data


def split_append(offset: int, data: bytes | memoryview, chunk_bytes: int) -> list[tuple[int, bytes]]:
    """Cut an append at chunk boundaries: [(chunk number, encoded piece), ...]."""
    mv = memoryview(data)
    out: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(mv):
        at = offset + pos
        n = at // chunk_bytes
        take = min(len(mv) - pos, (n + 1) * chunk_bytes - at)
        out.append((n, encode_piece(at, mv[pos:pos + take])))
        pos += take
    return out


def chunks_of(size: int, chunk_bytes: int) -> int:
    """How many chunks hold a file of ``size`` bytes."""
    return (size + chunk_bytes - 1) // chunk_bytes

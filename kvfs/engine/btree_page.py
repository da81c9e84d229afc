"""B+ tree pages: the on-disk page format, the root record, and page encode/decode.

Pure functions over bytes; ``btree.BTree`` does the I/O, allocation and tree algorithms.
The layout is specified in docs/format.md ("B+ tree pages"); keep the two in step.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

import crc32c

from kvfs.engine.errors import Corrupt, KVFSError

MAGIC = b"KVB1"
LEAF, BRANCH = 1, 2
MAX_KEY = 64
MAX_VALUE = 1024
MIN_PAGE_SIZE = 256
MAX_PAGE_SIZE = 65536  # entry lengths and nkeys are u16

HDR = struct.Struct("<4sBBHIQI")  # magic, kind, level, nkeys, self page, generation, crc
CRC = struct.Struct("<I")
CRC_OFF = struct.calcsize("<4sBBHIQ")
LEAF_ENT = struct.Struct("<BH")  # key length, value length; key and value follow
KLEN = struct.Struct("<B")
CHILD = struct.Struct("<I")
ROOT = struct.Struct("<qIbbxxQQQ")  # root, height, half, prev_half, count, alloc, generation
assert HDR.size == 24 and CRC_OFF == 20
assert LEAF_ENT.size == 3 and KLEN.size == 1 and CHILD.size == 4
assert ROOT.size == 40
TREE_ROOT_SIZE = ROOT.size


class PageIO(Protocol):
    """What the tree needs of a volume (``kvfs.engine.volume.VolumeFile`` is one)."""

    def pread(self, n: int, off: int) -> bytes: ...

    def pwrite(self, data: bytes | memoryview, off: int) -> None: ...


class TreeFull(KVFSError):
    """A commit cannot fit in the region; the tree stays at its old root.

    Right after a compaction the other half still holds the previous root, so a commit too big
    for what is left of the new half fails until a smaller commit lands: split the batch.
    """


class PageCorrupt(Corrupt):
    """A page fails its checksum or structure check."""


@dataclass(frozen=True)
class TreeRoot:
    root: int
    height: int
    count: int
    half: int
    alloc: int
    prev_half: int
    generation: int

    def pack(self) -> bytes:
        return ROOT.pack(self.root, self.height, self.half, self.prev_half,
                          self.count, self.alloc, self.generation)

    @classmethod
    def unpack(cls, b: bytes) -> TreeRoot:
        """Parse a packed root; trailing bytes (the superblock's zero padding) are ignored."""
        if len(b) < ROOT.size:
            raise Corrupt(f"tree root: {len(b)} bytes, need {ROOT.size}")
        root, height, half, prev, count, alloc, gen = ROOT.unpack_from(b)
        r = cls(root, height, count, half, alloc, prev, gen)
        if (half not in (0, 1) or prev not in (-1, 0, 1) or root < -1 or height > 64
                or (root == -1) != (height == 0) or (root == -1 and count)
                or (root >= 0 and root >= alloc) or alloc >= 1 << 32
                or count >= 1 << 48 or gen >= 1 << 62):  # each commit adds one: never near
            raise Corrupt(f"tree root inconsistent: {r}")
        return r

    @classmethod
    def empty(cls) -> TreeRoot:
        return cls(root=-1, height=0, count=0, half=0, alloc=0, prev_half=-1, generation=0)


class Node:
    """A decoded page. Leaf: keys + vals. Branch: keys (separators) + kids (page numbers)."""

    __slots__ = ("level", "keys", "vals", "kids", "gen")

    def __init__(self, level: int, keys: list[bytes], vals: list[bytes] | None = None,
                 kids: list[int] | None = None, gen: int = 0) -> None:
        self.level, self.keys, self.gen = level, keys, gen
        self.vals: list[bytes] = vals if vals is not None else []  # a branch's stay empty
        self.kids: list[int] = kids if kids is not None else []  # a leaf's stay empty


def encode_page(node: Node, abs_page: int, gen: int, page_size: int) -> bytes:
    """The bytes of page ``abs_page`` (its own index in the region) holding ``node``."""
    parts: list[bytes]
    if node.level == 0:
        parts = []
        for k, v in zip(node.keys, node.vals, strict=True):
            parts += (LEAF_ENT.pack(len(k), len(v)), k, v)
    else:
        parts = [CHILD.pack(node.kids[0])]
        for k, c in zip(node.keys, node.kids[1:], strict=True):
            parts += (KLEN.pack(len(k)), k, CHILD.pack(c))
    body = b"".join(parts)
    assert len(body) <= page_size - HDR.size, "node packed over a page"
    buf = bytearray(page_size)
    HDR.pack_into(buf, 0, MAGIC, BRANCH if node.level else LEAF, node.level,
                   len(node.keys), abs_page, gen, 0)
    buf[HDR.size:HDR.size + len(body)] = body
    CRC.pack_into(buf, CRC_OFF, crc32c.crc32c(buf))
    return bytes(buf)

def decode_page(buf: bytes, abs_page: int, page_size: int, half_pages: int) -> Node:
    """The node in page ``abs_page``; PageCorrupt unless every check passes."""
    where = f"tree page {abs_page}"
    if len(buf) != page_size:
        raise PageCorrupt(f"{where}: short read ({len(buf)} bytes)")
    magic, kind, level, n, self_no, gen, crc = HDR.unpack_from(buf)
    if magic != MAGIC:
        raise PageCorrupt(f"{where}: bad magic {magic!r}")
    if crc32c.crc32c(buf[:CRC_OFF] + b"\0\0\0\0" + buf[HDR.size:]) != crc:
        raise PageCorrupt(f"{where}: checksum mismatch")
    if kind not in (LEAF, BRANCH) or (kind == LEAF) != (level == 0) or self_no != abs_page:
        raise PageCorrupt(f"{where}: bad header kind={kind} level={level} self={self_no}")
    try:
        return _parse(buf, level, n, gen, page_size, half_pages)
    except (struct.error, IndexError, ValueError) as e:  # checksummed garbage: still no
        raise PageCorrupt(f"{where}: {e}") from e

def _parse(buf: bytes, level: int, n: int, gen: int, page_size: int, half_pages: int) -> Node:
    keys: list[bytes] = []
    off, end = HDR.size, page_size
    if level == 0:
        vals: list[bytes] = []
        for _ in range(n):
            klen, vlen = LEAF_ENT.unpack_from(buf, off)
            off += LEAF_ENT.size
            if not 1 <= klen <= MAX_KEY or off + klen + vlen > end:
                raise ValueError(f"entry {len(keys)} out of bounds")
            keys.append(buf[off:off + klen])
            vals.append(buf[off + klen:off + klen + vlen])
            off += klen + vlen
        node = Node(0, keys, vals=vals, gen=gen)
    else:
        kids = [CHILD.unpack_from(buf, off)[0]]
        off += CHILD.size
        for _ in range(n):
            klen = buf[off]
            if not 1 <= klen <= MAX_KEY or off + 1 + klen + CHILD.size > end:
                raise ValueError(f"separator {len(keys)} out of bounds")
            keys.append(buf[off + 1:off + 1 + klen])
            kids.append(CHILD.unpack_from(buf, off + 1 + klen)[0])
            off += 1 + klen + CHILD.size
        if max(kids) >= half_pages:
            raise ValueError("child pointer outside the half")
        node = Node(level, keys, kids=kids, gen=gen)
    if any(a >= b for a, b in zip(keys, keys[1:], strict=False)):
        raise ValueError("keys out of order")
    return node

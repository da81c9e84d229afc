"""On-disk layouts of a kvfs volume: every struct format in one place, sizes asserted.

The prose spec is docs/format.md; keep the two in step. Little-endian throughout.

    offset 0            superblock slot 0   (SB_SLOT bytes)
    offset SB_SLOT      superblock slot 1
    offset 2*SB_SLOT    B+ tree region      (tree_pages * PAGE bytes, two halves)
    ring_offset         ring               (ring_size bytes, entries aligned to ALIGN)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import crc32c

from .btree_page import TreeRoot
from .errors import BadSuperblock, Corrupt

VOLUME_MAGIC = b"KVFSVOL1"
VERSION = 2  # 2: data entries hold independently checked blocks (version 1 is refused)
SB_SLOT = 4096
PAGE = 4096
ALIGN = 512  # entry alignment: one sector, so a torn write tears at most the last entry
RING_ALIGN = 1 << 20  # ring start aligned to 1 MiB for large sequential I/O
MIN_VOLUME = 4 << 20
MAX_ENTRY_RAW = 4 << 20  # raw bytes per data entry; bounds the resync search after corruption
BLOCK = 32 << 10  # raw bytes per block of a data entry (the last may be shorter)
TREE_ROOT_AREA = 64

SB_CLEAN = 1  # flag: closed cleanly
SB_NEEDS_FSCK = 2  # flag: an error was seen while in use; mounts refuse until fsck --repair
# ckpt_pos when no checkpoint stands for the index (it did not fit the tree region): recovery
# scans the whole ring from the tail. Outside [tail, tail + ring_size], so every kvfs does.
NO_CKPT = (1 << 64) - 1
MAX_POS = 1 << 62  # ring positions grow by bytes written: never near this in a volume's life
MAX_SNO = 1 << 62  # session numbers: one per session ever created, far below this

# superblock: magic, version, flags, seq, volume_size, ring_offset, ring_size, tree_offset,
# tree_pages, head, tail, ckpt_pos, next_sno, ckpt_time_ns, created_ns, tree root bytes,
# volume uuid (the RAM tier of agents keys its root by it), crc
SB_FMT = "<8sIIQQQQQQQQQQQQ64s16sI"
SB_SIZE = struct.calcsize(SB_FMT)
assert SB_SIZE == 8 + 4 + 4 + 8 * 12 + 64 + 16 + 4 == 196


@dataclass
class Superblock:
    seq: int
    flags: int
    volume_size: int
    ring_offset: int
    ring_size: int
    tree_offset: int
    tree_pages: int
    head: int
    tail: int
    ckpt_pos: int
    next_sno: int
    ckpt_time_ns: int
    created_ns: int
    tree_root: bytes  # packed kvfs.btree.TreeRoot, zero-padded to TREE_ROOT_AREA
    uuid: bytes = bytes(16)  # the volume's identity, random at creation, never changed

    def pack(self) -> bytes:
        body = struct.pack(
            SB_FMT[:-1], VOLUME_MAGIC, VERSION, self.flags, self.seq, self.volume_size,
            self.ring_offset, self.ring_size, self.tree_offset, self.tree_pages, self.head,
            self.tail, self.ckpt_pos, self.next_sno, self.ckpt_time_ns, self.created_ns,
            self.tree_root.ljust(TREE_ROOT_AREA, b"\0"), self.uuid,
        )
        raw = body + struct.pack("<I", crc32c.crc32c(body))
        return raw.ljust(SB_SLOT, b"\0")

    @classmethod
    def unpack(cls, raw: bytes) -> Superblock:
        """The superblock in ``raw``; BadSuperblock says whether magic, version or checksum
        is wrong, checked in that order (a newer version may lay out the rest differently)."""
        if len(raw) < SB_SIZE or raw[:8] != VOLUME_MAGIC:
            raise BadSuperblock("magic", "not a kvfs superblock (bad magic)")
        (version,) = struct.unpack_from("<I", raw, 8)
        if version != VERSION:
            if version > VERSION:
                raise BadSuperblock("version", f"created by a newer kvfs (version {version}); "
                                    f"this kvfs reads version {VERSION}", version)
            if version == 0:
                raise BadSuperblock("version", "unsupported version 0", version)
            raise BadSuperblock("version", f"created by an older kvfs (version {version}); this "
                                f"kvfs reads version {VERSION} only: copy the sessions out with "
                                "the kvfs that wrote it, then create a new volume", version)
        f = struct.unpack(SB_FMT, raw[:SB_SIZE])
        if crc32c.crc32c(raw[: SB_SIZE - 4]) != f[-1]:
            raise BadSuperblock("checksum", "superblock checksum mismatch")
        return cls(f[3], f[2], *f[4:17])

    def check_layout(self, file_size: int) -> None:
        """BadSuperblock("layout") unless the geometry fits a file of ``file_size`` bytes
        and the positions agree with it and with each other. A checksum only says the
        slot is what was written; this says it can be used (nothing past the file's end,
        no region over another) before any of it is."""
        def bad(why: str) -> BadSuperblock:
            return BadSuperblock("layout", f"superblock layout is impossible: {why}")

        if not MIN_VOLUME <= self.volume_size <= file_size:
            raise bad(f"volume_size {self.volume_size} outside [{MIN_VOLUME}, {file_size}] "
                      "(the file's size)")
        if self.tree_offset != 2 * SB_SLOT:
            raise bad(f"tree_offset {self.tree_offset}, expected {2 * SB_SLOT}")
        if self.tree_pages < 2 or self.tree_pages % 2 or self.tree_pages >= 1 << 33:
            raise bad(f"tree_pages {self.tree_pages} (two equal halves needed)")
        if self.tree_offset + self.tree_pages * PAGE > self.ring_offset:
            raise bad(f"tree region ends at {self.tree_offset + self.tree_pages * PAGE}, "
                      f"past ring_offset {self.ring_offset}")
        if self.ring_offset % RING_ALIGN or self.ring_size % RING_ALIGN or self.ring_size < RING_ALIGN:
            raise bad(f"ring at {self.ring_offset} of {self.ring_size} bytes is not "
                      f"{RING_ALIGN}-aligned")
        if self.ring_offset + self.ring_size > self.volume_size:
            raise bad(f"ring ends at {self.ring_offset + self.ring_size}, past volume_size "
                      f"{self.volume_size}")
        if not self.tail <= self.head <= MAX_POS or self.head - self.tail > self.ring_size:
            raise bad(f"head {self.head} and tail {self.tail} do not fit a ring of "
                      f"{self.ring_size} bytes")
        if self.ckpt_pos != NO_CKPT and not self.tail <= self.ckpt_pos <= self.head:
            raise bad(f"ckpt_pos {self.ckpt_pos} outside [tail, head] = [{self.tail}, {self.head}]")
        if not 1 <= self.next_sno <= MAX_SNO:
            raise bad(f"next_sno {self.next_sno}")
        try:
            root = TreeRoot.unpack(self.tree_root)
        except Corrupt as e:
            raise bad(str(e)) from None
        if root.alloc > self.tree_pages // 2:
            raise bad(f"tree root allocates {root.alloc} pages of a {self.tree_pages // 2}-page half")


# ring entry header: magic, type, flags, reserved, pos, name_hash, sno, file_off, fno,
# stored_len, raw_len, payload_crc, ts_ns, nblocks, header_crc (over the 68 bytes before it)
ENTRY_MAGIC = 0x3245564B  # "KVE2": version 1's "KVE1" entries never parse
HDR_FMT = "<IBBHQQQQIIIIQII"
HDR_SIZE = struct.calcsize(HDR_FMT)
assert HDR_SIZE == 72
_HDR = struct.Struct(HDR_FMT)
_HDR_BODY = struct.Struct(HDR_FMT[:-1])

# block table of a data entry (its payload starts with it): per block stored_len, raw_len,
# crc32c of the stored block, codec flags (F_ZSTD, F_PLANES), 3 pad bytes. The header's
# payload_crc is the CRC-32C of the table, so header -> table -> block is one chain.
BLOCK_ENTRY = struct.Struct("<IIIB3x")
assert BLOCK_ENTRY.size == 16

# entry types
T_PAD = 0  # filler up to the physical end of the ring; readers jump to the next lap
T_DATA = 1  # payload = bytes [file_off, file_off + raw_len) of file (sno, fno)
T_TRUNC = 2  # file (sno, fno) cut to file_off bytes
T_SMETA = 3  # session attributes + name (created, or attributes changed, or copied forward)
T_FMETA = 4  # file attributes + name
T_DELS = 5  # tombstone: session sno deleted (whole)
T_DELF = 6  # tombstone: file (sno, fno) deleted
TYPE_NAMES = {T_PAD: "pad", T_DATA: "data", T_TRUNC: "trunc", T_SMETA: "smeta",
              T_FMETA: "fmeta", T_DELS: "dels", T_DELF: "delf"}

# block flags (in the block table)
F_ZSTD = 1  # block compressed with zstd
F_PLANES = 2  # 16-bit values split into high/low byte planes (see codec.py)
# entry flags (in the header)
F_COPY = 4  # data copied forward by reclaim: replaces bytes, does not end the file there


class Header(NamedTuple):
    """An entry header (a tuple: built on every read, so it must be cheap)."""

    type: int
    flags: int
    pos: int
    name_hash: int
    sno: int
    file_off: int
    fno: int
    stored_len: int
    raw_len: int
    payload_crc: int  # data: CRC-32C of the block table; others: of the whole payload
    ts_ns: int
    nblocks: int = 0  # data: entries in the block table

    @property
    def size(self) -> int:
        """Bytes the entry occupies in the ring (header + payload, aligned)."""
        return entry_size(self.stored_len)

    def pack(self) -> bytes:
        body = _HDR_BODY.pack(ENTRY_MAGIC, self.type, self.flags, 0, self.pos, self.name_hash,
                              self.sno, self.file_off, self.fno, self.stored_len, self.raw_len,
                              self.payload_crc, self.ts_ns, self.nblocks)
        return body + struct.pack("<I", crc32c.crc32c(body))


_new_header = tuple.__new__


def unpack_header(raw: bytes | memoryview, off: int = 0) -> Header | None:
    """Parse a header at ``off``; None unless magic, checksum and type are right."""
    if len(raw) - off < HDR_SIZE:
        return None
    f = _HDR.unpack_from(raw, off)
    if f[0] != ENTRY_MAGIC or f[1] not in TYPE_NAMES:
        return None
    if crc32c.crc32c(raw[off: off + HDR_SIZE - 4]) != f[-1]:
        return None
    return _new_header(Header, (f[1], f[2], *f[4:14]))  # Header(...) without its Python __new__


def entry_size(stored_len: int) -> int:
    return (HDR_SIZE + stored_len + ALIGN - 1) // ALIGN * ALIGN


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


# payload of T_SMETA: mode, uid, gid, next_fno, ctime_ns, mtime_ns, then the UTF-8 name
# (times signed, as in the checkpoint records: a time before 1970 is negative; the bytes
# of every time an older kvfs could write and checkpoint read the same)
SMETA_FMT = struct.Struct("<IIIIqq")
# payload of T_FMETA: mode, uid, gid, ctime_ns, mtime_ns, then the UTF-8 name
FMETA_FMT = struct.Struct("<IIIqq")
TIME_MIN, TIME_MAX = -(1 << 63), (1 << 63) - 1  # ns since the epoch a record holds
U32_MAX = 0xFFFFFFFF

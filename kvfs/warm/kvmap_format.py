"""Byte layout of a ``.kvmap`` shard file (version 2): every constant and record format.

A shard file is ``[header slot A | header slot B | ... | index table | data extents ...]``:

* Two 128-byte header slots at offsets 0 and 128 (``HEADER`` + CRC32C of it). An update
  writes the slot the older copy lives in, so a process killed mid-write leaves the other
  valid. Open picks the newest slot whose magic, version and checksum are good; a file of
  another version is discarded (the tier is a cache of the cold copy) with a log line.
* An index table of fixed 64-byte entries (``ENTRY``, at ``FIRST_TABLE`` initially). When
  full, a table twice the size is written elsewhere and the header switched to it.
* Data extents, allocated first fit in freed gaps (else at the end), never moved.

Entry fields: ``crc`` = CRC32C of bytes 8..48 (uid .. cap, never changed after the entry
is written; for NAME entries also of the name bytes). ``state`` (EMPTY / LIVE / DEAD) and
``aux`` (NAME: last use time; only orders the LRU) are single stores. ``seal`` is one
aligned 8-byte store of ``used | scrc << 32``; ``used`` < 2**32 (extents are at most
``MAX_EXTENT`` bytes), so a kill between two stores leaves the older, still valid seal.

Extent checksums (kinds LAYER, SUMMARY, META): an extent of capacity ``cap`` is
``cap`` data bytes followed by ``cap // BLOCK`` little-endian u32 block checksums;
``bc[k]`` = CRC32C of data block ``k`` (``BLOCK`` bytes), written when the block fills.
``scrc`` = CRC32C over ``u64 used``, then ``bc[0 : used // BLOCK]``, then the partial tail
block ``data[used // BLOCK * BLOCK : used]``. So ``used`` and every data byte are covered:
a read checks the blocks it touches (the seal when it touches the tail); a change checks
the seal first; an append writes data and new block checksums beyond the old ``used``,
then the seal. Load checks every seal. For NAME entries ``used`` holds
flags and ``scrc`` covers ``u64 used`` only. A bad seal at load drops that session's warm
copy (served from cold when it has one); a bad block on a read is ``WarmCorrupt``.

    kind NAME     one per session: data = the session id (UTF-8), used = flags,
                  ``start`` = the session's incarnation id (0: unknown, written by an
                  older version), the value of the cold copy's ``.incarnation`` file
    kind LAYER    one segment of layer ``layer``: bytes [start, start + used) of that
                  layer's file; segments of a layer are contiguous, every one but the
                  last is full (used == cap). ``start`` of the first one is the "base":
                  the bytes below it live in the cold tier.
    kind SUMMARY  like LAYER, for the float32 round-summary stream
    kind META     meta.json bytes; ``start`` is a sequence number, the highest live wins
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = b"KVMAP\x00\r\n"
VERSION = 2

# header slot: magic, version, summary_dim, seq, created, shard, shards, shard_key,
# index_cap, index_off, total_bytes, total_tokens, sessions, padding; then crc32c of the
# first 124 bytes.
HEADER = struct.Struct("<8sIIQdIIIIQQQI48x")
HEADER_CRC = struct.Struct("<I")
HEADER_SLOT = 128
HEADER_SLOTS = (0, HEADER_SLOT)
assert HEADER.size + HEADER_CRC.size == HEADER_SLOT

FIRST_TABLE = 4096  # first index table, one page in
FIRST_TABLE_ENTRIES = 64

KEY_SESSION = 0  # shard = top bits of md5(session id)
KEY_DEVICE = 1  # shard = device id % shards

ENTRY = np.dtype(
    [
        ("crc", "<u4"),  # crc32c of bytes 8..48 (+ the name bytes for NAME entries)
        ("state", "<u4"),  # EMPTY / LIVE / DEAD, mutable
        ("uid", "<u8"),  # session incarnation id, unique within the shard file
        ("kind", "<u4"),
        ("layer", "<u4"),
        ("start", "<u8"),  # logical byte offset in the stream (META: sequence number)
        ("off", "<u8"),  # extent offset in the file
        ("cap", "<u8"),  # data capacity of the extent (block checksums follow it)
        ("seal", "<u8"),  # used | scrc << 32 (NAME: used = flags), mutable, one store
        ("aux", "<f8"),  # NAME: last use time, mutable
    ]
)
assert ENTRY.itemsize == 64
ENTRY_SIZE = 64
IMMUTABLE = struct.Struct("<QIIQQQ")  # uid, kind, layer, start, off, cap == bytes 8..48
assert ENTRY.fields is not None
assert IMMUTABLE.size == 40 and ENTRY.fields["uid"][1] == 8 and ENTRY.fields["seal"][1] == 48
USED = struct.Struct("<Q")  # the first bytes a seal checksum covers

EMPTY, LIVE, DEAD = 0, 1, 2
K_NAME, K_LAYER, K_SUMMARY, K_META = 1, 2, 3, 4
FLAG_MIGRATING = 1  # set while the session is being copied to cold; see WarmTier reopen
FLAG_ON_COLD = 2  # the cold copy exists with this incarnation (made durably by us)
FLAG_CLEAN = 4  # the cold copy holds every byte of the warm copy, fsynced

BLOCK = 16 << 10  # data bytes per block checksum: a read checks at most 2 more blocks
ALIGN = 64  # extent alignment (cache line); extents >= one page are page aligned
MIN_SEGMENT = 16 << 10  # first segment of a stream
MAX_SEGMENT = 64 << 20  # doubling stops here (a bigger single append gets its own size)
MAX_EXTENT = 1 << 30  # ``used`` is 32 bits in the seal: bigger appends are split
MAX_GROW = 256 << 20  # the file grows by doubling, at most this much at a time


def footprint(kind: int, cap: int) -> int:
    """Bytes an extent occupies in the file: data plus its block checksums."""
    return cap if kind == K_NAME else cap + 4 * (cap // BLOCK)

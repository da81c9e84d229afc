"""Byte layout of a ``.kvmap`` shard file: every constant and record format in one place.

A shard file is ``[header slot A | header slot B | ... | index table | data extents ...]``:

* Two 128-byte header slots at offsets 0 and 128. Each carries a sequence number and a
  CRC32C; an update writes the slot the older copy lives in, so a process killed in the
  middle of a header write leaves the other slot valid (the bbolt meta-page trick). Open
  picks the newest slot whose magic, version and checksum are good.
* An index table of fixed 64-byte entries (at ``FIRST_TABLE`` initially). When it is
  full a table twice the size is written elsewhere in the file and the header is
  switched to it; entry numbers do not change.
* Data extents, allocated by the shard (first fit in freed gaps, else at the end), never
  moved once allocated. Every extent belongs to exactly one live entry.

Entries (``ENTRY``) describe one extent each. The fields that never change after the
entry is written (uid .. cap) are covered by ``crc``; the fields updated in place are
single aligned stores (``state``, ``used``, ``aux``), so a kill between two stores leaves
a readable older state. An entry is written completely and only then made live.

    kind NAME     one per session: data = the session id (UTF-8), aux = last use
                  (clock seconds), used = flags (FLAG_MIGRATING)
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
VERSION = 1

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
        ("cap", "<u8"),  # extent length
        ("used", "<u8"),  # bytes valid (NAME: flags), mutable
        ("aux", "<f8"),  # NAME: last use time, mutable
    ]
)
assert ENTRY.itemsize == 64
ENTRY_SIZE = 64
IMMUTABLE = struct.Struct("<QIIQQQ")  # uid, kind, layer, start, off, cap == bytes 8..48
assert IMMUTABLE.size == 40 and ENTRY.fields["uid"][1] == 8 and ENTRY.fields["used"][1] == 48

EMPTY, LIVE, DEAD = 0, 1, 2
K_NAME, K_LAYER, K_SUMMARY, K_META = 1, 2, 3, 4
FLAG_MIGRATING = 1  # set while the session is being copied to cold; see WarmTier reopen

ALIGN = 64  # extent alignment (cache line); extents >= one page are page aligned
MIN_SEGMENT = 16 << 10  # first segment of a stream
MAX_SEGMENT = 64 << 20  # doubling stops here (a bigger single append gets its own size)
MAX_GROW = 256 << 20  # the file grows by doubling, at most this much at a time

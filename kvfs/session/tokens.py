"""The ``tokens`` file's format: the token ids of a session's layer files.

A layer file says what the model computed for each token, not which token it was. An engine
that serves many conversations (kvfs.vllm) must check that a prompt really continues a
stored session before it reuses its KV, and an edited history must match only up to the
first token that differs. So a session may carry the ids of its tokens: token ``t`` of the
layer files is id ``t`` of this file (meta.json's ``tokens`` still says how many tokens the
layers hold; ids past it mean nothing).

Format (docs/format.md): a sequence of records, each ``<4sQI`` (magic ``KVTK``, start token,
count) + ``count`` little-endian u32 ids + a CRC32C (u32) over the header and the ids. A
record replaces the ids from ``start`` on (a history edited at token ``start``), so the file
is only ever appended to (the mount's rule) and a reader rebuilds the list record by record.
A record that is torn, cut short or fails its checksum ends the list there (with one log
line): a reader gets a shorter, correct prefix, never a wrong id. No I/O here.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence

import crc32c
import numpy as np

from .names import TOKENS

log = logging.getLogger("kvfs.session")

MAGIC = b"KVTK"
_HEAD = struct.Struct("<4sQI")
_CRC = struct.Struct("<I")
MAX_RECORD = 1 << 24  # ids per record: a bigger count is a damaged header, not a record


def encode(start: int, ids: Sequence[int] | np.ndarray) -> bytes:
    """One record: the ids from token ``start`` on."""
    arr = np.asarray(ids, dtype="<u4")
    if arr.ndim != 1 or start < 0 or arr.size > MAX_RECORD:
        raise ValueError(f"token record: start={start}, {arr.size} ids (1-D, at most {MAX_RECORD})")
    body = _HEAD.pack(MAGIC, int(start), int(arr.size)) + arr.tobytes()
    return body + _CRC.pack(crc32c.crc32c(body))


def decode(raw: bytes, where: str = TOKENS) -> tuple[np.ndarray, int]:
    """The ids a ``tokens`` file describes (uint32), up to the first damaged record, and
    the bytes of its intact records."""
    ids = np.empty(0, dtype=np.uint32)
    off = 0
    while off < len(raw):
        bad = None
        if off + _HEAD.size > len(raw):
            bad = "a torn record header"
        else:
            magic, start, count = _HEAD.unpack_from(raw, off)
            end = off + _HEAD.size + 4 * count + _CRC.size
            if magic != MAGIC or count > MAX_RECORD:
                bad = "a record with a bad header"
            elif end > len(raw):
                bad = "a torn record"
            elif crc32c.crc32c(raw[off:end - _CRC.size]) != _CRC.unpack_from(raw, end - _CRC.size)[0]:
                bad = "a record that fails its checksum"
            elif start > ids.size:
                bad = f"a record starting at token {start} past the {ids.size} ids before it"
        if bad is not None:
            log.warning("%s: %s at byte %d; the ids end at token %d", where, bad, off, ids.size)
            break
        new = np.frombuffer(raw, dtype="<u4", count=count, offset=off + _HEAD.size)
        ids = np.concatenate([ids[:start], new.astype(np.uint32)])
        off = end
    return ids, off


def common_prefix(a: np.ndarray | Sequence[int], b: np.ndarray | Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    x, y = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n = min(x.size, y.size)
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if diff.size else n


def check_ids(sid: str, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    new = np.asarray(ids, dtype=np.int64)
    if new.size and (new.min() < 0 or new.max() > 0xFFFFFFFF):
        raise ValueError(f"session {sid!r}: token ids must fit in 32 bits")
    return new


def update(raw: bytes, sid: str, ids: Sequence[int] | np.ndarray) -> tuple[int, int, bytes | None]:
    """How to make a ``tokens`` file holding ``raw`` start with ``ids``: (the first id
    that differs, the bytes of its intact records -- cut there first when shorter than
    ``raw`` -- and the record to append there, None when nothing needs to change)."""
    new = check_ids(sid, ids)
    stored, good = decode(raw, f"session {sid!r} {TOKENS}")
    p = common_prefix(stored, new)
    return p, good, (None if p == new.size else encode(p, new[p:]))

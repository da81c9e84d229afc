"""Extent checksums of a ``.kvmap`` file (kvmap_format.py): seal words and block checksums."""

from __future__ import annotations

import crc32c
import numpy as np

from .kvmap_format import BLOCK, USED


def seal_of(mm: np.ndarray, off: int, cap: int, used: int) -> int:
    """The seal word of an extent holding ``used`` bytes (kvmap_format.py)."""
    full = used // BLOCK
    c = crc32c.crc32c(USED.pack(used))
    if full:
        c = crc32c.crc32c(mm[off + cap:off + cap + 4 * full].data, c)
    c = crc32c.crc32c(mm[off + full * BLOCK:off + used].data, c)
    return used | c << 32


def name_seal(flags: int) -> int:
    return flags | crc32c.crc32c(USED.pack(flags)) << 32


def fill_blocks(mm: np.ndarray, off: int, cap: int, lo: int, used: int) -> None:
    """Checksum every full block at or after the one holding byte ``lo``."""
    bc = mm[off + cap:off + cap + 4 * (cap // BLOCK)].view("<u4")
    for k in range(lo // BLOCK, used // BLOCK):
        bc[k] = crc32c.crc32c(mm[off + k * BLOCK:off + (k + 1) * BLOCK].data)

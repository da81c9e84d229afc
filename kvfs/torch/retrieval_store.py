"""The retrieval state in storage: the ``key_centroids`` side stream and the ``meta.json`` entry.

The live session appends one record per block that leaves its window (:func:`write_records`,
run by the spill thread in order with the layer bytes) and saves the blocks its next step
attends in ``meta.json`` (``retrieval``: ``block``, ``origin``, ``tokens``, ``chosen`` per
layer in slot order; :func:`chosen_from_meta` takes them back only when they fit exactly).

A resumed session needs the centroids of every block that has left its window. They come
from the session's ``key_centroids`` stream (warm tier, or the mount through it) when its
header matches the session's block layout and its records check; the records missing
after the valid prefix -- a session written by an older version or by another writer, a
record torn by a crash, a flipped bit, another block size -- are recomputed from the
stored keys (exact: the same sums of the same bytes) and the stream is rewritten
to hold exactly those blocks, so the live session appends after them. Separate from
:mod:`kvfs.torch.retrieval`, which runs per step; this runs once, at resume.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from kvfs.torch.blocks import HEADER_BYTES, STREAM, BlockLayout, Selector, centroids_of_keys
from kvfs.torch.recall import read_tokens
from kvfs.torch.seams import Bytes, WarmStore

log = logging.getLogger("kvfs.torch.retrieval")

#: tokens per read while recomputing centroids (bounds the memory of a long backfill)
BACKFILL_TOKENS = 4096


class BlockSession(Protocol):
    """The session whose block centroids are loaded: its id and its warm tier (a cache)."""

    session_id: str

    @property
    def warm(self) -> WarmStore | None: ...


def _warm(c: BlockSession) -> WarmStore:
    if c.warm is None:
        raise ValueError(f"session {c.session_id!r}: retrieval needs a warm tier")
    return c.warm


def stored_centroids(c: BlockSession, lay: BlockLayout, need: int) -> torch.Tensor:
    """The valid prefix (at most ``need`` records) of the session's stream, on the CPU."""
    warm, sid = _warm(c), c.session_id
    size = warm.side_size(sid, STREAM)
    if size < HEADER_BYTES or not lay.header_matches(warm.side_read(sid, STREAM, 0, HEADER_BYTES)):
        return centroids_shape(lay, 0)
    end = min(size, lay.offset(need))
    whole = (end - HEADER_BYTES) // lay.record_bytes
    if whole <= 0:
        return centroids_shape(lay, 0)
    return lay.parse(warm.side_read(sid, STREAM, HEADER_BYTES, lay.offset(whole)))


def centroids_shape(lay: BlockLayout, n: int) -> torch.Tensor:
    g = lay.geo
    return torch.empty((n, g.num_layers, g.num_kv_heads, 2, g.head_dim), dtype=g.dtype)


def recompute(c: BlockSession, lay: BlockLayout, first: int, end: int) -> torch.Tensor:
    """Centroids of blocks ``[first, end)`` from the stored keys ``[n, L, H, 2, D]`` (CPU)."""
    out = centroids_shape(lay, end - first)
    per = max(1, BACKFILL_TOKENS // lay.block)
    for b in range(first, end, per):
        e = min(end, b + per)
        a, z = lay.span(b)[0], lay.span(e - 1)[1]
        for layer in range(lay.geo.num_layers):
            k, _ = read_tokens(_warm(c), c.session_id, layer, lay.geo, a, z, "cpu", promote=False)
            out[b - first:e - first, layer] = centroids_of_keys(k, lay.block)
    return out


def recompute_reps(c: BlockSession, lay: BlockLayout, sel: Selector, layer: int, need: int,
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sel``'s representatives (and scales) of blocks ``[0, need)`` of ``layer``, from the
    stored keys (read in pieces of :data:`BACKFILL_TOKENS`), on ``device``."""
    per = max(1, BACKFILL_TOKENS // lay.block)
    reps, scales = [], []
    for b in range(0, need, per):
        e = min(need, b + per)
        k, _ = read_tokens(_warm(c), c.session_id, layer, lay.geo, lay.span(b)[0], lay.span(e - 1)[1],
                           device, promote=False)
        r, s = sel.represent(k, lay.block)
        reps.append(r)
        if s is not None:
            scales.append(s)
    return torch.cat(reps), (torch.cat(scales) if scales else None)


def load_centroids(c: BlockSession, lay: BlockLayout, need: int) -> tuple[torch.Tensor, int]:
    """Centroids ``[need, L, H, 2, D]`` (CPU) of blocks ``[0, need)`` and how many were
    recomputed; afterwards the stream holds exactly their header and records."""
    warm, sid = _warm(c), c.session_id
    have = stored_centroids(c, lay, need)
    valid = have.shape[0]
    size = warm.side_size(sid, STREAM)
    if valid < need:
        log.info("session %r: %d of %d block centroids stored; recomputing %d from the stored keys",
                 sid, valid, need, need - valid)
        have = torch.cat([have, recompute(c, lay, valid, need)])
    keep = lay.offset(valid) if valid else 0  # a valid record implies a matching header
    if size > keep:
        warm.side_truncate(sid, STREAM, keep)
    if need > valid:
        data = lay.records(valid, have[valid:]).tobytes()
        warm.side_append(sid, STREAM, data if valid else lay.header() + data)
    return have, need - valid


def write_records(warm: WarmStore, sid: str, lay: BlockLayout, first: int, cents: torch.Tensor) -> None:
    """Spill thread: append the records of blocks ``first, ...`` (``cents`` ``[m, L, H, 2,
    D]``, any device; the header first when ``first`` is 0)."""
    records = lay.records(first, cents.cpu())
    data: Bytes = memoryview(lay.header() + records.tobytes()) if first == 0 else records
    new = warm.side_append(sid, STREAM, data)
    want = lay.offset(first + cents.shape[0])
    if new != want:
        raise RuntimeError(f"session {sid!r}: {STREAM} is {new} bytes after appending records up "
                           f"to block {first + cents.shape[0]}, expected {want}")


def chosen_from_meta(saved: Any, layout: BlockLayout, tokens: int, blocks: int, most: int,
                     layers: int) -> list[tuple[int, ...]]:
    """The chosen blocks saved in meta.json when they fit this session exactly (same block
    layout, saved at ``tokens``, the same number of distinct valid blocks for every layer, at
    most ``most``: fewer when recalled rounds held some blocks); else none for every layer
    (the first step then attends sinks and window only, and its queries choose)."""
    none: list[tuple[int, ...]] = [()] * layers
    if not isinstance(saved, dict) or saved.get("block") != layout.block or \
            saved.get("origin") != layout.origin or saved.get("tokens") != tokens:
        return none
    got = saved.get("chosen")
    if not isinstance(got, list) or len(got) != layers:
        return none
    out = []
    for ch in got:
        if (not isinstance(ch, list) or len(ch) > most or len(ch) != len(got[0])
                or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < blocks for b in ch)
                or len(set(ch)) != len(ch)):
            log.warning("meta.json retrieval entry does not fit the session; the first step "
                        "attends no retrieved blocks")
            return none
        out.append(tuple(ch))
    return out

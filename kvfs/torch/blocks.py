"""Blocks of old KV and their representatives, and the selectors that score them.

Selectors (:func:`selector`): ``int8-sum`` (the default: every key of a block quantized to
int8 per token and KV head, scored exactly; a block's score its attention mass),
``int8-max``/``int4-*`` (its best token; 4-bit codes), ``quest`` (per-channel bounds) and
``centroids`` (below; the default before, and the only one with a side stream: the others are
recomputed from the stored keys on resume).

A session's tokens past the sinks are cut into blocks of ``block`` tokens from a fixed
``origin`` (the sink count): block ``i`` is tokens ``[origin + i*block, origin + (i+1)*block)``.
A block's representatives, per layer and KV head, are two centroids: the mean key (post-RoPE,
as cached) of its first ``ceil(block/2)`` tokens and of the rest. A query ranks the blocks by
the attention share the centroids would get (:func:`block_scores`). They replace Quest's
per-channel minimum and maximum (the same bytes), which on SmolLM2 ranked first the blocks
whose keys spread widest, not the ones a head attends: a name said once was seldom found.

Each centroid is summed token by token in float32, in token order, then divided by its
token count (IEEE operations, each correctly rounded: the same bytes on any device), so
centroids computed on the device as blocks leave the window, read back from the tiers, or
recomputed from the stored keys are the same bytes: retrieval ranks alike in a live, a
resumed and a forked session.

The ``key_centroids`` side stream (``sessions/<id>/key_centroids`` on the mount) holds them:

* a 64-byte header: magic ``KVFSKC01``, version, block, origin, layers, KV heads, head
  dim, dtype name, then the CRC32C of the bytes before it;
* one record per block, in block order: ``u64 block index``, ``u32`` CRC32C of the index and
  the payload, ``u32`` zero, then the payload ``[layers, kv_heads, 2, head_dim]`` (first
  half's centroid, second half's) in the model's dtype, little-endian.

A record that fails its checksum or index ends the valid prefix; what follows is recomputed
from the stored keys (:func:`centroids_of_keys`), as are the centroids of sessions written
without them (older sessions, other writers). Pure functions over tensors and bytes: no I/O here.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import crc32c
import numpy as np
import torch

from kvfs.session.names import KEY_CENTROIDS
from kvfs.torch.fingerprint import KVGeometry, dtype_name

MAGIC = b"KVFSKC01"
VERSION = 1
STREAM = KEY_CENTROIDS  # the warm tier's side stream (a file of the session, kvfs.session)
_HEAD = struct.Struct("<8sIIIIII8s20x")  # magic, version, block, origin, layers, heads, dim, dtype
_HEAD_CRC = struct.Struct("<I")
HEADER_BYTES = _HEAD.size + _HEAD_CRC.size
_REC = struct.Struct("<QII")  # block index, crc32c(index + payload), zero
assert HEADER_BYTES == 64 and _REC.size == 16


@dataclass(frozen=True)
class BlockLayout:
    """How a session's tokens are cut into blocks, and the bytes of one block's centroids."""

    block: int
    origin: int
    geo: KVGeometry

    @property
    def payload_bytes(self) -> int:
        g = self.geo
        return g.num_layers * g.num_kv_heads * 2 * g.head_dim * g.itemsize

    @property
    def record_bytes(self) -> int:
        return _REC.size + self.payload_bytes

    def span(self, i: int) -> tuple[int, int]:
        """Tokens ``[start, end)`` of block ``i``."""
        a = self.origin + i * self.block
        return a, a + self.block

    def blocks_before(self, token: int) -> int:
        """Whole blocks that end at or before ``token``."""
        return max(0, (token - self.origin) // self.block)

    def offset(self, i: int) -> int:
        """Byte offset of record ``i`` in the stream."""
        return HEADER_BYTES + i * self.record_bytes

    # --- bytes ----------------------------------------------------------------------------
    def header(self) -> bytes:
        g = self.geo
        head = _HEAD.pack(MAGIC, VERSION, self.block, self.origin, g.num_layers, g.num_kv_heads,
                          g.head_dim, dtype_name(g.dtype).encode())
        return head + _HEAD_CRC.pack(crc32c.crc32c(head))

    def header_matches(self, raw: bytes | np.ndarray) -> bool:
        """Whether ``raw`` (the stream's first bytes) is an intact header of this layout."""
        b = np.frombuffer(cast(Any, raw), np.uint8)[:HEADER_BYTES].tobytes() if len(raw) >= HEADER_BYTES else b""
        return len(b) == HEADER_BYTES and b == self.header()

    def records(self, first: int, cents: torch.Tensor) -> np.ndarray:
        """The bytes of records ``first, first + 1, ...`` from CPU centroids ``cents``
        ``[n, layers, kv_heads, 2, head_dim]`` (model dtype)."""
        n = cents.shape[0]
        payload = cents.contiguous().view(torch.uint8).reshape(n, -1).numpy()
        if payload.shape[1] != self.payload_bytes:
            raise ValueError(f"centroids of {payload.shape[1]} bytes per block, layout has {self.payload_bytes}")
        out = np.zeros((n, self.record_bytes), np.uint8)
        out[:, _REC.size:] = payload
        for j in range(n):
            idx = struct.pack("<Q", first + j)
            crc = crc32c.crc32c(payload[j], crc32c.crc32c(idx))
            out[j, :_REC.size] = np.frombuffer(_REC.pack(first + j, crc, 0), np.uint8)
        return out.reshape(-1)

    def parse(self, raw: np.ndarray, first: int = 0) -> torch.Tensor:
        """Centroids ``[n, layers, kv_heads, 2, head_dim]`` of the valid prefix of records
        ``first, ...`` in ``raw`` (whole records only; stops at the first record whose index
        or checksum is wrong)."""
        g, rb = self.geo, self.record_bytes
        buf = np.ascontiguousarray(np.asarray(raw, np.uint8).reshape(-1))
        n = 0
        while (n + 1) * rb <= buf.size:
            rec = buf[n * rb:(n + 1) * rb]
            idx, crc, zero = _REC.unpack(rec[:_REC.size].tobytes())
            want = crc32c.crc32c(cast(Any, rec[_REC.size:]), crc32c.crc32c(struct.pack("<Q", first + n)))
            if idx != first + n or zero != 0 or crc != want:
                break
            n += 1
        rows = buf[:n * rb].reshape(n, rb)[:, _REC.size:].copy()
        t = torch.from_numpy(rows).view(g.dtype)
        return t.reshape(n, g.num_layers, g.num_kv_heads, 2, g.head_dim)


def next_slots(old: tuple[int, ...], top: set[int]) -> tuple[int, ...]:
    """The slot order of the blocks ``top`` after ``old``: a block that stays keeps its slot,
    new blocks take the freed slots in ascending order (then new slots at the end); with
    fewer blocks, the freed slots left over close up."""
    freed = [i for i, b in enumerate(old) if b not in top]
    incoming = sorted(top.difference(old))
    order = list(old)
    for i, b in zip(freed, incoming, strict=False):
        order[i] = b
    if len(incoming) > len(freed):
        order += incoming[len(freed):]
    elif len(freed) > len(incoming):
        gone = set(freed[len(incoming):])
        order = [b for i, b in enumerate(order) if i not in gone]
    return tuple(order)


def centroids_of_keys(keys: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block centroids of ``keys`` ``[1, H, n*block, D]``: ``[n, H, 2, D]``, the mean key of
    each block's first ``ceil(block/2)`` tokens and of the rest (of the one token when
    ``block`` is 1), summed in float32 in token order: the same bytes on any device."""
    h, t, d = keys.shape[1], keys.shape[2], keys.shape[3]
    if t % block:
        raise ValueError(f"{t} keys are not whole blocks of {block}")
    k = keys[0].reshape(h, t // block, block, d).float()
    half = (block + 1) // 2
    parts = []
    for a, e in ((0, half), (half, block) if block > 1 else (0, 1)):
        acc = k[:, :, a]
        for j in range(a + 1, e):  # one add at a time: a reduction's order differs by device
            acc = acc + k[:, :, j]
        parts.append((acc / (e - a)).to(keys.dtype))
    return torch.stack(parts, dim=2).transpose(0, 1).contiguous()


def scoring_layout(cents: torch.Tensor) -> torch.Tensor:
    """``[n, H, R, D]`` representatives (R = 2: centroids) as ``[H, D, R*n]``: per KV head
    the representatives as columns, block by block (what :func:`block_scores` reads)."""
    n, h, r, d = cents.shape
    return cents.permute(1, 3, 0, 2).reshape(h, d, r * n)


def centroids_layout(scoring: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`scoring_layout`: ``[n, H, 2, D]``."""
    h, d = scoring.shape[0], scoring.shape[1]
    return scoring.reshape(h, d, -1, 2).permute(2, 0, 3, 1)


@contextlib.contextmanager
def _one_thread(t: torch.Tensor) -> Iterator[None]:
    """CPU: run with one intra-op thread. A matmul this small costs 10-40x more split over
    threads when the cores are busy (measured: 14 us on one thread, 40-540 us on two)."""
    if t.device.type != "cpu" or torch.get_num_threads() == 1:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def block_scores(query: torch.Tensor, scoring: torch.Tensor) -> torch.Tensor:
    """Score of each block for a step's queries: ``[..., n]``.

    ``query`` ``[L, Hq, T, D]`` (post-RoPE; ``L`` layers, or one), ``scoring`` ``[L, Hkv, D,
    2n]`` (:func:`scoring_layout` per layer). Per KV head and query of its group (``Hq / Hkv``
    heads, ``T`` tokens) the logits of every centroid (one batched matmul for all layers),
    their softmax at the attention's scale ``1/sqrt(D)``, a block's share the sum of its two
    centroids'; the largest share over the group's queries, summed over the KV heads: a
    block counts as much as the attention some query of a head would give it. (A share, not
    a logit: heads differ in scale, and a sum of logits lets one head choose for all.)"""
    hkv, d = scoring.shape[-3], scoring.shape[-2]
    layers = query.shape[0]
    q = query.reshape(layers * hkv, -1, d).to(scoring.dtype)  # query head j reads KV head j // group
    with _one_thread(q):
        s = torch.bmm(q, scoring.reshape(layers * hkv, d, -1))
        share = torch.softmax(s.float() * d ** -0.5, dim=-1)
    share = share.unflatten(-1, (-1, 2)).sum(-1)
    return share.amax(1).reshape(layers, hkv, -1).sum(1)


# --- selectors: what represents a block, and how a step's queries score it ------------------

Reps = tuple[torch.Tensor, "torch.Tensor | None"]  # [m, H, R, D] values or codes, [m, H, R] scales


class Selector(Protocol):
    """How a block is represented (``columns`` vectors per KV head, optionally with a scale
    each) and scored. ``represent`` must be a function of the key bytes alone, computed the
    same way on any device (a resumed session recomputes it from the stored keys)."""

    name: str
    #: score at every step; else only at a step of several tokens (a turn arriving), at the
    #: ``fresh`` decode steps after one, and at one that adds a block to the candidates, the
    #: choice holding between (exact scores cost)
    every_step: bool
    fresh: int

    def columns(self, block: int) -> int: ...

    def represent(self, keys: torch.Tensor, block: int) -> Reps: ...

    def scores(self, query: torch.Tensor, reps: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor: ...


def scale_layout(scale: torch.Tensor) -> torch.Tensor:
    """``[n, H, R]`` scales as ``[H, R*n]`` (the columns of :func:`scoring_layout`)."""
    n, h, r = scale.shape
    return scale.permute(1, 0, 2).reshape(h, r * n)


def _share(logits: torch.Tensor, d: int, cols: int, agg: str) -> torch.Tensor:
    """``[L*Hkv, Q, cols*n]`` logits -> ``[L, n]`` after :func:`block_scores`' rule with
    ``agg`` (sum or max) over a block's columns."""
    share = torch.softmax(logits.float() * d ** -0.5, dim=-1).unflatten(-1, (-1, cols))
    share = share.sum(-1) if agg == "sum" else share.amax(-1)
    return share.amax(1)


class Centroids:
    """Two mean keys per block and KV head (:func:`centroids_of_keys`, :func:`block_scores`)."""

    name = "centroids"
    every_step = True
    fresh = 0

    def columns(self, block: int) -> int:
        return 2

    def represent(self, keys: torch.Tensor, block: int) -> Reps:
        return centroids_of_keys(keys, block), None

    def scores(self, query: torch.Tensor, reps: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return block_scores(query, reps)


class Bounds:
    """Quest's per-channel minimum and maximum of a block's keys; a query's bound on its
    logit ``sum_d max(q_d min_d, q_d max_d)``, turned into a share as :func:`block_scores`."""

    name = "quest"
    every_step = True
    fresh = 0

    def columns(self, block: int) -> int:
        return 2

    def represent(self, keys: torch.Tensor, block: int) -> Reps:
        h, t, d = keys.shape[1], keys.shape[2], keys.shape[3]
        k = keys[0].reshape(h, t // block, block, d)
        return torch.stack([k.amin(2), k.amax(2)], dim=2).transpose(0, 1).contiguous(), None

    def scores(self, query: torch.Tensor, reps: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        hkv, d = reps.shape[-3], reps.shape[-2]
        layers = query.shape[0]
        q = query.reshape(layers * hkv, -1, d).to(reps.dtype)
        r = reps.reshape(layers * hkv, d, -1, 2)
        lo, hi = r[..., 0].contiguous(), r[..., 1].contiguous()
        with _one_thread(q):
            bound = torch.bmm(q.clamp(min=0), hi) + torch.bmm(q.clamp(max=0), lo)
        share = torch.softmax(bound.float() * d ** -0.5, dim=-1)
        return share.amax(1).reshape(layers, hkv, -1).sum(1)


class QuantizedKeys:
    """Every key of a block, quantized symmetrically per token and KV head to ``bits``
    (int8 codes, a float32 scale each: ``absmax / (2**(bits-1) - 1)``, round half to even:
    the same bytes on any device); a query's logits against all of them exactly as over
    these keys, their softmax over every old token at the attention's scale, a block's share
    the ``agg`` (sum: its attention mass; max: its best token) of its tokens'; the largest
    over the queries of a KV head, summed over the heads."""

    def __init__(self, block: int, bits: int = 8, agg: str = "max", every_step: bool = False,
                 fresh: int = 0) -> None:
        if agg not in ("max", "sum") or not 2 <= bits <= 8 or not 0 <= fresh <= 4096:
            raise ValueError(f"quantized keys need 2-8 bits, agg max or sum and 0-4096 fresh steps, "
                             f"got {bits}, {agg!r}, {fresh}")
        self.block, self.bits, self.agg = block, bits, agg
        self.every_step = every_step  # else a decode step keeps the choice unless a block left ...
        self.fresh = fresh  # ... or it is one of the first ``fresh`` after a turn
        self.name = f"int{bits}-{agg}" + ("-every" if every_step else f"-fresh{fresh}" if fresh else "")
        self.qmax = float(2 ** (bits - 1) - 1)

    def columns(self, block: int) -> int:
        return block

    def represent(self, keys: torch.Tensor, block: int) -> Reps:
        h, t, d = keys.shape[1], keys.shape[2], keys.shape[3]
        k = keys[0].float()  # [H, T, D]
        scale = k.abs().amax(-1) / self.qmax  # [H, T]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(k / safe.unsqueeze(-1)).clamp(-self.qmax, self.qmax).to(torch.int8)
        codes = codes.reshape(h, t // block, block, d).transpose(0, 1).contiguous()
        return codes, scale.reshape(h, t // block, block).transpose(0, 1).contiguous()

    def scores(self, query: torch.Tensor, reps: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if scale is None:
            raise ValueError("quantized keys are scored with their scales")
        hkv, d = reps.shape[-3], reps.shape[-2]
        layers = query.shape[0]
        q = query.reshape(layers * hkv, -1, d).float()
        r = reps.reshape(layers * hkv, d, -1)
        with _one_thread(q):  # a layer at a time: its keys in float stay in the CPU's cache
            s = torch.cat([torch.bmm(q[i:i + hkv], r[i:i + hkv].float()) for i in range(0, layers * hkv, hkv)])
        s = s * scale.reshape(layers * hkv, 1, -1)
        return _share(s, d, self.block, self.agg).reshape(layers, hkv, -1).sum(1)


SELECTORS: dict[str, Callable[[], Selector]] = {"centroids": Centroids, "quest": Bounds}


def selector(name: str, block: int) -> Selector:
    """The selector called ``name``: ``centroids``, ``quest``, ``int8-max``, ``int8-sum``,
    ``int4-max``, ``int4-sum``; a quantized one with ``-every`` chooses at every decode step,
    with ``-fresh<N>`` at the first N decode steps after a turn (``int8-sum-fresh8``)."""
    if name in SELECTORS:
        return SELECTORS[name]()
    if name.startswith("int") and "-" in name:
        parts = name[3:].split("-")
        every = parts[2:] == ["every"]
        fresh = parts[2][5:] if len(parts) == 3 and parts[2].startswith("fresh") else None
        if parts[0].isdigit() and (len(parts) == 2 or every or (fresh or "").isdigit()):
            return QuantizedKeys(block, int(parts[0]), parts[1], every, int(fresh or 0))
    raise ValueError(f"unknown retrieval selector {name!r}")

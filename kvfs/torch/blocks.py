"""Blocks of old KV and their representatives: per-channel key bounds (Quest) and their bytes.

A session's tokens past the sinks are cut into blocks of ``block`` tokens from a fixed
``origin`` (the sink count): block ``i`` is tokens ``[origin + i*block, origin + (i+1)*block)``.
A block's representative, per layer and KV head, is the per-channel minimum and maximum of
its keys (post-RoPE, as cached): for a query ``q`` the bound ``sum_d max(q_d*min_d, q_d*max_d)``
is at least ``q . k`` for every key ``k`` of the block, so ranking blocks by it finds the
blocks that can score highest (Quest, Tang et al. 2024). Minimum and maximum are exact in
any dtype, so bounds computed on the device as blocks leave the window, read back from the
tiers, or recomputed from the stored keys are the same bytes: retrieval ranks alike in a
live, a resumed and a forked session.

The ``key_bounds`` side stream (``sessions/<id>/key_bounds`` on the mount) holds them:

* a 64-byte header: magic ``KVFSKB01``, version, block, origin, layers, KV heads, head
  dim, dtype name, then the CRC32C of the bytes before it;
* one record per block, in block order: ``u64 block index``, ``u32`` CRC32C of the index and
  the payload, ``u32`` zero, then the payload ``[layers, kv_heads, 2, head_dim]`` (minimum,
  maximum) in the model's dtype, little-endian.

A record that fails its checksum or index ends the valid prefix; what follows is recomputed
from the stored keys (:func:`bounds_of_keys`), as are the bounds of sessions written without
them (older sessions, other writers). Pure functions over tensors and bytes: no I/O here.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import crc32c
import numpy as np
import torch

from kvfs.torch.fingerprint import KVGeometry, dtype_name

MAGIC = b"KVFSKB01"
VERSION = 1
STREAM = "key_bounds"  # the warm tier's side stream (cold file sessions/<id>/key_bounds)
_HEAD = struct.Struct("<8sIIIIII8s20x")  # magic, version, block, origin, layers, heads, dim, dtype
_HEAD_CRC = struct.Struct("<I")
HEADER_BYTES = _HEAD.size + _HEAD_CRC.size
_REC = struct.Struct("<QII")  # block index, crc32c(index + payload), zero
assert HEADER_BYTES == 64 and _REC.size == 16


@dataclass(frozen=True)
class BlockLayout:
    """How a session's tokens are cut into blocks, and the bytes of one block's bounds."""

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
        b = bytes(memoryview(raw)[:HEADER_BYTES]) if len(raw) >= HEADER_BYTES else b""
        return len(b) == HEADER_BYTES and b == self.header()

    def records(self, first: int, bounds: torch.Tensor) -> np.ndarray:
        """The bytes of records ``first, first + 1, ...`` from CPU ``bounds``
        ``[n, layers, kv_heads, 2, head_dim]`` (model dtype)."""
        n = bounds.shape[0]
        payload = bounds.contiguous().view(torch.uint8).reshape(n, -1).numpy()
        if payload.shape[1] != self.payload_bytes:
            raise ValueError(f"bounds of {payload.shape[1]} bytes per block, layout has {self.payload_bytes}")
        out = np.zeros((n, self.record_bytes), np.uint8)
        out[:, _REC.size:] = payload
        for j in range(n):
            idx = struct.pack("<Q", first + j)
            crc = crc32c.crc32c(payload[j], crc32c.crc32c(idx))
            out[j, :_REC.size] = np.frombuffer(_REC.pack(first + j, crc, 0), np.uint8)
        return out.reshape(-1)

    def parse(self, raw: np.ndarray, first: int = 0) -> torch.Tensor:
        """Bounds ``[n, layers, kv_heads, 2, head_dim]`` of the valid prefix of records
        ``first, ...`` in ``raw`` (whole records only; stops at the first record whose index
        or checksum is wrong)."""
        g, rb = self.geo, self.record_bytes
        buf = np.ascontiguousarray(np.asarray(raw, np.uint8).reshape(-1))
        n = 0
        while (n + 1) * rb <= buf.size:
            rec = buf[n * rb:(n + 1) * rb]
            idx, crc, zero = _REC.unpack(rec[:_REC.size].tobytes())
            want = crc32c.crc32c(rec[_REC.size:], crc32c.crc32c(struct.pack("<Q", first + n)))
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


def bounds_of_keys(keys: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block key bounds of ``keys`` ``[1, H, n*block, D]``: ``[n, H, 2, D]`` (min, max)."""
    h, t, d = keys.shape[1], keys.shape[2], keys.shape[3]
    if t % block:
        raise ValueError(f"{t} keys are not whole blocks of {block}")
    k = keys[0].reshape(h, t // block, block, d)
    return torch.stack((k.amin(2), k.amax(2)), dim=2).transpose(0, 1).contiguous()


def scoring_layout(bounds: torch.Tensor) -> torch.Tensor:
    """``[n, H, 2, D]`` bounds (min, max) as ``[H, 2D, n]``: per KV head the maxima's rows,
    then the minima's, blocks along the last dimension (what :func:`block_scores` reads)."""
    return torch.cat((bounds[:, :, 1], bounds[:, :, 0]), dim=-1).permute(1, 2, 0)


def bounds_layout(scoring: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`scoring_layout`: ``[n, H, 2, D]``."""
    d = scoring.shape[1] // 2
    t = scoring.permute(2, 0, 1)
    return torch.stack((t[..., d:], t[..., :d]), dim=2)


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

    ``query`` ``[L, Hq, T, D]`` (post-RoPE; ``L`` layers, or one), ``scoring`` ``[L, Hkv, 2D,
    n]`` (:func:`scoring_layout` per layer). Per KV head the Quest bound of every query of its
    group (``Hq / Hkv`` heads, ``T`` tokens): ``sum_d max(q_d*min_d, q_d*max_d) = q+ . max +
    q- . min``, one batched matmul for all layers; the largest bound over the group's queries,
    divided by that head's largest over the blocks, summed over the KV heads: a block counts
    when some query of a head would attend to it."""
    hkv, d2 = scoring.shape[-3], scoring.shape[-2]
    layers = query.shape[0]
    q = query.reshape(layers * hkv, -1, d2 // 2).to(scoring.dtype)  # query head j reads KV head j // group
    q2 = torch.cat((q.clamp(min=0), q.clamp(max=0)), dim=-1)
    with _one_thread(q2):
        s = torch.bmm(q2, scoring.reshape(layers * hkv, d2, -1))
    s = s.amax(1).reshape(layers, hkv, -1)
    # each KV head's bounds over its largest: heads differ in scale, and a sum of raw bounds
    # lets one head choose for all (measured on SmolLM2: more pass keys found)
    return (s / s.abs().amax(-1, keepdim=True).clamp(min=1e-6)).sum(1)

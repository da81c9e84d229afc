"""The representatives of one session's old blocks, on the device: what a selector scores.

Every block that has left the window gets ``cols`` representatives per layer and KV head
(:meth:`kvfs.torch.blocks.Selector.represent`: two centroids, Quest's bounds, or every key in
int8 with a scale per key). They live in one tensor for all layers, in the layout the
selectors' ``scores`` read (:func:`~kvfs.torch.blocks.scoring_layout`), so one matmul ranks
every layer's blocks at once. The tensor grows by a quarter at a time (appends rarely copy).

The device budget may take the tensors (:meth:`Representatives.release`) and leave the count
of blocks represented: the owner rebuilds them from the stored keys before the session's
next step, and they are a function of the keys alone, so the rebuilt ones score alike.
"""

from __future__ import annotations

import torch

from kvfs.torch.blocks import centroids_layout, scale_layout, scoring_layout


def capacity(blocks: int) -> int:
    """Blocks the tensor has room for once it holds ``blocks``: it grows by a quarter (at
    least 8) at a time."""
    return blocks + max(8, blocks // 4)


class Representatives:
    """Per layer, the representatives of blocks ``[0, count[layer])``."""

    def __init__(self, layers: int, cols: int, block_bytes: int) -> None:
        self.layers = layers
        self.cols = cols  # representatives per block and KV head
        self.block_bytes = block_bytes  # device bytes of one block's representatives, all layers
        self.count = [0] * layers  # blocks represented, per layer (kept when released)
        self.out = False  # the budget took the tensors: rebuild before the next step
        self._reps: torch.Tensor | None = None  # [layers, H, D, cols * capacity]
        self._scale: torch.Tensor | None = None  # [layers, H, cols * capacity] (quantized keys)

    @property
    def held(self) -> bool:
        """Whether any block's representatives are on the device."""
        return self._reps is not None

    @property
    def device_bytes(self) -> int:
        """Device bytes the tensors hold now (their whole capacity)."""
        return sum(t.numel() * t.element_size() for t in (self._reps, self._scale) if t is not None)

    @property
    def capacity(self) -> int:
        """Blocks the tensors have room for now."""
        return 0 if self._reps is None else self._reps.shape[-1] // self.cols

    def growth_bytes(self, blocks: int) -> int:
        """Device bytes the tensors grow by when they come to hold ``blocks``."""
        return (capacity(blocks) - self.capacity) * self.block_bytes if blocks > self.capacity else 0

    @property
    def refill_bytes(self) -> int:
        """Device bytes a rebuild takes (0 unless the budget took the tensors)."""
        return capacity(self.count[0]) * self.block_bytes if self.out else 0

    def append(self, layer: int, new: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Add ``[m, H, cols, D]`` representatives (and ``[m, H, cols]`` scales) to ``layer``
        (all layers grow when the first one is full)."""
        n, cur, m, r = self.count[layer], self._reps, new.shape[0], self.cols
        lay = scoring_layout(new)
        if cur is None or cur.shape[-1] < r * (n + m):
            cap = capacity(n + m)
            grown = lay.new_empty((self.layers, *lay.shape[:2], r * cap))
            if cur is not None:
                grown[..., :cur.shape[-1]] = cur
            self._reps = cur = grown
            if scale is not None:
                gs = torch.empty((self.layers, lay.shape[0], r * cap), dtype=scale.dtype, device=lay.device)
                if self._scale is not None:
                    gs[..., :self._scale.shape[-1]] = self._scale
                self._scale = gs
        cur[layer, ..., r * n:r * (n + m)] = lay
        if scale is not None and self._scale is not None:
            self._scale[layer, :, r * n:r * (n + m)] = scale_layout(scale)
        self.count[layer] = n + m

    def first(self, n: int, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The representatives (and scales) of blocks ``[0, n)``: of every layer
        (``[layers, H, D, cols*n]``), or of one (``[1, H, D, cols*n]``)."""
        if self._reps is None:
            raise RuntimeError("no block's representatives are on the device")
        lay = slice(None) if layer is None else slice(layer, layer + 1)
        scale = None if self._scale is None else self._scale[lay, :, :self.cols * n]
        return self._reps[lay, ..., :self.cols * n], scale

    def centroids(self, layer: int) -> torch.Tensor:
        """``[n, H, 2, D]`` centroids of ``layer``'s blocks (the centroids selector)."""
        reps, _ = self.first(self.count[layer], layer)
        return centroids_layout(reps[0])

    def centroid_span(self, first: int, end: int) -> torch.Tensor:
        """``[end - first, layers, H, 2, D]`` centroids of blocks ``[first, end)`` of every
        layer: the records of the ``key_centroids`` side stream."""
        if self._reps is None:
            raise RuntimeError("no block's representatives are on the device")
        span = self._reps[..., 2 * first:2 * end].flatten(0, 1)
        return centroids_layout(span).unflatten(1, (self.layers, -1))

    def release(self) -> int:
        """Free the tensors and keep the count (the budget's move); bytes freed."""
        freed = self.device_bytes
        if freed:
            self._reps = self._scale = None
            self.out = True
        return freed

    def reset(self) -> None:
        """Forget every block (before a rebuild)."""
        self._reps = self._scale = None
        self.out = False
        self.count = [0] * self.layers

    def drop(self) -> None:
        """Free the tensors for good: the session is gone."""
        self._reps = self._scale = None

    def copy(self) -> Representatives:
        other = Representatives(self.layers, self.cols, self.block_bytes)
        other.count = list(self.count)
        other.out = self.out
        other._reps = None if self._reps is None else self._reps.clone()
        other._scale = None if self._scale is None else self._scale.clone()
        return other

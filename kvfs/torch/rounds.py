"""A session's rounds: the closed ones' token ranges and the open round's running key sum.

Owns ``closed`` (``[start, end)`` per closed round, as in meta.json), where the open round
starts, and the sum of its summary-layer keys (folded every 32 steps, so few tensors stay
referenced); :meth:`Rounds.summary` is the open round's summary vector
(:func:`kvfs.torch.recall.summarize_keys`). Knows nothing of storage: the cache queues a
closed round's summary below.
"""

from __future__ import annotations

import numpy as np
import torch

from kvfs.torch.recall import summarize_keys

#: steps of keys kept before they are folded into the sum
FOLD_EVERY = 32


class Rounds:
    """One session's round bookkeeping (module docstring)."""

    def __init__(self, summary_dim: int) -> None:
        self.summary_dim = summary_dim
        self.closed: list[list[int]] = []
        self.start = 0  # first token of the open round
        self._sum: torch.Tensor | None = None  # [H, D], float
        self._keys: list[torch.Tensor] = []  # summary-layer keys not yet summed
        self._count = 0  # tokens of the open round summed or kept

    def add(self, keys: torch.Tensor) -> None:
        """Add a step's summary-layer keys ``[1, H, T, D]`` to the open round."""
        self._keys.append(keys)
        self._count += keys.shape[-2]
        if len(self._keys) >= FOLD_EVERY or keys.shape[-2] > 64:  # keep few refs alive
            self._fold()

    def _fold(self) -> None:
        if self._keys:
            s = torch.cat(self._keys, dim=-2)[0].float().sum(dim=1)  # [H, D]
            self._sum = s if self._sum is None else self._sum + s
            self._keys = []

    def summary(self) -> np.ndarray:
        """Summary vector of the open round so far (zeros while it is empty)."""
        self._fold()
        if self._sum is None or self._count == 0:
            return np.zeros(self.summary_dim, np.float32)
        mean = (self._sum / self._count).reshape(1, -1).cpu().numpy()
        return summarize_keys(mean, self.summary_dim)

    def close(self, end: int) -> tuple[int, np.ndarray] | None:
        """Close the open round ``[start, end)``: its index and summary (None if empty)."""
        if end <= self.start:
            return None
        idx = len(self.closed)
        self.closed.append([self.start, end])
        summary = self.summary()
        self.start = end
        self._sum, self._keys, self._count = None, [], 0
        return idx, summary

    def restart(self, keys: torch.Tensor, end: int) -> None:
        """The open round now ends at ``end`` (a crop): its sum rebuilt from ``keys``, the
        summary layer's keys of tokens ``[0, end)``."""
        self._sum, self._count = None, end - self.start
        self._keys = [keys[..., self.start:end, :]] if self._count else []

    def restore(self, closed: list[list[int]]) -> None:
        """Resume: the stored rounds; the open round starts after the last (keys added next)."""
        self.closed = [list(r) for r in closed]
        self.start = self.closed[-1][1] if self.closed else 0
        self._sum, self._keys, self._count = None, [], 0

    def copy_to(self, other: Rounds) -> None:
        """Give ``other`` (a fork's) these rounds and the open round's key sum."""
        self._fold()
        other.closed = [list(r) for r in self.closed]
        other.start = self.start
        other._sum = None if self._sum is None else self._sum.clone()
        other._keys = []
        other._count = self._count

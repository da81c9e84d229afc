"""One layer's hot window: the ``CacheLayerMixin`` that transformers calls per attention layer.

Owns the layer's device-resident K/V (``[1, H, stored, D]``), its counters (``seen``,
``spilled``, ``held``) and its recalled copies, and implements the window rule of
:mod:`kvfs.torch.cache` in ``update``: attend the stored window plus the step's input, keep
the last ``max_kv_len`` tokens, queue what falls out (only tokens not already handed down).
Everything that involves more than one layer (hooks, budget, rounds, storage) is the
owning :class:`~kvfs.torch.cache.TieredCache`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicLayer

from kvfs.torch.fingerprint import KVMismatch

if TYPE_CHECKING:
    from kvfs.torch.cache import TieredCache


class TieredLayer(DynamicLayer):
    """One layer's hot window. ``keys``/``values`` are ``[1, H, stored, D]`` on the device."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, cache: TieredCache, idx: int) -> None:
        super().__init__()
        self._cache = cache
        self.idx = idx
        self.seen = 0  # tokens this layer has processed, absolute
        self.spilled = 0  # tokens [0, spilled) handed to the warm tier
        self.held = 0  # tokens of storage kept alive by self.keys (a view may hold one more)
        self.recall_keys: torch.Tensor | None = None
        self.recall_values: torch.Tensor | None = None

    # --- state ---------------------------------------------------------------------------
    @property
    def stored(self) -> int:
        return 0 if self.keys is None or not self.is_initialized else self.keys.shape[-2]

    @property
    def recalled(self) -> int:
        return 0 if self.recall_keys is None else self.recall_keys.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        geo = self._cache.geo
        if key_states.dtype != geo.dtype:
            raise KVMismatch(f"layer {self.idx}: K/V arrive as {key_states.dtype}, the cache was "
                             f"built for {geo.dtype} (pass dtype= to match the model)")
        if key_states.shape[0] != 1:
            raise ValueError(f"TieredCache holds one sequence per session; got batch size {key_states.shape[0]}")
        self.device = key_states.device
        b, h, _, d = key_states.shape
        self.keys = key_states.new_empty((b, h, 0, d))
        self.values = value_states.new_empty((b, h, 0, d))
        self.is_initialized = True

    def set_window(self, k: torch.Tensor, v: torch.Tensor, seen: int) -> None:
        """Install ``k``/``v`` as the window ending at token ``seen`` (resume)."""
        self.device = k.device
        self.keys, self.values = k, v
        self.seen = seen
        self.spilled = seen
        self.held = k.shape[-2]
        self.is_initialized = True

    # --- the transformers layer interface --------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._cache
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if self.idx == 0:
            c._step_begin(q)
        full_k = torch.cat([self.keys, key_states], dim=-2)
        full_v = torch.cat([self.values, value_states], dim=-2)
        self.seen += q
        n = full_k.shape[-2]
        w = c.max_kv_len
        if w is not None and n > w:
            drop = n - w
            first = self.seen - n  # absolute index of full_k[..., 0, :]
            s = max(self.spilled - first, 0)
            if s < drop:
                c._spill(self.idx, first + s, full_k[..., s:drop, :], full_v[..., s:drop, :])
                self.spilled = first + drop
            if drop > 1:  # e.g. a long prefill: do not keep its whole storage alive
                self.keys = full_k[..., drop:, :].clone()
                self.values = full_v[..., drop:, :].clone()
                self.held = w
            else:  # decode: a view, holding one token more than the window
                self.keys = full_k[..., drop:, :]
                self.values = full_v[..., drop:, :]
                self.held = n
        else:
            self.keys, self.values = full_k, full_v
            self.held = n
        if self.idx == c.summary_layer:
            c._accumulate(key_states)
        if self.idx == c.num_layers - 1:
            c._step_end()
        if self.recall_keys is not None:
            return (torch.cat([self.recall_keys, full_k], dim=-2),
                    torch.cat([self.recall_values, full_v], dim=-2))
        return full_k, full_v

    def get_seq_length(self) -> int:
        return self.seen

    def prepend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put ``k``/``v`` (the tokens just before the window) back in front of it (refill)."""
        self.keys = torch.cat([k, self.keys], dim=-2)
        self.values = torch.cat([v, self.values], dim=-2)
        self.held = self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored, rec = self.stored, self.recalled
        return rec + stored + query_length, self.seen - stored - rec

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("TieredCache cannot be cropped (tokens may already be below)")

    def reset(self) -> None:
        super().reset()
        self.seen = self.spilled = self.held = 0
        self.recall_keys = self.recall_values = None

    # --- moves -----------------------------------------------------------------------------
    def drop_front(self, n: int) -> None:
        """Hand the ``n`` oldest window tokens to the warm tier and free them (between steps)."""
        n = min(n, self.stored)
        if n <= 0:
            return
        ws = self.seen - self.stored
        s = max(self.spilled - ws, 0)
        if s < n:
            self._cache._spill(self.idx, ws + s, self.keys[..., s:n, :], self.values[..., s:n, :])
            self.spilled = ws + n
        self.keys = self.keys[..., n:, :].clone()
        self.values = self.values[..., n:, :].clone()
        self.held = self.keys.shape[-2]

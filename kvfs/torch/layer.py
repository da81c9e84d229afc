"""One layer's hot window: the ``CacheLayerMixin`` that transformers calls per attention layer.

Owns the layer's device-resident K/V (``[1, H, stored, D]``), its counters (``seen``,
``spilled``, ``held``) and its recalled copies, and implements the window rule of
:mod:`kvfs.torch.cache` in ``update``: attend the stored sinks and window plus the step's
input, keep the sinks and the last ``max_kv_len`` tokens, queue what falls out (only tokens
not already handed down).

Storage layout: ``keys[..., :pinned, :]`` are the session's first ``pinned = min(sinks,
seen)`` tokens (the attention sinks, absolute ``[0, pinned)``); the rest is the window,
absolute ``[window_start, seen)`` with ``window_start >= pinned``. While the session is
shorter than sinks + window the two parts are contiguous. Recalled copies are attended
between the two parts (position order). Everything that involves more than one layer
(hooks, budget, rounds, storage) is the owning :class:`~kvfs.torch.cache.TieredCache`'s.
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

    @property
    def pinned(self) -> int:
        """Sink tokens at the front of the storage (absolute ``[0, pinned)``)."""
        if self._cache.sinks_moved:
            return 0
        return min(self._cache.sink_tokens, self.seen, self.stored)

    @property
    def window_start(self) -> int:
        """Absolute index of the first window token (``keys[..., pinned, :]``)."""
        return self.seen - (self.stored - self.pinned)

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
        """Install ``k``/``v`` (sinks then window) as the storage ending at ``seen`` (resume)."""
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
        p = min(c.sink_tokens, self.seen)  # the front p tokens of full_k are absolute [0, p)
        w = c.max_kv_len
        if w is not None and n - p > w:
            drop = n - p - w
            first = self.seen - (n - p)  # absolute index of full_k[..., p, :]
            if self.spilled < first + drop:
                self._hand_down(full_k, full_v, p, first, self.spilled, first + drop)
                self.spilled = first + drop
            if p:  # cut the dropped tokens out from between the sinks and the window
                self.keys = torch.cat([full_k[..., :p, :], full_k[..., p + drop:, :]], dim=-2)
                self.values = torch.cat([full_v[..., :p, :], full_v[..., p + drop:, :]], dim=-2)
                self.held = p + w
            elif drop > 1:  # e.g. a long prefill: do not keep its whole storage alive
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
        if self.recall_keys is not None:  # sinks, recalled rounds, window, input
            full_k = torch.cat([full_k[..., :p, :], self.recall_keys, full_k[..., p:, :]], dim=-2)
            full_v = torch.cat([full_v[..., :p, :], self.recall_values, full_v[..., p:, :]], dim=-2)
        if self.idx == c.summary_layer:
            c._accumulate(key_states, self.seen - q)
        if self.idx == c.num_layers - 1:
            c._step_end()  # may start a recall: for the next steps, not this one
        return full_k, full_v

    def get_seq_length(self) -> int:
        return self.seen

    def held_after(self, q: int) -> int:
        """Tokens of storage this layer holds after a step of ``q`` tokens (see ``update``)."""
        n = self.stored + q
        w = self._cache.max_kv_len
        p = min(self._cache.sink_tokens, self.seen + q)
        if w is None or n - p <= w:
            return n
        if p:
            return p + w
        return w if n - w > 1 else n

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
    def _hand_down(self, k: torch.Tensor, v: torch.Tensor, p: int, first: int, a: int, b: int) -> None:
        """Queue absolute tokens ``[a, b)`` of a storage tensor whose first ``p`` tokens are
        ``[0, p)`` and whose token ``p`` is absolute ``first``."""
        c = self._cache
        if first != p and a < p:  # sinks first (never dropped, handed down in order)
            e = min(b, p)
            c._spill(self.idx, a, k[..., a:e, :], v[..., a:e, :])
            a = e
        if a < b:
            if a < first and first != p:
                raise AssertionError(f"layer {self.idx}: tokens [{a}, {first}) are in no tier")
            s = p + a - first  # = a when sinks and window are contiguous
            c._spill(self.idx, a, k[..., s:s + b - a, :], v[..., s:s + b - a, :])

    def flush_pending(self) -> None:
        """Queue the stored tokens not yet handed down (they stay on the device)."""
        if self.is_initialized and self.spilled < self.seen:
            self._hand_down(self.keys, self.values, self.pinned, self.window_start, self.spilled,
                            self.seen)
            self.spilled = self.seen

    def prepend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put ``k``/``v`` (the tokens just before the window) back in front of it (refill)."""
        p = self.pinned
        self.keys = torch.cat([self.keys[..., :p, :], k, self.keys[..., p:, :]], dim=-2)
        self.values = torch.cat([self.values[..., :p, :], v, self.values[..., p:, :]], dim=-2)
        self.held = self.keys.shape[-2]

    def drop_front(self, n: int) -> None:
        """Hand the ``n`` oldest window tokens to the warm tier and free them (between steps).

        The sinks stay: they are on the device for the session's life."""
        p = self.pinned
        n = min(n, self.stored - p)
        if n <= 0:
            return
        ws = self.window_start
        if self.spilled < ws + n:
            self._hand_down(self.keys, self.values, p, ws, self.spilled, ws + n)
            self.spilled = ws + n
        self.keys = torch.cat([self.keys[..., :p, :], self.keys[..., p + n:, :]], dim=-2)
        self.values = torch.cat([self.values[..., :p, :], self.values[..., p + n:, :]], dim=-2)
        self.held = self.keys.shape[-2]

    def drop_all(self) -> None:
        """Free the whole storage (everything already handed down; between steps)."""
        if self.spilled < self.seen:
            raise AssertionError(f"layer {self.idx}: tokens [{self.spilled}, {self.seen}) not handed down")
        self.keys = self.keys[..., :0, :].clone()
        self.values = self.values[..., :0, :].clone()
        self.held = 0

    def release(self) -> None:
        """Forget the device tensors (the router dropped the session)."""
        self.keys = self.values = self.recall_keys = self.recall_values = None
        self.held = 0
        self.is_initialized = False

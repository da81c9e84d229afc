"""One layer's hot window: the ``CacheLayerMixin`` that transformers calls per attention layer.

Owns the layer's device-resident K/V, its counters (``seen``, ``spilled``) and its recalled
copies, and implements the window rule of :mod:`kvfs.torch.cache` in ``update``: attend the
stored sinks and window plus the step's input, keep the sinks and the last ``max_kv_len``
tokens, queue what falls out (only tokens not already handed down).

Logical storage (``keys``/``values``, ``[1, H, stored, D]``): the session's first ``pinned =
min(sinks, seen)`` tokens (the attention sinks, absolute ``[0, pinned)``), then the window,
absolute ``[window_start, seen)`` with ``window_start >= pinned``. Recalled copies are
attended between the two parts (position order). Everything that involves more than one
layer (hooks, budget, rounds, storage) is the owning cache's (a
:class:`~kvfs.torch.cache.TieredCache`); what a layer reads and calls of it is
:class:`~kvfs.torch.seams.LayerHost`, so this module never imports the cache.

Physical storage: one preallocated buffer per K and V with ``window_slack`` tokens of room
past the stored ones, so a decode step copies its input and the sinks, never the window:
the input is written after the window and attention gets a slice of the buffer (sinks,
window, input: contiguous), not a concatenation. When a step drops
tokens from the front of the window, the sinks are written again just before the new
window start at the beginning of the *next* step (this step's attention still reads the
old slice): between steps the buffer run from ``_a`` is ``[sinks | _gap dropped tokens |
window]``. When the room runs out the stored tokens move to a fresh buffer (every
``window_slack`` steps at decode), and the tokens that will leave the window until then are
handed to the spill thread in one piece. Only ``update`` writes into a buffer; every other
move (budget, refill, resume) installs new tensors, so a slice handed to attention is never
changed before the attention that reads it has run. ``keys``/``values`` read between steps
are views valid until the next step (or copies while sinks are pending).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvfs.torch.fingerprint import KVMismatch
from kvfs.torch.rotation import SinkRotation
from kvfs.torch.seams import LayerHost


class _DecodeViews:
    """Every view the steady decode steps of one buffer need, made at once (a few calls for
    all steps until the buffer is full; slicing per step costs a Python-to-ATen call a view).

    Steady decode: one input token, the window full, sinks + window + input = ``n`` tokens,
    one token dropped per step. Step ``i`` attends the run ``[start + i, start + i + n)``:
    ``fk[i]``/``fv[i]``; its input goes to ``ik[i]``/``iv[i]`` (the run's last token), the
    sinks to ``sk[i]``/``sv[i]`` (its first ``p`` tokens). Between two such steps the layer's
    ``_gap`` is ``gap`` and its ``_n`` is ``between``."""

    __slots__ = ("start", "n", "p", "w", "cap", "count", "gap", "between", "fk", "fv", "ik", "iv", "sk",
                 "sv")

    def __init__(self, kb: torch.Tensor, vb: torch.Tensor, start: int, n: int, p: int, w: int) -> None:
        self.start, self.n, self.p, self.w = start, n, p, w
        self.gap, self.between = (1, n) if p else (0, n - 1)
        self.cap = kb.shape[-2]
        self.count = count = self.cap - n - start + 1
        self.fk, self.fv = (b.narrow(2, start, n + count - 1).unfold(2, n, 1).transpose(-1, -2).unbind(2)
                            for b in (kb, vb))
        self.ik, self.iv = (b.narrow(2, start + n - 1, count).split(1, 2) for b in (kb, vb))
        self.sk: tuple[torch.Tensor, ...]
        self.sv: tuple[torch.Tensor, ...]
        self.sk, self.sv = ((b.narrow(2, start, p + count - 1).unfold(2, p, 1).transpose(-1, -2).unbind(2)
                             for b in (kb, vb)) if p else ((), ()))


#: room past the stored tokens of a windowed layer's buffer, as a fraction of sinks + window
#: (capped): the tokens move to a fresh buffer once per that many decode steps
WINDOW_SLACK_FRACTION = 8
WINDOW_SLACK_MAX = 64


def window_slack(max_kv_len: int | None, sink_tokens: int) -> int:
    """Buffer room of a cache's layers. No window: none, the storage grows by the step (as a
    ``DynamicCache``'s), so a budget sees every byte."""
    if max_kv_len is None:
        return 0
    return min(WINDOW_SLACK_MAX, max(1, (max_kv_len + sink_tokens) // WINDOW_SLACK_FRACTION))


def one_sequence(n: int) -> str:
    """The refusal of more than one sequence per session (beam search, batches)."""
    return (f"TieredCache holds one sequence per session, so it cannot run beam search "
            f"(num_beams > 1), return several sequences or take a batch: got {n} sequences. "
            "Use num_beams=1 with one prompt; to explore several continuations, fork the session "
            "(KVRouter.fork) and continue each branch")


def _pair(k: torch.Tensor | None, v: torch.Tensor | None, idx: int,
          what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if k is None or v is None:
        raise AssertionError(f"layer {idx} holds no {what}")
    return k, v


#: fewest decode steps a buffer must have room for before its views are made in one go
MIN_VIEW_STEPS = 8


class TieredLayer(DynamicLayer):
    """One layer's hot window (see the module docstring for the storage layout)."""

    is_sliding = False
    is_compileable = False

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        """Without a window every token is on the device: the cache can be cut back."""
        return self._cache.max_kv_len is None

    def __init__(self, cache: LayerHost, idx: int) -> None:
        self._install(None, None)  # before the base class assigns keys/values
        self._sk: torch.Tensor | None = None  # a copy of the sinks (the source of the move up)
        self._sv: torch.Tensor | None = None
        super().__init__()
        self._cache = cache
        self.idx = idx
        self.seen = 0  # tokens this layer has processed, absolute
        self.spilled = 0  # tokens [0, spilled) handed to the warm tier
        self.recall_keys: torch.Tensor | None = None
        self.recall_values: torch.Tensor | None = None
        self._rot = 0  # positions the stored sinks' keys are rotated by (rope_rerotate)
        self._sk0: torch.Tensor | None = None  # the sinks' own keys, once they are rotated

    # --- physical storage ----------------------------------------------------------------------
    def _install(self, k: torch.Tensor | None, v: torch.Tensor | None, owned: bool = False) -> None:
        """Make ``k``/``v`` (sinks then window, or None) the storage. Not ``owned``: never
        written into (the next step moves the tokens to a buffer of its own first)."""
        self._kb, self._vb = k, v
        self._a = 0  # buffer index of the first stored token
        self._n = 0 if k is None else k.shape[-2]  # buffer tokens from _a: sinks, gap, window
        self._gap = 0  # dropped tokens between the sinks and the window (overwritten next step)
        self._gp = 0  # sinks in front of the gap
        self._owned = owned
        self._views: _DecodeViews | None = None  # of this buffer, made at the first steady step

    def _logical(self, buf: torch.Tensor | None) -> torch.Tensor | None:
        if buf is None:
            return None
        if not self._gap:
            return buf.narrow(-2, self._a, self._n)
        a, p = self._a, self._gp
        return torch.cat([buf.narrow(-2, a, p), buf.narrow(-2, a + p + self._gap, self._n - p - self._gap)],
                         dim=-2)

    @property
    def keys(self) -> torch.Tensor | None:
        return self._logical(self._kb)

    @keys.setter
    def keys(self, k: torch.Tensor | None) -> None:
        self._install(k, self.values)

    @property
    def values(self) -> torch.Tensor | None:
        return self._logical(self._vb)

    @values.setter
    def values(self, v: torch.Tensor | None) -> None:
        self._install(self.keys, v)

    def _kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys``, ``values`` of a layer that holds storage (between steps)."""
        return _pair(self._logical(self._kb), self._logical(self._vb), self.idx, "storage")

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The physical K and V buffers (a step runs on an initialized layer)."""
        return _pair(self._kb, self._vb, self.idx, "storage")

    def _sinks_held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The copy of the sinks that moves up to the window after a drop."""
        return _pair(self._sk, self._sv, self.idx, "copy of its sinks")

    # --- state ---------------------------------------------------------------------------
    @property
    def stored(self) -> int:
        return 0 if self._kb is None or not self.is_initialized else self._n - self._gap

    @property
    def held(self) -> int:
        """Tokens of device storage this layer keeps alive (stored, dropped-not-overwritten, room)."""
        return 0 if self._kb is None else self._kb.shape[-2]

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
    def sink_shift(self) -> int:
        """Positions the stored sinks' keys are rotated by (``rope_rerotate``; else 0)."""
        return self._rot

    @property
    def window_start(self) -> int:
        """Absolute index of the first window token (``keys[..., pinned, :]``)."""
        return self.seen - (self.stored - self.pinned)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        geo = self._cache.geo
        if key_states.dtype != geo.dtype:
            raise KVMismatch(f"layer {self.idx}: K/V arrive as {key_states.dtype}, the cache was "
                             f"built for {geo.dtype} (pass dtype= to match the model)")
        self.device = key_states.device
        b, h, _, d = key_states.shape
        self._install(key_states.new_empty((b, h, 0, d)), value_states.new_empty((b, h, 0, d)))
        self.is_initialized = True

    def set_window(self, k: torch.Tensor, v: torch.Tensor, seen: int) -> None:
        """Install ``k``/``v`` (sinks then window, the model's own keys) as the storage
        ending at ``seen`` (resume)."""
        self.device = k.device
        self._install(k, v)
        self.seen = seen
        self.spilled = seen
        self._sk = self._sv = self._sk0 = None
        self._rot = 0
        self.is_initialized = True

    def copy_to(self, dst: TieredLayer) -> None:
        """Give ``dst`` (a layer of a new, empty cache) copies of this layer's storage,
        counters, sink rotation and recalled copies (a fork; between steps)."""
        if not self.is_initialized or self._kb is None:
            return
        keys, values = self._kv()
        dst.set_window(keys.clone(), values.clone(), self.seen)
        dst.spilled = self.spilled
        dst._rot, dst._sk0 = self._rot, None if self._sk0 is None else self._sk0.clone()
        if self.recall_keys is not None and self.recall_values is not None:
            dst.recall_keys = self.recall_keys.clone()
            dst.recall_values = self.recall_values.clone()

    # --- the transformers layer interface --------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._cache
        if key_states.shape[0] != 1:
            raise ValueError(one_sequence(key_states.shape[0]))
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if self.idx == 0:
            c.step_begin(q)
        rot = c.rotation
        if rot.rope is not None and rot.step_shift != self._rot:
            self._align_sinks(rot, rot.step_shift)
        v = self._views
        if (v is not None and q == 1 and self._gap == v.gap and self._n == v.between
                and self._a + v.gap - v.start < v.count and c.max_kv_len == v.w
                and c.sink_tokens == v.p and v.cap <= v.n + 2 * c.step_slack):
            return self._decode(c, v, key_states, value_states)
        return self._update(c, q, key_states, value_states)

    def _decode(self, c: LayerHost, v: _DecodeViews, key_states: torch.Tensor,
                value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A steady decode step (see :class:`_DecodeViews`): the same rule as ``_update``."""
        i = self._a + v.gap - v.start
        if v.gap:  # the last step's drop: its attention has run, move the sinks up
            sk, sv = self._sinks_held()
            v.sk[i].copy_(sk)
            v.sv[i].copy_(sv)
        v.ik[i].copy_(key_states)
        v.iv[i].copy_(value_states)
        full_k, full_v = v.fk[i], v.fv[i]
        self._a += 1
        self.seen = seen = self.seen + 1
        first = seen - v.n + v.p  # absolute index of full_k[..., p, :]; it leaves the window
        if self.spilled <= first:
            self._spill_ahead(full_k, full_v, v.p, first, first + 1, seen, c.step_slack)
        return self._finish(c, key_states, full_k, full_v, v.p, seen)

    def _update(self, c: LayerHost, q: int, key_states: torch.Tensor,
                value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Any step: sinks moved up, input written (a fresh buffer when out of room), what
        leaves the window handed down."""
        (kb, vb), a, n0, gap = self._buffers(), self._a, self._n, self._gap
        if gap:  # the last step's drop: its attention has run, move the sinks up
            a += gap
            n0 -= gap
            sk, sv = self._sinks_held()
            kb[:, :, a:a + self._gp] = sk
            vb[:, :, a:a + self._gp] = sv
            self._gap = 0
        n = n0 + q
        slack = c.step_slack
        if not self._owned or a + n > kb.shape[-2]:  # out of room: a fresh buffer
            kb, vb = self._move(kb, vb, a, n0, n + slack)
            a = 0
        kb[:, :, a + n0:a + n] = key_states
        vb[:, :, a + n0:a + n] = value_states
        full_k, full_v = kb.narrow(-2, a, n), vb.narrow(-2, a, n)
        self.seen = seen = self.seen + q
        p = min(c.sink_tokens, seen)  # the front p tokens of full_k are absolute [0, p)
        w = c.window_keep(seen)
        self._a, self._n, self._views = a, n, None
        if w is not None and n - p > w:
            drop = n - p - w
            first = seen - (n - p)  # absolute index of full_k[..., p, :]
            if self.spilled < first + drop:
                self._spill_ahead(full_k, full_v, p, first, first + drop, seen, slack)
            if c.retrieval is not None:  # whole blocks leave the window: their bounds
                c.retrieval.left_window(self.idx, first, full_k[:, :, p:p + drop], full_v[:, :, p:p + drop])
            if kb.shape[-2] > p + w + 1 + 2 * slack:  # e.g. a long prefill: keep sinks + window only
                nk, nv = self._move(full_k, full_v, 0, p, p + w + 1 + slack)
                nk[:, :, p:p + w] = full_k[:, :, n - w:]
                nv[:, :, p:p + w] = full_v[:, :, n - w:]
                self._n = p + w
            else:
                if p:  # the sinks move up to the window at the next step
                    self._gap, self._gp = drop, p
                    if self._sk is None or self._sk.shape[-2] != p:
                        self._sk, self._sv = full_k[:, :, :p].clone(), full_v[:, :, :p].clone()
                else:
                    self._a, self._n = a + drop, n - drop
                if (q == 1 and drop == 1 and p == c.sink_tokens and c.retrieval is None
                        and kb.shape[-2] - n - a >= MIN_VIEW_STEPS):  # steady decode from here on
                    self._views = _DecodeViews(kb, vb, a + 1, n, p, w)
        return self._finish(c, key_states, full_k, full_v, p, seen)

    def _align_sinks(self, rot: SinkRotation, t: int) -> None:
        """Rotate the stored sinks' keys by ``t`` positions, the cache's shift for this
        step (``rope_rerotate``, :meth:`SinkRotation.shift_for`)."""
        p = self.pinned
        if not p or self._kb is None or rot.rope is None:
            return
        if self._sk0 is None:  # the stored sinks are still the model's own keys
            self._sk0 = self._kb.narrow(-2, self._a, p).clone()
        new = rot.rope.rotate(self._sk0, t)
        if not self._gap:  # else the sinks are written from _sk when they move up
            if self._owned:
                self._kb[:, :, self._a:self._a + p] = new
            else:
                keys, values = self._kv()
                self._install(torch.cat([new, keys[..., p:, :]], dim=-2), values)
        if self._sk is not None:
            self._sk = new
        self._rot = t

    def _spill_ahead(self, k: torch.Tensor, v: torch.Tensor, p: int, first: int, leaving: int,
                     seen: int, slack: int) -> None:
        """Hand down the tokens up to ``leaving`` (they fall out of the window now) and the
        ones that leave before the buffer is full again: one hand-down per ``slack`` steps."""
        upto = min(seen, leaving + slack)
        self._hand_down(k, v, p, first, self.spilled, upto)
        self.spilled = upto

    def _finish(self, c: LayerHost, key_states: torch.Tensor, full_k: torch.Tensor,
                full_v: torch.Tensor, p: int, seen: int) -> tuple[torch.Tensor, torch.Tensor]:
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        if self.recall_keys is not None and self.recall_values is not None:
            ks.append(self.recall_keys)
            vs.append(self.recall_values)
        joined = None
        if c.retrieval is not None:
            if not ks and key_states.shape[-2] == 1:  # a decode step: the blocks' own buffer
                joined = c.retrieval.joined(self.idx, full_k, full_v, p)
            if joined is None:
                rk, rv = c.retrieval.step_kv(self.idx)
                ks += rk
                vs += rv
            # this layer's queries choose the next step's blocks (and, in a step of several
            # tokens, its own: spliced in after the sinks and recalled rounds)
            at = p + (0 if self.recall_keys is None else self.recall_keys.shape[-2])
            c.retrieval.expect(self.idx, at if key_states.shape[-2] > 1 else None)
        if joined is not None:  # sinks, retrieved blocks, window, input: one slice
            full_k, full_v = joined
        elif ks:  # sinks, recalled rounds, retrieved blocks, window, input
            full_k = torch.cat([full_k[:, :, :p], *ks, full_k[:, :, p:]], dim=-2)
            full_v = torch.cat([full_v[:, :, :p], *vs, full_v[:, :, p:]], dim=-2)
        if self.idx == c.summary_layer:
            c.step_keys(key_states, seen - key_states.shape[-2])
        if self.idx == c.num_layers - 1:
            c.step_end()  # may start a recall: for the next steps, not this one
        return full_k, full_v

    def _move(self, k: torch.Tensor, v: torch.Tensor, a: int, n: int,
              cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New owned buffers of ``cap`` tokens holding ``k``/``v``'s tokens ``[a, a + n)`` first."""
        h, d = k.shape[1], k.shape[-1]
        nk, nv = k.new_empty((1, h, cap, d)), v.new_empty((1, h, cap, d))
        if n:
            nk[:, :, :n] = k[:, :, a:a + n]
            nv[:, :, :n] = v[:, :, a:a + n]
        self._install(nk, nv, owned=True)
        self._n = n
        return nk, nv

    def get_seq_length(self) -> int:
        return self.seen

    def held_after(self, q: int) -> int:
        """Tokens of storage this layer holds after a step of ``q`` tokens (see ``update``)."""
        return self.capacity_after(q, self._cache.room_for(q))

    def capacity_after(self, q: int, slack: int) -> int:
        """``held`` after a step of ``q`` tokens that allocates ``slack`` tokens of room."""
        a, n = self._a + self._gap, self._n - self._gap + q
        cap = self.held
        if not self._owned or a + n > cap:
            cap = n + slack
        w = self._cache.window_keep(self.seen + q)
        p = min(self._cache.sink_tokens, self.seen + q)
        if w is not None and n - p > w and cap > p + w + 1 + 2 * slack:
            cap = p + w + 1 + slack
        return cap

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        attended = self.stored + (0 if self.recall_keys is None else self.recall_keys.shape[-2])
        ret = self._cache.retrieval
        if ret is not None:
            attended += len(ret.chosen[self.idx]) * ret.block
        return attended + query_length, self.seen - attended

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """One layer alone cannot be cut (the cache's rounds and tiers span layers)."""
        if tokens_to_remove:
            raise NotImplementedError("crop the TieredCache (TieredCache.crop), not one of its layers")

    def cut_to(self, seen: int) -> None:
        """Keep tokens ``[0, seen)`` (no window: all of them are stored; between steps)."""
        keys, values = self._kv()
        self._install(keys[..., :seen, :].clone(), values[..., :seen, :].clone())
        self.seen = seen
        self.spilled = min(self.spilled, seen)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise ValueError(one_sequence(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError(one_sequence(len(beam_idx)))

    def reset(self) -> None:
        super().reset()
        self.seen = self.spilled = 0
        self.recall_keys = self.recall_values = None
        self._sk = self._sv = self._sk0 = None
        self._rot = 0

    # --- moves -----------------------------------------------------------------------------
    def _hand_down(self, k: torch.Tensor, v: torch.Tensor, p: int, first: int, a: int, b: int) -> None:
        """Queue absolute tokens ``[a, b)`` of a storage tensor whose first ``p`` tokens are
        ``[0, p)`` and whose token ``p`` is absolute ``first``."""
        c = self._cache
        if first != p and a < p:  # sinks first (never dropped, handed down in order)
            e = min(b, p)
            # the model's own keys, never rotated ones (kept in _sk0 once rotated)
            sk = self._sk0 if self._rot and self._sk0 is not None else k
            c.hand_down(self.idx, a, sk[..., a:e, :], v[..., a:e, :])
            a = e
        if a < b:
            if a < first and first != p:
                raise AssertionError(f"layer {self.idx}: tokens [{a}, {first}) are in no tier")
            s = p + a - first  # = a when sinks and window are contiguous
            c.hand_down(self.idx, a, k[..., s:s + b - a, :], v[..., s:s + b - a, :])

    def flush_pending(self) -> None:
        """Queue the stored tokens not yet handed down (they stay on the device)."""
        if self.is_initialized and self.spilled < self.seen:
            keys, values = self._kv()
            self._hand_down(keys, values, self.pinned, self.window_start, self.spilled, self.seen)
            self.spilled = self.seen

    def prepend(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put ``k``/``v`` (the tokens just before the window) back in front of it (refill)."""
        p, (keys, values) = self.pinned, self._kv()
        self._install(torch.cat([keys[..., :p, :], k, keys[..., p:, :]], dim=-2),
                      torch.cat([values[..., :p, :], v, values[..., p:, :]], dim=-2))

    def drop_front(self, n: int) -> None:
        """Hand the ``n`` oldest window tokens to the warm tier and free them (between steps).

        The sinks stay: they are on the device for the session's life."""
        p = self.pinned
        n = min(n, self.stored - p)
        if n <= 0:
            return
        (keys, values), ws = self._kv(), self.window_start
        if self.spilled < ws + n:
            self._hand_down(keys, values, p, ws, self.spilled, ws + n)
            self.spilled = ws + n
        self._install(torch.cat([keys[..., :p, :], keys[..., p + n:, :]], dim=-2),
                      torch.cat([values[..., :p, :], values[..., p + n:, :]], dim=-2))

    def drop_all(self) -> None:
        """Free the whole storage (everything already handed down; between steps)."""
        if self.spilled < self.seen:
            raise AssertionError(f"layer {self.idx}: tokens [{self.spilled}, {self.seen}) not handed down")
        kb, vb = self._buffers()
        self._install(kb[..., :0, :].clone(), vb[..., :0, :].clone())
        self._rot, self._sk = 0, None  # the sinks come back as the model's own keys

    def release(self) -> None:
        """Forget the device tensors (the router dropped the session)."""
        self._install(None, None)
        self.recall_keys = self.recall_values = None
        self._sk = self._sv = self._sk0 = None
        self._rot = 0
        self.is_initialized = False

"""The hot tier: a transformers ``Cache`` that keeps a window of each layer's K/V on the device.

Owns one session's device-resident K/V, the bookkeeping of what has already been handed
down (``spilled`` per layer), round boundaries, the running summary of the open round,
recall and resume. Never writes to disk itself: bytes go to the warm tier through the
spill thread (:mod:`kvfs.torch.spill`); meta.json and summaries go the same ordered way.

Window semantics (``max_kv_len = W``; ``None`` = no window):

* Every forward step attends to the K/V *stored before the step* (at most ``W`` tokens per
  layer, plus recalled tokens, see below) followed by the step's own input tokens
  (causally). After the step the layer keeps the last ``W`` tokens; the ones that fall out
  are queued for the warm tier. A prompt longer than the window is therefore attended in
  full during its own prefill step (a cache cannot change the prefill mask), then the
  window applies.
* ``get_seq_length()`` is the number of tokens seen (it drives input slicing and position
  ids, so positions keep counting across turns); ``get_mask_sizes(q)`` is
  ``(recalled + stored + q, seen - stored - recalled)``.
* Tokens already copied below by :meth:`TieredCache.flush` are not appended again when they
  later fall out of the window (``spilled`` per layer).

Rounds: a round is the tokens processed between two :meth:`TieredCache.end_round` calls
(``[start, end)`` in meta.json). Note that ``generate`` does not feed its last sampled token
through the model, so that token is processed at the start of the next call and belongs to
the next round.

Recall (:meth:`TieredCache.recall`): the chosen closed rounds' tokens that are no longer in
the window are read back from the warm tier (exact bytes) and *prepended* to every layer's
window, in round order, for every step until the next ``end_round()`` (or
:meth:`TieredCache.clear_recall`). Their keys carry their original rotary positions; they are
copies (the window and ``spilled`` are unchanged) and a new ``recall`` replaces the previous
one.

Budget moves and refill: the router may move the oldest rounds of an idle session's window
(and its recalled copies) to the warm tier to stay under the device budget. Before that
session's next step (when the model asks ``get_mask_sizes``, i.e. before any layer runs)
the missing tail of the window and the recalled copies are read back, so what a step
attends never depends on the budget: only its latency does. A step that had to read from
the warm/cold tier first (refill, a fresh recall, the first step after resume) counts as a
hot miss; every other step is a hot hit.

Batch size is 1 per session (the layer file format has no batch dimension).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

from kvfs.ops import metrics
from kvfs.torch.fingerprint import (
    KVCorrupt,
    KVGeometry,
    build_meta,
    check_meta,
    dtype_name,
    fingerprint,
    geometry,
)
from kvfs.torch.layer import TieredLayer
from kvfs.torch.recall import query_summary, rank_rounds, read_spans, read_tokens, summarize_keys
from kvfs.torch.spill import Spiller

log = logging.getLogger("kvfs.torch.cache")


class TieredCache(Cache):
    """A windowed, tiered KV cache for one session (see the module docstring for semantics).

    Build it through :meth:`kvfs.torch.KVRouter.cache` (budget, shared spill thread), or
    directly: ``TieredCache(model, warm=WarmTier(...), session_id="s1", max_kv_len=24)``.
    ``warm=None`` gives a plain windowed cache whose dropped tokens are discarded.
    """

    def __init__(self, model_or_config: Any, *, session_id: str = "default", warm: Any = None,
                 max_kv_len: int | None = 24, spiller: Spiller | None = None, router: Any = None,
                 summary_dim: int = 128, dtype: torch.dtype | None = None) -> None:
        if max_kv_len is not None and max_kv_len < 1:
            raise ValueError(f"max_kv_len must be >= 1 or None, got {max_kv_len}")
        self.geo: KVGeometry = geometry(model_or_config, dtype)
        self.fingerprint = fingerprint(model_or_config)
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.geo.num_layers)])
        self.session_id = session_id
        self.warm = warm
        self.max_kv_len = max_kv_len
        self.num_layers = self.geo.num_layers
        self.summary_layer = self.num_layers - 1
        self.summary_dim = summary_dim
        self._router = router
        self._own_spiller = spiller is None and warm is not None
        self.spiller = spiller if spiller is not None else (Spiller(warm) if warm is not None else None)
        self.rounds: list[list[int]] = []
        self._round_start = 0
        self._round_sum: torch.Tensor | None = None
        self._round_keys: list[torch.Tensor] = []  # summary-layer keys not yet summed
        self._round_count = 0
        self.recalled_rounds: list[int] = []
        self._recall_spans: list[tuple[int, int]] = []
        self._miss_pending = False  # the next step had to read from below first
        self._closed = False
        # per-session statistics
        self.steps = 0
        self.hits = 0
        self.misses = 0
        self.spilled_tokens = 0  # layer-0 tokens handed down
        self.evicted_rounds = 0  # watermark moves of this session
        self.recalls = 0
        self.refills = 0  # windows read back after budget moves
        self._warned_discard = False

    # --- views -------------------------------------------------------------------------------
    @property
    def seen(self) -> int:
        return self.layers[0].seen

    @property
    def stored(self) -> int:
        return self.layers[0].stored

    @property
    def window_start(self) -> int:
        """First token on the device now (budget moves may have taken the window's front)."""
        return self.seen - self.stored

    @property
    def attended_start(self) -> int:
        """First token the next step attends in the window (what a refill restores)."""
        return 0 if self.max_kv_len is None else max(0, self.seen - self.max_kv_len)

    @property
    def hot_bytes(self) -> int:
        """Device bytes this session's K/V storage holds (window, its view slack, recall)."""
        lay = self.layers[0]
        return (lay.held + lay.recalled) * self.geo.session_token_bytes

    @property
    def device(self) -> torch.device | None:
        return getattr(self.layers[0], "device", None)

    def stats(self) -> dict[str, Any]:
        return {
            "seen": self.seen, "hot_tokens": self.stored, "recalled_tokens": self.layers[0].recalled,
            "hot_bytes": self.hot_bytes, "spilled_tokens": self.spilled_tokens,
            "rounds": len(self.rounds), "steps": self.steps, "hits": self.hits, "misses": self.misses,
            "hit_rate": self.hits / self.steps if self.steps else 1.0,
            "evicted_rounds": self.evicted_rounds, "recalls": self.recalls, "refills": self.refills,
            "recalled_rounds": list(self.recalled_rounds),
        }

    def __repr__(self) -> str:
        return (f"TieredCache(session={self.session_id!r}, seen={self.seen}, hot={self.stored}, "
                f"max_kv_len={self.max_kv_len}, rounds={len(self.rounds)})")

    # --- hooks called from the layers ---------------------------------------------------------
    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The model asks this once per forward, before any layer runs: refill first."""
        if layer_idx == 0:
            self._prepare_step()
        return super().get_mask_sizes(query_length, layer_idx)

    def _prepare_step(self) -> None:
        """Read back what budget moves took from the window (and recalled copies)."""
        lay0 = self.layers[0]
        if self.warm is None or not lay0.is_initialized:
            return
        want = self.seen if self.max_kv_len is None else min(self.seen, self.max_kv_len)
        missing = want - lay0.stored
        rec = self._recall_spans if self._recall_spans and lay0.recall_keys is None else []
        if missing <= 0 and not rec:
            return
        n_rec = sum(b - a for a, b in rec)
        if self._router is not None:
            self._router._reserve(self, (max(missing, 0) + n_rec) * self.geo.session_token_bytes)
        if self.spiller is not None:
            self.spiller.wait()
        dev = lay0.device
        if missing > 0:
            ws = self.window_start
            kv = read_spans(self.warm, self.session_id, self.geo, [(ws - missing, ws)], dev)
            for lay, (k, v) in zip(self.layers, kv, strict=True):
                lay.prepend(k, v)
            self.refills += 1
        if rec:
            self._materialize_recall(rec, dev)
        self._miss_pending = True
        if self._router is not None:
            self._router._account(self)

    def _step_begin(self, q: int) -> None:
        self.steps += 1
        if self._miss_pending:
            self._miss_pending = False
            self.misses += 1
            metrics.hot_misses.inc()
        else:
            self.hits += 1
            metrics.hot_hits.inc()
        if self._router is not None:
            self._router._before_step(self, q)

    def _step_end(self) -> None:
        if self._router is not None:
            self._router._after_step(self)

    def _spill(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer == 0:
            self.spilled_tokens += k.shape[-2]
        if self.spiller is None:
            if not self._warned_discard:
                log.info("session %r has no warm tier: tokens leaving the window are discarded",
                            self.session_id)
                self._warned_discard = True
            return
        self.spiller.submit_kv(self.session_id, layer, start * self.geo.token_bytes, k, v)

    def _accumulate(self, key_states: torch.Tensor) -> None:
        """Add a step's summary-layer keys to the open round (folded every 32 steps)."""
        self._round_keys.append(key_states)
        self._round_count += key_states.shape[-2]
        if len(self._round_keys) >= 32 or key_states.shape[-2] > 64:  # keep few refs alive
            self._fold()

    def _fold(self) -> None:
        if self._round_keys:
            s = torch.cat(self._round_keys, dim=-2)[0].float().sum(dim=1)  # [H, D]
            self._round_sum = s if self._round_sum is None else self._round_sum + s
            self._round_keys = []

    # --- rounds --------------------------------------------------------------------------------
    def current_summary(self) -> np.ndarray:
        """Summary vector of the open round so far (e.g. a new question: use it as a recall query)."""
        self._fold()
        if self._round_sum is None or self._round_count == 0:
            return np.zeros(self.summary_dim, np.float32)
        mean = (self._round_sum / self._round_count).reshape(1, -1).cpu().numpy()
        return summarize_keys(mean, self.summary_dim)

    def end_round(self) -> int | None:
        """Close the current round ``[start, seen)``; returns its index (None if it was empty).

        Queues its summary (``put_summary``) and a meta.json snapshot on the spill thread, and
        ends any active recall.
        """
        self.clear_recall()
        end = self.seen
        if end <= self._round_start:
            return None
        idx = len(self.rounds)
        self.rounds.append([self._round_start, end])
        summary = self.current_summary()
        self._round_start = end
        self._round_sum, self._round_keys, self._round_count = None, [], 0
        if self.spiller is not None:
            self.spiller.submit_call(self.warm.put_summary, self.session_id, idx, summary)
            self._queue_meta()
        metrics.update_hot_hit_rate()
        return idx

    def _queue_meta(self) -> int | None:
        """Queue a meta.json snapshot that claims only tokens already queued for appending."""
        if self.spiller is None:
            return None
        tokens = min(lay.spilled for lay in self.layers)
        rounds = [list(r) for r in self.rounds if r[1] <= tokens]
        meta = build_meta(self.fingerprint, self.geo, tokens, rounds)
        return self.spiller.submit_call(self.warm.put_meta, self.session_id, meta)

    def flush(self, wait: bool = True) -> None:
        """Copy the window's not-yet-stored tokens below and write meta.json (between steps).

        After ``flush()`` every token seen is in the warm tier; the window stays on the device.
        """
        if self.spiller is None:
            return
        for lay in self.layers:
            if lay.spilled < lay.seen and lay.is_initialized:
                off = lay.spilled - (lay.seen - lay.stored)
                self._spill(lay.idx, lay.spilled, lay.keys[..., off:, :], lay.values[..., off:, :])
                lay.spilled = lay.seen
        self._queue_meta()
        self.spiller.submit_call(self.warm.flush, self.session_id)
        if wait:
            self.spiller.wait()

    # --- recall --------------------------------------------------------------------------------
    def rank(self, query: torch.Tensor | np.ndarray) -> list[int]:
        """Closed rounds not fully in the window, by similarity of their summary to ``query``.

        ``query``: a summary vector (``[summary_dim]``), or keys/key-space vectors (see
        :func:`kvfs.torch.recall.query_summary`), e.g. ``cache.current_summary()``.
        """
        if self.warm is None:
            return []
        if self.spiller is not None:
            self.spiller.wait()
        summ = np.asarray(self.warm.summaries(self.session_id), np.float32)
        q = query_summary(query, self.geo, self.summary_dim)
        ws = self.attended_start
        among = [i for i, (a, _b) in enumerate(self.rounds) if a < ws and i < len(summ)]
        return rank_rounds(summ, q, among)

    def recall(self, rounds: list[int] | None = None, *, query: Any = None, k: int = 1) -> list[int]:
        """Bring closed rounds back into the attended window until the next ``end_round()``.

        ``rounds``: indices into :attr:`rounds`; or ``query`` (see :meth:`rank`) and ``k``:
        the ``k`` most similar rounds. Returns the rounds recalled (sorted). Only the part of
        a round that has left the window is read (the rest is still attended); the bytes
        come from the warm tier (or cold, through it) unchanged.
        """
        if self.warm is None:
            raise RuntimeError("recall needs a warm tier")
        if rounds is None:
            if query is None:
                raise ValueError("recall(rounds=[...]) or recall(query=..., k=...)")
            rounds = self.rank(query)[:k]
        for r in rounds:
            if not 0 <= r < len(self.rounds):
                raise IndexError(f"round {r} does not exist (session has {len(self.rounds)} closed rounds)")
        chosen = sorted(set(rounds))
        ws = self.attended_start  # not the device window: a refill brings that part back
        spans = [(self.rounds[r][0], min(self.rounds[r][1], ws)) for r in chosen]
        spans = [(a, b) for a, b in spans if b > a]
        self.clear_recall()
        if spans:
            if self._router is not None:
                need = sum(b - a for a, b in spans) * self.geo.session_token_bytes
                self._router._reserve(self, need)
            if self.spiller is not None:
                self.spiller.wait()  # everything below the window is readable
            self._materialize_recall(spans, self.device or torch.device("cpu"))
            self._recall_spans = spans
            self.recalled_rounds = chosen
            self._miss_pending = True
            if self._router is not None:
                self._router._account(self)
        self.recalls += 1
        return self.recalled_rounds

    def _materialize_recall(self, spans: list[tuple[int, int]], device: torch.device) -> None:
        per_layer = read_spans(self.warm, self.session_id, self.geo, spans, device)
        for lay, (k, v) in zip(self.layers, per_layer, strict=True):
            lay.recall_keys, lay.recall_values = k, v

    def clear_recall(self) -> None:
        """End the active recall (``end_round`` does this)."""
        for lay in self.layers:
            lay.recall_keys = lay.recall_values = None
        self.recalled_rounds = []
        self._recall_spans = []

    # --- moves out (router watermark) ----------------------------------------------------------
    def evict_oldest_round(self, min_tokens: int = 1) -> int:
        """Move the window's oldest round (at least ``min_tokens`` tokens) to the warm tier.

        Drops recalled copies first (they are read back, like the window, before the
        session's next step). Synchronous: returns after the bytes are in the warm tier.
        Returns the bytes freed on the device. Call between steps only.
        """
        before = self.hot_bytes
        if self.layers[0].recall_keys is not None:
            for lay in self.layers:
                lay.recall_keys = lay.recall_values = None
            return before - self.hot_bytes
        if self.stored == 0:
            return 0
        ws = self.window_start
        upto = next((b for a, b in self.rounds if b > ws), None)
        if upto is None or upto - ws < min_tokens:
            upto = max(upto or 0, ws + min_tokens)  # inside the open round: token-granular
        n = min(upto - ws, self.stored)
        for lay in self.layers:
            lay.drop_front(n)
        if self.spiller is not None:
            self.spiller.wait()
        self.evicted_rounds += 1
        return before - self.hot_bytes

    # --- resume ---------------------------------------------------------------------------------
    def load(self, device: torch.device | str = "cpu") -> TieredCache:
        """Rebuild this (empty) cache from the session's stored meta.json and layer files.

        Checks the fingerprint (:class:`KVMismatch`) and every layer's length
        (:class:`KVCorrupt`); layer bytes beyond meta.json's ``tokens`` (writes after the last
        meta snapshot) are truncated away. The window becomes the last ``max_kv_len`` tokens.
        """
        if self.warm is None:
            raise RuntimeError("resume needs a warm tier")
        sid = self.session_id
        meta = self.warm.get_meta(sid)
        if meta is None:
            raise KeyError(f"session {sid!r}: no meta.json in the warm or cold tier")
        check_meta(meta, self.fingerprint, self.geo, sid)
        tokens = meta["tokens"]
        tb = self.geo.token_bytes
        for layer in range(self.num_layers):
            have = self.warm.size(sid, layer)
            if have < tokens * tb:
                raise KVCorrupt(
                    f"session {sid!r} layer_{layer}: {have} bytes, meta.json says {tokens} tokens x "
                    f"{tb} B = {tokens * tb} B: the layer file is truncated")
            if have > tokens * tb:
                log.warning("session %r layer_%d: %d bytes past meta.json's %d tokens; truncating",
                            sid, layer, have - tokens * tb, tokens)
                self.warm.truncate(sid, layer, tokens * tb)
        start = 0 if self.max_kv_len is None else max(0, tokens - self.max_kv_len)
        # straight from where the bytes are: the window goes to the device, not to RAM first
        kv = read_spans(self.warm, sid, self.geo, [(start, tokens)], device, promote=False)
        for lay, (k, v) in zip(self.layers, kv, strict=True):
            lay.set_window(k, v, tokens)
        self.rounds = [list(r) for r in meta["rounds"]]
        self._round_start = self.rounds[-1][1] if self.rounds else 0
        if self._round_start < tokens:  # an open round: rebuild its running key sum
            k, _ = read_tokens(self.warm, sid, self.summary_layer, self.geo, self._round_start,
                               tokens, device, promote=False)
            self._accumulate(k)
        self._miss_pending = True  # the first step runs on a window read from below
        log.info("resumed session %r: %d tokens, %d rounds, %d hot (dtype %s)", sid, tokens,
                 len(self.rounds), tokens - start, dtype_name(self.geo.dtype))
        return self

    # --- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop this cache's own spill thread (if it has one) after draining it."""
        if self._closed:
            return
        self._closed = True
        if self._own_spiller and self.spiller is not None:
            self.spiller.close()

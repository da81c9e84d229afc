"""Budget moves, refill and resume of a :class:`~kvfs.torch.cache.TieredCache` (a mixin of it).

What the device holds of a session changes outside its steps in three ways: the router
moves the oldest rounds of an idle session (and, last, its sinks) to the warm tier to stay
under the device budget; before the session's next step the missing window and recalled
copies are read back (refill); and a stored session is rebuilt from its meta.json and
layer files (resume). Semantics in :mod:`kvfs.torch.cache`; separate from it because
these run between steps and wait on the spill thread, while the cache module holds the
per-step hooks and rounds. The attributes used here are the cache's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvfs.torch.fingerprint import dtype_name
from kvfs.torch.meta import reconcile
from kvfs.torch.meta import stored as stored_meta
from kvfs.torch.recall import read_spans, read_tokens

if TYPE_CHECKING:
    from kvfs.torch.cache import TieredCache

log = logging.getLogger("kvfs.torch.cache")  # resume messages are the cache's


class MovesMixin:
    """TieredCache's refill, budget-move and resume methods."""

    rounds: list[list[int]]
    _recall_spans: list[tuple[int, int]]

    # --- refill ---------------------------------------------------------------------------------
    def _prepare_step(self) -> None:
        """Read back what budget moves took from the window (and recalled copies)."""
        lay0 = self.layers[0]
        if self.warm is None or not lay0.is_initialized:
            self._check_refill = self.warm is not None  # nothing to read back without a warm tier
            return
        ws = self.window_start
        spans = [(0, min(self.sink_tokens, self.seen))] if self.sinks_moved else []
        if ws > self.attended_start:
            spans.append((self.attended_start, ws))
        missing = sum(b - a for a, b in spans)
        rec = self._recall_spans if self._recall_spans and lay0.recall_keys is None else []
        ret = self.retrieval is not None and self.retrieval.missing()
        if missing <= 0 and not rec and not ret:
            self._check_refill = False
            return
        n_rec = sum(b - a for a, b in rec) + (self.retrieval.attended_tokens if ret else 0)
        if self.router is not None:
            self.router.reserve(self, (missing + n_rec) * self.geo.session_token_bytes)
        if self.spiller is not None:
            self.spiller.wait()
        dev = lay0.device
        if missing > 0:
            kv = read_spans(self.warm, self.session_id, self.geo, spans, dev)
            for lay, (k, v) in zip(self.layers, kv, strict=True):
                lay.prepend(k, v)  # sinks moved: the storage was empty, this is sinks + window
            self.sinks_moved = False
            self.refills += 1
        if rec:
            self._materialize_recall(rec, dev)
        if ret:
            self.retrieval.refill()
        self._check_refill = False
        self._miss_pending = True
        if self.router is not None:
            self.router.account(self)

    # --- moves out (router watermark) ----------------------------------------------------------
    def evict_oldest_round(self, min_tokens: int = 1) -> int:
        """Move the window's oldest round (at least ``min_tokens`` tokens) to the warm tier.

        Drops recalled copies first (they are read back, like the window, before the
        session's next step). Synchronous: returns after the bytes are in the warm tier.
        Returns the bytes freed on the device. Call between steps only.
        """
        before = self.hot_bytes
        self._check_refill = True
        if self.layers[0].recall_keys is not None:
            for lay in self.layers:
                lay.recall_keys = lay.recall_values = None
            return before - self.hot_bytes
        if self.retrieval is not None and self.retrieval.release_device():
            return before - self.hot_bytes
        movable = self.stored - self.sinks  # the sinks stay on the device
        if movable <= 0:
            return 0
        ws = self.window_start
        upto = next((b for a, b in self.rounds if b > ws), None)
        if upto is None or upto - ws < min_tokens:
            upto = max(upto or 0, ws + min_tokens)  # inside the open round: token-granular
        n = min(upto - ws, movable)
        for lay in self.layers:
            lay.drop_front(n)
        if self.spiller is not None:
            self.spiller.wait()
        self.evicted_rounds += 1
        return before - self.hot_bytes

    def evict_sinks(self) -> int:
        """Move the sinks to the warm tier: the budget's last resort once no window token of
        any session is left to move. Read back before the session's next step. Returns the
        bytes freed. Call between steps, after :meth:`evict_oldest_round` returned 0."""
        if self.sinks_moved or self.sinks == 0 or self.stored != self.sinks:
            return 0
        before = self.hot_bytes
        self._check_refill = True
        for lay in self.layers:
            lay.flush_pending()
            lay.drop_all()
        self.sinks_moved = True
        if self.spiller is not None:
            self.spiller.wait()
        self.evicted_rounds += 1
        return before - self.hot_bytes

    # --- resume ---------------------------------------------------------------------------------
    def load(self, device: torch.device | str = "cpu") -> TieredCache:
        """Rebuild this (empty) cache from the session's stored meta.json and layer files.

        Checks meta.json field by field and the fingerprint (:class:`KVMismatch`), and every
        layer's length (:class:`KVCorrupt`); layer bytes beyond meta.json's ``tokens`` are
        cut only as a crash tail (:func:`kvfs.torch.meta.reconcile`). The device holds the sinks and the last ``max_kv_len``
        tokens again.
        """
        if self.warm is None:
            raise RuntimeError("resume needs a warm tier")
        sid = self.session_id
        meta = stored_meta(self.warm, sid)  # bounded and checked field by field
        if meta is None:
            raise KeyError(f"session {sid!r}: no meta.json in the warm or cold tier")
        # against the model and the files; only a crash tail is cut (kvfs.torch.meta)
        tokens = reconcile(self.warm, sid, meta, self.fingerprint, self.geo, self.num_layers)
        sinks = min(self.sink_tokens, tokens)
        start = self.window_from(tokens)
        spans = [(0, tokens)] if start <= sinks else [(0, sinks), (start, tokens)]
        # straight from where the bytes are: the window goes to the device, not to RAM first
        kv = read_spans(self.warm, sid, self.geo, spans, device, promote=False, checked=True)
        for lay, (k, v) in zip(self.layers, kv, strict=True):
            lay.set_window(k, v, tokens)
        if self.retrieval is not None:  # bounds of the blocks before the window, chosen blocks
            self.retrieval.load(meta, tokens, start, device)
        self.rounds = [list(r) for r in meta["rounds"]]
        self._round_start = self.rounds[-1][1] if self.rounds else 0
        if self._round_start < tokens:  # an open round: rebuild its running key sum
            k, _ = read_tokens(self.warm, sid, self.summary_layer, self.geo, self._round_start,
                               tokens, device, promote=False, checked=True)
            self._accumulate(k, -1)
        self._miss_pending = True  # the first step runs on a window read from below
        self._check_refill = True
        log.info("resumed session %r: %d tokens, %d rounds, %d hot (dtype %s)", sid, tokens,
                 len(self.rounds), self.stored, dtype_name(self.geo.dtype))
        return self

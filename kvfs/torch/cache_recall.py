"""Recall and re-rotation of a :class:`~kvfs.torch.cache.TieredCache` (a mixin of it).

Recall brings closed rounds that left the window back into attention, from the warm tier,
until the next ``end_round()`` (semantics in :mod:`kvfs.torch.cache`). Re-rotation
(``rope_rerotate``) decides how far the sinks' keys, and recalled copies with them, move
toward the query: :meth:`RecallMixin.sink_shift_for` is the one rule, a function of the
window alone, so a resumed or forked session rotates exactly as one that never stopped.
The attributes used here are the cache's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvfs.torch.recall import query_summary, rank_rounds, read_spans


class RecallMixin:
    """TieredCache's recall and re-rotation methods."""

    rounds: list[list[int]]
    recall_shifts: list[int]
    recalled_rounds: list[int]
    _recall_spans: list[tuple[int, int]]

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
        among = [i for i in range(min(len(self.rounds), len(summ))) if self._unattended(i)]
        return rank_rounds(summ, q, among)

    def _unattended(self, r: int) -> tuple[int, int] | None:
        """The part of closed round ``r`` outside the sinks and the window (None: none)."""
        a, b = self.rounds[r]
        a, b = max(a, min(self.sink_tokens, self.seen)), min(b, self.attended_start)
        return (a, b) if b > a else None

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
        # not the device window: a refill brings that part back
        spans = [sp for sp in (self._unattended(r) for r in chosen) if sp is not None]
        self.clear_recall()
        if spans:
            if self.router is not None:
                need = sum(b - a for a, b in spans) * self.geo.session_token_bytes
                self.router.reserve(self, need)
            if self.spiller is not None:
                self.spiller.wait()  # everything below the window is readable
            self.recall_shifts = self._recall_shifts(spans)
            self._materialize_recall(spans, self.device or torch.device("cpu"))
            self._recall_spans = spans
            self.recalled_rounds = chosen
            self._miss_pending = True
            if self.router is not None:
                self.router.account(self)
        self.recalls += 1
        return self.recalled_rounds

    def _auto_recall(self, query: torch.Tensor) -> None:
        """Recall the ``recall_rounds`` rounds most similar to ``query`` (between steps)."""
        ranked = self.rank(query)
        chosen = ranked[: self.recall_rounds]
        if self.router is not None:  # within the budget: fewer rounds rather than none fitting
            while chosen and not self.router.has_room(self, sum(
                    b - a for a, b in (self._unattended(r) or (0, 0) for r in chosen))
                    * self.geo.session_token_bytes):
                chosen = chosen[:-1]
        if chosen:
            self.recall(rounds=chosen)
            self.auto_recalls += 1

    def _materialize_recall(self, spans: list[tuple[int, int]], device: torch.device) -> None:
        per_layer = read_spans(self.warm, self.session_id, self.geo, spans, device)
        if any(self.recall_shifts):  # each span moved by its shift (rope_rerotate)
            per_layer = [(self._rotate_spans(k, spans), v) for k, v in per_layer]
        for lay, (k, v) in zip(self.layers, per_layer, strict=True):
            lay.recall_keys, lay.recall_values = k, v

    def _rotate_spans(self, k: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        parts, off = [], 0
        for (a, b), shift in zip(spans, self.recall_shifts, strict=True):
            part = k[..., off:off + b - a, :]
            parts.append(self.rope.rotate(part, shift) if shift else part)
            off += b - a
        return torch.cat(parts, dim=-2)

    # --- re-rotation ---------------------------------------------------------------------------
    def sink_shift_for(self, window_start: int, sinks: int) -> int:
        """Positions the sinks' keys move for a step whose window starts at ``window_start``
        (a function of the window alone: resumed and forked sessions rotate alike).

        ``window``: just before the window, ``window_start - sinks`` rounded down to a
        multiple of ``rope_quantum``. ``reach``: not at all while the sinks are within
        ``rope_reach`` positions of the query, then only as far as keeps them there (rounded
        up), never past the window."""
        qn, room = self.rope_quantum, window_start - sinks
        if self.rope_mode == "window" or self.rope_reach is None:
            return room // qn * qn
        need = window_start + (self.max_kv_len or 0) - self.rope_reach
        return 0 if need <= 0 else min(-(-need // qn) * qn, room // qn * qn)

    def _recall_shifts(self, spans: list[tuple[int, int]]) -> list[int]:
        """Per recalled span, the positions its keys move (0 without re-rotation)."""
        if self.rope is None:
            return [0] * len(spans)
        ws, p = self.attended_start, min(self.sink_tokens, self.seen)
        if self.rope_mode == "window" or self.rope_reach is None:  # end where the sinks begin
            at, out = ws - p - sum(b - a for a, b in spans), []
            for a, b in spans:
                out.append(at - a)
                at += b - a
            return out
        t = self.sink_shift_for(ws, p)  # with the sinks, never past the window
        return [max(0, min(t, ws - b)) for a, b in spans]

    def clear_recall(self) -> None:
        """End the active recall (``end_round`` does this)."""
        for lay in self.layers:
            lay.recall_keys = lay.recall_values = None
        self.recalled_rounds = []
        self._recall_spans = []

"""Recall: closed rounds that left the window brought back into attention, from the warm tier.

Owns one session's active recall -- the rounds, their token spans, each span's rotation
(``rope_rerotate``) -- and the automatic recall's pending query; until the next
``end_round()`` every layer attends the recalled copies between the sinks and the window
(semantics in :mod:`kvfs.torch.cache`). What it needs of the cache is :class:`RecallHost`;
it never imports the cache.

Recall (:meth:`TieredCache.recall`): the chosen closed rounds' tokens that are no longer
attended (outside the sinks and the window) are read back from the warm tier (exact bytes)
and attended between the sinks and the window, in round order, for every step until the
next ``end_round()`` (or :meth:`TieredCache.clear_recall`). Their keys carry their original
rotary positions (with ``rope_rerotate``: moved to end where the sinks begin); they
are copies (the window and ``spilled`` are unchanged) and a new ``recall`` replaces the
previous one.

Automatic recall (``auto_recall=True``, ``recall_rounds = k``): at the first step of each
new round the keys of that step's input (summary layer) rank the older rounds by their
summaries (:meth:`TieredCache.rank`) and the top ``k`` are recalled for the rest of the
round, within the router's device budget (fewer rounds when they would not fit). The first
step itself attends without them (its attention mask is built before any layer runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from kvfs.torch.blocks import BlockLayout
from kvfs.torch.layer import TieredLayer
from kvfs.torch.recall import query_summary, rank_rounds, read_spans
from kvfs.torch.rotation import SinkRotation
from kvfs.torch.seams import BudgetedCache, CacheRouter, WarmStore
from kvfs.torch.spill import Spiller

Span = tuple[int, int]


class RecallHost(BudgetedCache, Protocol):
    """What recall reads and asks of its cache."""

    summary_dim: int
    sink_tokens: int
    rotation: SinkRotation

    @property
    def warm(self) -> WarmStore | None: ...
    @property
    def spiller(self) -> Spiller | None: ...
    @property
    def router(self) -> CacheRouter | None: ...
    @property
    def tiered(self) -> Sequence[TieredLayer]: ...
    @property
    def rounds(self) -> list[list[int]]: ...
    @property
    def seen(self) -> int: ...
    @property
    def attended_start(self) -> int: ...
    @property
    def device(self) -> torch.device | None: ...
    def miss_next(self) -> None: ...


class Recall:
    """One session's recall (module docstring)."""

    def __init__(self, host: RecallHost) -> None:
        self.host = host
        self.rounds: list[int] = []  # the rounds recalled, sorted
        self.spans: list[Span] = []  # their parts outside the sinks and the window
        self.shifts: list[int] = []  # per span, positions its keys moved
        self.query: torch.Tensor | None = None  # the automatic recall's, taken at step end
        self.recalls = 0
        self.auto_recalls = 0

    @property
    def active(self) -> bool:
        return bool(self.spans)

    def rank(self, query: torch.Tensor | np.ndarray) -> list[int]:
        """Closed rounds not fully in the window, by similarity of their summary to ``query``.

        ``query``: a summary vector (``[summary_dim]``), or keys/key-space vectors (see
        :func:`kvfs.torch.recall.query_summary`), e.g. ``cache.current_summary()``.
        """
        h = self.host
        if h.warm is None:
            return []
        if h.spiller is not None:
            h.spiller.wait()
        summ = np.asarray(h.warm.summaries(h.session_id), np.float32)
        q = query_summary(query, h.geo, h.summary_dim)
        among = [i for i in range(min(len(h.rounds), len(summ))) if self.unattended(i)]
        return rank_rounds(summ, q, among)

    def unattended(self, r: int) -> Span | None:
        """The part of closed round ``r`` outside the sinks and the window (None: none)."""
        h = self.host
        a, b = h.rounds[r]
        a, b = max(a, min(h.sink_tokens, h.seen)), min(b, h.attended_start)
        return (a, b) if b > a else None

    def recall(self, rounds: list[int] | None = None, *, query: Any = None, k: int = 1) -> list[int]:
        """Bring closed rounds back into the attended window until the next ``end_round()``.

        ``rounds``: indices into the closed rounds; or ``query`` (see :meth:`rank`) and ``k``:
        the ``k`` most similar rounds. Returns the rounds recalled (sorted). Only the part of
        a round that has left the window is read (the rest is still attended); the bytes
        come from the warm tier (or cold, through it) unchanged.
        """
        h = self.host
        if h.warm is None:
            raise RuntimeError("recall needs a warm tier")
        if rounds is None:
            if query is None:
                raise ValueError("recall(rounds=[...]) or recall(query=..., k=...)")
            rounds = self.rank(query)[:k]
        for r in rounds:
            if not 0 <= r < len(h.rounds):
                raise IndexError(f"round {r} does not exist (session has {len(h.rounds)} closed rounds)")
        chosen = sorted(set(rounds))
        # not the device window: a refill brings that part back
        spans = [sp for sp in (self.unattended(r) for r in chosen) if sp is not None]
        self.clear()
        if spans:
            if h.router is not None:
                h.router.reserve(h, sum(b - a for a, b in spans) * h.geo.session_token_bytes)
            if h.spiller is not None:
                h.spiller.wait()  # everything below the window is readable
            self.shifts = h.rotation.span_shifts(spans, h.attended_start, min(h.sink_tokens, h.seen))
            self.materialize(spans, h.device or torch.device("cpu"))
            self.spans = spans
            self.rounds = chosen
            h.miss_next()
            if h.router is not None:
                h.router.account(h)
        self.recalls += 1
        return self.rounds

    def auto(self, query: torch.Tensor, k: int) -> None:
        """Recall the ``k`` rounds most similar to ``query`` (between steps), fewer when they
        would not fit the router's budget."""
        h = self.host
        chosen = self.rank(query)[:k]
        if h.router is not None:  # within the budget: fewer rounds rather than none fitting
            while chosen and not h.router.has_room(h, sum(
                    b - a for a, b in (self.unattended(r) or (0, 0) for r in chosen))
                    * h.geo.session_token_bytes):
                chosen = chosen[:-1]
        if chosen:
            self.recall(rounds=chosen)
            self.auto_recalls += 1

    def materialize(self, spans: list[Span], device: torch.device) -> None:
        """Read ``spans`` of every layer from below and make them the recalled copies."""
        h = self.host
        assert h.warm is not None  # a recall needs a warm tier
        per_layer = read_spans(h.warm, h.session_id, h.geo, spans, device)
        for lay, (k, v) in zip(h.tiered, per_layer, strict=True):
            lay.recall_keys, lay.recall_values = h.rotation.rotate_spans(k, spans, self.shifts), v

    def missing(self) -> list[Span]:
        """The spans to read back before the next step (the budget took the copies)."""
        return self.spans if self.spans and self.host.tiered[0].recall_keys is None else []

    def drop_copies(self) -> bool:
        """Free the recalled copies (read back before the next step); whether there were any."""
        layers = self.host.tiered
        if layers[0].recall_keys is None:
            return False
        for lay in layers:
            lay.recall_keys = lay.recall_values = None
        return True

    def clear(self) -> None:
        """End the active recall."""
        for lay in self.host.tiered:
            lay.recall_keys = lay.recall_values = None
        self.rounds = []
        self.spans = []

    def blocks(self, layout: BlockLayout) -> set[int]:
        """Blocks that overlap the active recall (retrieval leaves them to it)."""
        out: set[int] = set()
        o, n = layout.origin, layout.block
        for a, b in self.spans:
            out.update(range(max(0, (a - o) // n), -(-(b - o) // n)))
        return out

    def copy_to(self, other: Recall) -> None:
        """Give ``other`` (a fork's, whose layers got copies of the recalled tensors) this
        recall's rounds, spans and shifts."""
        other.spans = list(self.spans)
        other.shifts = list(self.shifts)
        other.rounds = list(self.rounds)

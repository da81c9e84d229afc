"""The router's device budget: the watermark checks around every step and the moves out.

Split from router.py, which maps sessions to caches and owns their lifetimes; this is
only the policy that keeps their device bytes under the line. A mixin of
:class:`~kvfs.torch.router.KVRouter`, whose attributes (``budget``, ``watermark``,
``hot_total``, ``_sessions``, ...) it uses.

Budget (checked at every forward step of every session):

* CPU: the K/V bytes the router's caches hold (window storage + recalled copies, counted
  exactly from tensor sizes) against ``watermark * device_budget_bytes``. With no budget,
  nothing is enforced.
* CUDA: ``torch.cuda.memory_reserved()`` against ``watermark * budget`` (budget = the
  device's total memory unless given). The caching allocator never shrinks on its own and
  ``torch.cuda.empty_cache()`` is never called: rounds are moved out until the *allocated*
  bytes leave room for the step, so freed blocks are reused and ``memory_reserved`` stops
  growing.

Before a step, room for the step's growth (and for reading back what earlier moves took
from this session, see "refill" in :mod:`kvfs.torch.cache`) is made by moving rounds of
*other* sessions (a session cannot shrink mid-step: its attention mask is already built).
After the step the budget is enforced over all sessions, the stepping one last (it is the
most recent). Moves are synchronous: they return once the bytes are in the warm tier.
Moves change what is on the device, never what a step attends. Moves take window tokens
(and recalled copies); a session's sinks stay on the device unless no window token of any
session is left to move, and are then read back, like the window, before its next step.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from kvfs.ops import metrics

if TYPE_CHECKING:
    from kvfs.torch.cache import TieredCache

log = logging.getLogger("kvfs.torch.router")  # budget messages are the router's


class BudgetMixin:
    """KVRouter's budget methods: limit, account, before_step / reserve / has_room /
    after_step (called by the caches), device_usage_ratio and the moves out."""

    budget: int | None
    watermark: float
    device: torch.device
    hot_total: int
    peak_hot_bytes: int
    watermark_moves: int
    move_ms_total: float
    _cuda: bool
    _sessions: OrderedDict[str, TieredCache]
    _accounted: dict[str, int]

    @property
    def limit(self) -> float | None:
        return None if self.budget is None else self.watermark * self.budget

    def account(self, c: TieredCache) -> None:
        """Record ``c``'s device bytes now (called by the cache after it changed them)."""
        now = c.hot_bytes
        self.hot_total += now - self._accounted.get(c.session_id, 0)
        self._accounted[c.session_id] = now
        if self.hot_total > self.peak_hot_bytes:  # every change is seen, corrections included
            self.peak_hot_bytes = self.hot_total

    def _pressure(self, extra: int) -> bool:
        lim = self.limit
        if lim is None:
            return False
        if self._cuda:
            alloc = torch.cuda.memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            # over the line now, or the step would have to grow the reserved pool past it
            return alloc + extra > lim or (reserved + extra > lim and reserved - alloc < extra)
        return self.hot_total + extra > lim

    def _tokens_needed(self, c: TieredCache, extra: int) -> int:
        """Tokens of ``c`` whose move would bring usage under the line (at least 1)."""
        lim = self.limit or 0.0
        used = torch.cuda.memory_allocated(self.device) if self._cuda else self.hot_total
        over = used + extra - lim
        return max(1, -(-int(over) // c.geo.session_token_bytes))

    def before_step(self, c: TieredCache, q: int) -> None:
        """Make room for ``c``'s step of ``q`` tokens (called by the cache's first layer)."""
        self._sessions.move_to_end(c.session_id)
        if self.limit is None:
            return
        lay = c.layers[0]
        extra = max(0, lay.held_after(q) - lay.held) * c.geo.session_token_bytes
        if c.retrieval is not None:  # blocks chosen, leaving the window, their bounds
            extra += c.retrieval.step_growth(q)
        if self._pressure(extra):
            self._move_out(extra, exclude=c)

    def reserve(self, c: TieredCache, extra: int) -> None:
        """Make room for ``extra`` bytes ``c`` is about to read back (refill, recall)."""
        if self.limit is not None and self._pressure(extra):
            self._move_out(extra, exclude=c)

    def has_room(self, c: TieredCache, extra: int) -> bool:
        """Whether ``c`` can grow by ``extra`` bytes within the budget (others moved out)."""
        lim = self.limit
        return lim is None or c.hot_bytes + extra <= lim

    def after_step(self, c: TieredCache) -> None:
        """Account ``c``'s step and enforce the budget (called by the cache's last layer)."""
        self.account(c)
        if self.limit is not None and self._pressure(0):
            self._move_out(0, exclude=None)
        metrics.hot_bytes.set(self.hot_total)
        metrics.hot_device_usage.set(self.device_usage_ratio())

    def device_usage_ratio(self) -> float:
        """Device memory reserved (CUDA) or hot bytes (CPU) over the budget; 0 without one."""
        if not self.budget:
            return 0.0
        used = torch.cuda.memory_reserved(self.device) if self._cuda else self.hot_total
        return used / self.budget

    def _move_out(self, extra: int, exclude: TieredCache | None) -> None:
        """Move the oldest round of the least recently used sessions out until under the line."""
        t0 = time.perf_counter()
        moved = 0
        progress = True
        while progress and self._pressure(extra):
            progress = False
            for c in list(self._sessions.values()):  # LRU first, round-robin one round each
                if c is exclude or c.hot_bytes == 0:
                    continue
                if c.evict_oldest_round(min_tokens=self._tokens_needed(c, extra)) > 0:
                    progress = True
                    moved += 1
                    self.account(c)
                    metrics.hot_watermark_moves.inc()
                if not self._pressure(extra):
                    break
        if self._pressure(extra):  # last resort: the sinks of idle sessions (LRU first)
            for c in list(self._sessions.values()):
                if c is not exclude and c.evict_sinks() > 0:
                    moved += 1
                    self.account(c)
                    metrics.hot_watermark_moves.inc()
                    if not self._pressure(extra):
                        break
        if moved:
            ms = (time.perf_counter() - t0) * 1e3
            self.watermark_moves += moved
            self.move_ms_total += ms
            metrics.hot_sessions.set(self.hot_session_count())
            log.debug("watermark: moved %d rounds out in %.2f ms (hot %d B)", moved, ms, self.hot_total)
        if self._pressure(extra):
            log.warning("device budget: nothing left to move out (hot %d B, extra %d B, limit %s)",
                        self.hot_total, extra, self.limit)

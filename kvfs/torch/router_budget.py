"""The router's device budget: the watermark checks around every step and the moves out.

Split from router.py, which maps sessions to caches and owns their lifetimes; this is
only the policy that keeps their device bytes under the line: :class:`HotBudget`, a part
of :class:`~kvfs.torch.router.KVRouter` that owns the line (budget, watermark), the bytes
accounted per session, their total and peak and the move counters. It reads the router's
sessions (least recently used first) and moves their bytes through the caches' own calls
(:class:`~kvfs.torch.seams.BudgetedCache`); it never imports the router or the cache.

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
(and recalled copies, and retrieved blocks); once no window token of any session is left to
move, the representatives retrieval scores old blocks by (rebuilt from the stored keys) and
then the sinks of idle sessions go too, and are read back, like the window, before their
session's next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import torch

from kvfs.ops import metrics
from kvfs.torch.seams import BudgetedCache

log = logging.getLogger("kvfs.torch.router")  # budget messages are the router's


class HotBudget:
    """The device budget of a router's sessions (module docstring): ``limit``, ``account``,
    ``before_step`` / ``reserve`` / ``has_room`` / ``after_step`` (what the caches call,
    through the router), ``usage_ratio`` and ``move_out``."""

    def __init__(self, sessions: Mapping[str, BudgetedCache], budget: int | None,
                 watermark: float, device: torch.device) -> None:
        if not 0 < watermark <= 1:
            raise ValueError(f"watermark must be in (0, 1], got {watermark}")
        self.sessions = sessions  # the router's, least recently used first (read only here)
        self.budget = budget
        self.watermark = watermark
        self.device = device
        self.cuda = device.type == "cuda"
        self.hot_total = 0
        self.peak_hot_bytes = 0
        self.watermark_moves = 0
        self.move_ms_total = 0.0
        self._accounted: dict[str, int] = {}

    @property
    def limit(self) -> float | None:
        return None if self.budget is None else self.watermark * self.budget

    def account(self, c: BudgetedCache) -> None:
        """Record ``c``'s device bytes now (called by the cache after it changed them)."""
        now = c.hot_bytes
        self.hot_total += now - self._accounted.get(c.session_id, 0)
        self._accounted[c.session_id] = now
        if self.hot_total > self.peak_hot_bytes:  # every change is seen, corrections included
            self.peak_hot_bytes = self.hot_total

    def register(self, c: BudgetedCache) -> None:
        """A session joined the device: account its bytes from nothing."""
        self._accounted[c.session_id] = 0
        self.account(c)

    def forget(self, sid: str) -> None:
        """The session left the device: its bytes leave the total."""
        self.hot_total -= self._accounted.pop(sid, 0)

    def hot_sessions(self) -> int:
        """Sessions holding device bytes."""
        return sum(1 for c in self.sessions.values() if c.hot_bytes > 0)

    def _pressure(self, extra: int) -> bool:
        lim = self.limit
        if lim is None:
            return False
        if self.cuda:
            alloc = torch.cuda.memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            # over the line now, or the step would have to grow the reserved pool past it
            return alloc + extra > lim or (reserved + extra > lim and reserved - alloc < extra)
        return self.hot_total + extra > lim

    def _tokens_needed(self, c: BudgetedCache, extra: int) -> int:
        """Tokens of ``c`` whose move would bring usage under the line (at least 1)."""
        lim = self.limit or 0.0
        used = torch.cuda.memory_allocated(self.device) if self.cuda else self.hot_total
        over = used + extra - lim
        return max(1, -(-int(over) // c.geo.session_token_bytes))

    def before_step(self, c: BudgetedCache, q: int) -> None:
        """Make room for ``c``'s step of ``q`` tokens (called by the cache's first layer)."""
        if self.limit is None:
            return
        extra = c.step_growth(q)
        if self._pressure(extra):
            self.move_out(extra, exclude=c)

    def reserve(self, c: BudgetedCache, extra: int) -> None:
        """Make room for ``extra`` bytes ``c`` is about to read back (refill, recall)."""
        if self.limit is not None and self._pressure(extra):
            self.move_out(extra, exclude=c)

    def has_room(self, c: BudgetedCache, extra: int) -> bool:
        """Whether ``c`` can grow by ``extra`` bytes within the budget (others moved out)."""
        lim = self.limit
        return lim is None or c.hot_bytes + extra <= lim

    def after_step(self, c: BudgetedCache) -> None:
        """Account ``c``'s step and enforce the budget (called by the cache's last layer)."""
        self.account(c)
        if self.limit is not None and self._pressure(0):
            self.move_out(0, exclude=None)
        metrics.hot_bytes.set(self.hot_total)
        metrics.hot_device_usage.set(self.usage_ratio())

    def usage_ratio(self) -> float:
        """Device memory reserved (CUDA) or hot bytes (CPU) over the budget; 0 without one."""
        if not self.budget:
            return 0.0
        used = torch.cuda.memory_reserved(self.device) if self.cuda else self.hot_total
        return used / self.budget

    def move_out(self, extra: int, exclude: BudgetedCache | None = None) -> None:
        """Move the oldest round of the least recently used sessions out until ``extra``
        more bytes fit under the line (``exclude``: a session that cannot shrink now)."""
        t0 = time.perf_counter()
        moved = 0
        progress = True
        while progress and self._pressure(extra):
            progress = False
            for c in list(self.sessions.values()):  # LRU first, round-robin one round each
                if c is exclude or c.hot_bytes == 0:
                    continue
                if c.evict_oldest_round(min_tokens=self._tokens_needed(c, extra)) > 0:
                    progress = True
                    moved += 1
                    self.account(c)
                    metrics.hot_watermark_moves.inc()
                if not self._pressure(extra):
                    break
        # last resorts, LRU first: the retrieval representatives of idle sessions (rebuilt
        # from the stored keys before their next step), then their sinks
        last: tuple[Callable[[BudgetedCache], int], ...] = (lambda c: c.evict_reps(),
                                                           lambda c: c.evict_sinks())
        for evict in last:
            if not self._pressure(extra):
                break
            for c in list(self.sessions.values()):
                if c is not exclude and evict(c) > 0:
                    moved += 1
                    self.account(c)
                    metrics.hot_watermark_moves.inc()
                    if not self._pressure(extra):
                        break
        if moved:
            ms = (time.perf_counter() - t0) * 1e3
            self.watermark_moves += moved
            self.move_ms_total += ms
            metrics.hot_sessions.set(self.hot_sessions())
            log.debug("watermark: moved %d rounds out in %.2f ms (hot %d B)", moved, ms, self.hot_total)
        if self._pressure(extra):
            log.warning("device budget: nothing left to move out (hot %d B, extra %d B, limit %s)",
                        self.hot_total, extra, self.limit)

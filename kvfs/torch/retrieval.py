"""Retrieval of old KV by relevance: one session's blocks, their bounds and the attended set.

Owns, for one :class:`~kvfs.torch.cache.TieredCache`: the key bounds of every block that
has left the window (on the device, per layer, :mod:`kvfs.torch.blocks`), the blocks each
layer attends, their K/V on the device, the fetches that bring newly chosen blocks up from
the warm tier, the ``key_bounds`` side stream (appended in the spill thread's order, checked
and completed on resume) and the ``retrieval`` entry of ``meta.json``.

The rule (deterministic: a function of the tokens alone, never of timing):

* With retrieval the window reaches back to the start of its block (``block`` tokens from
  ``origin`` = the sinks): blocks leave it whole, and each block's bounds are computed then.
* Step ``t`` of layer ``l`` attends the sinks, the blocks chosen for it, the window and the
  step's input. After the attention of layer ``l`` at step ``t`` its queries rank every block
  that has left the window (:func:`~kvfs.torch.blocks.block_scores`); the top
  ``min(attend, blocks)`` are the blocks of step ``t + 1``. So the choice of a step runs
  ahead of the step that attends it: blocks already on the device are kept, the others are
  read from the warm tier (or the mount through it) on a reader thread while the rest of
  the step and the sampling run, and the next step waits only for what is still missing.
* Every layer attends the same number of blocks, known before a step starts (its attention
  mask is built before any layer runs).
* The choice for the step after the last one is saved in ``meta.json`` (``retrieval``) when
  every token is stored, so a resumed or forked session attends what the live one would.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kvfs.torch import attention
from kvfs.torch.blocks import STREAM, BlockLayout, block_scores, bounds_of_keys
from kvfs.torch.fingerprint import KVUnsupported
from kvfs.torch.recall import layer_pool, read_tokens

if TYPE_CHECKING:
    from kvfs.torch.cache import TieredCache

log = logging.getLogger("kvfs.torch.retrieval")

#: blocks that just left the window kept on the device per layer: recent blocks are the ones
#: most often chosen next, and their bytes may still be on their way to the warm tier
FRESH_BLOCKS = 2


class Retrieval:
    """One session's retrieval state (see the module docstring)."""

    def __init__(self, cache: TieredCache, block: int, attend: int) -> None:
        if block < 1 or attend < 1:
            raise ValueError(f"retrieval needs block >= 1 and at least one block attended, got "
                             f"block={block}, attend={attend}")
        self.c = cache
        self.layout = BlockLayout(int(block), cache.sink_tokens, cache.geo)
        self.block = int(block)
        self.attend = int(attend)
        n = cache.num_layers
        self.count = [0] * n  # blocks with bounds (left the window), per layer
        self._bounds: list[torch.Tensor | None] = [None] * n  # [capacity, H, 2, D]
        self.chosen: list[tuple[int, ...]] = [()] * n  # blocks of the next step, ascending
        self._kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n  # of ``chosen``
        self._pending: list[tuple[dict, Future] | None] = [None] * n
        self._fresh: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(n)]
        self.written = 0  # blocks whose record is queued to the side stream
        self._observed = -1  # layers that reported their queries this step (-1: no step yet)
        # statistics
        self.fetched_blocks = 0
        self.fetch_waits = 0  # steps that had to wait for a read still running
        self.fetch_wait_s = 0.0
        self.backfilled_blocks = 0

    # --- views ------------------------------------------------------------------------------
    @property
    def attended_tokens(self) -> int:
        """Retrieved tokens every layer attends in the next step."""
        return len(self.chosen[0]) * self.block

    @property
    def device_bytes(self) -> int:
        it = self.c.geo.itemsize
        n = sum(b.numel() for b in self._bounds if b is not None) * it
        n += sum(k.numel() + v.numel() for kv in self._kv if kv is not None for k, v in (kv,)) * it
        n += sum(k.numel() + v.numel() for f in self._fresh for k, v in f.values()) * it
        return n

    def step_growth(self, q: int) -> int:
        """Device bytes a step of ``q`` tokens may add at most: the chosen blocks' K/V (one
        layer's rebuilt beside its old ones at a time), the blocks leaving the window kept
        fresh, their bounds."""
        c, blk = self.c, self.block
        leaving = (c.window_from(c.seen + q) - c.window_from(c.seen)) // blk
        stb = c.geo.session_token_bytes
        now = sum(k.shape[-2] for kv in self._kv[:1] if kv is not None for k in kv[:1])
        kv = max(0, min(self.attend, self.count[0] + leaving) * blk - now) * stb
        fresh = max(0, min(FRESH_BLOCKS, len(self._fresh[0]) + leaving) - len(self._fresh[0])) * blk * stb
        cap = 0 if self._bounds[0] is None else self._bounds[0].shape[0]
        need = self.count[0] + leaving
        grown = need + max(8, need // 4) - cap if need > cap else 0
        return kv + fresh + grown * stb  # a block's bounds: as many bytes as one token's K/V

    def window_from(self, seen: int, base: int) -> int:
        """Start of the window for ``seen`` tokens, ``base`` the start without blocks:
        reaches back to the start of its block."""
        o = self.layout.origin
        if base <= o:
            return base
        return o + (base - o) // self.block * self.block

    def stats(self) -> dict[str, Any]:
        return {"blocks": self.count[0], "attend": self.attend, "block": self.block,
                "attended_blocks": len(self.chosen[0]), "fetched_blocks": self.fetched_blocks,
                "fetch_waits": self.fetch_waits, "fetch_wait_ms": round(self.fetch_wait_s * 1e3, 3),
                "backfilled_blocks": self.backfilled_blocks}

    # --- the step ---------------------------------------------------------------------------
    def step_begin(self) -> None:
        """Layer 0 of a step: the previous step must have reported every layer's queries."""
        if 0 <= self._observed < self.c.num_layers and self.count[0]:
            raise KVUnsupported(
                f"retrieval saw the queries of {self._observed} of {self.c.num_layers} layers in the "
                "last step: the model's attention does not report them (build the cache from the "
                "model, KVRouter.cache(sid, model) or TieredCache(model, ...), which installs "
                "kvfs.torch.attention), or pass retrieval=False")
        self._observed = 0

    def left_window(self, layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens ``[first, first + T)`` of ``layer`` (whole blocks, K/V ``[1, H, T, D]``) left
        the window in this step: their bounds join the candidates."""
        b0 = (first - self.layout.origin) // self.block
        if b0 != self.count[layer]:
            raise AssertionError(f"layer {layer}: block {b0} left the window, expected {self.count[layer]}")
        nb = k.shape[-2] // self.block
        self._append_bounds(layer, bounds_of_keys(k, self.block))
        fresh = self._fresh[layer]
        for j in range(max(0, nb - FRESH_BLOCKS), nb):
            s = slice(j * self.block, (j + 1) * self.block)
            fresh[b0 + j] = (k[..., s, :].clone(), v[..., s, :].clone())
        for b in sorted(fresh)[:max(0, len(fresh) - FRESH_BLOCKS)]:
            del fresh[b]

    def _append_bounds(self, layer: int, new: torch.Tensor) -> None:
        n, cur = self.count[layer], self._bounds[layer]
        if cur is None or cur.shape[0] < n + new.shape[0]:
            cap = n + new.shape[0] + max(8, (n + new.shape[0]) // 4)  # room for a few more
            grown = new.new_empty((cap, *new.shape[1:]))
            if n:
                grown[:n] = cur[:n]
            self._bounds[layer] = cur = grown
        cur[n:n + new.shape[0]] = new
        self.count[layer] = n + new.shape[0]

    def bounds(self, layer: int) -> torch.Tensor:
        b = self._bounds[layer]
        n = self.count[layer]
        return b[:n] if b is not None else torch.empty(0)

    def step_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K/V of the blocks ``layer`` attends in this step (``[1, H, attended, D]``)."""
        if not self.chosen[layer]:
            return None
        if self._pending[layer] is not None:
            if not self._pending[layer][1].done():
                t0 = time.perf_counter()
                self._settle(layer)
                self.fetch_wait_s += time.perf_counter() - t0
                self.fetch_waits += 1
                self.c.step_waited()
            else:
                self._settle(layer)
        if self._kv[layer] is None:  # the budget took them: read back (a refill)
            self._kv[layer] = self._assemble(layer, self._read(layer, list(self.chosen[layer])))
        return self._kv[layer]

    def _settle(self, layer: int) -> None:
        """Wait for ``layer``'s fetch and put its chosen blocks together."""
        pieces, fut = self._pending[layer]
        pieces.update(fut.result())
        self._kv[layer] = self._assemble(layer, pieces)
        self._pending[layer] = None

    def _assemble(self, layer: int, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        order = self.chosen[layer]
        return (torch.cat([pieces[b][0] for b in order], dim=-2),
                torch.cat([pieces[b][1] for b in order], dim=-2))

    def expect(self, layer: int) -> None:
        """Have this step's attention of ``layer`` hand its queries to :meth:`observe`."""
        attention.expect(self.observe, layer)

    def observe(self, layer: int, query: torch.Tensor) -> None:
        """Rank the blocks against ``layer``'s queries of this step; choose the next step's."""
        self._observed += 1
        n = self.count[layer]
        if n == 0:
            return
        with torch.no_grad():
            scores = block_scores(query, self.bounds(layer))
            excluded = {b for b in self.c.recalled_blocks(self.layout) if b < n}
            if excluded:
                scores[list(excluded)] = float("-inf")
            k = min(self.attend, n - len(excluded))
            new = tuple(sorted(torch.topk(scores, k).indices.tolist())) if k > 0 else ()
        if new != self.chosen[layer]:
            self._choose(layer, new)

    def _choose(self, layer: int, new: tuple[int, ...]) -> None:
        """Make ``new`` the blocks of ``layer``'s next step: what is on the device now is
        kept, the rest is read on a reader thread."""
        old, kv = self.chosen[layer], self._kv[layer]
        pend = self._pending[layer]
        have: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if pend is not None and pend[1].done():  # a fetch not used yet (chosen, then dropped)
            have.update(pend[0])
            have.update(pend[1].result())
        elif pend is not None:
            have.update(pend[0])
        if kv is not None:
            for i, b in enumerate(old):
                s = slice(i * self.block, (i + 1) * self.block)
                have[b] = (kv[0][..., s, :], kv[1][..., s, :])
        fresh = self._fresh[layer]
        pieces = {b: have.get(b) or fresh[b] for b in new if b in have or b in fresh}
        missing = [b for b in new if b not in pieces]
        self.chosen[layer] = new
        if missing:
            self._kv[layer] = None
            self._pending[layer] = (pieces, layer_pool().submit(self._read, layer, missing))
        else:
            self._pending[layer] = None
            self._kv[layer] = self._assemble(layer, pieces) if new else None

    def _read(self, layer: int, blocks: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Read ``blocks`` of ``layer`` from the warm tier (exact bytes)."""
        c = self.c
        dev = c.device or torch.device("cpu")
        tb = c.geo.token_bytes
        if c.spiller is not None and c.warm.size(c.session_id, layer) < self.layout.span(max(blocks))[1] * tb:
            c.spiller.wait()  # still on its way to the warm tier
        out = {}
        for b in blocks:
            a, e = self.layout.span(b)
            out[b] = read_tokens(c.warm, c.session_id, layer, c.geo, a, e, dev, promote=False)
        self.fetched_blocks += len(blocks)
        return out

    # --- device budget ------------------------------------------------------------------------
    def missing(self) -> bool:
        """Chosen blocks whose K/V are neither on the device nor being read (budget moves)."""
        return any(ch and kv is None and p is None
                   for ch, kv, p in zip(self.chosen, self._kv, self._pending, strict=True))

    def refill(self) -> None:
        """Read back the chosen blocks the budget took (before a step)."""
        for layer, ch in enumerate(self.chosen):
            if ch and self._kv[layer] is None and self._pending[layer] is None:
                self._kv[layer] = self._assemble(layer, self._read(layer, list(ch)))

    def release_device(self) -> int:
        """Free the chosen blocks' K/V and the fresh copies (read back before the next step).
        Returns the tokens freed per layer."""
        freed = sum(kv[0].shape[-2] for kv in self._kv if kv is not None)
        freed += sum(len(f) for f in self._fresh)
        for i in range(len(self._kv)):
            pend = self._pending[i]
            if pend is not None:
                pend[1].result()  # let no reader write into what is being dropped
                self._pending[i] = None
            self._kv[i] = None
            self._fresh[i].clear()
        return freed

    # --- storage ------------------------------------------------------------------------------
    def queue_records(self) -> None:
        """Queue the records of the blocks that left the window since the last call (all
        layers have their bounds: called at the end of a step and before a flush)."""
        n = min(self.count)
        if n <= self.written or self.c.spiller is None:
            return
        first = self.written
        new = torch.stack([b[first:n] for b in self._bounds], dim=1)  # [m, L, H, 2, D]
        self.c.spiller.submit_call(self._write_records, first, new)
        self.written = n

    def _write_records(self, first: int, bounds: torch.Tensor) -> None:
        """Spill thread: append records ``first, ...`` (after the header when first)."""
        c, lay = self.c, self.layout
        data = lay.records(first, bounds.cpu())
        if first == 0:
            data = memoryview(lay.header() + data.tobytes())
        new = c.warm.side_append(c.session_id, STREAM, data)
        want = lay.offset(first + bounds.shape[0])
        if new != want:
            raise RuntimeError(f"session {c.session_id!r}: {STREAM} is {new} bytes after appending "
                               f"records up to block {first + bounds.shape[0]}, expected {want}")

    def meta_state(self, tokens: int) -> dict[str, Any]:
        """The ``retrieval`` entry of meta.json: the blocks each layer attends next."""
        return {"block": self.block, "origin": self.layout.origin, "tokens": int(tokens),
                "chosen": [list(ch) for ch in self.chosen]}

    def load(self, meta: dict, tokens: int, window_start: int, device: torch.device | str) -> None:
        """Resume: bounds of the blocks before ``window_start`` from the side stream,
        checked, completed from the stored keys where missing or damaged (the stream is
        rewritten to match), and the chosen blocks from ``meta.json`` when it saved them
        for exactly ``tokens`` tokens."""
        from kvfs.torch.retrieval_store import load_bounds  # noqa: PLC0415 - resume only

        need = self.layout.blocks_before(window_start)
        bounds, self.backfilled_blocks = load_bounds(self.c, self.layout, need)
        for layer in range(self.c.num_layers):
            self._bounds[layer] = None
            self.count[layer] = 0
            if need:
                self._append_bounds(layer, bounds[:, layer].to(device))
        self.written = need
        chosen = chosen_from_meta(meta.get("retrieval"), self.layout, tokens, need,
                                  min(self.attend, need), self.c.num_layers)
        self.chosen = chosen
        for layer in range(self.c.num_layers):
            self._kv[layer] = (self._assemble(layer, self._read(layer, list(chosen[layer])))
                               if chosen[layer] else None)

    def copy_to(self, other: Retrieval) -> None:
        """Give ``other`` (a fork's, empty) this state: bounds, chosen blocks and their K/V."""
        for layer in range(self.c.num_layers):
            if self._pending[layer] is not None:
                self._settle(layer)
            b = self._bounds[layer]
            other._bounds[layer] = None if b is None else b.clone()
            kv = self._kv[layer]
            other._kv[layer] = None if kv is None else (kv[0].clone(), kv[1].clone())
            other._fresh[layer] = {b: (k.clone(), v.clone()) for b, (k, v) in self._fresh[layer].items()}
        other.count = list(self.count)
        other.chosen = list(self.chosen)
        other.written = self.written
        other._observed = self._observed


def chosen_from_meta(saved: Any, layout: BlockLayout, tokens: int, blocks: int, each: int,
                     layers: int) -> list[tuple[int, ...]]:
    """The chosen blocks saved in meta.json when they fit this session exactly (same block
    layout, saved at ``tokens``, ``each`` valid blocks per layer); else none for every layer
    (the first step then attends sinks and window only, and its queries choose)."""
    none: list[tuple[int, ...]] = [()] * layers
    if not isinstance(saved, dict) or saved.get("block") != layout.block or \
            saved.get("origin") != layout.origin or saved.get("tokens") != tokens:
        return none
    got = saved.get("chosen")
    if not isinstance(got, list) or len(got) != layers:
        return none
    out = []
    for ch in got:
        if (not isinstance(ch, list) or len(ch) != each
                or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < blocks for b in ch)
                or ch != sorted(set(ch))):
            log.warning("meta.json retrieval entry does not fit the session; the first step "
                        "attends no retrieved blocks")
            return none
        out.append(tuple(ch))
    return out

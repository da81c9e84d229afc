"""Retrieval of old KV by relevance: one session's blocks, their representatives and the attended set.

Owns, for one :class:`~kvfs.torch.cache.TieredCache`: the representatives of every block that
has left the window (on the device, per layer, :mod:`kvfs.torch.representatives`: by default
each key quantized to int8, else the centroids or Quest's bounds of
:mod:`kvfs.torch.blocks`), the blocks each
layer attends and their K/V on the device (in one buffer per layer with room for the sinks
and the window, :mod:`kvfs.torch.attended`: a decode step attends a slice of it, no copy
of the blocks), blocks kept for reuse (the reads that bring newly chosen blocks up from the
tiers below: :mod:`kvfs.torch.block_reads`), the records of the ``key_centroids`` side stream and
the ``retrieval`` entry of ``meta.json`` (:mod:`kvfs.torch.retrieval_store` reads them back).

The rule (deterministic: a function of the tokens alone, never of timing):

* With retrieval the window reaches back to the start of its block (``block`` tokens from
  ``origin`` = the sinks): blocks leave it whole, and each block's representatives are
  computed then.
* Step ``t`` of layer ``l`` attends the sinks, the blocks chosen for it, the window and the
  step's input. After the attention of layer ``l`` at step ``t`` its queries rank every block
  that has left the window (the selector's ``scores``; the default's, exact logits over the
  int8 keys, only at a step of several tokens, the 4 decode steps after it, and a step that
  adds a block, the choice holding over the decode steps between); the top
  ``min(attend, blocks)`` are the blocks of step ``t + 1``, in stable slots
  (:func:`~kvfs.torch.blocks.next_slots`: the order of keys changes the rounding of
  attention, so it too is a function of the choices alone). The choice of a step runs ahead
  of the step that attends it: blocks on the device (chosen, or kept for reuse) stay there,
  blocks in the RAM tier are copied up at once, blocks on the mount are read on a reader
  thread while the rest of the step and the sampling run; the next step waits only for a
  read still running (a hot miss), never attends less.
* A step of several tokens (a turn arriving) does not attend the blocks the step before
  chose: before the attention of layer ``l``, that step's own queries rank the blocks and the
  top ones (as many as the step was built with) are spliced in, read from where they are and
  waited for (:meth:`Retrieval.splice`). A question sees the fact it asks about while it is
  read; a decode step attends the choice that runs ahead (made by the step before).
* Every layer attends the same number of blocks, known before a step starts (its attention
  mask is built before any layer runs).
* The choice for the step after the last one is saved in ``meta.json`` (``retrieval``) when
  every token is stored, so a resumed or forked session attends what the live one would.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

import kvfs.torch.attention as attention
from kvfs.torch.attended import KV, AttendedBlocks
from kvfs.torch.block_reads import BlockReads
from kvfs.torch.blocks import BlockLayout, Selector, next_slots, selector
from kvfs.torch.fingerprint import KVUnsupported
from kvfs.torch.representatives import Representatives
from kvfs.torch.retrieval_store import (
    chosen_from_meta,
    load_centroids,
    recompute_reps,
    write_records,
)

if TYPE_CHECKING:
    from kvfs.torch.seams import RetrievalHost

log = logging.getLogger("kvfs.torch.retrieval")

#: Besides the chosen blocks, ``FRESH_BLOCKS`` more are kept on the device per layer, least
#: recently used out first: the last blocks to leave the window are chosen often while their
#: bytes may still be on their way to the warm tier, and blocks leave the choice and come
#: back. The rest of the budget is attended: on SmolLM2 a block attended found more of the
#: facts of tools/bench_memory.py than a block kept.
FRESH_BLOCKS = 2

#: How blocks are represented and scored (:func:`kvfs.torch.blocks.selector`): every key of a
#: block in int8, a block's score its attention mass; the first 4 decode steps after a turn
#: choose from their own queries (an answer copying a value finds the block its last digits
#: sit in), later ones hold the choice until a block leaves the window. Chosen on the dev
#: split of tools/memory_chats.py over the centroids, Quest's bounds, int4 keys, the best
#: token instead of the mass, blocks of 8, and holding from the first decode step or choosing
#: at every one (docs/quality.md, "Held-out chats").
DEFAULT_SELECTOR = "int8-sum-fresh4"

#: A step of several tokens chooses its own blocks from its queries before it attends them
#: (:meth:`Retrieval.splice`); chosen on the dev split of tools/memory_chats.py over the
#: choice of the step before (docs/quality.md, "Held-out chats"). Read when a session's
#: retrieval is built; off only to compare (bench_memory's ``+step=prev``).
IN_STEP = True


class Retrieval:
    """One session's retrieval state (see the module docstring)."""

    def __init__(self, cache: RetrievalHost, block: int, attend: int, select: str | None = None,
                 share: float = 0.0, most: int | None = None) -> None:
        if block < 1 or attend < 1:
            raise ValueError(f"retrieval needs block >= 1 and at least one block attended, got "
                             f"block={block}, attend={attend}")
        if not 0.0 <= share <= 1.0 or (most is not None and most < attend):
            raise ValueError(f"retrieval share must be in [0, 1] and its most at least {attend} "
                             f"blocks, got share={share}, most={most}")
        self.c = cache
        self.layout = BlockLayout(int(block), cache.sink_tokens, cache.geo)
        self.block = int(block)
        self.attend = int(attend)  # blocks attended per layer, at least (when there are)
        self.share = float(share)  # ... or this share of the old blocks, when more
        self.most = int(attend if most is None else most)  # ... up to this many
        self.in_step = IN_STEP  # a step of several tokens chooses its own blocks
        self.keep = FRESH_BLOCKS  # blocks kept for reuse per layer, besides the chosen ones
        self.selector: Selector = selector(select or DEFAULT_SELECTOR, self.block)
        n = cache.geo.num_layers
        self.reps = Representatives(n, self.selector.columns(self.block), self._rep_block_bytes())
        self._queries: list[torch.Tensor | None] = [None] * n  # this step's, until the last layer
        self.chosen: list[tuple[int, ...]] = [()] * n  # blocks of the next step, in slot order
        # chosen blocks on the device, in one buffer per layer with room for the sinks and for
        # a decode step's window (it reaches back to the start of its block) and input
        self._tail = (cache.max_kv_len or 0) + self.block
        self._on = [AttendedBlocks(self.block, cache.sink_tokens, self._tail) for _ in range(n)]
        self._kept: list[OrderedDict[int, KV]] = [OrderedDict() for _ in range(n)]
        self.reads = BlockReads(cache, self.layout)
        self.written = 0  # blocks whose record is queued to the side stream
        self._observed = -1  # layers that reported their queries this step (-1: no step yet)
        self._before = 0  # blocks that had left the window when this step began
        self._scored: tuple[int, tuple[int, ...]] = (0, ())  # blocks and recalled ones at the last scoring
        self._decodes = 0  # single-token steps since the last step of several tokens
        self.backfilled_blocks = 0
        self.reps_rebuilt = 0  # representatives rebuilt after the budget took them

    def _rep_block_bytes(self) -> int:
        """Device bytes of one block's representatives, all layers."""
        g, name = self.c.geo, self.selector.name
        one = g.head_dim * (g.itemsize if name in ("centroids", "quest") else 1)
        if name not in ("centroids", "quest"):
            one += 4  # the scale
        return g.num_layers * g.num_kv_heads * self.selector.columns(self.block) * one

    # --- views ------------------------------------------------------------------------------
    @property
    def attended_tokens(self) -> int:
        """Retrieved tokens every layer attends in the next step."""
        return len(self.chosen[0]) * self.block

    @property
    def refill_tokens(self) -> int:
        """Tokens of device storage (all layers alike) a refill of the blocks the budget took
        brings back: the blocks, and their buffer's room for the sinks and the window."""
        return self.attended_tokens + self.c.sink_tokens + self._tail if self.attended_tokens else 0

    @property
    def count(self) -> list[int]:
        """Blocks that have left the window (and have representatives), per layer."""
        return self.reps.count

    @property
    def device_bytes(self) -> int:
        n = self.reps.device_bytes + sum(on.nbytes for on in self._on)
        g = self.c.geo  # a kept block: K and V of block tokens
        return n + sum(map(len, self._kept)) * 2 * g.num_kv_heads * self.block * g.head_dim * g.itemsize

    def attend_for(self, blocks: int) -> int:
        """Blocks each layer attends when ``blocks`` have left the window: ``attend``, or
        ``share`` of them when more, at most ``most`` (a function of the token count alone:
        a resumed session attends as many as the live one)."""
        grown = min(self.most, math.ceil(self.share * blocks)) if self.share else 0
        return min(blocks, max(self.attend, grown))

    def step_growth(self, q: int) -> int:
        """Device bytes a step of ``q`` tokens may add at most: the chosen blocks (and, the first
        time, their buffer's room for the sinks and the window), the blocks leaving the window
        kept for reuse, their centroids."""
        c, blk = self.c, self.block
        leaving = (c.window_from(c.seen + q) - c.window_from(c.seen)) // blk
        stb = c.geo.session_token_bytes
        chosen = max(0, self.attend_for(self.count[0] + leaving) - len(self._on[0]))
        kept = max(0, min(self.keep, len(self._kept[0]) + leaving + chosen) - len(self._kept[0]))
        room = c.sink_tokens + self._tail if chosen and not self._on[0].nbytes else 0  # a new buffer's
        return (room + (chosen + kept) * blk) * stb + self.reps.growth_bytes(self.count[0] + leaving)

    def window_from(self, seen: int, base: int) -> int:
        """Start of the window for ``seen`` tokens, ``base`` the start without blocks:
        reaches back to the start of its block."""
        o = self.layout.origin
        if base <= o:
            return base
        return o + (base - o) // self.block * self.block

    def stats(self) -> dict[str, Any]:
        return {"blocks": self.count[0], "attend": self.attend, "attend_most": self.most,
                "attend_share": self.share, "block": self.block,
                "selector": self.selector.name,
                "attended_blocks": len(self.chosen[0]), **self.reads.stats(),
                "backfilled_blocks": self.backfilled_blocks, "reps_rebuilt": self.reps_rebuilt}

    # --- blocks leaving the window -----------------------------------------------------------
    def step_begin(self) -> None:
        """Layer 0 of a step: the previous step must have reported every layer's queries."""
        if 0 <= self._observed < self.c.num_layers and self.count[0]:
            raise KVUnsupported(
                f"retrieval saw the queries of {self._observed} of {self.c.num_layers} layers in the "
                "last step: the model's attention does not report them (build the cache from the "
                "model, KVRouter.cache(sid, model) or TieredCache(model, ...), which installs "
                "kvfs.torch.attention), or pass retrieval=False")
        self._observed = 0
        self._before = self.count[0]  # the blocks a step's own choice picks from
        self.reads.step_begin()

    def left_window(self, layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens ``[first, first + T)`` of ``layer`` (whole blocks, K/V ``[1, H, T, D]``) left
        the window in this step: their centroids join the candidates, the last ones are kept."""
        b0 = (first - self.layout.origin) // self.block
        if b0 != self.count[layer]:
            raise AssertionError(f"layer {layer}: block {b0} left the window, expected {self.count[layer]}")
        nb = k.shape[-2] // self.block
        self.reps.append(layer, *self.selector.represent(k, self.block))
        for j in range(max(0, nb - FRESH_BLOCKS), nb):
            s = slice(j * self.block, (j + 1) * self.block)
            self._keep_block(layer, b0 + j, (k[..., s, :].clone(), v[..., s, :].clone()))

    def _keep_block(self, layer: int, b: int, kv: KV) -> None:
        kept = self._kept[layer]
        kept[b] = kv
        kept.move_to_end(b)
        while len(kept) > self.keep:
            kept.popitem(last=False)

    @property
    def streamed(self) -> bool:
        """Whether the representatives go to the ``key_centroids`` side stream (centroids);
        others are recomputed from the stored keys on resume."""
        return self.selector.name == "centroids"

    # --- the attended blocks ------------------------------------------------------------------
    def step_kv(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V pieces of the blocks ``layer`` attends in this step, in slot order."""
        if not self.chosen[layer]:
            return [], []
        self._ready(layer)
        return self._on[layer].pieces()

    def joined(self, layer: int, full_k: torch.Tensor, full_v: torch.Tensor,
               p: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step's keys and values of ``layer``: the sinks (``full_k``'s first ``p``
        tokens), the chosen blocks, the window and the input, as one slice of the buffer the
        blocks live in (no copy of the blocks); None when no block is chosen."""
        if not self.chosen[layer]:
            return None
        self._ready(layer)
        return self._on[layer].around(full_k, full_v, p)

    def _ready(self, layer: int) -> None:
        """Every chosen block of ``layer`` on the device: wait for its read, read back what
        the budget took."""
        self._land(layer, self.reads.wait(layer))
        on = self._on[layer]
        if not on.complete:  # the budget took them: read back (a refill)
            self._land(layer, self.reads.read(layer, [b for b in self.chosen[layer] if b not in on]))

    def _land(self, layer: int, blocks: dict[int, KV] | None) -> None:
        """``blocks`` read for ``layer`` join its chosen ones."""
        on = self._on[layer]
        for b, kv in (blocks or {}).items():
            on.put(b, kv)

    def expect(self, layer: int, at: int | None = None) -> None:
        """Have this step's attention of ``layer`` hand its queries to :meth:`observe`; with
        ``at`` (where its blocks start in the attended keys), choose them from this step's
        own queries first (:meth:`splice`)."""
        splice = None
        if at is not None and self.in_step:
            def splice(layer: int, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return self.splice(layer, query, key, value, at)
        attention.expect(self.observe, layer, splice)

    def splice(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of several tokens (a turn arriving) attends the blocks its own queries rank
        highest, not the ones the step before chose: a question must see the fact it asks
        about while it is read, or its tokens carry on without it. As many blocks as the
        step was built with; the reads wait (a turn's prefill, not a decode step)."""
        k, n = len(self.chosen[layer]), self._before  # blocks that left before this step
        if k == 0 or n == 0 or not self.reps.held:
            return key, value
        excluded = [b for b in self.c.recalled_blocks(self.layout) if b < n] if self.c.recalling else []
        if n - len(excluded) < k:  # recalled rounds took the candidates: keep the choice
            return key, value
        scores = self.selector.scores(query.detach(), *self.reps.first(n, layer))[0]
        if excluded:
            scores[excluded] = float("-inf")
        top = set(torch.topk(scores, k).indices.tolist())
        if top != set(self.chosen[layer]):
            self._choose(layer, top)
        rk, rv = self.step_kv(layer)
        e = at + k * self.block
        return (torch.cat([key[:, :, :at], *rk, key[:, :, e:]], dim=-2),
                torch.cat([value[:, :, :at], *rv, value[:, :, e:]], dim=-2))

    def observe(self, layer: int, query: torch.Tensor) -> None:
        """Keep ``layer``'s queries of this step; after the last layer's, rank the blocks of
        every layer against them at once and choose the next step's."""
        self._observed += 1
        self._queries[layer] = query.detach()
        if layer == self.c.num_layers - 1:
            self._choose_all()

    def _choose_all(self) -> None:
        got, self._queries = self._queries, [None] * self.c.num_layers
        qs = [q for q in got if q is not None]
        if qs:
            self._decodes = self._decodes + 1 if qs[0].shape[-2] == 1 else 0
        n = self.count[-1]
        if n == 0 or len(qs) < len(got):
            return
        excluded = [b for b in self.c.recalled_blocks(self.layout) if b < n] if self.c.recalling else []
        scored = (n, tuple(excluded))
        sel = self.selector
        if (not sel.every_step and qs[0].shape[-2] == 1 and self._decodes > sel.fresh and self.chosen[0]
                and scored == self._scored):
            return  # a decode step past the fresh ones, no new block, the same recall: the choice holds
        self._scored = scored
        scores = self.selector.scores(torch.cat(qs), *self.reps.first(n))  # [layers, n]: one matmul
        if excluded:
            scores[:, excluded] = float("-inf")
        k = min(self.attend_for(n), n - len(excluded))
        tops = torch.topk(scores, k).indices.tolist() if k > 0 else [[]] * len(qs)
        for layer, top in enumerate(tops):
            top = set(top)
            if top != set(self.chosen[layer]):
                self._choose(layer, top)

    def _choose(self, layer: int, top: set[int]) -> None:
        """Make ``top`` the blocks of ``layer``'s next step: a block that leaves the choice is
        kept for reuse; a new one comes from the kept ones, else from RAM now, else (the
        mount, or still on its way to the warm tier) on a reader thread."""
        self._land(layer, self.reads.settle(layer))
        old, on, kept = self.chosen[layer], self._on[layer], self._kept[layer]
        self.chosen[layer] = next_slots(old, top)
        leaving = [(b, on.pop(b)) for b in old if b not in top and b in on]
        on.arrange(self.chosen[layer])
        missing = []
        for b in top:
            if b in on:
                continue
            if b in kept:
                on.put(b, kept.pop(b))
            else:
                missing.append(b)
        for b, kv in leaving:  # after taking from the kept ones: these go to their end
            self._keep_block(layer, b, kv)
        if missing:
            self._land(layer, self.reads.fetch(layer, missing))

    # --- device budget ------------------------------------------------------------------------
    def missing(self) -> bool:
        """Chosen blocks neither on the device nor being read, or the representatives (budget
        moves took them)."""
        return self.reps.out or any(len(on) < len(ch) and not self.reads.in_flight(layer)
                                     for layer, (ch, on) in enumerate(zip(self.chosen, self._on, strict=True)))

    @property
    def refill_rep_bytes(self) -> int:
        """Device bytes the representatives take when rebuilt (0 unless the budget took them)."""
        return self.reps.refill_bytes

    def refill(self, device: torch.device | str) -> None:
        """Rebuild the representatives and read back the chosen blocks the budget took
        (before a step)."""
        if self.reps.out:
            self._build_reps(self.count[0], device)
            self.reps_rebuilt += 1
        for layer, ch in enumerate(self.chosen):
            on = self._on[layer]
            if not on.complete and not self.reads.in_flight(layer):
                self._land(layer, self.reads.read(layer, [b for b in ch if b not in on]))

    def release_device(self) -> int:
        """Free the chosen and kept blocks (read back before the next step); blocks freed."""
        freed = sum(map(len, self._on)) + sum(map(len, self._kept))
        self.reads.drop()  # nothing may land in what is being dropped
        for i in range(len(self._on)):
            self._on[i].clear()
            self._kept[i].clear()
        return freed

    def release_reps(self) -> int:
        """Free the representatives of the blocks that left the window (the budget's last
        resort before the sinks: rebuilding them reads the old keys back); bytes freed. They
        are a function of the stored keys alone, so the rebuilt ones choose exactly as these
        would have."""
        if not self.reps.held:
            return 0
        self.queue_records()  # centroids not yet in the side stream go there first
        return self.reps.release()

    def release(self) -> None:
        """Forget every device tensor: the router dropped the session. The cache and its
        parts refer to each other, so whatever they still hold would wait for Python's
        cyclic collector, outside the budget (device memory on CUDA, heap on CPU)."""
        self.release_device()
        self.reps.drop()
        self._queries = [None] * len(self._queries)

    # --- storage ------------------------------------------------------------------------------
    def queue_records(self) -> None:
        """Queue the records of the blocks that left the window since the last call (all
        layers have their centroids: called at the end of a step and before a flush)."""
        n, spiller = min(self.count), self.c.spiller
        if n <= self.written or spiller is None or not self.reps.held or not self.streamed:
            return
        first = self.written
        new = self.reps.centroid_span(first, n)
        c = self.c
        spiller.submit_call(write_records, c.warm, c.session_id, self.layout, first, new)
        self.written = n

    def meta_state(self, tokens: int) -> dict[str, Any]:
        """The ``retrieval`` entry of meta.json: the blocks each layer attends next."""
        return {"block": self.block, "origin": self.layout.origin, "tokens": int(tokens),
                "selector": self.selector.name, "decodes": self._decodes,
                "chosen": [list(ch) for ch in self.chosen]}

    def load(self, meta: dict, tokens: int, window_start: int, device: torch.device | str) -> None:
        """Resume: the centroids of the blocks before ``window_start`` (the side stream, checked,
        completed from the stored keys: :func:`~kvfs.torch.retrieval_store.load_centroids`)
        and the chosen blocks from ``meta.json`` when it saved them for exactly ``tokens``."""
        need = self.layout.blocks_before(window_start)
        self._build_reps(need, device)
        self._scored = (need, ())  # a live session scores whenever a block leaves its window
        saved = meta.get("retrieval")
        dec = saved.get("decodes") if isinstance(saved, dict) and saved.get("tokens") == tokens else None
        self._decodes = dec if isinstance(dec, int) and dec >= 0 else 0  # the fresh steps go on
        self.chosen = chosen_from_meta(meta.get("retrieval"), self.layout, tokens, need,
                                       self.attend_for(need), self.c.num_layers)
        for layer in range(self.c.num_layers):
            self._on[layer] = AttendedBlocks(self.block, self.c.sink_tokens, self._tail)
            self._on[layer].arrange(self.chosen[layer])
            if self.chosen[layer]:
                self._land(layer, self.reads.read(layer, list(self.chosen[layer])))

    def _build_reps(self, need: int, device: torch.device | str) -> None:
        """The representatives of blocks ``[0, need)`` of every layer: the centroids from the
        side stream (completed from the stored keys), others from the stored keys."""
        self.reps.reset()
        if self.streamed:
            cents, self.backfilled_blocks = load_centroids(self.c, self.layout, need)
            for layer in range(self.c.num_layers):
                if need:
                    self.reps.append(layer, cents[:, layer].to(device))
        else:
            for layer in range(self.c.num_layers):
                if need:
                    self.reps.append(layer, *recompute_reps(self.c, self.layout, self.selector,
                                                                  layer, need, device))
            self.backfilled_blocks = need
        self.written = need

    def copy_to(self, other: Retrieval) -> None:
        """Give ``other`` (a fork's, empty) this state: centroids, chosen and kept blocks."""
        for layer in range(self.c.num_layers):
            self._land(layer, self.reads.settle(layer))
            other._on[layer] = self._on[layer].copy()
            other._kept[layer] = OrderedDict((b, (k.clone(), v.clone()))
                                             for b, (k, v) in self._kept[layer].items())
        other.reps = self.reps.copy()
        other.chosen = list(self.chosen)
        other.written = self.written
        other._scored = self._scored
        other._decodes = self._decodes
        other._observed = self._observed
        other._before = self._before

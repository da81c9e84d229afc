"""The hot tier: a transformers ``Cache`` that keeps a window of each layer's K/V on the device.

Owns one session's device-resident K/V, the bookkeeping of what has already been handed
down (``spilled`` per layer), round boundaries, the running summary of the open round,
recall and resume. Never writes to disk itself: bytes go to the warm tier through the
spill thread (:mod:`kvfs.torch.spill`); meta.json and summaries go the same ordered way.

Window semantics (``max_kv_len = W``; ``None`` = no window; ``sink_tokens = S``):

* Every forward step attends to the K/V *stored before the step* -- the session's first
  ``S`` tokens (the attention sinks of StreamingLLM: attention parks probability mass on
  the first tokens, and a window without them loses most of its quality), recalled
  tokens (see below) and the last ``W`` tokens, in that order -- followed by the step's own
  input tokens (causally). After the step the layer keeps the sinks and the last ``W``
  tokens; the ones that fall out of the window are queued for the warm tier. The sinks stay
  on the device for the session's life (budget moves never take them; a resume rebuilds
  sinks + last ``W``). A prompt longer than the window is attended in full during its own
  prefill step (a cache cannot change the prefill mask), then the window applies.
* ``get_seq_length()`` is the number of tokens seen (it drives input slicing and position
  ids, so positions keep counting across turns); ``get_mask_sizes(q)`` is
  ``(recalled + stored + q, seen - stored - recalled)`` (stored = sinks + window).
* Long sessions: positions keep counting; ``rope_rerotate`` keeps every attended distance
  within the window (:mod:`kvfs.torch.rotation`). Without it the cache logs one
  ``logging.warning`` (logger ``kvfs.torch.cache``) when a session crosses the model's
  ``max_position_embeddings``.
* Tokens already copied below by :meth:`TieredCache.flush` are not appended again when they
  later fall out of the window (``spilled`` per layer). Tokens leave in batches: the ones
  that will fall out within ``window_slack`` steps are handed down together (see
  :mod:`kvfs.torch.layer` for the buffer that makes a decode step cost no window copy).

Rounds: a round is the tokens processed between two :meth:`TieredCache.end_round` calls
(``[start, end)`` in meta.json). Note that ``generate`` does not feed its last sampled token
through the model, so that token is processed at the start of the next call and belongs to
the next round.

Recall and automatic recall: :mod:`kvfs.torch.cache_recall`. Budget moves, refill and
resume: :mod:`kvfs.torch.cache_moves`. A step that had to read from the warm/cold tier first
(refill, a fresh recall, the first step after resume) counts as a hot miss; every other step
is a hot hit.

Batch size is 1 per session (the layer file format has no batch dimension).

Parts (each its own state; none imports this module): one :class:`~kvfs.torch.layer.
TieredLayer` per layer (the window), :class:`~kvfs.torch.spill.SessionSpill` (the way down),
:class:`~kvfs.torch.rounds.Rounds`, :class:`~kvfs.torch.rotation.SinkRotation`,
:class:`~kvfs.torch.cache_recall.Recall`, :class:`~kvfs.torch.cache_moves.Moves` (budget
moves, refill; resume), :class:`~kvfs.torch.stepstats.StepStats` and, when on,
:class:`~kvfs.torch.retrieval.Retrieval`. The cache holds them and runs the step hooks.
"""
from __future__ import annotations

import logging
from typing import Any, cast

import numpy as np
import torch
from transformers.cache_utils import Cache

import kvfs.torch.attention as attention
from kvfs.ops import metrics
from kvfs.torch.blocks import BlockLayout
from kvfs.torch.cache_moves import Moves, resume
from kvfs.torch.cache_recall import Recall
from kvfs.torch.compat import require_cache_keyword
from kvfs.torch.fingerprint import KVGeometry, build_meta, fingerprint, geometry
from kvfs.torch.layer import TieredLayer, window_slack
from kvfs.torch.parts import Shown
from kvfs.torch.retrieval import FRESH_BLOCKS, Retrieval
from kvfs.torch.rope import RopeShift
from kvfs.torch.rotation import SinkRotation
from kvfs.torch.rounds import Rounds
from kvfs.torch.seams import CacheRouter, WarmStore
from kvfs.torch.spill import SessionSpill, Spiller
from kvfs.torch.stepstats import StepStats

log = logging.getLogger("kvfs.torch.cache")

#: defaults when neither the caller nor the profile sets them
DEFAULT_SINK_TOKENS = 4
DEFAULT_AUTO_RECALL = False  # on per profile: each recall is one read from below per round
DEFAULT_RECALL_ROUNDS = 2
DEFAULT_ROPE_REROTATE = False
DEFAULT_RETRIEVAL = False  # on per profile (every shipped one)
DEFAULT_RETRIEVAL_BLOCK = 16

class TieredCache(Cache):
    """A windowed, tiered KV cache for one session (see the module docstring for semantics).

    Build it through :meth:`kvfs.torch.KVRouter.cache` (budget, shared spill thread), or
    directly: ``TieredCache(model, warm=WarmTier(...), session_id="s1", max_kv_len=24)``.
    ``warm=None`` gives a plain windowed cache whose dropped tokens are discarded.
    """

    #: see :class:`~kvfs.torch.stepstats.StepStats`
    PUBLISH_HITS_EVERY = StepStats.PUBLISH_HITS_EVERY

    def __init__(self, model_or_config: Any, *, session_id: str = "default",
                 warm: WarmStore | None = None, max_kv_len: int | None = 24,
                 sink_tokens: int = DEFAULT_SINK_TOKENS, auto_recall: bool = DEFAULT_AUTO_RECALL,
                 recall_rounds: int = DEFAULT_RECALL_ROUNDS, spiller: Spiller | None = None,
                 router: CacheRouter | None = None, summary_dim: int = 128,
                 dtype: torch.dtype | None = None,
                 rope_rerotate: bool | str = DEFAULT_ROPE_REROTATE,
                 rope_reach: int | None = None, retrieval: bool = DEFAULT_RETRIEVAL,
                 retrieval_block: int = DEFAULT_RETRIEVAL_BLOCK,
                 retrieval_bytes: int | None = None, retrieval_share: float = 0.0,
                 retrieval_max_bytes: int | None = None) -> None:
        require_cache_keyword()
        if max_kv_len is not None and max_kv_len < 1:
            raise ValueError(f"max_kv_len must be >= 1 or None, got {max_kv_len}")
        if sink_tokens < 0 or recall_rounds < 0:
            raise ValueError(f"sink_tokens and recall_rounds must be >= 0, got {sink_tokens}, "
                             f"{recall_rounds}")
        self.geo: KVGeometry = geometry(model_or_config, dtype)
        self.fingerprint = fingerprint(model_or_config)
        # the window, one part per layer (transformers sees the same list as ``layers``)
        self.tiered: list[TieredLayer] = [TieredLayer(self, i) for i in range(self.geo.num_layers)]
        # one list, transformers' and ours (it types it as its base layers' union)
        super().__init__(layers=cast("list[Any]", self.tiered))
        self.session_id = session_id
        self.warm = warm
        self.max_kv_len = max_kv_len
        self.sink_tokens: int = int(sink_tokens)
        self.window_slack = window_slack(max_kv_len, self.sink_tokens)  # buffer room, tokens
        self.step_slack = self.window_slack  # the room the current step's layers allocate
        self.auto_recall = bool(auto_recall)
        self.recall_rounds = int(recall_rounds)
        self.config = getattr(model_or_config, "config", model_or_config)
        self.max_positions: int | None = getattr(self.config, "max_position_embeddings", None)
        self.rotation = SinkRotation(model_or_config, rope_rerotate, max_kv_len,
                                     max(1, self.window_slack), self.max_positions, rope_reach)
        self.num_layers: int = self.geo.num_layers
        self.summary_layer = self.num_layers - 1
        self.summary_dim = summary_dim
        self.router = router
        self.spill = SessionSpill(session_id, warm, spiller, self.geo.token_bytes)
        self.round_log = Rounds(summary_dim)
        self.recalled = Recall(self)
        self.moves = Moves(self)
        self.counts = StepStats()
        self._closed = False
        self.retrieval: Retrieval | None = None
        self.retrieval_block = int(retrieval_block)
        if retrieval and max_kv_len is not None:
            self.retrieval = self._make_retrieval(model_or_config, retrieval_block, retrieval_bytes,
                                                  retrieval_share, retrieval_max_bytes)

    def _make_retrieval(self, model_or_config: Any, block: int, budget: int | None,
                        share: float = 0.0, most_bytes: int | None = None) -> Retrieval | None:
        """The session's retrieval: ``budget`` device bytes of blocks (all layers),
        ``budget // (block * session_token_bytes)`` per layer, all attended but
        :data:`~kvfs.torch.retrieval.FRESH_BLOCKS` kept for reuse; with ``share``, that share
        of the old blocks when it is more, up to ``most_bytes``."""
        if self.warm is None:
            raise ValueError("retrieval needs a warm tier (warm=...) to read old blocks from")
        if budget is None:
            raise ValueError("retrieval needs retrieval_bytes, the device bytes of the blocks "
                             "it attends per step")
        attend = int(budget) // (int(block) * self.geo.session_token_bytes) - FRESH_BLOCKS
        if attend < 1:
            log.warning("session %r: retrieval_bytes=%d holds fewer than %d blocks of %d tokens "
                        "(%d B each over all layers); retrieval is off", self.session_id, budget,
                        FRESH_BLOCKS + 1, block, block * self.geo.session_token_bytes)
            return None
        if not attention.installed(model_or_config):
            if not hasattr(model_or_config, "named_parameters"):
                raise ValueError("retrieval needs the model (TieredCache(model, ...)): its "
                                 "attention is set up to report the queries")
            attention.install(model_or_config)
        most = attend
        if share > 0 and most_bytes is not None:
            most = max(attend, int(most_bytes) // (int(block) * self.geo.session_token_bytes) - FRESH_BLOCKS)
        return Retrieval(self, block, attend, share=share if most > attend else 0.0, most=most)

    # --- the parts' state, read through the cache as before ------------------------------------
    spiller = Shown[Spiller | None]("spill", "spiller")
    rounds = Shown[list[list[int]]]("round_log", "closed")  # closed rounds, [start, end) each
    recalled_rounds = Shown[list[int]]("recalled", "rounds")
    recall_shifts = Shown[list[int]]("recalled", "shifts")  # per recalled span (rope_rerotate)
    recalling = Shown[bool]("recalled", "active")
    recalls = Shown[int]("recalled", "recalls")
    auto_recalls = Shown[int]("recalled", "auto_recalls")
    sinks_moved = Shown[bool]("moves", "sinks_moved")
    refills = Shown[int]("moves", "refills")
    evicted_rounds = Shown[int]("moves", "evicted_rounds")
    rope = Shown[RopeShift | None]("rotation", "rope")
    rope_mode = Shown[str | None]("rotation", "mode")
    rope_reach = Shown[int | None]("rotation", "reach")
    rope_quantum = Shown[int]("rotation", "quantum")
    steps = Shown[int]("counts", "steps")
    hits = Shown[int]("counts", "hits")
    misses = Shown[int]("counts", "misses")
    spilled_tokens = Shown[int]("spill", "spilled_tokens")  # layer-0 tokens handed down

    def sink_shift_for(self, window_start: int, sinks: int) -> int:
        """:meth:`SinkRotation.shift_for`: a function of the window alone."""
        return self.rotation.shift_for(window_start, sinks)

    # --- views -------------------------------------------------------------------------------
    @property
    def seen(self) -> int:
        return self.tiered[0].seen

    @property
    def stored(self) -> int:
        return self.tiered[0].stored

    @property
    def sinks(self) -> int:
        """Sink tokens on the device (the session's first ``min(sink_tokens, seen)``)."""
        return self.tiered[0].pinned

    @property
    def window_start(self) -> int:
        """First window token on the device now (budget moves may have taken the front)."""
        return self.tiered[0].window_start

    def window_from(self, seen: int) -> int:
        """First window token after ``seen`` tokens: the last ``max_kv_len`` tokens past the
        sinks, with retrieval reaching back to the start of their block."""
        sinks = min(self.sink_tokens, seen)
        if self.max_kv_len is None:
            return sinks
        base = max(sinks, seen - self.max_kv_len)
        return base if self.retrieval is None else self.retrieval.window_from(seen, base)

    def window_keep(self, seen: int) -> int | None:
        """Window tokens kept after ``seen`` tokens (None: no window)."""
        if self.max_kv_len is None:
            return None
        return seen - self.window_from(seen) if self.retrieval is not None else self.max_kv_len

    @property
    def attended_start(self) -> int:
        """First token the next step attends in the window (what a refill restores)."""
        return self.window_from(self.seen)

    @property
    def attended_tokens(self) -> int:
        """Sinks + window tokens the next step attends (before its input and recall)."""
        if self.max_kv_len is None:
            return self.seen
        return min(self.sink_tokens, self.seen) + self.seen - self.attended_start

    @property
    def hot_bytes(self) -> int:
        """Device bytes this session's K/V storage holds (sinks, window, the buffer's room, recall)."""
        lay = self.tiered[0]
        ret = 0 if self.retrieval is None else self.retrieval.device_bytes
        return (lay.held + lay.recalled) * self.geo.session_token_bytes + ret

    def step_growth(self, q: int) -> int:
        """Device bytes a step of ``q`` tokens may add (the router makes room first)."""
        lay = self.tiered[0]
        extra = max(0, lay.held_after(q) - lay.held) * self.geo.session_token_bytes
        if self.retrieval is not None:  # blocks chosen, leaving the window, their bounds
            extra += self.retrieval.step_growth(q)
        return extra

    @property
    def device(self) -> torch.device | None:
        return getattr(self.tiered[0], "device", None)

    def stats(self) -> dict[str, Any]:
        self.counts.publish()
        n = self.counts
        return {
            "seen": self.seen, "hot_tokens": self.stored, "sink_tokens": self.sinks,
            "recalled_tokens": self.tiered[0].recalled, "auto_recalls": self.auto_recalls,
            "hot_bytes": self.hot_bytes, "spilled_tokens": self.spilled_tokens,
            "rounds": len(self.rounds), "steps": n.steps, "hits": n.hits, "misses": n.misses,
            "hit_rate": n.hits / n.steps if n.steps else 1.0,
            "evicted_rounds": self.evicted_rounds, "recalls": self.recalls, "refills": self.refills,
            "recalled_rounds": list(self.recalled_rounds),
            "retrieval": None if self.retrieval is None else self.retrieval.stats(),
        }

    def __repr__(self) -> str:
        return (f"TieredCache(session={self.session_id!r}, seen={self.seen}, hot={self.stored}, "
                f"max_kv_len={self.max_kv_len}, sinks={self.sink_tokens}, rounds={len(self.rounds)})")

    # --- hooks called by transformers and the layers -------------------------------------------
    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The model asks this once per forward, before any layer runs: refill first."""
        if layer_idx == 0 and self.moves.check:
            self.moves.prepare_step()
        if layer_idx >= len(self.tiered):
            return super().get_mask_sizes(query_length, layer_idx)
        return self.tiered[layer_idx].get_mask_sizes(query_length)

    def room_for(self, q: int) -> int:
        """Buffer room a step of ``q`` tokens allocates: ``window_slack``, or none when the
        session would not fit the router's budget with it (the storage is then exact)."""
        slack, r = self.window_slack, self.router
        if slack and r is not None and r.limit is not None:
            lay = self.tiered[0]
            if not r.has_room(self, (lay.capacity_after(q, slack) - lay.held) * self.geo.session_token_bytes):
                return 0
        return slack

    def miss_next(self) -> None:
        """The next step runs on bytes read from below first: a hot miss."""
        self.counts.miss_next()

    def step_waited(self) -> None:
        """The running step waited for a read from below (a retrieval fetch): a hot miss."""
        self.counts.waited()

    def step_begin(self, q: int) -> None:
        """The first layer of a step of ``q`` tokens: its shift, room and budget."""
        self.counts.begin()
        lay = self.tiered[0]
        self.rotation.begin_step(lay.window_start, lay.pinned, lay.seen + q, self.session_id)
        self.step_slack = self.room_for(q) if self.router is not None else self.window_slack
        if self.retrieval is not None:
            self.retrieval.step_begin()
        if self.router is not None:
            self.router.before_step(self, q)

    def step_keys(self, keys: torch.Tensor, start: int) -> None:
        """The summary layer's keys of a step (tokens from ``start``): the open round's;
        the first step of a new round is the automatic recall's query."""
        if (start == self.round_log.start and self.auto_recall and self.recall_rounds
                and self.rounds and self.warm is not None and self.max_kv_len is not None
                and not self.recalled.active):
            self.recalled.query = keys
        self.round_log.add(keys)

    def step_end(self) -> None:
        """The last layer of a step: count it, queue block records, recall, budget."""
        self.counts.end()
        if self.retrieval is not None:
            self.retrieval.queue_records()
        query, self.recalled.query = self.recalled.query, None
        if query is not None:
            if self.router is not None:
                self.router.account(self)  # this step's growth first: the recall reserves room
            self.recalled.auto(query, self.recall_rounds)
        if self.router is not None:
            self.router.after_step(self)

    def hand_down(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue tokens ``[start, start + T)`` of ``layer`` for the warm tier."""
        self.spill.kv(layer, start, k, v)

    # --- recall -----------------------------------------------------------------------------------
    def rank(self, query: torch.Tensor | np.ndarray) -> list[int]:
        """Closed rounds not fully in the window, most similar to ``query`` first (:meth:`Recall.rank`)."""
        return self.recalled.rank(query)

    def recall(self, rounds: list[int] | None = None, *, query: Any = None, k: int = 1) -> list[int]:
        """Bring closed rounds back into the attended window until the next ``end_round()``
        (``rounds``, or the ``k`` most similar to ``query``: :meth:`Recall.recall`)."""
        return self.recalled.recall(rounds, query=query, k=k)

    def clear_recall(self) -> None:
        """End the active recall (``end_round`` does this)."""
        self.recalled.clear()

    def recalled_blocks(self, layout: BlockLayout) -> set[int]:
        """Blocks that overlap the active recall (retrieval leaves them to it)."""
        return self.recalled.blocks(layout)

    # --- budget moves and resume (:mod:`kvfs.torch.cache_moves`) --------------------------------
    def evict_oldest_round(self, min_tokens: int = 1) -> int:
        """Move the window's oldest round to the warm tier (:meth:`Moves.evict_oldest_round`);
        the bytes freed on the device. Between steps only."""
        return self.moves.evict_oldest_round(min_tokens)

    def evict_reps(self) -> int:
        """Free the retrieval's representatives, rebuilt before the next step
        (:meth:`Moves.evict_reps`)."""
        return self.moves.evict_reps()

    def evict_sinks(self) -> int:
        """Move the sinks to the warm tier, the budget's last resort (:meth:`Moves.evict_sinks`)."""
        return self.moves.evict_sinks()

    def load(self, device: torch.device | str = "cpu") -> TieredCache:
        """Rebuild this (empty) cache from the session's stored meta.json and layer files
        (:func:`kvfs.torch.cache_moves.resume`)."""
        resume(self, device)
        self.moves.check = True
        return self

    # --- rounds --------------------------------------------------------------------------------
    def current_summary(self) -> np.ndarray:
        """Summary vector of the open round so far (e.g. a new question: use it as a recall query)."""
        return self.round_log.summary()

    def end_round(self) -> int | None:
        """Close the current round ``[start, seen)``; returns its index (None if it was empty).

        Queues its summary (``put_summary``) and a meta.json snapshot on the spill thread, and
        ends any active recall.
        """
        self.clear_recall()
        closed = self.round_log.close(self.seen)
        if closed is None:
            return None
        idx, summary = closed
        if self.spiller is not None:
            self.spill.summary(idx, summary)
            self._queue_meta()
        self.counts.publish()
        metrics.update_hot_hit_rate()
        return idx

    def _queue_meta(self) -> int | None:
        """Queue a meta.json snapshot that claims only tokens already queued for appending."""
        if self.spiller is None:
            return None
        tokens = min(lay.spilled for lay in self.tiered)
        rounds = [list(r) for r in self.rounds if r[1] <= tokens]
        meta = build_meta(self.fingerprint, self.geo, tokens, rounds)
        if self.retrieval is not None and tokens == self.seen:  # what the next step attends
            self.retrieval.queue_records()
            meta["retrieval"] = self.retrieval.meta_state(tokens)
        return self.spill.meta(meta)

    def flush(self, wait: bool = True) -> None:
        """Copy the window's not-yet-stored tokens below and write meta.json (between steps).

        After ``flush()`` every token seen is in the warm tier; the window stays on the device.
        """
        self.counts.publish()
        if self.spiller is None:
            return
        for lay in self.tiered:
            lay.flush_pending()
        self._queue_meta()
        self.spill.flush(wait)

    # --- branching --------------------------------------------------------------------------------
    def copy_state_to(self, other: TieredCache) -> None:
        """Make ``other`` (a new, empty cache of the same model whose session holds a copy of
        this one's stored bytes) continue exactly like this one: device tensors cloned,
        rounds, the open round's key sum and the active recall copied. Between steps."""
        if other.geo != self.geo or other.fingerprint != self.fingerprint:
            raise ValueError("copy_state_to needs a cache of the same model")
        for src, dst in zip(self.tiered, other.tiered, strict=True):
            src.copy_to(dst)
        self.round_log.copy_to(other.round_log)
        self.recalled.copy_to(other.recalled)
        other.rotation.adopt(self.rotation)
        other.moves.sinks_moved = self.moves.sinks_moved
        other.moves.check = True
        if self.retrieval is not None and other.retrieval is not None:
            self.retrieval.copy_to(other.retrieval)

    # --- the rest of transformers' surface ---------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: assisted and
        prompt-lookup decoding cut the rejected draft tokens). Only without a window
        (``max_kv_len=None``): with one, the tokens that left the device would have to come
        back and what they chose for retrieval be undone. Never below the open round's start;
        stored copies past the cut (after a ``flush``) are truncated."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the number of tokens to remove as a negative count, "
                             f"got {tokens_to_remove}")
        n = -int(tokens_to_remove)
        if n == 0 or not self.tiered[0].is_initialized:
            return
        if self.max_kv_len is not None:
            raise NotImplementedError(
                f"TieredCache with a window (max_kv_len={self.max_kv_len}) cannot be cropped: tokens "
                "have left the device; for assisted or prompt-lookup decoding use max_kv_len=None")
        new = self.seen - n
        start = self.round_log.start
        if new < start:
            raise ValueError(f"crop of {n} tokens would cut into closed rounds (the open round "
                             f"starts at token {start}, {self.seen} seen)")
        stored = max(lay.spilled for lay in self.tiered)
        for lay in self.tiered:
            lay.cut_to(new)
        if stored > new and self.spiller is not None and self.warm is not None:
            self.spill.wait()
            for layer in range(self.num_layers):
                if self.warm.size(self.session_id, layer) > new * self.geo.token_bytes:
                    self.warm.truncate(self.session_id, layer, new * self.geo.token_bytes)
            self._queue_meta()
        keys = self.tiered[self.summary_layer].keys  # the open round's key sum, from its keys
        assert keys is not None  # initialized above
        self.round_log.restart(keys, new)

    def __deepcopy__(self, memo: dict) -> TieredCache:
        """A copy that continues like this cache: only for a cache without tiers (``warm=None``);
        a session's stored copies are branched with :meth:`KVRouter.fork`."""
        if self.warm is not None:
            raise TypeError(f"copy.deepcopy cannot copy session {self.session_id!r}: it lives in the "
                            f"warm and cold tiers too; branch it with KVRouter.fork({self.session_id!r}, "
                            "new_id), which copies the stored tokens and continues exactly")
        other = TieredCache(self.config, session_id=self.session_id, warm=None,
                            max_kv_len=self.max_kv_len, sink_tokens=self.sink_tokens,
                            summary_dim=self.summary_dim, dtype=self.geo.dtype)
        other.fingerprint = self.fingerprint
        self.copy_state_to(other)
        other.moves.check = False
        memo[id(self)] = other
        return other

    # --- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop this cache's own spill thread (if it has one) after draining it."""
        self.counts.publish()
        if self._closed:
            return
        self._closed = True
        self.spill.close()

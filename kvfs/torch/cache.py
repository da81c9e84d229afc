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
* Long sessions: positions keep counting (the query of token ``t`` is at position ``t``),
  so without re-rotation the sinks sit ``t`` positions away from it; once ``t`` passes the
  model's ``max_position_embeddings`` that is a distance the model was never trained on.
  ``rope_rerotate=True`` (RoPE models, :mod:`kvfs.torch.rope`) rotates the stored sinks'
  keys so they sit just before the window (at ``window_start - S``, rounded down to a
  multiple of ``rope_quantum`` tokens) and recalled rounds just before the sinks: every
  distance a step attends stays within the window, as with transformers' former
  ``SinkCache``. Only the device copies are rotated; the tiers below hold the model's own
  keys. The cache logs one ``logging.warning`` (logger ``kvfs.torch.cache``) when a session
  without re-rotation crosses ``max_position_embeddings``.
* Tokens already copied below by :meth:`TieredCache.flush` are not appended again when they
  later fall out of the window (``spilled`` per layer). Tokens leave in batches: the ones
  that will fall out within ``window_slack`` steps are handed down together (see
  :mod:`kvfs.torch.layer` for the buffer that makes a decode step cost no window copy).

Rounds: a round is the tokens processed between two :meth:`TieredCache.end_round` calls
(``[start, end)`` in meta.json). Note that ``generate`` does not feed its last sampled token
through the model, so that token is processed at the start of the next call and belongs to
the next round.

Recall (:meth:`TieredCache.recall`): the chosen closed rounds' tokens that are no longer
attended (outside the sinks and the window) are read back from the warm tier (exact bytes)
and attended between the sinks and the window, in round order, for every step until the
next ``end_round()`` (or :meth:`TieredCache.clear_recall`). Their keys carry their original
rotary positions (with ``rope_rerotate``: moved to end where the sinks begin); they are copies (the window and ``spilled`` are unchanged) and a new
``recall`` replaces the previous one.

Automatic recall (``auto_recall=True``, ``recall_rounds = k``): at the first step of each
new round the keys of that step's input (summary layer) rank the older rounds by their
summaries (:meth:`TieredCache.rank`) and the top ``k`` are recalled for the rest of the
round, within the router's device budget (fewer rounds when they would not fit). The first
step itself attends without them (its attention mask is built before any layer runs).

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

import kvfs.torch.attention as attention
from kvfs.ops import metrics
from kvfs.torch.cache_moves import MovesMixin
from kvfs.torch.cache_recall import RecallMixin
from kvfs.torch.compat import require_cache_keyword
from kvfs.torch.fingerprint import (
    KVGeometry,
    build_meta,
    fingerprint,
    geometry,
)
from kvfs.torch.layer import TieredLayer, window_slack
from kvfs.torch.recall import summarize_keys
from kvfs.torch.retrieval import FRESH_BLOCKS, Retrieval
from kvfs.torch.rope import RopeShift
from kvfs.torch.spill import Spiller

log = logging.getLogger("kvfs.torch.cache")

#: defaults when neither the caller nor the profile sets them
DEFAULT_SINK_TOKENS = 4
DEFAULT_AUTO_RECALL = False  # on per profile: each recall is one read from below per round
DEFAULT_RECALL_ROUNDS = 2
DEFAULT_ROPE_REROTATE = False
DEFAULT_RETRIEVAL = False  # on per profile (every shipped one)
DEFAULT_RETRIEVAL_BLOCK = 16


class TieredCache(RecallMixin, MovesMixin, Cache):
    """A windowed, tiered KV cache for one session (see the module docstring for semantics).

    Build it through :meth:`kvfs.torch.KVRouter.cache` (budget, shared spill thread), or
    directly: ``TieredCache(model, warm=WarmTier(...), session_id="s1", max_kv_len=24)``.
    ``warm=None`` gives a plain windowed cache whose dropped tokens are discarded.
    """

    def __init__(self, model_or_config: Any, *, session_id: str = "default", warm: Any = None,
                 max_kv_len: int | None = 24, sink_tokens: int = DEFAULT_SINK_TOKENS,
                 auto_recall: bool = DEFAULT_AUTO_RECALL, recall_rounds: int = DEFAULT_RECALL_ROUNDS,
                 spiller: Spiller | None = None, router: Any = None,
                 summary_dim: int = 128, dtype: torch.dtype | None = None,
                 rope_rerotate: bool | str = DEFAULT_ROPE_REROTATE,
                 rope_reach: int | None = None, retrieval: bool = DEFAULT_RETRIEVAL,
                 retrieval_block: int = DEFAULT_RETRIEVAL_BLOCK,
                 retrieval_bytes: int | None = None) -> None:
        require_cache_keyword()
        if max_kv_len is not None and max_kv_len < 1:
            raise ValueError(f"max_kv_len must be >= 1 or None, got {max_kv_len}")
        if rope_reach is not None and rope_reach < 1:
            raise ValueError(f"rope_reach must be >= 1 or None, got {rope_reach}")
        if sink_tokens < 0 or recall_rounds < 0:
            raise ValueError(f"sink_tokens and recall_rounds must be >= 0, got {sink_tokens}, "
                             f"{recall_rounds}")
        self.geo: KVGeometry = geometry(model_or_config, dtype)
        self.fingerprint = fingerprint(model_or_config)
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.geo.num_layers)])
        self.session_id = session_id
        self.warm = warm
        self.max_kv_len = max_kv_len
        self.sink_tokens = int(sink_tokens)
        self.window_slack = window_slack(max_kv_len, self.sink_tokens)  # buffer room, tokens
        # sinks re-rotated toward the window (no window: every position is attended anyway)
        mode = {False: None, "off": None, True: "window"}.get(rope_rerotate, rope_rerotate)
        if mode not in (None, "window", "reach"):
            raise ValueError(f"rope_rerotate must be off, window or reach, got {rope_rerotate!r}")
        self.rope_mode: str | None = mode if max_kv_len is not None else None
        self.rope: RopeShift | None = RopeShift.of(model_or_config) if self.rope_mode else None
        self.rope_quantum = max(1, self.window_slack)
        self.step_sink_shift = 0  # the sinks' shift for the step being run
        self.auto_recall = bool(auto_recall)
        self.recall_rounds = int(recall_rounds)
        self.config = getattr(model_or_config, "config", model_or_config)
        self.max_positions: int | None = getattr(self.config, "max_position_embeddings", None)
        # reach: the farthest the sinks may be from a query (within what the model was
        # trained on, a quantum of margin)
        reach = [r for r in (rope_reach, self.max_positions and self.max_positions - 1 - self.rope_quantum)
                 if r]
        self.rope_reach: int | None = min(reach) if reach and self.rope_mode == "reach" else None
        self._warned_positions = False
        self._auto_query: torch.Tensor | None = None
        self.sinks_moved = False  # the budget took the sinks too (read back before a step)
        # storage may miss what the next step attends (budget moves, a branch): check first
        self._check_refill = True
        self.num_layers = self.geo.num_layers
        self.summary_layer = self.num_layers - 1
        self.summary_dim = summary_dim
        self.router = router
        self._own_spiller = spiller is None and warm is not None
        self.spiller = spiller if spiller is not None else (Spiller(warm) if warm is not None else None)
        self.rounds: list[list[int]] = []
        self._round_start = 0
        self._round_sum: torch.Tensor | None = None
        self._round_keys: list[torch.Tensor] = []  # summary-layer keys not yet summed
        self._round_count = 0
        self.recalled_rounds: list[int] = []
        self._recall_spans: list[tuple[int, int]] = []
        self.recall_shifts: list[int] = []  # per recalled span, positions its keys moved
        self._miss_pending = False  # the next step had to read from below first
        self._closed = False
        # per-session statistics
        self.steps = 0
        self.hits = 0
        self.misses = 0
        self.spilled_tokens = 0  # layer-0 tokens handed down
        self.evicted_rounds = 0  # watermark moves of this session
        self.recalls = 0
        self.auto_recalls = 0
        self.refills = 0  # windows read back after budget moves
        self._warned_discard = False
        self.step_slack = self.window_slack  # the room the current step's layers allocate
        self._hits_unpublished = 0  # hot hits not yet added to the process-wide counter
        self._step_miss = False  # the running step read from below first
        self.retrieval: Retrieval | None = None
        self.retrieval_block = int(retrieval_block)
        if retrieval and max_kv_len is not None:
            self.retrieval = self._make_retrieval(model_or_config, retrieval_block, retrieval_bytes)

    def _make_retrieval(self, model_or_config: Any, block: int, budget: int | None) -> Retrieval | None:
        """The session's retrieval: ``budget`` device bytes of blocks (all layers),
        ``budget // (block * session_token_bytes)`` per layer, all attended but
        :data:`~kvfs.torch.retrieval.FRESH_BLOCKS` kept for reuse."""
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
        return Retrieval(self, block, attend)

    # --- views -------------------------------------------------------------------------------
    @property
    def seen(self) -> int:
        return self.layers[0].seen

    @property
    def stored(self) -> int:
        return self.layers[0].stored

    @property
    def sinks(self) -> int:
        """Sink tokens on the device (the session's first ``min(sink_tokens, seen)``)."""
        return self.layers[0].pinned

    @property
    def window_start(self) -> int:
        """First window token on the device now (budget moves may have taken the front)."""
        return self.layers[0].window_start

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
        lay = self.layers[0]
        ret = 0 if self.retrieval is None else self.retrieval.device_bytes
        return (lay.held + lay.recalled) * self.geo.session_token_bytes + ret

    @property
    def device(self) -> torch.device | None:
        return getattr(self.layers[0], "device", None)

    def stats(self) -> dict[str, Any]:
        self._publish_hits()
        return {
            "seen": self.seen, "hot_tokens": self.stored, "sink_tokens": self.sinks,
            "recalled_tokens": self.layers[0].recalled, "auto_recalls": self.auto_recalls,
            "hot_bytes": self.hot_bytes, "spilled_tokens": self.spilled_tokens,
            "rounds": len(self.rounds), "steps": self.steps, "hits": self.hits, "misses": self.misses,
            "hit_rate": self.hits / self.steps if self.steps else 1.0,
            "evicted_rounds": self.evicted_rounds, "recalls": self.recalls, "refills": self.refills,
            "recalled_rounds": list(self.recalled_rounds),
            "retrieval": None if self.retrieval is None else self.retrieval.stats(),
        }

    def __repr__(self) -> str:
        return (f"TieredCache(session={self.session_id!r}, seen={self.seen}, hot={self.stored}, "
                f"max_kv_len={self.max_kv_len}, sinks={self.sink_tokens}, rounds={len(self.rounds)})")

    # --- hooks called from the layers ---------------------------------------------------------
    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The model asks this once per forward, before any layer runs: refill first."""
        if layer_idx == 0 and self._check_refill:
            self._prepare_step()
        if layer_idx >= len(self.layers):
            return super().get_mask_sizes(query_length, layer_idx)
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def room_for(self, q: int) -> int:
        """Buffer room a step of ``q`` tokens allocates: ``window_slack``, or none when the
        session would not fit the router's budget with it (the storage is then exact)."""
        slack, r = self.window_slack, self.router
        if slack and r is not None and r.limit is not None:
            lay = self.layers[0]
            if not r.has_room(self, (lay.capacity_after(q, slack) - lay.held) * self.geo.session_token_bytes):
                return 0
        return slack

    #: hot hits are added to the process-wide counter in batches (a counter update costs as
    #: much as a layer's cache work at decode): every this many steps, at round ends and stats
    PUBLISH_HITS_EVERY = 64

    def _publish_hits(self) -> None:
        if self._hits_unpublished:
            metrics.hot_hits.inc(self._hits_unpublished)
            self._hits_unpublished = 0

    def _step_begin(self, q: int) -> None:
        self.steps += 1
        if self.rope is not None:  # one shift for every layer of this step (same window)
            lay = self.layers[0]
            p = lay.pinned
            self.step_sink_shift = self.sink_shift_for(lay.window_start, p) if p else 0
        self.step_slack = self.room_for(q) if self.router is not None else self.window_slack
        mp = self.max_positions
        if mp and not self._warned_positions and self.seen + q > mp:
            self._warned_positions = True
            if self.rope is None:
                log.warning("session %r passes the model's max_position_embeddings (%d) at token "
                            "%d: the sinks are now farther from the query than the model was "
                            "trained on (rope_rerotate keeps them next to the window)",
                            self.session_id, mp, self.seen + q)
            else:
                log.info("session %r passes max_position_embeddings (%d) at token %d; its sinks "
                         "are re-rotated next to the window", self.session_id, mp, self.seen + q)
        self._step_miss, self._miss_pending = self._miss_pending, False
        if self.retrieval is not None:
            self.retrieval.step_begin()
        if self.router is not None:
            self.router.before_step(self, q)

    def step_waited(self) -> None:
        """The running step waited for a read from below (a retrieval fetch): a hot miss."""
        self._step_miss = True

    def _count_step(self) -> None:
        if self._step_miss:
            self._step_miss = False
            self.misses += 1
            metrics.hot_misses.inc()
        else:
            self.hits += 1
            self._hits_unpublished += 1
            if self._hits_unpublished >= self.PUBLISH_HITS_EVERY:
                self._publish_hits()

    def _step_end(self) -> None:
        self._count_step()
        if self.retrieval is not None:
            self.retrieval.queue_records()
        if self._auto_query is not None:
            query, self._auto_query = self._auto_query, None
            if self.router is not None:
                self.router.account(self)  # this step's growth first: the recall reserves room
            self._auto_recall(query)
        if self.router is not None:
            self.router.after_step(self)

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

    def _accumulate(self, key_states: torch.Tensor, start: int) -> None:
        """Add a step's summary-layer keys (tokens from ``start``) to the open round (folded
        every 32 steps); the first step of a new round is the automatic recall's query."""
        if (start == self._round_start and self.auto_recall and self.recall_rounds
                and self.rounds and self.warm is not None and self.max_kv_len is not None
                and not self._recall_spans):
            self._auto_query = key_states
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
        self._publish_hits()
        metrics.update_hot_hit_rate()
        return idx

    def _queue_meta(self) -> int | None:
        """Queue a meta.json snapshot that claims only tokens already queued for appending."""
        if self.spiller is None:
            return None
        tokens = min(lay.spilled for lay in self.layers)
        rounds = [list(r) for r in self.rounds if r[1] <= tokens]
        meta = build_meta(self.fingerprint, self.geo, tokens, rounds)
        if self.retrieval is not None and tokens == self.seen:  # what the next step attends
            self.retrieval.queue_records()
            meta["retrieval"] = self.retrieval.meta_state(tokens)
        return self.spiller.submit_call(self.warm.put_meta, self.session_id, meta)

    def flush(self, wait: bool = True) -> None:
        """Copy the window's not-yet-stored tokens below and write meta.json (between steps).

        After ``flush()`` every token seen is in the warm tier; the window stays on the device.
        """
        self._publish_hits()
        if self.spiller is None:
            return
        for lay in self.layers:
            lay.flush_pending()
        self._queue_meta()
        self.spiller.submit_call(self.warm.flush, self.session_id)
        if wait:
            self.spiller.wait()

    # --- branching --------------------------------------------------------------------------------
    def copy_state_to(self, other: TieredCache) -> None:
        """Make ``other`` (a new, empty cache of the same model whose session holds a copy of
        this one's stored bytes) continue exactly like this one: device tensors cloned,
        rounds, the open round's key sum and the active recall copied. Between steps."""
        if other.geo != self.geo or other.fingerprint != self.fingerprint:
            raise ValueError("copy_state_to needs a cache of the same model")
        for src, dst in zip(self.layers, other.layers, strict=True):
            src.copy_to(dst)
        self._fold()
        other.rounds = [list(r) for r in self.rounds]
        other._round_start = self._round_start
        other._round_sum = None if self._round_sum is None else self._round_sum.clone()
        other._round_count = self._round_count
        other._recall_spans = list(self._recall_spans)
        other.recall_shifts = list(self.recall_shifts)
        other.rope, other.rope_mode, other.rope_reach = self.rope, self.rope_mode, self.rope_reach
        other.sinks_moved = self.sinks_moved
        other._check_refill = True
        other.recalled_rounds = list(self.recalled_rounds)
        if self.retrieval is not None and other.retrieval is not None:
            self.retrieval.copy_to(other.retrieval)

    @property
    def recalling(self) -> bool:
        return bool(self._recall_spans)

    def recalled_blocks(self, layout: Any) -> set[int]:
        """Blocks that overlap the active recall (retrieval leaves them to it)."""
        out: set[int] = set()
        o, n = layout.origin, layout.block
        for a, b in self._recall_spans:
            out.update(range(max(0, (a - o) // n), -(-(b - o) // n)))
        return out

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
        if n == 0 or not self.layers[0].is_initialized:
            return
        if self.max_kv_len is not None:
            raise NotImplementedError(
                f"TieredCache with a window (max_kv_len={self.max_kv_len}) cannot be cropped: tokens "
                "have left the device; for assisted or prompt-lookup decoding use max_kv_len=None")
        new = self.seen - n
        if new < self._round_start:
            raise ValueError(f"crop of {n} tokens would cut into closed rounds (the open round "
                             f"starts at token {self._round_start}, {self.seen} seen)")
        stored = max(lay.spilled for lay in self.layers)
        for lay in self.layers:
            lay.cut_to(new)
        if stored > new and self.spiller is not None:
            self.spiller.wait()
            for layer in range(self.num_layers):
                if self.warm.size(self.session_id, layer) > new * self.geo.token_bytes:
                    self.warm.truncate(self.session_id, layer, new * self.geo.token_bytes)
            self._queue_meta()
        keys = self.layers[self.summary_layer].keys  # the open round's key sum, from its keys
        self._round_sum, self._round_count = None, new - self._round_start
        self._round_keys = [keys[..., self._round_start:new, :]] if self._round_count else []

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
        other._check_refill = False
        memo[id(self)] = other
        return other

    # --- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop this cache's own spill thread (if it has one) after draining it."""
        self._publish_hits()
        if self._closed:
            return
        self._closed = True
        if self._own_spiller and self.spiller is not None:
            self.spiller.close()

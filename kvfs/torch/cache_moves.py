"""Budget moves, refill and resume: what the device holds of a session, changed between steps.

Three ways: the router moves the oldest rounds of an idle session (and, last, its retrieval
representatives and its sinks) out of the device to stay under the device budget; before
the session's next step the missing window and recalled copies are read back and the
representatives rebuilt (refill); and a stored session is rebuilt from its meta.json and
layer files (resume). Semantics in :mod:`kvfs.torch.cache`. :class:`Moves`
owns whether the sinks were moved and whether the next step must check for a refill;
what it needs of the cache is :class:`MovesHost` (it never imports the cache). These run
between steps and wait on the spill thread.

Budget moves and refill: the router may move the oldest rounds of an idle session's window
(and its recalled copies) to the warm tier to stay under the device budget. Before that
session's next step (when the model asks ``get_mask_sizes``, i.e. before any layer runs)
the missing tail of the window and the recalled copies are read back, so what a step
attends never depends on the budget: only its latency does. A step that had to read from
the warm/cold tier first (refill, a fresh recall, the first step after resume) counts as a
hot miss; every other step is a hot hit.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from kvfs.torch.cache_recall import Recall, RecallHost
from kvfs.torch.fingerprint import dtype_name
from kvfs.torch.meta import reconcile
from kvfs.torch.meta import stored as stored_meta
from kvfs.torch.recall import read_spans, read_tokens
from kvfs.torch.rounds import Rounds

log = logging.getLogger("kvfs.torch.cache")  # resume messages are the cache's


class MovableRetrieval(Protocol):
    """The part of a session's retrieval that budget moves, refill and resume touch."""

    @property
    def refill_tokens(self) -> int: ...
    @property
    def refill_rep_bytes(self) -> int: ...
    def missing(self) -> bool: ...
    def refill(self, device: torch.device | str) -> None: ...
    def release_device(self) -> int: ...
    def release_reps(self) -> int: ...
    def load(self, meta: dict, tokens: int, window_start: int, device: torch.device | str) -> None: ...


class MovesHost(RecallHost, Protocol):
    """What moves and resume read and ask of their cache."""

    fingerprint: str
    num_layers: int
    summary_layer: int
    recalled: Recall
    round_log: Rounds

    @property
    def retrieval(self) -> MovableRetrieval | None: ...
    @property
    def window_start(self) -> int: ...
    @property
    def stored(self) -> int: ...
    @property
    def sinks(self) -> int: ...
    def window_from(self, seen: int) -> int: ...


class Moves:
    """One session's budget moves and refill (module docstring)."""

    def __init__(self, host: MovesHost) -> None:
        self.host = host
        self.sinks_moved = False  # the budget took the sinks too (read back before a step)
        # storage may miss what the next step attends (budget moves, a branch): check first
        self.check = True
        self.refills = 0  # windows read back after budget moves
        self.evicted_rounds = 0  # watermark moves of this session

    # --- refill ---------------------------------------------------------------------------------
    def prepare_step(self) -> None:
        """Read back what budget moves took from the window (and recalled copies)."""
        h = self.host
        lay0 = h.tiered[0]
        if h.warm is None or not lay0.is_initialized:
            self.check = h.warm is not None  # nothing to read back without a warm tier
            return
        ws, start = h.window_start, h.attended_start
        spans = [(0, min(h.sink_tokens, h.seen))] if self.sinks_moved else []
        if ws > start:
            spans.append((start, ws))
        missing = sum(b - a for a, b in spans)
        rec = h.recalled.missing()
        ret = h.retrieval if h.retrieval is not None and h.retrieval.missing() else None
        if missing <= 0 and not rec and ret is None:
            self.check = False
            return
        n_rec = sum(b - a for a, b in rec) + (ret.refill_tokens if ret is not None else 0)
        if h.router is not None:
            h.router.reserve(h, (missing + n_rec) * h.geo.session_token_bytes
                             + (ret.refill_rep_bytes if ret is not None else 0))
        if h.spiller is not None:
            h.spiller.wait()
        dev = lay0.device
        if missing > 0:
            kv = read_spans(h.warm, h.session_id, h.geo, spans, dev)
            for lay, (k, v) in zip(h.tiered, kv, strict=True):
                lay.prepend(k, v)  # sinks moved: the storage was empty, this is sinks + window
            self.sinks_moved = False
            self.refills += 1
        if rec:
            h.recalled.materialize(rec, dev)
        if ret is not None:
            ret.refill(dev)
        self.check = False
        h.miss_next()
        if h.router is not None:
            h.router.account(h)

    # --- moves out (router watermark) ----------------------------------------------------------
    def evict_oldest_round(self, min_tokens: int = 1) -> int:
        """Move the window's oldest round (at least ``min_tokens`` tokens) to the warm tier.

        Drops recalled copies (then retrieved blocks) first: they are read back, like the
        window, before the session's next step. Synchronous: returns after the bytes are in
        the warm tier. Returns the bytes freed on the device. Call between steps only.
        """
        h = self.host
        before = h.hot_bytes
        self.check = True
        if h.recalled.drop_copies():
            return before - h.hot_bytes
        if h.retrieval is not None and h.retrieval.release_device():
            return before - h.hot_bytes
        movable = h.stored - h.sinks  # the sinks stay on the device
        if movable <= 0:
            return 0
        ws = h.window_start
        upto = next((b for a, b in h.rounds if b > ws), None)
        if upto is None or upto - ws < min_tokens:
            upto = max(upto or 0, ws + min_tokens)  # inside the open round: token-granular
        n = min(upto - ws, movable)
        for lay in h.tiered:
            lay.drop_front(n)
        if h.spiller is not None:
            h.spiller.wait()
        self.evicted_rounds += 1
        return before - h.hot_bytes

    def evict_reps(self) -> int:
        """Free the retrieval's representatives of the old blocks (rebuilt from the stored
        keys before the session's next step): a last resort of the budget, before the sinks,
        once no window token of any session is left to move. Returns the bytes freed."""
        h = self.host
        if h.retrieval is None:
            return 0
        freed = h.retrieval.release_reps()  # the refill waits for the spill before rebuilding
        if freed:
            self.check = True
            self.evicted_rounds += 1
        return freed

    def evict_sinks(self) -> int:
        """Move the sinks to the warm tier: the budget's last resort once no window token of
        any session is left to move. Read back before the session's next step. Returns the
        bytes freed. Call between steps, after :meth:`evict_oldest_round` returned 0."""
        h = self.host
        if self.sinks_moved or h.sinks == 0 or h.stored != h.sinks:
            return 0
        before = h.hot_bytes
        self.check = True
        for lay in h.tiered:
            lay.flush_pending()
            lay.drop_all()
        self.sinks_moved = True
        if h.spiller is not None:
            h.spiller.wait()
        self.evicted_rounds += 1
        return before - h.hot_bytes


def resume(h: MovesHost, device: torch.device | str) -> None:
    """Rebuild ``h`` (an empty cache) from the session's stored meta.json and layer files.

    Checks meta.json field by field and the fingerprint (:class:`KVMismatch`), and every
    layer's length (:class:`KVCorrupt`); layer bytes beyond meta.json's ``tokens`` are cut
    only as a crash tail (:func:`kvfs.torch.meta.reconcile`). The device holds the sinks and
    the last ``max_kv_len`` tokens again.
    """
    if h.warm is None:
        raise RuntimeError("resume needs a warm tier")
    sid = h.session_id
    meta = stored_meta(h.warm, sid)  # bounded and checked field by field
    if meta is None:
        raise KeyError(f"session {sid!r}: no meta.json in the warm or cold tier")
    # against the model and the files; only a crash tail is cut (kvfs.torch.meta)
    tokens = reconcile(h.warm, sid, meta, h.fingerprint, h.geo, h.num_layers)
    sinks = min(h.sink_tokens, tokens)
    start = h.window_from(tokens)
    spans = [(0, tokens)] if start <= sinks else [(0, sinks), (start, tokens)]
    # straight from where the bytes are: the window goes to the device, not to RAM first
    kv = read_spans(h.warm, sid, h.geo, spans, device, promote=False, checked=True)
    for lay, (k, v) in zip(h.tiered, kv, strict=True):
        lay.set_window(k, v, tokens)
    if h.retrieval is not None:  # bounds of the blocks before the window, chosen blocks
        h.retrieval.load(meta, tokens, start, device)
    rounds = h.round_log
    rounds.restore(meta["rounds"])
    if rounds.start < tokens:  # an open round: rebuild its running key sum
        k, _ = read_tokens(h.warm, sid, h.summary_layer, h.geo, rounds.start, tokens, device,
                           promote=False, checked=True)
        rounds.add(k)
    h.miss_next()  # the first step runs on a window read from below
    log.info("resumed session %r: %d tokens, %d rounds, %d hot (dtype %s)", sid, tokens,
             len(rounds.closed), h.stored, dtype_name(h.geo.dtype))

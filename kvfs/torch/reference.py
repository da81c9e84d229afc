"""Models and references for the hot-tier tests, benchmarks and the demo (no hub downloads).

``tiny_llama(seed, dtype)`` always builds the same weights for the same arguments, in any
process, so a subprocess can rebuild "the same model" to resume a session. The real model,
SmolLM2-135M-Instruct, is :mod:`kvfs.torch.models`' (``load_smollm2``, ``smollm2_gguf``:
public API, re-exported here for the tests and tools).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from kvfs.torch.models import SMOLLM2_GGUF, load_smollm2, smollm2_gguf

__all__ = ["SMOLLM2_GGUF", "RetrievalReference", "WindowReference", "generate_turns",
           "load_smollm2", "profile_rope", "prompt", "smollm2_gguf", "tiny_config", "tiny_llama",
           "token_major"]


def tiny_config(**over: object) -> LlamaConfig:
    kw: dict = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                    max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.3,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None,
                    tie_word_embeddings=False)
    kw.update(over)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **over: object) -> LlamaForCausalLM:
    """A seeded random Llama (2 layers, 2 KV heads of 16 dims by default), eval mode.

    ``initializer_range=0.3`` makes greedy outputs depend on the context (at the default 0.02
    a random model repeats one token), so window and recall differences show in the tokens.
    """
    cfg = tiny_config(**over)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype).eval()  # type: ignore[arg-type]  # transformers' .to stub takes no dtype
    # no eos (fixed-length turns) and no pad token (so no generated id is ever masked out)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model


def profile_rope(name: str = "gov") -> dict:
    """The ``rope_rerotate``/``rope_reach`` arguments a router gives caches under profile
    ``name`` (a reference cache built like the router's)."""
    from kvfs.ops import profiles

    prof = profiles.load(name)
    return {"rope_rerotate": prof.rope_rerotate, "rope_reach": prof.rope_reach}


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    """A DynamicCache's layers (transformers types them as the union of every layer kind)."""
    return cast("list[DynamicLayer]", cache.layers)


def _kv(lay: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """An initialized layer's K and V."""
    assert lay.keys is not None and lay.values is not None
    return lay.keys, lay.values


def prompt(seed: int, n: int, vocab: int = 256) -> torch.Tensor:
    """``[1, n]`` random token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g)


# --- references for the exactness tests ----------------------------------------------------

def generate_turns(model, cache, turns: list[torch.Tensor], new_tokens: int,
                   end_round: bool = True) -> list[torch.Tensor]:
    """Multi-turn greedy generation through ``model.generate(..., cache=cache)``.

    ``turns``: the new user tokens of each turn (``[1, n]``). Each call passes the whole
    conversation so far (generate slices off what the cache has seen). Returns the tokens
    generated per turn.
    """
    dev = model.device
    ids = torch.empty(1, 0, dtype=torch.long, device=dev)
    outs = []
    for t in turns:
        ids = torch.cat([ids, t.to(dev)], dim=1)
        full = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                              max_new_tokens=new_tokens, do_sample=False)
        outs.append(full[:, ids.shape[1]:])
        ids = full
        if end_round and hasattr(cache, "end_round"):
            cache.end_round()
    return outs


def conversation(turns: list[torch.Tensor], outs: list[torch.Tensor]) -> torch.Tensor:
    """User turns and replies interleaved as one ``[1, n]`` id tensor."""
    return torch.cat([x for t, o in zip(turns, outs, strict=True) for x in (t, o)], 1)


def continue_turns(model: Any, cache: Any, ids: torch.Tensor, turns: list[torch.Tensor],
                   want: list[torch.Tensor], new_tokens: int) -> torch.Tensor:
    """Greedy turns on a (resumed) cache after the conversation ``ids``, each reply compared
    with the reference's tokens ``want`` (AssertionError at the first that differs); the
    conversation after them."""
    for t, w in zip(turns, want, strict=True):
        ids = torch.cat([ids, t], 1)
        full = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                              max_new_tokens=new_tokens, do_sample=False)
        if not torch.equal(full[:, ids.shape[1]:], w):
            raise AssertionError(f"turn after {ids.shape[1]} tokens: {full[:, ids.shape[1]:].tolist()} "
                                 f"!= {w.tolist()}")
        ids = full
        cache.end_round()
    return ids


class WindowReference:
    """A manual greedy loop that attends to exactly the first ``sinks`` tokens and the last
    ``window`` cached tokens plus the current input at every step (a DynamicCache cut after
    each step, explicit position ids); ``window=None`` keeps everything. ``history(l)``
    holds every K/V ever produced. ``prefix`` (optional, per layer) is extra K/V attended
    between the sinks and the window in the next steps (recall). ``rerotate`` (a quantum
    ``Q``): the sinks' keys are moved ``(window_start - sinks) // Q * Q`` positions later
    for each step, with the model's own rotary embedding (``rope_rerotate="window"``); or a
    function ``(window_start, sinks) -> shift`` (another rule, e.g. a cache's
    ``sink_shift_for``)."""

    def __init__(self, model, window: int | None, sinks: int = 4,
                 rerotate: int | Callable[[int, int], int] | None = None) -> None:
        self.model, self.window, self.sinks, self.rerotate = model, window, sinks, rerotate
        self.cache = DynamicCache(config=model.config)
        self.pos = 0
        self.pending: torch.Tensor | None = None  # last generated token, not yet fed
        n = model.config.num_hidden_layers
        self.hist_k: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.hist_v: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def rotate(self, k: torch.Tensor, shift: int) -> torch.Tensor:
        """``k`` moved ``shift`` positions later by the model's rotary embedding."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = self.model.model.rotary_emb(k, torch.tensor([[shift]], device=k.device))
        return apply_rotary_pos_emb(k, k, cos, sin)[1]

    def _sink_shift(self) -> int:
        own = _layers(self.cache)[0]
        if not self.rerotate or own.keys is None:
            return 0
        p = min(self.sinks, self.pos)
        ws = self.pos - (own.keys.shape[-2] - p)
        if callable(self.rerotate):
            return self.rerotate(ws, p)
        return (ws - p) // self.rerotate * self.rerotate

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> int:
        """One forward step over input ids ``x``; returns the greedy next token."""
        q = x.shape[1]
        cache = self.cache
        shift = self._sink_shift()
        if self.prefix is not None or shift:  # this step only: rotated sinks, recalled tokens
            p = min(self.sinks, self.pos)
            layers = _layers(self.cache)
            prefix: list[Any] = list(self.prefix) if self.prefix is not None else [None] * len(layers)
            data: list[Any] = []
            for pre, lay in zip(prefix, layers, strict=True):
                if lay.keys is None:
                    data.append(pre)
                    continue
                keys, values = _kv(lay)
                sk = self.rotate(keys[..., :p, :], shift) if shift else keys[..., :p, :]
                ks, vs = [sk], [values[..., :p, :]]
                if pre is not None:
                    ks.append(pre[0])
                    vs.append(pre[1])
                data.append((torch.cat(ks + [keys[..., p:, :]], -2),
                             torch.cat(vs + [values[..., p:, :]], -2)))
            cache = DynamicCache(ddp_cache_data=data)
        pos = torch.arange(self.pos, self.pos + q, device=x.device).unsqueeze(0)
        out = self.model(input_ids=x, position_ids=pos, cache=cache, use_cache=True)
        for i, lay in enumerate(_layers(cache)):
            lk, lv = _kv(lay)
            k, v = lk[..., -q:, :], lv[..., -q:, :]
            self.hist_k[i].append(k)
            self.hist_v[i].append(v)
            own = _layers(self.cache)[i]
            if cache is not self.cache:
                own.keys = k if own.keys is None else torch.cat([own.keys, k], -2)
                own.values = v if own.values is None else torch.cat([own.values, v], -2)
                own.is_initialized = True
            s, w = self.sinks, self.window
            ok, ov = _kv(own)
            if w is not None and ok.shape[-2] > s + w:
                own.keys = torch.cat([ok[..., :s, :], ok[..., -w:, :]], -2)
                own.values = torch.cat([ov[..., :s, :], ov[..., -w:, :]], -2)
        self.pos += q
        return int(out.logits[0, -1].argmax())

    def turn(self, new: torch.Tensor, new_tokens: int) -> torch.Tensor:
        dev = self.model.device
        new = new.to(dev)
        x = new if self.pending is None else torch.cat([self.pending, new], dim=1)
        toks = [self.step(x)]
        for _ in range(new_tokens - 1):
            toks.append(self.step(torch.tensor([[toks[-1]]], device=dev)))
        self.pending = torch.tensor([[toks[-1]]], device=dev)
        return torch.tensor([toks], device=dev)

    def history(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.hist_k[layer], -2), torch.cat(self.hist_v[layer], -2)


def token_major(k: torch.Tensor, v: torch.Tensor) -> bytes:
    """The layer-file bytes of ``[1,H,T,D]`` K/V: per token K then V."""
    tm = torch.stack((k[0].transpose(0, 1), v[0].transpose(0, 1)), dim=1).contiguous().cpu()
    return tm.reshape(-1).view(torch.uint8).numpy().tobytes()


class RetrievalReference(WindowReference):
    """:class:`WindowReference` with retrieval, written from the rule rather than the cache:
    each step attends the first ``sinks`` tokens, the blocks chosen for it, the window (the
    last ``window`` tokens reaching back to the start of their block of ``block`` tokens
    counted from ``sinks``) and its input. After a step, each layer's queries (recomputed
    by a pre-hook on its attention: ``q_proj`` and the rotary embedding) rank every block
    that has left the window by the default selector's scores of its representatives
    (:mod:`kvfs.torch.blocks`, from the full history), and the top ``attend`` are the next
    step's, in slots: a block
    that stays keeps its place, new ones take the freed places in ascending order (a selector
    that does not score every step holds the choice over decode steps that add no block).
    A step of several tokens first chooses its own: before each layer's attention, its
    queries rank the blocks that had left the window before the step, and that layer's
    attended K/V are rebuilt with the top ones (as many as it had), in slots.
    Llama layout."""

    def __init__(self, model, window: int, sinks: int, block: int, attend: int) -> None:
        super().__init__(model, None, sinks)
        self.win, self.block, self.attend = window, block, attend
        n = model.config.num_hidden_layers
        self.chosen: list[list[int]] = [[] for _ in range(n)]
        self.queries: list[torch.Tensor | None] = [None] * n
        self.scored = 0  # blocks at the last scoring
        self.decodes = 0  # single-token steps since the last step of several tokens
        self._live: tuple[Any, int, int, int, int] | None = None  # the step being run
        self._hooks = [lay.self_attn.register_forward_pre_hook(self._capture(i), with_kwargs=True)
                       for i, lay in enumerate(model.model.layers)]

    def _capture(self, i: int):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        def hook(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            q = module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim).transpose(1, 2)
            self.queries[i] = apply_rotary_pos_emb(q, q, cos, sin)[0]
            if self._live is not None and q.shape[-2] > 1 and self.chosen[i]:
                self._choose_in_step(i)
        return hook

    def _choose_in_step(self, i: int) -> None:
        """A step of several tokens: layer ``i``'s own queries choose its blocks among those
        that had left the window before the step, and its attended K/V are rebuilt."""
        from kvfs.torch.blocks import next_slots, scale_layout, scoring_layout, selector
        from kvfs.torch.retrieval import DEFAULT_SELECTOR

        query = self.queries[i]
        assert self._live is not None and query is not None
        cache, s, ws, n, nb = self._live
        b, o = self.block, self.sinks
        sel = selector(DEFAULT_SELECTOR, b)
        hk, hv = self.history(i)
        reps, scale = sel.represent(hk[..., o:o + nb * b, :], b)
        sc = None if scale is None else scale_layout(scale)[None]
        scores = sel.scores(query, scoring_layout(reps)[None], sc)[0]
        top = set(torch.topk(scores, len(self.chosen[i])).indices.tolist())
        self.chosen[i] = list(next_slots(tuple(self.chosen[i]), top))
        parts = [(0, s)] + [(o + c * b, o + (c + 1) * b) for c in self.chosen[i]] + [(ws, n)]
        lay = _layers(cache)[i]
        lay.keys = torch.cat([hk[..., a:e, :] for a, e in parts], -2)
        lay.values = torch.cat([hv[..., a:e, :] for a, e in parts], -2)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def scored_blocks(self, n: int) -> int:
        """Blocks that have left the window after ``n`` tokens."""
        return max(0, (self.window_from(n) - self.sinks) // self.block)

    def window_from(self, n: int) -> int:
        s = min(self.sinks, n)
        base = max(s, n - self.win)
        return base if base <= self.sinks else self.sinks + (base - self.sinks) // self.block * self.block

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> int:
        from kvfs.torch.blocks import scale_layout, scoring_layout, selector
        from kvfs.torch.retrieval import DEFAULT_SELECTOR

        q, n, b, o = x.shape[1], self.pos, self.block, self.sinks
        s, ws = min(self.sinks, n), self.window_from(n)
        data: list[Any] = []
        for i in range(len(self.hist_k)):
            if not self.hist_k[i]:
                data.append(None)
                continue
            hk, hv = self.history(i)
            parts = [(0, s)] + [(o + c * b, o + (c + 1) * b) for c in self.chosen[i]] + [(ws, n)]
            data.append((torch.cat([hk[..., a:e, :] for a, e in parts], -2),
                         torch.cat([hv[..., a:e, :] for a, e in parts], -2)))
        cache = DynamicCache(ddp_cache_data=data) if data[0] is not None else DynamicCache(config=self.model.config)
        pos = torch.arange(n, n + q, device=x.device).unsqueeze(0)
        self._live = (cache, s, ws, n, self.scored_blocks(n))
        try:
            out = self.model(input_ids=x, position_ids=pos, cache=cache, use_cache=True)
        finally:
            self._live = None
        for i, lay in enumerate(_layers(cache)):
            lk, lv = _kv(lay)
            self.hist_k[i].append(lk[..., -q:, :])
            self.hist_v[i].append(lv[..., -q:, :])
        self.pos = n + q
        nb = max(0, (self.window_from(self.pos) - o) // b)
        sel = selector(DEFAULT_SELECTOR, b)
        self.decodes = self.decodes + 1 if q == 1 else 0
        if not sel.every_step and q == 1 and self.decodes > sel.fresh and nb == self.scored and self.chosen[0]:
            nb = 0  # a decode step past the fresh ones that adds no block: the choice holds
        if nb:  # every layer's blocks scored at once, as the cache does, by its selector
            self.scored = nb
            reps = [sel.represent(self.history(i)[0][..., o:o + nb * b, :], b) for i in range(len(self.hist_k))]
            cents = torch.stack([scoring_layout(r) for r, _ in reps])
            scales = [s for _, s in reps if s is not None]
            scale = torch.stack([scale_layout(s) for s in scales]) if scales else None
            queries = [qs for qs in self.queries if qs is not None]  # every layer's, from its hook
            all_scores = sel.scores(torch.cat(queries), cents, scale)
        for i in range(len(self.hist_k)):
            if nb:
                top = set(torch.topk(all_scores[i], min(self.attend, nb)).indices.tolist())
                # slots: a block that stays keeps its place, new ones fill the freed places
                # in ascending order, then new places at the end
                old = self.chosen[i]
                new = sorted(top - set(old))
                order = [c if c in top else (new.pop(0) if new else None) for c in old]
                self.chosen[i] = [c for c in order if c is not None] + new
        return int(out.logits[0, -1].argmax())

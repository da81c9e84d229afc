"""Hot tier, one session: exactness against DynamicCache and a reference that attends the
first ``sinks`` tokens + the last ``W`` (StreamingLLM), spill bytes, flush without
duplicates, recall (explicit and automatic), refused models, the fingerprint over weights.
Tiny random models, greedy decoding, CPU."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache

from kvfs.torch import KVCorrupt, Spiller, SpillError, TieredCache
from kvfs.torch.recall import summarize_keys
from kvfs.torch.reference import WindowReference, generate_turns, prompt, tiny_llama, token_major

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def turns(n: int, length: int = 5, seed: int = 100) -> list:
    return [prompt(seed + i, length) for i in range(n)]


def test_import_kvfs_does_not_import_torch():
    code = "import sys, kvfs; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_no_window_single_turn_matches_dynamic_cache(model, warm):
    ids = prompt(1, 12)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=16, do_sample=False)
    cache = TieredCache(model, warm=warm, session_id="single", max_kv_len=None)
    out = model.generate(ids, cache=cache, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == ids.shape[1] + 15
    cache.close()


def test_window_larger_than_conversation_multi_turn_matches_dynamic_cache(model, warm):
    ts = turns(4, 7)
    ref = generate_turns(model, DynamicCache(config=model.config), ts, 9)
    cache = TieredCache(model, warm=warm, session_id="multi", max_kv_len=1000)
    out = generate_turns(model, cache, ts, 9)
    assert all(torch.equal(a, b) for a, b in zip(ref, out, strict=True))
    assert cache.stored == cache.seen and len(cache.rounds) == 4
    cache.close()


@pytest.mark.parametrize("window,sinks", [(6, 0), (6, 4), (16, 4), (5, 1)])
def test_window_matches_sinks_plus_last_w_reference(model, warm, window, sinks):
    """Every step attends to the first `sinks` tokens and the last `window` cached tokens
    plus its input; the first prompt (20 tokens) is longer than sinks + window and is
    attended in full during its prefill."""
    ts = [prompt(7, 20)] + turns(4, 6, seed=300)
    ref = WindowReference(model, window, sinks=sinks)
    expected = [ref.turn(t, 10) for t in ts]
    cache = TieredCache(model, warm=warm, session_id=f"win{window}-{sinks}", max_kv_len=window,
                        sink_tokens=sinks)
    out = generate_turns(model, cache, ts, 10)
    assert all(torch.equal(a, b) for a, b in zip(expected, out, strict=True))
    full = generate_turns(model, DynamicCache(config=model.config), ts, 10)
    assert not all(torch.equal(a, b) for a, b in zip(full, out, strict=True)), "window had no effect"
    # positions kept counting; the hot window is bounded; the sinks are the first tokens
    assert cache.seen == sum(t.shape[1] for t in ts) + 10 * len(ts) - 1
    assert all(lay.keys.shape[-2] == sinks + window for lay in cache.layers)
    assert cache.sinks == sinks and cache.window_start == cache.seen - window
    for layer, lay in enumerate(cache.layers):
        hk, _ = ref.history(layer)
        assert torch.equal(lay.keys[..., :sinks, :], hk[..., :sinks, :])
    # every token that fell out is below, exactly the bytes the reference produced
    cache.flush()
    for layer in range(cache.num_layers):
        k, v = ref.history(layer)
        assert warm.size(cache.session_id, layer) == cache.seen * cache.geo.token_bytes
        got = warm.read(cache.session_id, layer, 0, cache.seen * cache.geo.token_bytes)
        assert np.asarray(got).tobytes() == token_major(k, v)[: cache.seen * cache.geo.token_bytes]
    cache.close()


def test_manual_forward_loop_with_window(model, warm):
    window, sinks = 5, 4
    cache = TieredCache(model, warm=warm, session_id="manual", max_kv_len=window, sink_tokens=sinks)
    ref = WindowReference(model, window, sinks=sinks)
    x = prompt(3, 9)
    expected = ref.turn(x, 12)
    toks = []
    with torch.no_grad():
        for _ in range(12):
            logits = model(input_ids=x, cache=cache, use_cache=True).logits
            toks.append(int(logits[0, -1].argmax()))
            x = torch.tensor([[toks[-1]]])
    assert toks == expected[0].tolist()
    assert cache.get_mask_sizes(1, 0) == (sinks + window + 1, cache.seen - window - sinks)
    cache.close()


def test_flush_then_continue_appends_nothing_twice(model, warm):
    window = 8
    cache = TieredCache(model, warm=warm, session_id="flushy", max_kv_len=window)
    ref = WindowReference(model, window)
    tb = cache.geo.token_bytes
    ts = turns(5, 6, seed=500)
    ids = torch.empty(1, 0, dtype=torch.long)
    for i, t in enumerate(ts):
        ref.turn(t, 7)
        ids = torch.cat([ids, t], 1)
        ids = model.generate(ids, cache=cache, max_new_tokens=7, do_sample=False)
        cache.end_round()
        if i % 2 == 0:  # window copied below while it stays hot
            cache.flush()
            assert warm.size("flushy", 0) == cache.seen * tb
    cache.flush()
    meta = warm.get_meta("flushy")
    assert set(meta) == {"format", "model", "num_layers", "num_kv_heads", "head_dim", "dtype",
                         "tokens", "rounds"}
    assert meta["tokens"] == cache.seen and meta["rounds"] == cache.rounds
    assert meta["dtype"] == "float32" and meta["num_kv_heads"] == 2 and meta["head_dim"] == 16
    for layer in range(cache.num_layers):
        got = np.asarray(warm.read("flushy", layer, 0, cache.seen * tb)).tobytes()
        assert got == token_major(*ref.history(layer))[: cache.seen * tb]
    cache.close()


def test_rounds_and_summaries(model, warm):
    cache = TieredCache(model, warm=warm, session_id="rounds", max_kv_len=8)
    generate_turns(model, cache, turns(3, 4, seed=50), 5)
    # 4 prompt + 4 fed of 5 sampled; then 1 pending + 4 + 4 (the last sampled token opens the next)
    assert cache.rounds == [[0, 8], [8, 17], [17, 26]]
    cache.flush()
    summ = np.asarray(warm.summaries("rounds"))
    assert summ.shape == (3, cache.summary_dim)
    np.testing.assert_allclose(np.linalg.norm(summ, axis=1), 1.0, rtol=1e-5)
    # a summary is the shared definition over the round's last-layer keys (as stored)
    a, b = cache.rounds[0]
    tb = cache.geo.token_bytes
    raw = np.asarray(warm.read("rounds", cache.summary_layer, a * tb, b * tb)).tobytes()
    keys = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(b - a, 2, 2, 16)[:, 0]
    np.testing.assert_allclose(summarize_keys(keys.reshape(b - a, -1).numpy(), cache.summary_dim),
                               summ[0], atol=1e-5)
    cache.close()


def test_recall_restores_exact_round_bytes_and_attends_them(model, warm):
    window, sinks = 8, 4
    cache = TieredCache(model, warm=warm, session_id="recall", max_kv_len=window, sink_tokens=sinks)
    ref = WindowReference(model, window, sinks=sinks)
    ts = turns(5, 6, seed=700)
    for t in ts:
        ref.turn(t, 6)
    outs = generate_turns(model, cache, ts, 6)
    conv = torch.cat([x for t, o in zip(ts, outs, strict=True) for x in (t, o)], 1)
    assert cache.rounds[1][1] <= cache.window_start  # round 1 has left the window
    a, b = cache.rounds[1]
    got = cache.recall(rounds=[1])
    assert got == [1]
    for layer, lay in enumerate(cache.layers):
        hk, hv = ref.history(layer)
        assert torch.equal(lay.recall_keys, hk[..., a:b, :])
        assert torch.equal(lay.recall_values, hv[..., a:b, :])
    assert cache.get_mask_sizes(1, 0) == ((b - a) + sinks + window + 1,
                                          cache.seen - sinks - window - (b - a))
    # the next turn attends round 1 + the window + its input: same as the reference doing so
    ref.prefix = [(lay.recall_keys, lay.recall_values) for lay in cache.layers]
    nxt = prompt(999, 4)
    expected = ref.turn(nxt, 6)
    hits = cache.misses
    out = model.generate(torch.cat([conv, nxt], 1), cache=cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(out[:, -6:], expected)
    assert cache.misses == hits + 1  # only the step right after the read from below
    cache.end_round()  # recall ends with the round
    assert cache.layers[0].recall_keys is None
    assert cache.get_mask_sizes(1, 0)[0] == sinks + window + 1
    cache.close()


def test_recall_by_query_ranks_by_summary(model, warm):
    cache = TieredCache(model, warm=warm, session_id="query", max_kv_len=6)
    generate_turns(model, cache, turns(6, 5, seed=900), 5)
    cache.flush()
    summ = np.asarray(warm.summaries("query"))
    for target in (0, 2, 3):
        assert cache.recall(query=summ[target], k=1) == [target]
    assert len(cache.recall(query=torch.from_numpy(summ[1]), k=3)) == 3
    # a query in key space: the keys of round 2 themselves
    a, b = cache.rounds[2]
    tb = cache.geo.token_bytes
    raw = np.asarray(warm.read("query", cache.summary_layer, a * tb, b * tb)).tobytes()
    tm = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(b - a, 2, 2, 16)
    keys = tm[:, 0].reshape(b - a, -1).numpy()
    np.testing.assert_allclose(summarize_keys(keys, cache.summary_dim), summ[2], atol=1e-4)
    assert cache.recall(query=torch.from_numpy(keys), k=1) == [2]
    cache.close()


def test_recall_of_truncated_file_is_a_clear_error(model, warm):
    cache = TieredCache(model, warm=warm, session_id="trunc", max_kv_len=4)
    generate_turns(model, cache, turns(3, 5, seed=1), 5)
    cache.flush()
    warm.truncate("trunc", 1, cache.rounds[0][1] * cache.geo.token_bytes // 2)
    with pytest.raises(KVCorrupt, match="truncated"):
        cache.recall(rounds=[0])
    cache.close()


def test_bf16_window_and_bytes(warm):
    m = tiny_llama(seed=3, dtype=torch.bfloat16)
    ts = turns(3, 6, seed=40)
    ref = WindowReference(m, 7)
    expected = [ref.turn(t, 8) for t in ts]
    cache = TieredCache(m, warm=warm, session_id="bf16", max_kv_len=7)
    out = generate_turns(m, cache, ts, 8)
    assert all(torch.equal(a, b) for a, b in zip(expected, out, strict=True))
    cache.flush()
    assert warm.get_meta("bf16")["dtype"] == "bfloat16"
    tb = cache.geo.token_bytes
    assert tb == 2 * 2 * 16 * 2
    got = np.asarray(warm.read("bf16", 0, 0, cache.seen * tb)).tobytes()
    assert got == token_major(*ref.history(0))[: cache.seen * tb]
    cache.close()


class _SlowWarm:
    """Records appends; sleeps to make the queue fill; can fail on demand."""

    def __init__(self, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.files: dict = {}
        self.delay, self.fail_at, self.calls = delay, fail_at, 0

    def append(self, sid, layer, data):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise OSError(28, "No space left on device")
        time.sleep(self.delay)
        buf = self.files.setdefault((sid, layer), bytearray())
        buf += np.asarray(data).tobytes()
        return len(buf)


def test_spiller_back_pressure_keeps_order():
    w = _SlowWarm(delay=0.002)
    sp = Spiller(w, max_pending_bytes=4096)
    k = torch.arange(2 * 16 * 4, dtype=torch.float32).view(1, 2, 16, 4)  # 16 tokens of 64 B
    v = -k
    for t in range(16):
        sp.submit_kv("s", 0, t * 64, k[..., t:t + 1, :], v[..., t:t + 1, :])
    sp.wait()
    assert bytes(w.files[("s", 0)]) == token_major(k, v)
    big = torch.zeros(1, 2, 64, 4)
    for t in range(6):  # 4 KiB each: every submit after the first waits for room
        sp.submit_kv("s", 1, t * 4096, big, big)
    sp.close()
    assert sp.stalls >= 1 and sp.peak_pending_bytes <= 4096 + 4096


def test_spill_failure_surfaces_as_spill_error(model):
    w = _SlowWarm(fail_at=1)
    sp = Spiller(w)
    cache = TieredCache(model, warm=w, session_id="bad", max_kv_len=2, sink_tokens=0, spiller=sp)
    with pytest.raises(SpillError, match="No space left"):
        with torch.no_grad():
            model(input_ids=prompt(1, 6), cache=cache, use_cache=True)
            sp.wait()
    with pytest.raises(SpillError):
        sp.submit_call(print)


def test_automatic_recall_attends_the_closest_round_for_the_rest_of_the_round(model, warm):
    """At each new round the keys of its first step rank the older rounds by summary; the
    best one is attended (between sinks and window) for the round's other steps, exactly
    as a reference that attends those bytes does."""
    window, sinks, new = 6, 2, 5
    cache = TieredCache(model, warm=warm, session_id="auto", max_kv_len=window, sink_tokens=sinks,
                        auto_recall=True, recall_rounds=1)
    ref = WindowReference(model, window, sinks=sinks)
    last = cache.summary_layer
    pending = None
    for i, t in enumerate(turns(7, 5, seed=1300)):
        x = t if pending is None else torch.cat([pending, t], 1)
        for step in range(new):
            with torch.no_grad():
                tok = int(model(input_ids=x, cache=cache, use_cache=True).logits[0, -1].argmax())
            assert tok == ref.step(x), (i, step)
            if step == 0:  # the first step ranked the rounds with its own keys
                hk, hv = ref.history(last)
                ranked = cache.rank(hk[..., -x.shape[1]:, :])
                assert cache.recalled_rounds == ranked[:1], i
                if ranked:
                    spans = [cache.recalled.unattended(r) for r in ranked[:1]]
                    for layer, lay in enumerate(cache.layers):
                        k, v = ref.history(layer)
                        assert torch.equal(lay.recall_keys, torch.cat([k[..., a:b, :] for a, b in spans], -2))
                        assert torch.equal(lay.recall_values, torch.cat([v[..., a:b, :] for a, b in spans], -2))
                    ref.prefix = [(lay.recall_keys, lay.recall_values) for lay in cache.layers]
            x = torch.tensor([[tok]])
        pending = x
        cache.end_round()
        ref.prefix = None
        assert cache.layers[0].recall_keys is None
    assert cache.auto_recalls >= 4 and cache.stats()["auto_recalls"] == cache.auto_recalls
    cache.close()


def test_sinks_are_never_recalled_twice_and_rounds_inside_them_are_not_candidates(model, warm):
    cache = TieredCache(model, warm=warm, session_id="sinkrec", max_kv_len=4, sink_tokens=6)
    generate_turns(model, cache, [prompt(1, 3), prompt(2, 3), prompt(3, 3), prompt(4, 3)], 3)
    assert cache.rounds[0] == [0, 5]  # wholly inside the 6 sinks: always attended
    cache.flush()
    assert 0 not in cache.rank(np.ones(cache.summary_dim, np.float32))
    a, b = cache.rounds[1]  # [5, 11): token 5 is a sink, the rest left the window
    assert cache.recall(rounds=[1]) == [1]
    assert cache.layers[0].recalled == b - 6
    cache.close()


@pytest.mark.parametrize("build", ["mla", "sliding", "hybrid"])
def test_models_the_cache_cannot_serve_are_refused_when_it_is_built(build):
    from transformers import DeepseekV3Config, Gemma2Config, MistralConfig

    from kvfs.torch import KVUnsupported

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=64)
    cfg = {"mla": lambda: DeepseekV3Config(**small, kv_lora_rank=16, q_lora_rank=16),
           "sliding": lambda: MistralConfig(**small, sliding_window=16),
           "hybrid": lambda: Gemma2Config(**small)}[build]()
    with pytest.raises(KVUnsupported, match="cannot serve"):
        TieredCache(cfg, max_kv_len=8)


def test_fingerprint_covers_the_weights():
    from kvfs.torch import fingerprint

    a, b = tiny_llama(seed=0), tiny_llama(seed=0)
    assert fingerprint(a) == fingerprint(b)  # same weights, rebuilt: same model
    with torch.no_grad():
        b.model.layers[1].mlp.down_proj.weight.mul_(1.01)  # a "fine-tune" of one matrix
    b2 = tiny_llama(seed=0)
    with torch.no_grad():
        b2.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    assert fingerprint(b2) != fingerprint(a)
    assert fingerprint(tiny_llama(seed=1)) != fingerprint(a)
    assert fingerprint(a.config) != fingerprint(a)  # a bare config cannot stand for weights


def test_crossing_max_position_embeddings_warns_once(warm, caplog):
    m = tiny_llama(seed=0, max_position_embeddings=20)
    cache = TieredCache(m, warm=warm, session_id="long", max_kv_len=6)
    with caplog.at_level("WARNING", logger="kvfs.torch.cache"):
        generate_turns(m, cache, [prompt(1, 12), prompt(2, 12)], 8)
    hits = [r for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert len(hits) == 1 and "(20)" in hits[0].getMessage()
    cache.close()


@pytest.mark.parametrize("sinks", [4, 0])
def test_decode_steps_write_into_the_buffer_and_match_the_reference(model, warm, monkeypatch, sinks):
    """A window big enough for the steady decode path (preallocated buffer, views made once
    per buffer, the tokens leaving the window handed down in batches): the same tokens as
    the reference, the same bytes below, the logical storage exactly sinks + last W."""
    from kvfs.torch.layer import TieredLayer

    window, new = 64, 30
    ts = [prompt(9, 80)] + turns(3, 5, seed=700)
    ref = WindowReference(model, window, sinks=sinks)
    expected = [ref.turn(t, new) for t in ts]
    cache = TieredCache(model, warm=warm, session_id=f"buf{sinks}", max_kv_len=window, sink_tokens=sinks)
    decodes, spills = [0], [0]
    real_decode, real_spill = TieredLayer._decode, cache.hand_down

    def count_decode(self, *a):
        decodes[0] += self.idx == 0
        return real_decode(self, *a)

    def count_spill(layer, *a):
        spills[0] += layer == 0
        real_spill(layer, *a)

    monkeypatch.setattr(TieredLayer, "_decode", count_decode)
    monkeypatch.setattr(cache, "hand_down", count_spill)
    out = generate_turns(model, cache, ts, new)
    assert all(torch.equal(a, b) for a, b in zip(expected, out, strict=True))
    steps = cache.steps
    assert cache.window_slack == (window + sinks) // 8
    assert decodes[0] > steps // 2, "the steady decode path was not taken"
    assert spills[0] < steps // 3, "hand-downs were not batched"
    for layer, lay in enumerate(cache.layers):
        assert lay.held <= sinks + window + 1 + 2 * cache.window_slack
        hk, hv = ref.history(layer)
        s = cache.seen
        assert torch.equal(lay.keys, torch.cat([hk[..., :sinks, :], hk[..., s - window:s, :]], -2))
        assert torch.equal(lay.values, torch.cat([hv[..., :sinks, :], hv[..., s - window:s, :]], -2))
    cache.flush()
    tb = cache.geo.token_bytes
    for layer in range(cache.num_layers):
        got = np.asarray(warm.read(cache.session_id, layer, 0, cache.seen * tb)).tobytes()
        assert got == token_major(*ref.history(layer))[: cache.seen * tb]
    cache.close()


def test_moves_between_decode_steps_keep_the_window_exact(model, warm):
    """Budget moves between turns replace the buffer (and its views); the next turn reads the
    front back, decodes through a fresh buffer and attends exactly what the reference does."""
    window, new = 64, 20
    ts = [prompt(11, 70)] + turns(4, 6, seed=900)
    ref = WindowReference(model, window)
    expected = [ref.turn(t, new) for t in ts]
    cache = TieredCache(model, warm=warm, session_id="moved", max_kv_len=window)
    ids = torch.empty(1, 0, dtype=torch.long)
    for i, t in enumerate(ts):
        ids = torch.cat([ids, t], 1)
        full = model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False)
        assert torch.equal(full[:, ids.shape[1]:], expected[i]), i
        ids = full
        cache.end_round()
        if i % 2 == 0:
            assert cache.evict_oldest_round(min_tokens=10) > 0
            assert cache.stored < cache.attended_tokens
    assert cache.refills >= 2
    cache.close()


def test_hot_hits_reach_the_counter_by_the_end_of_each_round(model, warm):
    from kvfs.ops import metrics

    before = metrics.sample(metrics.hot_hits, "_total")
    cache = TieredCache(model, warm=warm, session_id="hits", max_kv_len=16)
    generate_turns(model, cache, turns(2, 5, seed=60), 40)
    assert cache.hits > TieredCache.PUBLISH_HITS_EVERY
    assert metrics.sample(metrics.hot_hits, "_total") == before + cache.hits
    cache.close()


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 6), (torch.float32, 5)])
def test_token_major_bytes_round_trip_exactly_at_any_alignment(dtype, head_dim):
    """The layout copies move the widest words a head row allows; rows of odd width, K/V
    that are views and bytes at an odd offset take the element-wide path, same bytes."""
    from kvfs.torch.fingerprint import (
        KVGeometry,
        kv_from_bytes,
        kv_to_token_major,
        token_major_bytes,
    )

    heads, tokens = 3, 7
    g = torch.Generator().manual_seed(head_dim)
    k = torch.randn(1, heads, tokens + 2, head_dim, generator=g).to(dtype)[..., 1:-1, :]  # a view
    v = torch.randn(1, heads, tokens, head_dim, generator=g).to(dtype)
    raw = token_major_bytes(kv_to_token_major(k, v))
    geo = KVGeometry(num_layers=1, num_kv_heads=heads, head_dim=head_dim, dtype=dtype)
    for shift in (0, 1, 2):  # bytes at an offset of 1 or 2 from an aligned buffer
        buf = np.zeros(raw.size + shift, np.uint8)
        buf[shift:] = raw
        k2, v2 = kv_from_bytes(buf[shift:], geo, tokens)
        assert torch.equal(k2.view(torch.uint8), k.contiguous().view(torch.uint8))
        assert torch.equal(v2.view(torch.uint8), v.view(torch.uint8))

"""Re-rotated sinks (``rope_rerotate``): the rotation is the model's own rotary embedding, a
re-rotating cache attends exactly what a reference that rotates the sinks with transformers'
``apply_rotary_pos_emb`` attends, the tiers below hold the model's own keys, recalled copies
keep their places across budget moves, and models whose rotation kvfs cannot reproduce are
refused when the cache is built. Tiny random models, greedy decoding, CPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvfs.torch import TieredCache
from kvfs.torch.fingerprint import KVUnsupported
from kvfs.torch.recall import read_tokens
from kvfs.torch.reference import (
    WindowReference,
    generate_turns,
    prompt,
    tiny_config,
    tiny_llama,
    token_major,
)
from kvfs.torch.rope import RopeShift


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def turns(n: int, length: int, seed: int) -> list:
    return [prompt(seed + i, length) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_the_models_rotary_embedding(model, dtype):
    rope = RopeShift.of(model)
    ref = WindowReference(model, 8)
    k = torch.randn(1, 2, 5, model.config.head_dim).to(dtype)
    for shift in (1, 3, 17, 250):
        got, want = rope.rotate(k, shift), ref.rotate(k.float(), shift).to(dtype)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    kf = k.float()
    torch.testing.assert_close(rope.rotate(rope.rotate(kf, 40), 60), rope.rotate(kf, 100), atol=1e-5, rtol=1e-5)
    # from a config alone (no rotary module): the same frequencies
    torch.testing.assert_close(RopeShift.of(model.config).rotate(kf, 33), rope.rotate(kf, 33), atol=1e-6, rtol=1e-6)
    assert torch.equal(rope.rotate(k, 0), k)


@pytest.mark.parametrize("window,sinks,new", [(6, 4, 10), (16, 2, 10), (64, 4, 40)])
def test_rerotating_window_matches_reference_and_stores_the_models_keys(model, warm, window, sinks, new):
    ts = [prompt(7, 20)] + turns(4, 6, seed=300)
    cache = TieredCache(model, warm=warm, session_id=f"rot{window}", max_kv_len=window,
                        sink_tokens=sinks, rope_rerotate=True)
    qn = cache.rope_quantum
    assert qn == max(1, (window + sinks) // 8)
    ref = WindowReference(model, window, sinks=sinks, rerotate=qn)
    expected = [ref.turn(t, new) for t in ts]
    out = generate_turns(model, cache, ts, new)
    assert all(torch.equal(a, b) for a, b in zip(expected, out, strict=True))
    plain = WindowReference(model, window, sinks=sinks)
    assert not all(torch.equal(plain.turn(t, new), o) for t, o in zip(ts, out, strict=True)), \
        "re-rotation had no effect"
    # the device sinks sit just before the window the last step attended (a decode step: one
    # token before today's window start); the window itself is the model's keys
    shift = (cache.window_start - 1 - sinks) // qn * qn
    assert shift > 0
    for layer, lay in enumerate(cache.layers):
        hk, _ = ref.history(layer)
        s = cache.seen
        torch.testing.assert_close(lay.keys[..., :sinks, :], ref.rotate(hk[..., :sinks, :], shift),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lay.keys[..., sinks:, :], hk[..., s - window:s, :], atol=1e-4, rtol=1e-4)
    # below: the keys the model produced, never rotated ones (the reference rotates with
    # float32 angles, the cache with float64 ones: later layers differ in the last bits)
    cache.flush()
    tb = cache.geo.token_bytes
    for layer in range(cache.num_layers):
        got = np.frombuffer(np.asarray(warm.read(cache.session_id, layer, 0, cache.seen * tb)).tobytes(),
                            np.float32)
        want = np.frombuffer(token_major(*ref.history(layer))[: cache.seen * tb], np.float32)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        if layer == 0:  # keys of the first layer do not depend on attention: bit for bit
            assert got.tobytes() == want.tobytes()
    cache.close()


def test_budget_moves_and_refills_keep_rotated_sinks_and_recall_exact(model, warm):
    """Window moves, a move of the sinks themselves, refills and an explicit recall: the
    same tokens as the reference, recalled copies rotated to end where the sinks begin."""
    window, sinks, new = 8, 4, 6
    ts = turns(6, 7, seed=40)
    cache = TieredCache(model, warm=warm, session_id="moves", max_kv_len=window, sink_tokens=sinks,
                        rope_rerotate=True)
    ref = WindowReference(model, window, sinks=sinks, rerotate=cache.rope_quantum)
    ids = torch.empty(1, 0, dtype=torch.long)
    for i, t in enumerate(ts):
        ids = torch.cat([ids, t], 1)
        full = model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False)
        assert torch.equal(full[:, ids.shape[1]:], ref.turn(t, new)), i
        ids = full
        cache.end_round()
        ref.prefix = None
        if i == 1:
            assert cache.evict_oldest_round(min_tokens=3) > 0
        if i == 2:
            while cache.evict_oldest_round() > 0:
                pass
            assert cache.evict_sinks() > 0 and cache.stored == 0
        if i == 3:
            assert cache.recall(rounds=[0]) == [0]
            a, b = cache.recalled.spans[0]
            at = cache.attended_start - sinks - (b - a)
            for layer, lay in enumerate(cache.layers):
                k, v = read_tokens(warm, cache.session_id, layer, cache.geo, a, b, torch.device("cpu"))
                torch.testing.assert_close(lay.recall_keys, ref.rotate(k, at - a), atol=1e-5, rtol=1e-5)
                assert torch.equal(lay.recall_values, v)
            before = [lay.recall_keys.clone() for lay in cache.layers]
            cache.evict_oldest_round()  # drops the recalled copies: read back before the next step
            assert cache.layers[0].recall_keys is None
            cache.moves.prepare_step()
            assert all(torch.equal(b_, lay.recall_keys) for b_, lay in zip(before, cache.layers, strict=True))
            ref.prefix = [(lay.recall_keys.clone(), lay.recall_values.clone()) for lay in cache.layers]
    assert cache.refills >= 2
    cache.close()


def test_crossing_max_position_embeddings_is_not_a_warning_when_re_rotating(warm, caplog):
    m = tiny_llama(seed=0, max_position_embeddings=20)
    caplog.set_level(logging.INFO, logger="kvfs.torch.cache")
    cache = TieredCache(m, warm=warm, session_id="long", max_kv_len=8, rope_rerotate=True)
    generate_turns(m, cache, turns(3, 8, seed=5), 6)
    hits = [r for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert len(hits) == 1 and hits[0].levelno == logging.INFO and "re-rotated" in hits[0].getMessage()
    cache.close()


@pytest.mark.parametrize("config", [
    lambda: tiny_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    lambda: _gpt_neox_config(),
], ids=["dynamic-rope", "gpt-neox-layout"])
def test_rotations_kvfs_cannot_reproduce_are_refused_when_the_cache_is_built(config):
    cfg = config()
    with pytest.raises(KVUnsupported, match="rope_rerotate"):
        TieredCache(cfg, max_kv_len=8, rope_rerotate=True)
    assert TieredCache(cfg, max_kv_len=8).rope is None  # off: nothing to reproduce
    assert TieredCache(tiny_config(), max_kv_len=None, rope_rerotate=True).rope is None  # no window


def _gpt_neox_config():
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=256)


@pytest.mark.parametrize("mode", ["window", "reach"])
def test_resumed_session_rotates_exactly_as_the_uninterrupted_one(tmp_path, mode):
    """Sinks are rotated by a function of the window alone: a session released after three
    turns and resumed holds bit for bit the device K/V of one that never stopped."""
    from kvfs.torch import KVRouter

    model = tiny_llama(seed=0, max_position_embeddings=64)  # the session passes it
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True)
    r = KVRouter(mount=str(cold), warm_root=str(tmp_path / "warm"), max_kv_len=40, auto_recall=False,
                 rope_rerotate=mode, warm_options={"shards": 16})
    ts = turns(4, 9, seed=70)
    outs = {}
    for sid in ("kept", "resumed"):
        c = r.cache(sid, model)
        assert c.rope_quantum == 5
        ids = torch.empty(1, 0, dtype=torch.long)
        for i, t in enumerate(ts):
            if sid == "resumed" and i == 3:
                r.release(sid)
                c = r.resume(sid, model)
            ids = model.generate(torch.cat([ids, t], 1), cache=c, max_new_tokens=12, do_sample=False)
            c.end_round()
        outs[sid] = (ids, c)
    assert torch.equal(outs["kept"][0], outs["resumed"][0])
    for a, b in zip(outs["kept"][1].layers, outs["resumed"][1].layers, strict=True):
        assert a.sink_shift > 0 and a.sink_shift == b.sink_shift
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    r.close()


def test_profile_re_rotates_where_the_model_allows_and_says_where_not(tmp_path, model, caplog):
    """The profile's ``rope_rerotate`` (on by default) applies to models whose rotation kvfs
    reproduces; another model is served with its sinks in place and one warning. Asked for
    explicitly, it is refused instead."""
    from transformers import GPTNeoXForCausalLM

    from kvfs.torch import KVRouter

    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True)
    kw = dict(mount=str(cold), warm_root=str(tmp_path / "warm"), max_kv_len=8,
              warm_options={"shards": 16})
    neox = GPTNeoXForCausalLM(_gpt_neox_config()).eval()
    r = KVRouter(**kw)
    c = r.cache("llama", model)  # the profile's mode reaches the cache, not a bool
    assert (c.rope_mode, c.rope_reach) == ("reach", min(2048, 4096 - 1 - c.rope_quantum))
    caplog.set_level(logging.WARNING, logger="kvfs.torch.router")
    for sid in ("neox1", "neox2"):
        c = r.cache(sid, neox)
        assert c.rope is None
        generate_turns(neox, c, turns(2, 6, seed=3), 6)
    assert len([x for x in caplog.records if "gpt_neox" in x.getMessage()]) == 1
    r.close()
    r = KVRouter(**kw, rope_rerotate=True)
    with pytest.raises(KVUnsupported, match="gpt_neox"):
        r.cache("neox3", neox)
    r.close()


def test_reach_mode_moves_sinks_only_to_stay_within_max_position_embeddings(warm):
    """``reach``: the sinks keep their own positions while the query is within
    max_position_embeddings of them, then move just enough to stay there; the same tokens
    as a reference rotating by that rule, the model's own keys below."""
    m = tiny_llama(seed=0, max_position_embeddings=64)
    window, sinks, new = 8, 4, 9
    cache = TieredCache(m, warm=warm, session_id="reach", max_kv_len=window, sink_tokens=sinks,
                        rope_rerotate="reach")
    qn = cache.rope_quantum
    assert cache.rope_mode == "reach" and cache.rope_reach == 64 - 1 - qn
    shifts = [cache.sink_shift_for(ws, sinks) for ws in range(sinks, 200)]
    assert shifts[:64 - 1 - qn - window - sinks] == [0] * (64 - 1 - qn - window - sinks)
    for ws, t in zip(range(sinks, 200), shifts, strict=True):  # query at ws + window
        assert ws + window - t <= 64 - 1 and 0 <= t <= ws - sinks and t % qn == 0
    ref = WindowReference(m, window, sinks=sinks, rerotate=cache.sink_shift_for)
    ts = turns(10, 7, seed=90)
    expected = [ref.turn(t, new) for t in ts]
    out = generate_turns(m, cache, ts, new)
    assert all(torch.equal(a, b) for a, b in zip(expected, out, strict=True))
    assert cache.seen > 100 and all(lay.sink_shift > 0 for lay in cache.layers)
    assert cache.seen - cache.layers[0].sink_shift <= 64 + qn  # the sinks stayed in reach
    cache.flush()
    tb = cache.geo.token_bytes
    got = np.asarray(warm.read(cache.session_id, 0, 0, cache.seen * tb)).tobytes()
    assert got == token_major(*ref.history(0))[: cache.seen * tb]  # layer 0: bit for bit
    cache.close()


def test_reach_mode_recall_keeps_recalled_rounds_before_the_window(warm):
    m = tiny_llama(seed=0, max_position_embeddings=40)
    cache = TieredCache(m, warm=warm, session_id="reach-recall", max_kv_len=8, sink_tokens=4,
                        rope_rerotate="reach")
    generate_turns(m, cache, turns(8, 7, seed=30), 6)
    got = cache.recall(rounds=[1, 2])
    assert got == [1, 2]
    ws, t = cache.attended_start, cache.sink_shift_for(cache.attended_start, 4)
    assert t > 0
    for (a, b), shift in zip(cache.recalled.spans, cache.recall_shifts, strict=True):
        assert shift == max(0, min(t, ws - b)) and b + shift <= ws  # never past the window
        k, _ = read_tokens(warm, cache.session_id, 0, cache.geo, a, b, torch.device("cpu"))
        rec = cache.layers[0].recall_keys
        off = sum(y - x for x, y in cache.recalled.spans[: cache.recalled.spans.index((a, b))])
        assert torch.equal(rec[..., off:off + b - a, :], cache.rope.rotate(k, shift) if shift else k)
    cache.close()


@pytest.mark.parametrize("bad", ["sideways", 3])
def test_an_unknown_rerotation_mode_is_refused(model, bad):
    with pytest.raises(ValueError, match="off, window or reach"):
        TieredCache(model, max_kv_len=8, rope_rerotate=bad)


def test_rope_reach_is_capped_by_what_the_model_was_trained_on(model):
    m = tiny_llama(seed=0, max_position_embeddings=64)
    c = TieredCache(m, max_kv_len=8, rope_rerotate="reach", rope_reach=20)
    assert c.rope_reach == 20
    assert c.sink_shift_for(4, 4) == 0 and c.sink_shift_for(100, 4) % c.rope_quantum == 0
    assert 100 + 8 - c.sink_shift_for(100, 4) <= 20  # the query stays within reach of the sinks
    assert TieredCache(m, max_kv_len=8, rope_rerotate="reach", rope_reach=10_000).rope_reach == 64 - 1 - 1
    assert TieredCache(m, max_kv_len=8, rope_reach=20).rope_reach is None  # re-rotation off
    with pytest.raises(ValueError, match="rope_reach"):
        TieredCache(m, max_kv_len=8, rope_rerotate="reach", rope_reach=0)

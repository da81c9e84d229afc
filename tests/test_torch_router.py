"""Hot tier, many sessions: the router's budget and watermark (sinks stay on the device),
profiles, resume in a new process (bf16 and fp32, from warm and from cold; the device again
holds the sinks + the last W tokens), forks, automatic recall under a budget, refusals
(another model, a fine-tune of the same one, truncated files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("kvfs.warm")

from transformers import DynamicCache

from kvfs.torch import KVCorrupt, KVMismatch, KVRouter, TieredCache
from kvfs.torch.reference import WindowReference, generate_turns, profile_rope, prompt, tiny_llama

REPO = Path(__file__).resolve().parents[1]
WARM_OPTS = {"shards": 16}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def make_router(tmp_path: Path, **kw) -> KVRouter:
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True, exist_ok=True)  # the layout of a mounted volume
    kw.setdefault("warm_options", WARM_OPTS)
    kw.setdefault("auto_recall", False)  # exactness against caches without a warm tier
    kw.setdefault("rope_rerotate", False)  # ... and against references that do not rotate
    kw.setdefault("retrieval", False)  # ... or retrieve (tests/test_torch_retrieval.py does)
    return KVRouter(mount=str(cold), warm_root=str(tmp_path / "warm"), **kw)


def conversation(ts, outs) -> torch.Tensor:
    return torch.cat([x for t, o in zip(ts, outs, strict=True) for x in (t, o)], 1)


def test_profile_values_and_explicit_overrides(tmp_path, model):
    from kvfs.ops import profiles

    prof = profiles.load("ecommerce")
    r = make_router(tmp_path, profile="ecommerce", auto_recall=None)
    assert r.max_kv_len == prof.max_kv_len == 12 and r.watermark == pytest.approx(prof.device_watermark)
    assert r.sink_tokens == getattr(prof, "sink_tokens", 4)
    assert r.auto_recall == getattr(prof, "auto_recall", False)
    assert r.recall_rounds == getattr(prof, "recall_rounds", 2)
    c = r.cache("p", model)
    assert (c.max_kv_len, c.sink_tokens, c.auto_recall, c.recall_rounds) == (
        r.max_kv_len, r.sink_tokens, r.auto_recall, r.recall_rounds)
    r.close()
    r = make_router(tmp_path / "b", profile="ecommerce", max_kv_len=None, watermark=0.5,
                    sink_tokens=0, recall_rounds=3)
    assert r.max_kv_len is None and r.watermark == 0.5 and r.sink_tokens == 0
    assert r.recall_rounds == 3 and not r.auto_recall
    r.close()


def test_budget_serves_many_sessions_under_one_sessions_full_kv(tmp_path, model):
    """Budget = the full KV of one 12-round session; 6 such sessions run interleaved with the
    gov window (24). The budget is never passed, rounds are moved out and read back, and
    every session generates exactly what it generates alone with no budget."""
    rounds, q_len, new, window, n = 12, 5, 6, 24, 6
    qs = {f"agent-{j}": [prompt(1000 * j + r, q_len) for r in range(rounds)] for j in range(n)}
    probe = TieredCache(model, max_kv_len=None)
    generate_turns(model, probe, qs["agent-0"], new)
    full_one = probe.hot_bytes
    r = make_router(tmp_path, max_kv_len=window, device_budget_bytes=full_one)
    convs = {s: torch.empty(1, 0, dtype=torch.long) for s in qs}
    peak = 0
    for rnd in range(rounds):
        for s in qs:
            c = r.cache(s, model)
            ids = torch.cat([convs[s], qs[s][rnd]], 1)
            convs[s] = model.generate(ids, cache=c, max_new_tokens=new, do_sample=False)
            c.end_round()
            peak = max(peak, r.hot_total)
    st = r.stats()
    assert st["peak_hot_bytes"] <= r.limit and peak <= r.limit  # at every step, not just between
    assert st["watermark_moves"] > 0 and st["sessions"] == n
    assert sum(p["refills"] for p in st["per_session"].values()) > 0
    assert n * full_one > r.budget  # DynamicCache would hold all six full KVs at once
    for s in qs:  # budget moves took window tokens, never the sinks
        c = r.cache(s, model)
        assert c.sinks == 4 and c.layers[0].stored >= 4
    for s in qs:  # the budget changed where KV lived, never what was attended
        alone = generate_turns(model, TieredCache(model, max_kv_len=window), qs[s], new)
        assert torch.equal(convs[s], conversation(qs[s], alone)), s
    r.flush()
    tb = probe.geo.token_bytes
    for s in qs:
        c = r.cache(s, model)
        assert c.seen == convs[s].shape[1] - 1
        for layer in range(c.num_layers):
            assert r.warm.size(s, layer) == c.seen * tb  # nothing lost, nothing twice
        assert r.warm.get_meta(s)["tokens"] == c.seen
    assert 0 < st["kv_hot_hit_rate"] < 1
    r.close()


def test_watermark_moves_the_least_recently_used_sessions_oldest_round(tmp_path, model):
    stb = TieredCache(model).geo.session_token_bytes
    r = make_router(tmp_path, max_kv_len=None, device_budget_bytes=10**9)
    for s in ("a", "b", "c"):
        generate_turns(model, r.cache(s, model), [prompt(1, 6), prompt(2, 6)], 4)
    a, b, c = (r.cache(s, model) for s in ("a", "b", "c"))  # LRU order: a, b, c
    hot_before = {s.session_id: s.stored for s in (a, b, c)}
    r.budget = (r.hot_total + 3 * stb) / r.watermark  # the next 6-token prefill of c must fit
    ids = torch.zeros(1, c.seen + 1 + 6, dtype=torch.long)
    with torch.no_grad():
        model(input_ids=ids[:, c.seen:], cache=c, use_cache=True)
    # a's oldest round went out first (but for its sinks, which stay)
    assert a.stored == hot_before["a"] - (a.rounds[0][1] - a.sinks) and a.sinks == 4
    assert b.stored == hot_before["b"]
    assert r.hot_total <= r.limit
    assert a.evicted_rounds == 1 and r.watermark_moves == 1
    r.flush()
    assert r.warm.size("a", 0) == a.seen * a.geo.token_bytes
    r.close()


def test_recall_and_window_come_back_after_budget_moves(tmp_path, model):
    """A recalls a round; B's steps push A's recall and window out; A's next turn reads them
    back first and attends exactly what it would have attended with no budget."""
    window, new = 16, 6
    r = make_router(tmp_path, max_kv_len=window)
    ts = [prompt(40 + i, 6) for i in range(4)]
    ref = WindowReference(model, window)
    for t in ts:
        ref.turn(t, new)
    a = r.cache("A", model)
    conv = conversation(ts, generate_turns(model, a, ts, new))
    assert a.recall(rounds=[1]) == [1]
    ref.prefix = [(lay.recall_keys.clone(), lay.recall_values.clone()) for lay in a.layers]
    stb = a.geo.session_token_bytes
    r.budget = (a.hot_bytes + stb) / r.watermark  # A fits alone, A and B do not
    generate_turns(model, r.cache("B", model), [prompt(99, 20)], new)
    assert a.layers[0].recall_keys is None and a.stored < window and a.evicted_rounds >= 1
    nxt = prompt(77, 5)
    expected = ref.turn(nxt, new)
    misses = a.misses
    out = model.generate(torch.cat([conv, nxt], 1), cache=a, max_new_tokens=new, do_sample=False)
    assert torch.equal(out[:, -new:], expected)
    assert a.refills >= 1 and a.misses > misses and a.recalled_rounds == [1]
    assert r.peak_hot_bytes <= r.limit
    r.close()


CHILD = r"""
import json, sys
import torch
from kvfs.torch.reference import tiny_llama
from kvfs.torch import KVRouter
a = json.loads(sys.argv[1])
r = KVRouter(mount=a["cold"], warm_root=a["warm"], max_kv_len=a["window"], warm_options={"shards": 16},
             auto_recall=False, retrieval=a["retrieval"])
out = {}
for s in a["sessions"]:
    m = tiny_llama(seed=s["seed"], dtype=getattr(torch, s["dtype"]))
    cache = r.resume(s["sid"], m)
    where = r.warm.where(s["sid"])
    ids = torch.tensor([s["conv"]])
    gen = []
    for t in s["turns"]:
        ids = m.generate(torch.cat([ids, torch.tensor([t])], 1), cache=cache,
                         max_new_tokens=a["new"], do_sample=False)
        gen.append(ids[0, -a["new"]:].tolist())
        cache.end_round()
    out[s["sid"]] = {"gen": gen, "seen": cache.seen, "where_before": where}
r.close()
print(json.dumps(out))
"""


def test_resume_in_a_new_process_continues_identically(tmp_path):
    window, new = 10, 6
    specs = [("s-fp32", 0, "float32"), ("s-bf16", 5, "bfloat16")]
    before = [prompt(10 + i, 7) for i in range(3)]
    after = [prompt(20 + i, 5) for i in range(2)]
    r = make_router(tmp_path, max_kv_len=window, rope_rerotate=None)  # the profile's: re-rotate
    sessions, expected = [], {}
    for sid, seed, dt in specs:
        m = tiny_llama(seed=seed, dtype=getattr(torch, dt))
        outs = generate_turns(m, r.cache(sid, m), before, new)
        sessions.append({"sid": sid, "seed": seed, "dtype": dt,
                         "conv": conversation(before, outs)[0].tolist(),
                         "turns": [t[0].tolist() for t in after]})
        # the run that never stopped: same turns, one process, one cache
        ref = generate_turns(m, TieredCache(m, max_kv_len=window, **profile_rope()), before + after, new)
        expected[sid] = [t[0].tolist() for t in ref[len(before):]]
        assert all(torch.equal(x, y) for x, y in zip(ref[: len(before)], outs, strict=True))
    r.flush()
    assert r.warm.migrate(1) == ["s-fp32"]  # the LRU session now lives in cold only
    r.close()
    args = {"cold": str(tmp_path / "cold"), "warm": str(tmp_path / "warm"), "window": window,
            "new": new, "sessions": sessions, "retrieval": False}
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args), str(Path(__file__).parent)],
                       capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["s-fp32"]["where_before"] in ("cold", "both", "warm")
    for sid, _, _ in specs:
        assert got[sid]["gen"] == expected[sid], sid


def test_resume_refuses_another_model(tmp_path, model):
    r = make_router(tmp_path, max_kv_len=8)
    generate_turns(model, r.cache("s", model), [prompt(1, 9)], 4)
    r.flush()
    r.release("s")
    other = tiny_llama(seed=0, num_hidden_layers=3)
    with pytest.raises(KVMismatch, match="written by model"):
        r.resume("s", other)
    with pytest.raises(KVMismatch, match="written by model|dtype"):
        r.resume("s", tiny_llama(seed=0, dtype=torch.bfloat16))
    assert r.resume("s", model).seen == 12  # the right model still resumes
    r.close()


def test_resume_of_truncated_layer_file_is_a_clear_error(tmp_path, model):
    r = make_router(tmp_path, max_kv_len=8)
    generate_turns(model, r.cache("t", model), [prompt(1, 9), prompt(2, 9)], 4)
    r.flush()
    r.warm.migrate(1)
    r.close()
    layer1 = tmp_path / "cold" / "sessions" / "t" / "layer_1"
    size = layer1.stat().st_size
    os.truncate(layer1, size - 100)  # a torn tail: not even a whole token
    r = make_router(tmp_path, max_kv_len=8)
    with pytest.raises(KVCorrupt, match="layer_1.*truncated"):
        r.resume("t", model)
    r.close()


def test_cache_resumes_stored_sessions_and_fresh_starts_over(tmp_path, model):
    r = make_router(tmp_path, max_kv_len=8)
    generate_turns(model, r.cache("x", model), [prompt(1, 5)], 3)
    r.close()
    r = make_router(tmp_path, max_kv_len=8)
    assert r.cache("x", model).seen == 7
    assert r.cache("x", model, fresh=True).seen == 0
    assert r.warm.get_meta("x") is None
    r.close()


def test_no_window_router_matches_dynamic_cache(tmp_path, model):
    ts = [prompt(i, 6) for i in range(3)]
    r = make_router(tmp_path, max_kv_len=None)
    out = generate_turns(model, r.cache("nw", model), ts, 5)
    ref = generate_turns(model, DynamicCache(config=model.config), ts, 5)
    assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    st = r.stats()
    assert st["per_session"]["nw"]["hits"] == 15 and st["kv_hot_hit_rate"] == 1.0
    r.close()


@pytest.mark.parametrize("rerotate,pipelined", [(False, False), (True, False), (False, True)])
def test_resume_rebuilds_sinks_plus_last_w(tmp_path, model, rerotate, pipelined, monkeypatch):
    if pipelined:  # one layer per batch, the next read while one is laid out
        monkeypatch.setattr("kvfs.torch.recall.GROUP_BYTES", 1)
    window, sinks, new = 8, 4, 5
    r = make_router(tmp_path, max_kv_len=window, rope_rerotate=rerotate)
    ts = [prompt(60 + i, 7) for i in range(3)]
    ref = WindowReference(model, window, sinks=sinks, rerotate=1 if rerotate else None)
    for t in ts:
        ref.turn(t, new)
    conv = conversation(ts, generate_turns(model, r.cache("rs", model), ts, new))
    r.close()
    r = make_router(tmp_path, max_kv_len=window, rope_rerotate=rerotate)
    c = r.resume("rs", model)
    assert c.stored == sinks + window and c.sinks == sinks and (c.rope is not None) == rerotate
    # re-rotating: the reference rotates with float32 angles, the cache with float64 ones
    same = torch.testing.assert_close if rerotate else (lambda a, b: torch.equal(a, b) or pytest.fail("differ"))
    for layer, lay in enumerate(c.layers):
        hk, hv = ref.history(layer)
        hk, hv = hk[..., : c.seen, :], hv[..., : c.seen, :]
        same(lay.keys, torch.cat([hk[..., :sinks, :], hk[..., -window:, :]], -2))
        same(lay.values, torch.cat([hv[..., :sinks, :], hv[..., -window:, :]], -2))
    nxt = prompt(70, 5)
    out = model.generate(torch.cat([conv, nxt], 1), cache=c, max_new_tokens=new, do_sample=False)
    assert torch.equal(out[:, -new:], ref.turn(nxt, new))
    r.close()


def test_resume_refuses_a_fine_tune_of_the_same_model(tmp_path, model):
    r = make_router(tmp_path, max_kv_len=8)
    generate_turns(model, r.cache("ft", model), [prompt(1, 9)], 4)
    r.close()
    tuned = tiny_llama(seed=0)
    with torch.no_grad():
        tuned.model.layers[0].self_attn.k_proj.weight.add_(1e-3)
    r = make_router(tmp_path, max_kv_len=8)
    with pytest.raises(KVMismatch, match="written by model"):
        r.resume("ft", tuned)
    assert r.resume("ft", model).seen == 12
    r.close()


@pytest.mark.parametrize("live,rerotate", [(True, False), (False, False), (True, True)])
def test_fork_branches_continue_exactly(tmp_path, model, live, rerotate):
    """A session forked twice: each branch continues exactly like a never-forked run of its
    own token stream (a live source's active recall is cloned with it, re-rotated sinks too)."""
    window, new = 8, 5
    r = make_router(tmp_path, max_kv_len=window, rope_rerotate=rerotate)
    before = [prompt(80 + i, 6) for i in range(3)]
    branch = {"left": [prompt(90, 5), prompt(91, 4)], "right": [prompt(95, 7), prompt(96, 3)]}
    src = r.cache("root", model)
    conv = conversation(before, generate_turns(model, src, before, new))
    if live:
        assert src.recall(rounds=[1]) == [1]
        forks = {"left": r.fork("root", "left"), "right": r.fork("root", "right")}
    else:
        r.release("root")
        forks = {"left": r.fork("root", "left", model), "right": r.fork("root", "right")}
        assert forks["right"] is None
        forks["right"] = r.cache("right", model)
    with pytest.raises(ValueError, match="already exists"):
        r.fork("root", "left")
    tb = forks["left"].geo.token_bytes
    for name, c in forks.items():
        assert c.seen == conv.shape[1] - 1 and c.rounds == src.rounds
        assert r.warm.size(name, 0) == c.seen * tb
        assert np.array_equal(r.warm.read(name, 1, 0, c.seen * tb), r.warm.read("root", 1, 0, c.seen * tb))
        assert np.array_equal(r.warm.summaries(name), r.warm.summaries("root"))
    for name, turns in branch.items():
        c = forks[name]
        ref = WindowReference(model, window, rerotate=c.rope_quantum if rerotate else None)
        for t in before:
            ref.turn(t, new)
        if live:
            assert c.recalled_rounds == [1]
            ref.prefix = [(lay.recall_keys.clone(), lay.recall_values.clone()) for lay in c.layers]
        ids = conv
        for t in turns:
            expected = ref.turn(t, new)
            ids = model.generate(torch.cat([ids, t], 1), cache=c, max_new_tokens=new, do_sample=False)
            assert torch.equal(ids[:, -new:], expected), name
            c.end_round()
            ref.prefix = None
    r.close()


def test_automatic_recall_stays_within_the_budget(tmp_path, model):
    window, new = 8, 5
    stb = TieredCache(model).geo.session_token_bytes
    r = make_router(tmp_path, max_kv_len=window, auto_recall=True, recall_rounds=2,
                    device_budget_bytes=int((2 * (window + 4) + 12) * stb / 0.9))
    convs = {s: torch.empty(1, 0, dtype=torch.long) for s in ("a", "b")}
    for rnd in range(6):
        for s in convs:
            c = r.cache(s, model)
            ids = torch.cat([convs[s], prompt(100 * rnd + len(s), 6)], 1)
            convs[s] = model.generate(ids, cache=c, max_new_tokens=new, do_sample=False)
            c.end_round()
    st = r.stats()
    assert all(p["auto_recalls"] > 0 for p in st["per_session"].values())
    assert st["peak_hot_bytes"] <= r.limit
    r.close()


def test_budget_takes_idle_sinks_last_and_reads_them_back(tmp_path, model):
    """A budget of one session's sinks + window: serving B moves A's window out, then (last
    resort) A's sinks; A's next turn reads both back and continues exactly."""
    window, new = 8, 4
    stb = TieredCache(model).geo.session_token_bytes
    r = make_router(tmp_path, max_kv_len=window, device_budget_bytes=(4 + window + 1) * stb / 0.9)
    qs = {s: [prompt(200 + 10 * i + j, 5) for j in range(4)] for i, s in enumerate("ab")}
    convs = {s: torch.empty(1, 0, dtype=torch.long) for s in qs}
    sinks_moved = 0
    for rnd in range(4):
        for s in qs:
            c = r.cache(s, model)
            ids = torch.cat([convs[s], qs[s][rnd]], 1)
            convs[s] = model.generate(ids, cache=c, max_new_tokens=new, do_sample=False)
            c.end_round()
            other = r.cache("b" if s == "a" else "a", model) if rnd else None
            sinks_moved += bool(other is not None and other.sinks_moved)
    assert sinks_moved > 0 and r.peak_hot_bytes <= r.limit
    for s in qs:
        alone = generate_turns(model, TieredCache(model, max_kv_len=window), qs[s], new)
        assert torch.equal(convs[s], conversation(qs[s], alone)), s
    r.close()


def _tensors_of(cache) -> list:
    """Every tensor reachable from a cache through kvfs objects and containers (not the model)."""
    import gc
    import weakref

    seen, out, stack = set(), [], [cache]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (torch.nn.Module, type, str, bytes, int, float)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            out.append(weakref.ref(o))
        elif isinstance(o, (dict, list, tuple)) or type(o).__module__.startswith(("kvfs", "collections")):
            stack.extend(gc.get_referents(o))
    return out


def test_release_frees_the_sessions_tensors_without_the_cyclic_collector(tmp_path, model):
    """A released session's device tensors (window, retrieval blocks and centroids) are
    freed by ``release`` itself: its cache and parts refer to each other, so anything left
    in them would wait for the cyclic collector, outside the budget's account."""
    import gc

    r = make_router(tmp_path, profile="gov", retrieval=True)
    c = r.cache("s", model)
    generate_turns(model, c, [prompt(i, 40) for i in range(3)], 4)
    assert c.retrieval is not None and c.retrieval.device_bytes > 0  # blocks left the window
    held = _tensors_of(c)  # the walk finds at least the retrieval's tensors
    assert sum(w().numel() * w().element_size() for w in held) > c.retrieval.device_bytes
    gc.disable()
    try:
        r.release("s")
        left = [w() for w in held if w() is not None]
        # what may remain: constants of the model's rotation, not the session's K/V
        assert sum(t.numel() * t.element_size() for t in left) < 1024, [tuple(t.shape) for t in left]
        assert c.retrieval.device_bytes == 0
    finally:
        gc.enable()
        r.close()

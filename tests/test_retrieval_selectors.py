"""Retrieval's block selectors on a tiny random Llama: each choice is a function of the
tokens alone (two runs choose alike), a resumed session chooses as the one that never
stopped, and quantized keys score as the keys they stand for."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("kvfs.warm")

import kvfs.torch.retrieval as retrieval  # noqa: E402
from kvfs.torch import KVRouter, TieredCache, geometry  # noqa: E402
from kvfs.torch.blocks import QuantizedKeys, scale_layout, scoring_layout, selector  # noqa: E402
from kvfs.torch.reference import generate_turns, prompt, tiny_llama  # noqa: E402
from kvfs.torch.retrieval import FRESH_BLOCKS  # noqa: E402
from kvfs.warm import WarmTier  # noqa: E402

WARM_OPTS = {"shards": 16}
TURNS = [prompt(200 + i, 9 + i % 3) for i in range(7)]
NEW = 5
SELECTORS = ["centroids", "quest", "int8-max", "int8-sum", "int4-max", "int8-sum-every", "int8-sum-fresh3"]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def budget(model, blocks: int, block: int) -> int:
    return (blocks + FRESH_BLOCKS) * block * geometry(model).session_token_bytes


def run(tmp: Path, model, name: str, turns=TURNS):
    warm = WarmTier(cold_root=None, root=str(tmp), **WARM_OPTS)
    retrieval_default = retrieval.DEFAULT_SELECTOR
    retrieval.DEFAULT_SELECTOR = name
    try:
        c = TieredCache(model, session_id="s", warm=warm, max_kv_len=8, sink_tokens=4,
                        retrieval=True, retrieval_block=4, retrieval_bytes=budget(model, 3, 4),
                        rope_rerotate="reach", rope_reach=2048)
    finally:
        retrieval.DEFAULT_SELECTOR = retrieval_default
    assert c.retrieval.selector.name == name
    outs = [o[0].tolist() for o in generate_turns(model, c, turns, NEW)]
    chosen = [list(ch) for ch in c.retrieval.chosen]
    c.close()
    warm.close()
    return outs, chosen


@pytest.mark.parametrize("name", SELECTORS)
def test_choice_is_a_function_of_the_tokens(tmp_path, model, name):
    a = run(tmp_path / "a", model, name)
    b = run(tmp_path / "b", model, name)
    assert a == b
    assert any(a[1])


@pytest.mark.parametrize("name", SELECTORS)
def test_resume_chooses_as_the_session_that_never_stopped(tmp_path, model, name, monkeypatch):
    monkeypatch.setattr(retrieval, "DEFAULT_SELECTOR", name)
    before, after = TURNS[:4], TURNS[4:]
    expected, _ = run(tmp_path / "ref", model, name)
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True)
    kw = dict(warm_options=WARM_OPTS, max_kv_len=8, retrieval_block=4,
              retrieval_bytes=budget(model, 3, 4), retrieval_share=0.0)  # as run() attends
    r = KVRouter(mount=str(cold), warm_root=str(tmp_path / "w1"), **kw)
    c = r.cache("s", model)
    outs = generate_turns(model, c, before, NEW)
    assert [o[0].tolist() for o in outs] == expected[:len(before)]
    chosen = [list(ch) for ch in c.retrieval.chosen]
    r.save("s")
    r.warm.migrate(1)  # to the mount: the resume reads everything back from there
    r.close()
    r = KVRouter(mount=str(cold), warm_root=str(tmp_path / "w2"), **kw)
    c = r.resume("s", model)
    assert [list(ch) for ch in c.retrieval.chosen] == chosen
    ids = torch.cat([x for t, o in zip(before, outs, strict=True) for x in (t, o)], 1)
    got = []
    for t in after:
        ids = model.generate(torch.cat([ids, t], 1), cache=c, max_new_tokens=NEW, do_sample=False)
        got.append(ids[0, -NEW:].tolist())
        c.end_round()
    assert got == expected[len(before):]
    r.close()


def test_int8_scores_as_the_keys_it_stands_for():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, 32, 16, generator=g)
    q = torch.randn(1, 4, 3, 16, generator=g)
    sel = QuantizedKeys(8, 8, "sum")
    codes, scale = sel.represent(keys, 8)
    got = sel.scores(q, scoring_layout(codes)[None], scale_layout(scale)[None])
    # the exact attention mass of each block over the old keys, per KV head and query
    k = keys[0].unsqueeze(1)  # [H, 1, T, D]
    s = torch.softmax(q[0].view(2, 2, 3, 16) @ k.transpose(-1, -2) / 4.0, -1)  # [H, g, 3, T]
    want = s.reshape(2, 6, 4, 8).sum(-1).amax(1).sum(0)
    assert torch.allclose(got[0], want, atol=2e-3)
    assert codes.dtype == torch.int8 and selector("int8-sum", 8).name == "int8-sum"
    every = selector("int8-sum-every", 8)
    assert every.every_step and every.name == "int8-sum-every" and (every.bits, every.agg) == (8, "sum")
    fresh = selector("int8-sum-fresh8", 8)
    assert not fresh.every_step and fresh.fresh == 8 and fresh.name == "int8-sum-fresh8"
    for bad in ("int8-sum-fresh", "int8-sum-freshx", "int8-sum-often", "int8",
                "int8-sum-every-fresh4", "int8-sum-fresh4-fresh8", "int8-sum-every3"):
        with pytest.raises(ValueError):
            selector(bad, 8)
    with pytest.raises(ValueError):
        selector("nearest", 8)


@pytest.mark.parametrize("name", [None, "int8-sum-fresh3", "int8-sum-every"])
def test_the_default_follows_the_rule(tmp_path, model, name, monkeypatch):
    """The default selector (exact scores over int8 keys, chosen again at the first 4 decode
    steps of an answer, then held over decode steps that add no block), and the same keys
    chosen at the first 3 decode steps or at every one, choose what the reference written
    from the rule chooses, token for token."""
    from kvfs.torch.reference import RetrievalReference

    if name is None:
        assert retrieval.DEFAULT_SELECTOR == "int8-sum-fresh4" and not selector("int8-sum-fresh4", 4).every_step
    else:
        monkeypatch.setattr(retrieval, "DEFAULT_SELECTOR", name)
    warm = WarmTier(cold_root=None, root=str(tmp_path / "warm"), **WARM_OPTS)
    c = TieredCache(model, session_id="s", warm=warm, max_kv_len=8, sink_tokens=4, retrieval=True,
                    retrieval_block=4, retrieval_bytes=budget(model, 3, 4))
    got = generate_turns(model, c, TURNS, NEW)
    ref = RetrievalReference(model, 8, 4, 4, 3)
    try:
        want = [ref.turn(t, NEW) for t in TURNS]
    finally:
        ref.close()
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert [list(ch) for ch in c.retrieval.chosen] == ref.chosen
    c.close()
    warm.close()


@pytest.mark.parametrize("name,scorings", [("int8-sum", 1 + 3), ("int8-sum-fresh4", 1 + 4 + 2)])
def test_decode_steps_hold_the_choice_until_a_block_leaves(tmp_path, model, name, scorings, monkeypatch):
    """Exact scores are computed for a turn's tokens, at the decode steps after it its
    selector calls fresh, and when a block joins the candidates; single-token steps between
    keep the choice."""
    monkeypatch.setattr(retrieval, "DEFAULT_SELECTOR", name)
    warm = WarmTier(cold_root=None, root=str(tmp_path / "warm"), **WARM_OPTS)
    c = TieredCache(model, session_id="s", warm=warm, max_kv_len=8, sink_tokens=4, retrieval=True,
                    retrieval_block=4, retrieval_bytes=budget(model, 3, 4))
    calls = []
    real = c.retrieval.selector.scores
    c.retrieval.selector.scores = lambda *a: calls.append(c.retrieval.count[0]) or real(*a)
    with torch.no_grad():
        model(input_ids=prompt(300, 30), cache=c, use_cache=True)  # a turn: blocks leave, scored
        assert len(calls) == 1
        for t in range(12):  # decode steps: a block leaves every 4th
            model(input_ids=torch.tensor([[5 + t]]), cache=c, use_cache=True)
    # a block leaves every 4th step: one scoring per new block, and one per fresh step
    assert len(calls) == scorings and len(set(calls)) == 1 + 3
    c.close()
    warm.close()


def test_a_session_resumed_mid_answer_goes_on_with_its_fresh_steps(tmp_path, model, monkeypatch):
    """Saved and resumed two steps into an answer, a session with fresh steps chooses the
    rest of the answer as the one that never stopped (meta.json keeps the count)."""
    monkeypatch.setattr(retrieval, "DEFAULT_SELECTOR", "int8-sum-fresh3")
    kw = dict(warm_options=WARM_OPTS, max_kv_len=8, retrieval_block=4,
              retrieval_bytes=budget(model, 3, 4), retrieval_share=0.0)

    def steps(c, ids, n):
        out = []
        with torch.no_grad():
            for _ in range(n):
                logits = model(input_ids=ids, cache=c, use_cache=True).logits[0, -1]
                ids = logits.argmax().view(1, 1)
                out.append((int(ids), [list(ch) for ch in c.retrieval.chosen]))
        return out, ids

    runs = []
    for stop in (False, True):
        cold = tmp_path / f"cold{stop}"
        (cold / "sessions").mkdir(parents=True)
        r = KVRouter(mount=str(cold), warm_root=str(tmp_path / f"w{stop}"), **kw)
        c = r.cache("s", model)
        generate_turns(model, c, TURNS[:4], NEW)  # blocks have left the window
        first, ids = steps(c, TURNS[4], 3)  # a turn, then two steps of its answer
        if stop:
            r.save("s")
            r.close()
            r = KVRouter(mount=str(cold), warm_root=str(tmp_path / "w-resumed"), **kw)
            c = r.resume("s", model)
            assert c.retrieval._decodes == 2
        rest, _ = steps(c, ids, 4)
        runs.append(first + rest)
        r.close()
    assert runs[0] == runs[1]

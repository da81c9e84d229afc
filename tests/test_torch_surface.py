"""The rest of transformers' cache surface: crop (assisted and prompt-lookup decoding with the
window off), copy.deepcopy, and beam search refused with a message about beams."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache

from kvfs.torch import KVRouter, TieredCache
from kvfs.torch.reference import generate_turns, prompt, tiny_llama
from kvfs.warm import WarmTier


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def repetitive(n: int = 3) -> torch.Tensor:
    """A prompt that repeats itself: prompt lookup drafts from it, some drafts are rejected."""
    return torch.cat([prompt(1, 8)] * n, 1)


def test_prompt_lookup_decoding_with_the_window_off(model, monkeypatch, tmp_path):
    crops = []
    real = TieredCache.crop

    def spy(self, n):
        crops.append(n)
        return real(self, n)

    monkeypatch.setattr(TieredCache, "crop", spy)
    ids = repetitive()
    want = model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=16, do_sample=False)
    warm = WarmTier(cold_root=None, root=str(tmp_path / "warm"), shards=16)
    c = TieredCache(model, session_id="pl", warm=warm, max_kv_len=None)
    got = model.generate(ids, cache=c, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(got, want) and any(n < 0 for n in crops)
    assert c.seen == got.shape[1] - 1
    c.flush()  # what is stored is what was kept
    assert warm.size("pl", 0) == c.seen * c.geo.token_bytes
    c.close()
    warm.close()


def test_assisted_decoding_with_the_window_off(model):
    assistant = tiny_llama(seed=0, num_hidden_layers=1)
    ids = repetitive(2)
    want = model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=12, do_sample=False)
    c = TieredCache(model, max_kv_len=None)
    got = model.generate(ids, cache=c, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    assert torch.equal(got, want)


def test_crop_cuts_stored_tokens_and_refuses_what_it_cannot_honour(model, tmp_path):
    warm = WarmTier(cold_root=None, root=str(tmp_path / "warm"), shards=16)
    c = TieredCache(model, session_id="c", warm=warm, max_kv_len=None)
    generate_turns(model, c, [prompt(3, 10)], 6)
    with torch.no_grad():  # an open round of 5 tokens
        model(input_ids=prompt(4, 5), cache=c, use_cache=True)
    seen = c.seen
    c.flush()
    c.crop(-3)
    assert c.seen == seen - 3 and all(lay.keys.shape[-2] == seen - 3 for lay in c.layers)
    c.flush()
    assert warm.size("c", 1) == (seen - 3) * c.geo.token_bytes
    assert warm.get_meta("c")["tokens"] == seen - 3
    with pytest.raises(ValueError, match="closed rounds"):
        c.crop(-(c.seen - c.rounds[-1][1] + 1))
    with pytest.raises(ValueError, match="negative"):
        c.crop(2)
    w = TieredCache(model, max_kv_len=8)
    generate_turns(model, w, [prompt(5, 12)], 3)
    assert not w.is_croppable
    with pytest.raises(NotImplementedError, match="max_kv_len=None"):
        w.crop(-1)
    c.close()
    warm.close()


def test_cropped_cache_continues_like_a_cropped_dynamic_cache(model):
    a, b = TieredCache(model, max_kv_len=None), DynamicCache(config=model.config)
    x = prompt(6, 12)
    with torch.no_grad():
        model(input_ids=x, cache=a, use_cache=True)
        model(input_ids=x, cache=b, use_cache=True)
    a.crop(-3)
    b.crop(-3)
    assert a.get_seq_length() == b.get_seq_length() == 9
    y = prompt(7, 4)
    with torch.no_grad():
        la = model(input_ids=y, cache=a, use_cache=True).logits
        lb = model(input_ids=y, cache=b, use_cache=True).logits
    assert torch.equal(la, lb)


def test_deepcopy_continues_like_the_original(model):
    c = TieredCache(model, max_kv_len=6)
    ts = [prompt(10, 9), prompt(11, 5)]
    outs = generate_turns(model, c, ts, 4)
    d = copy.deepcopy(c)
    assert d is not c and d.seen == c.seen and d.layers[0].keys.data_ptr() != c.layers[0].keys.data_ptr()
    conv = torch.cat([ts[0], outs[0], ts[1], outs[1]], 1)
    nxt = torch.cat([conv, prompt(12, 5)], 1)
    a = model.generate(nxt, cache=c, max_new_tokens=5, do_sample=False)
    b = model.generate(nxt, cache=d, max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)


def test_deepcopy_of_a_stored_session_names_fork(model, tmp_path):
    (tmp_path / "cold" / "sessions").mkdir(parents=True)
    r = KVRouter(mount=str(tmp_path / "cold"), warm_root=str(tmp_path / "warm"), max_kv_len=8,
                 warm_options={"shards": 16})
    c = r.cache("s", model)
    generate_turns(model, c, [prompt(1, 9)], 3)
    with pytest.raises(TypeError, match=r"KVRouter.fork\('s', new_id\)"):
        copy.deepcopy(c)
    r.close()


@pytest.mark.parametrize("kw", [{"num_beams": 2}, {"num_beams": 3, "num_return_sequences": 2}])
def test_beam_search_is_refused_with_a_message_about_beams(model, kw):
    c = TieredCache(model, max_kv_len=8)
    with pytest.raises(ValueError, match=r"cannot run beam search \(num_beams > 1\)"):
        model.generate(prompt(2, 6), cache=c, max_new_tokens=3, do_sample=False, **kw)
    c = TieredCache(model, max_kv_len=8)  # a session that already holds a conversation
    generate_turns(model, c, [prompt(2, 6)], 3)
    with pytest.raises(ValueError, match="beam search"):
        model.generate(torch.cat([prompt(2, 6), prompt(3, 4)], 1), cache=c, max_new_tokens=3,
                       do_sample=False, **kw)

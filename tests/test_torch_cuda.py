"""Hot tier on a CUDA device: pinned staging with non-blocking copies, the memory_reserved
watermark (never ``torch.cuda.empty_cache()``), refill and resume onto the device.

Skipped without a GPU. Each test compares the GPU run with a GPU reference (CPU and GPU
kernels differ numerically), and the stored bytes with the K/V the reference produced.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("kvfs.warm")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kvfs.torch import KVRouter, Spiller, TieredCache
from kvfs.torch.reference import WindowReference, generate_turns, prompt, tiny_llama, token_major


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0).cuda()


def make_router(tmp_path: Path, **kw) -> KVRouter:
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True, exist_ok=True)
    kw.setdefault("auto_recall", False)  # exactness against caches without a warm tier
    return KVRouter(mount=str(cold), warm_root=str(tmp_path / "warm"), device="cuda",
                    warm_options={"shards": 16}, **kw)


def test_window_spill_through_pinned_staging(tmp_path, model):
    window = 8
    r = make_router(tmp_path, max_kv_len=window)
    ts = [prompt(10 + i, 6) for i in range(4)]
    ref = WindowReference(model, window, sinks=4)  # the router's default sinks
    expected = [ref.turn(t, 7) for t in ts]
    cache = r.cache("g", model)
    out = generate_turns(model, cache, ts, 7)
    assert all(torch.equal(a, b) for a, b in zip(expected, out, strict=True))
    assert cache.layers[0].keys.is_cuda
    r.flush()
    tb = cache.geo.token_bytes
    for layer in range(cache.num_layers):
        got = np.asarray(r.warm.read("g", layer, 0, cache.seen * tb)).tobytes()
        assert got == token_major(*ref.history(layer))[: cache.seen * tb]
    st = r.stats()
    assert st["spill"]["pinned_allocations"] <= 8  # staging buffers are reused
    r.close()


def test_spiller_pinned_copy_is_exact_and_non_blocking():
    class Sink:
        def __init__(self):
            self.buf = bytearray()

        def append(self, sid, layer, data):
            self.buf += np.asarray(data).tobytes()
            return len(self.buf)

    sink = Sink()
    sp = Spiller(sink)
    k = torch.randn(1, 2, 64, 16, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 64, 16, device="cuda", dtype=torch.bfloat16)
    off = 0
    for t in range(0, 64, 8):
        sp.submit_kv("s", 0, off, k[..., t:t + 8, :], v[..., t:t + 8, :])
        off += 8 * 2 * 2 * 16 * 2
    sp.close()
    assert bytes(sink.buf) == token_major(k, v)


def test_memory_reserved_watermark_moves_rounds_and_never_empties_cache(tmp_path, model, monkeypatch):
    def forbidden():
        raise AssertionError("torch.cuda.empty_cache() must never be called")

    monkeypatch.setattr(torch.cuda, "empty_cache", forbidden)
    window, new = 16, 6
    qs = {f"s{j}": [prompt(100 * j + i, 6) for i in range(6)] for j in range(4)}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    stb = TieredCache(model).geo.session_token_bytes
    # room for the weights and activations in use now plus about two windows (+ sinks) of KV
    budget = int((base + 2 * (window + 4 + 1) * stb + (1 << 20)) / 0.9)
    r = make_router(tmp_path, max_kv_len=window, device_budget_bytes=budget)
    convs = {s: torch.empty(1, 0, dtype=torch.long, device="cuda") for s in qs}
    for rnd in range(6):
        for s in qs:
            c = r.cache(s, model)
            ids = torch.cat([convs[s], qs[s][rnd].cuda()], 1)
            convs[s] = model.generate(ids, cache=c, max_new_tokens=new, do_sample=False)
            c.end_round()
    st = r.stats()
    assert st["watermark_moves"] > 0
    for s in qs:  # moves changed where KV lived, never what was attended
        alone = generate_turns(model, TieredCache(model, max_kv_len=window), qs[s], new)
        want = torch.cat([x.cuda() for t, o in zip(qs[s], alone, strict=True) for x in (t, o)], 1)
        assert torch.equal(convs[s], want), s
    r.close()


def test_resume_onto_the_device_continues_identically(tmp_path, model):
    window, new = 10, 5
    before = [prompt(1, 7), prompt(2, 7)]
    after = [prompt(3, 5)]
    r = make_router(tmp_path, max_kv_len=window)
    outs = generate_turns(model, r.cache("res", model), before, new)
    r.close(to_cold=True)
    r = make_router(tmp_path, max_kv_len=window)
    cache = r.resume("res", model)
    assert cache.layers[0].keys.is_cuda and cache.seen == sum(t.shape[1] for t in before) + 2 * new - 1
    conv = torch.cat([x.cuda() for t, o in zip(before, outs, strict=True) for x in (t, o)], 1)
    got = model.generate(torch.cat([conv, after[0].cuda()], 1), cache=cache, max_new_tokens=new,
                         do_sample=False)[:, -new:]
    ref = generate_turns(model, TieredCache(model, max_kv_len=window), before + after, new)
    assert torch.equal(got, ref[-1])
    r.close()

"""Retrieval by relevance: the rule against a reference written from it, resume and fork
token-identical to a run that never stopped (warm, cold, a new process), the key_bounds
stream (its bytes, torn / truncated / flipped / missing: recomputed from the stored keys),
the budget taking retrieved blocks, fetch timing, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("kvfs.warm")

from kvfs.torch import KVRouter, KVUnsupported, TieredCache, geometry
from kvfs.torch.blocks import HEADER_BYTES, STREAM, BlockLayout, bounds_of_keys
from kvfs.torch.testing import RetrievalReference, generate_turns, prompt, tiny_llama
from kvfs.warm import WarmTier

REPO = Path(__file__).resolve().parents[1]
WARM_OPTS = {"shards": 16}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def budget(model, blocks: int, block: int) -> int:
    """retrieval_bytes that attend ``blocks`` blocks of ``block`` tokens per layer."""
    return blocks * block * geometry(model).session_token_bytes


def make_router(tmp_path: Path, model, **kw) -> KVRouter:
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True, exist_ok=True)
    kw.setdefault("warm_options", WARM_OPTS)
    kw.setdefault("max_kv_len", 8)
    kw.setdefault("retrieval_block", 4)
    kw.setdefault("retrieval_bytes", budget(model, 3, kw["retrieval_block"]))
    return KVRouter(mount=str(cold), warm_root=str(kw.pop("warm", tmp_path / "warm")), **kw)


TURNS = [prompt(100 + i, 9 + i % 3) for i in range(7)]
NEW = 5


@pytest.mark.parametrize("window,sinks,block,attend", [(8, 4, 4, 3), (6, 0, 4, 2), (12, 4, 8, 1),
                                                       (5, 2, 3, 4)])
def test_retrieval_matches_the_rule(tmp_path, model, window, sinks, block, attend):
    warm = WarmTier(cold_root=None, root=str(tmp_path / "warm"), **WARM_OPTS)
    c = TieredCache(model, session_id="s", warm=warm, max_kv_len=window, sink_tokens=sinks,
                    retrieval=True, retrieval_block=block,
                    retrieval_bytes=budget(model, attend, block))
    got = generate_turns(model, c, TURNS, NEW)
    ref = RetrievalReference(model, window, sinks, block, attend)
    try:
        want = [ref.turn(t, NEW) for t in TURNS]
    finally:
        ref.close()
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    st = c.stats()["retrieval"]
    assert st["blocks"] > attend and st["attended_blocks"] == attend
    # the device holds what was chosen: the reference's choice for the next step
    assert [list(ch) for ch in c.retrieval.chosen] == ref.chosen
    c.close()
    warm.close()


def test_retrieval_changes_what_is_attended(tmp_path, model):
    """Not a window in disguise: with retrieval the answers differ from sinks + window."""
    warm = WarmTier(cold_root=None, root=str(tmp_path / "warm"), **WARM_OPTS)
    on = TieredCache(model, session_id="on", warm=warm, max_kv_len=8, retrieval=True,
                     retrieval_block=4, retrieval_bytes=budget(model, 3, 4))
    off = TieredCache(model, session_id="off", warm=warm, max_kv_len=8, retrieval=False)
    a, b = generate_turns(model, on, TURNS, NEW), generate_turns(model, off, TURNS, NEW)
    assert any(not torch.equal(x, y) for x, y in zip(a, b, strict=True))
    on.close()
    off.close()
    warm.close()

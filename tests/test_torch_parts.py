"""The hot tier's parts: composition, not mixins, and each part on its own.

``TieredCache`` and ``KVRouter`` hold named parts; a part never imports its owner (not
even for types: what it needs of it is a Protocol), and no class in ``kvfs.torch`` is a
mixin. The parts that hold state of their own are checked against the rule they implement.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvfs.torch as kt
from kvfs.torch.recall import summarize_keys
from kvfs.torch.reference import prompt, tiny_llama
from kvfs.torch.rotation import SinkRotation
from kvfs.torch.rounds import Rounds

TORCH = Path(kt.__file__).resolve().parent
TINY = tiny_llama()

#: part module -> the owners it must never import (at any level, TYPE_CHECKING included)
PARTS = {
    "layer": {"cache", "router"}, "cache_recall": {"cache", "router"},
    "cache_moves": {"cache", "router"}, "rounds": {"cache", "router"},
    "rotation": {"cache", "router"}, "stepstats": {"cache", "router"},
    "spill": {"cache", "router"}, "seams": {"cache", "router"}, "parts": {"cache", "router"},
    "router_budget": {"cache", "router"},
    "retrieval_store": {"cache", "router"}, "meta": {"cache", "router"},
}


def _torch_imports(path: Path) -> set[str]:
    """kvfs.torch modules ``path`` imports anywhere in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        out.update(n.split(".")[2] for n in names if n.startswith("kvfs.torch."))
    return out


@pytest.mark.parametrize("part", sorted(PARTS))
def test_a_part_never_imports_its_owner(part: str) -> None:
    bad = _torch_imports(TORCH / f"{part}.py") & PARTS[part]
    assert not bad, f"kvfs/torch/{part}.py imports its owner {sorted(bad)}"


def test_no_mixins_in_the_hot_tier() -> None:
    for path in TORCH.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert not node.name.endswith("Mixin"), f"{path.name}: class {node.name}"


def test_the_cache_is_made_of_its_parts() -> None:
    """Each part owns its state; the cache's names read the part's values."""
    cache = kt.TieredCache(TINY, max_kv_len=8, sink_tokens=2)
    assert cache.layers is cache.tiered and all(isinstance(lay, kt.TieredLayer) for lay in cache.layers)
    with torch.no_grad():
        for t in (prompt(1, 12), prompt(2, 5)):
            out = TINY(input_ids=t, cache=cache, use_cache=True)
            assert out.logits.shape[1] == t.shape[1]
            cache.end_round()
    assert cache.rounds is cache.round_log.closed and cache.rounds == [[0, 12], [12, 17]]
    assert cache.steps == cache.counts.steps == 2 and cache.hits + cache.misses == 2
    # handed down: the sinks (a copy: they stay), the 7 tokens that left the window, and
    # the ones that leave within window_slack steps
    assert cache.spilled_tokens == cache.spill.spilled_tokens == cache.tiered[0].spilled
    assert 2 + 7 <= cache.spilled_tokens <= 2 + 7 + cache.window_slack
    assert cache.refills == cache.moves.refills == 0 and not cache.sinks_moved
    assert cache.stored == 2 + 8 and cache.seen == 17


def test_rounds_sum_the_open_round_and_close_it() -> None:
    """The summary of a round is the summary of its keys' mean, whatever the folding."""
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(1, 2, n, 16, generator=g) for n in (70, *([1] * 40), 5)]  # folds twice
    r = Rounds(32)
    for k in steps:
        r.add(k)
    keys = torch.cat(steps, dim=-2)[0]  # [H, T, D]
    want = summarize_keys(keys.float().mean(dim=1).reshape(1, -1).numpy(), 32)
    np.testing.assert_allclose(r.summary(), want, rtol=1e-5, atol=1e-6)
    fork = Rounds(32)
    r.copy_to(fork)
    np.testing.assert_allclose(fork.summary(), want, rtol=1e-5, atol=1e-6)
    assert r.close(r.start) is None  # an empty round is not a round
    idx, summary = r.close(keys.shape[1])
    assert idx == 0 and r.closed == [[0, keys.shape[1]]] and r.start == keys.shape[1]
    np.testing.assert_allclose(summary, want, rtol=1e-5, atol=1e-6)
    assert not r.summary().any() and fork.closed == []  # the fork's rounds are its own
    r.restore([[0, 4], [4, 9]])
    assert r.start == 9 and r.closed == [[0, 4], [4, 9]]


@pytest.mark.parametrize("mode", ["window", "reach"])
def test_sink_rotation_follows_the_window_alone(mode: str) -> None:
    """``window``: the sinks sit just before the window, on the quantum's grid; ``reach``:
    they stay put until they are ``reach`` positions from the query, then move just enough
    (rounded up to the quantum), never past the window."""
    w, q, reach = 24, 4, 40
    rot = SinkRotation(TINY, mode, w, q, None, reach)
    assert rot.rope is not None and rot.mode == mode and rot.reach == (reach if mode == "reach" else None)
    for ws in range(4, 200, 3):
        got = rot.shift_for(ws, 4)
        if mode == "window":
            assert got == (ws - 4) // q * q
        else:
            need = ws + w - reach
            assert got == (0 if need <= 0 else min(-(-need // q) * q, (ws - 4) // q * q))
            assert got <= ws - 4 and (need <= 0 or ws + w - got <= reach or got == (ws - 4) // q * q)
    off = SinkRotation(TINY, False, w, q, None, None)
    assert off.rope is None and off.span_shifts([(4, 10), (12, 20)], 50, 4) == [0, 0]
    with pytest.raises(ValueError, match="rope_rerotate"):
        SinkRotation(TINY, "sideways", w, q, None, None)

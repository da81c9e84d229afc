"""Retrieval by relevance: the rule against a reference written from it, resume and fork
token-identical to a run that never stopped (warm, cold, a new process), the key_centroids
stream (its bytes, torn / truncated / flipped / missing: recomputed from the stored keys),
the budget taking retrieved blocks, fetch timing, refusals."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import crc32c
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("kvfs.warm")

from kvfs.torch import KVRouter, KVUnsupported, TieredCache, geometry
from kvfs.torch.blocks import HEADER_BYTES, STREAM, BlockLayout, centroids_of_keys
from kvfs.torch.reference import RetrievalReference, generate_turns, prompt, tiny_llama
from kvfs.torch.retrieval import FRESH_BLOCKS
from kvfs.torch.retrieval_store import chosen_from_meta
from kvfs.warm import WarmTier

REPO = Path(__file__).resolve().parents[1]
WARM_OPTS = {"shards": 16}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(autouse=True)
def centroid_selector(monkeypatch):
    """This file pins the centroid selector and its ``key_centroids`` stream (the default
    selector's rule, determinism and resume: tests/test_retrieval_selectors.py)."""
    monkeypatch.setattr("kvfs.torch.retrieval.DEFAULT_SELECTOR", "centroids")


def budget(model, blocks: int, block: int) -> int:
    """retrieval_bytes that attend ``blocks`` blocks of ``block`` tokens per layer (and keep
    FRESH_BLOCKS for reuse)."""
    return (blocks + FRESH_BLOCKS) * block * geometry(model).session_token_bytes


GROW_SHARE, GROW_MOST = 0.25, 6


def make_router(tmp_path: Path, model, **kw) -> KVRouter:
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True, exist_ok=True)
    kw.setdefault("warm_options", WARM_OPTS)
    kw.setdefault("max_kv_len", 8)
    kw.setdefault("retrieval_block", 4)
    kw.setdefault("retrieval_bytes", budget(model, 3, kw["retrieval_block"]))
    kw.setdefault("retrieval_share", GROW_SHARE)  # grows past 3 blocks as the session does
    kw.setdefault("retrieval_max_bytes", budget(model, GROW_MOST, kw["retrieval_block"]))
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


def conversation(ts, outs) -> torch.Tensor:
    return torch.cat([x for t, o in zip(ts, outs, strict=True) for x in (t, o)], 1)


def continue_turns(model, cache, conv, turns, new=NEW, end_round=True) -> list[list[int]]:
    out, ids = [], conv
    for t in turns:
        ids = model.generate(torch.cat([ids, t], 1), cache=cache, max_new_tokens=new, do_sample=False)
        out.append(ids[0, -new:].tolist())
        if end_round:
            cache.end_round()
    return out


def uninterrupted(tmp_path, model, turns, **kw) -> list[list[int]]:
    """The run that never stopped: one cache, every turn (the router's settings)."""
    warm = WarmTier(cold_root=None, root=str(tmp_path / "warm-ref"), **WARM_OPTS)
    c = TieredCache(model, session_id="ref", warm=warm, max_kv_len=kw.get("window", 8),
                    retrieval=True, retrieval_block=4, retrieval_bytes=budget(model, 3, 4),
                    retrieval_share=GROW_SHARE, retrieval_max_bytes=budget(model, GROW_MOST, 4),
                    rope_rerotate="reach", rope_reach=2048)
    out = [o[0].tolist() for o in generate_turns(model, c, turns, NEW)]
    c.close()
    warm.close()
    return out


BEFORE, AFTER = TURNS[:4], TURNS[4:]


@pytest.mark.parametrize("where", ["warm", "cold", "mid-round"])
def test_resume_continues_like_a_run_that_never_stopped(tmp_path, model, where):
    expected = uninterrupted(tmp_path, model, BEFORE + AFTER)
    r = make_router(tmp_path, model)
    c = r.cache("s", model)
    outs = generate_turns(model, c, BEFORE, NEW)
    if where == "mid-round":  # saved inside a round: the next turn continues the same round
        c.rounds.pop()
        c.round_log.start = c.rounds[-1][1]
    assert [o[0].tolist() for o in outs] == expected[:len(BEFORE)]
    chosen = [list(ch) for ch in c.retrieval.chosen]
    r.save("s")
    meta = r.warm.get_meta("s")
    assert meta["retrieval"]["tokens"] == c.seen and meta["retrieval"]["chosen"] == chosen
    if where == "cold":
        r.warm.migrate(1)
        assert r.warm.where("s") == "cold"
    r.close()
    r = make_router(tmp_path, model, warm=tmp_path / ("warm2" if where == "cold" else "warm"))
    c = r.resume("s", model)
    assert [list(ch) for ch in c.retrieval.chosen] == chosen
    assert c.retrieval.backfilled_blocks == 0  # every centroid came from the stream
    got = continue_turns(model, c, conversation(BEFORE, outs), AFTER)
    assert got == expected[len(BEFORE):]
    r.close()


CHILD = r"""
import json, sys
import torch
from kvfs.torch.reference import tiny_llama
from kvfs.torch import KVRouter, geometry
a = json.loads(sys.argv[1])
import kvfs.torch.retrieval
kvfs.torch.retrieval.DEFAULT_SELECTOR = a["selector"]
m = tiny_llama(seed=0)
tb = geometry(m).session_token_bytes  # the parent's settings: the same rule, the same blocks
r = KVRouter(mount=a["cold"], warm_root=a["warm"], max_kv_len=8, warm_options={"shards": 16},
             retrieval_block=4, retrieval_bytes=(3 + 2) * 4 * tb, retrieval_share=a["share"],
             retrieval_max_bytes=(a["most"] + 2) * 4 * tb)
c = r.resume("s", m)
ids, out = torch.tensor([a["conv"]]), []
for t in a["turns"]:
    ids = m.generate(torch.cat([ids, torch.tensor([t])], 1), cache=c, max_new_tokens=a["new"], do_sample=False)
    out.append(ids[0, -a["new"]:].tolist())
    c.end_round()
r.close()
print(json.dumps(out))
"""


def test_resume_in_a_new_process_attends_the_same_blocks(tmp_path, model):
    expected = uninterrupted(tmp_path, model, BEFORE + AFTER)
    r = make_router(tmp_path, model)
    outs = generate_turns(model, r.cache("s", model), BEFORE, NEW)
    r.close()  # flushes: every token, the centroids and the next step's blocks on the mount
    args = {"cold": str(tmp_path / "cold"), "warm": str(tmp_path / "warm-child"), "new": NEW,
            "selector": "centroids", "share": GROW_SHARE, "most": GROW_MOST,
            "conv": conversation(BEFORE, outs)[0].tolist(), "turns": [t[0].tolist() for t in AFTER]}
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True,
                       text=True, cwd=REPO, timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == expected[len(BEFORE):]


@pytest.mark.parametrize("live", [True, False])
def test_fork_branches_attend_like_their_own_runs(tmp_path, model, live):
    branches = {"left": [prompt(200, 6), prompt(201, 4)], "right": [prompt(205, 7), prompt(206, 5)]}
    r = make_router(tmp_path, model)
    src = r.cache("root", model)
    conv = conversation(BEFORE, generate_turns(model, src, BEFORE, NEW))
    if not live:
        r.release("root")
    forks = {name: r.fork("root", name, model) for name in branches}
    for name, c in forks.items():
        assert r.warm.side_size(name, STREAM) == r.warm.side_size("root", STREAM) > HEADER_BYTES
        got = continue_turns(model, c, conv, branches[name])
        assert got == uninterrupted(tmp_path / name, model, BEFORE + branches[name])[len(BEFORE):], name
    r.close()


def stored_history(warm, sid, model, seen):
    """K of every layer from the stored layer bytes."""
    from kvfs.torch.recall import read_tokens

    geo = geometry(model)
    return [read_tokens(warm, sid, layer, geo, 0, seen, "cpu")[0] for layer in range(geo.num_layers)]


def test_runs_of_blocks_are_read_in_one_call_with_the_stored_bytes(tmp_path, model):
    """The reads of chosen blocks: several runs of one layer in one call of the warm tier
    give each run's stored K/V, in order; a run past the layer's end is a clear error."""
    from kvfs.torch.fingerprint import KVCorrupt
    from kvfs.torch.recall import read_runs, read_tokens

    r = make_router(tmp_path, model)
    c = r.cache("s", model)
    generate_turns(model, c, BEFORE, NEW)
    r.save("s")
    geo = geometry(model)
    runs = [(20, 28), (4, 8), (40, 41)]
    for layer in (0, geo.num_layers - 1):
        k, v = read_runs(r.warm, "s", layer, geo, runs, "cpu")
        parts = [read_tokens(r.warm, "s", layer, geo, a, e, "cpu") for a, e in runs]
        assert torch.equal(k, torch.cat([p[0] for p in parts], dim=-2))
        assert torch.equal(v, torch.cat([p[1] for p in parts], dim=-2))
    with pytest.raises(KVCorrupt, match="cannot read tokens"):
        read_runs(r.warm, "s", 0, geo, [(4, 8), (c.seen, c.seen + 1)], "cpu")
    r.close()


def test_key_centroids_stream_holds_the_centroids_of_every_block_that_left(tmp_path, model):
    r = make_router(tmp_path, model)
    c = r.cache("s", model)
    generate_turns(model, c, BEFORE, NEW)
    r.save("s")
    lay = BlockLayout(4, 4, geometry(model))
    n = c.retrieval.count[0]
    raw = r.warm.side_read("s", STREAM, 0, r.warm.side_size("s", STREAM))
    assert raw.size == lay.offset(n) and lay.header_matches(raw)
    got = lay.parse(raw[HEADER_BYTES:])
    keys = stored_history(r.warm, "s", model, c.seen)
    for layer, k in enumerate(keys):
        assert torch.equal(got[:, layer], centroids_of_keys(k[..., 4:4 + n * 4, :], 4))
        assert torch.equal(got[:, layer], c.retrieval.reps.centroids(layer).cpu())
    r.close()
    assert (tmp_path / "cold" / "sessions" / "s" / STREAM).stat().st_size == lay.offset(n)


def _damage(path: Path, how: str, lay: BlockLayout) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":  # a bit inside the third record's payload
        data[lay.offset(2) + 40] ^= 0x10
    elif how == "torn":  # the last record cut in half
        del data[len(data) - lay.record_bytes // 2:]
    elif how == "header":  # another block size
        data[:HEADER_BYTES] = BlockLayout(8, 4, lay.geo).header()
    elif how == "earlier":  # the min/max bounds an earlier version wrote: another magic
        head = bytearray(lay.header())
        head[:8] = b"KVFSKB01"
        head[60:64] = struct.pack("<I", crc32c.crc32c(bytes(head[:60])))
        data[:HEADER_BYTES] = head
    elif how == "missing":  # a session written by another writer: no centroids at all
        path.unlink()
        return
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "torn", "header", "earlier", "missing"])
def test_damaged_or_missing_centroids_are_recomputed_from_the_stored_keys(tmp_path, model, how):
    expected = uninterrupted(tmp_path, model, BEFORE + AFTER)
    r = make_router(tmp_path, model)
    outs = generate_turns(model, r.cache("s", model), BEFORE, NEW)
    r.save("s")
    r.warm.migrate(1)  # the mount's copy is the session
    r.close()
    lay = BlockLayout(4, 4, geometry(model))
    f = tmp_path / "cold" / "sessions" / "s" / STREAM
    n = (f.stat().st_size - HEADER_BYTES) // lay.record_bytes
    _damage(f, how, lay)
    r = make_router(tmp_path, model, warm=tmp_path / "warm2")
    c = r.resume("s", model)
    want = {"flip": n - 2, "torn": 1, "header": n, "earlier": n, "missing": n}[how]
    assert c.retrieval.backfilled_blocks == want
    got = continue_turns(model, c, conversation(BEFORE, outs), AFTER)
    assert got == expected[len(BEFORE):]  # recomputed centroids are the same bytes
    r.save("s")
    raw = r.warm.side_read("s", STREAM, 0, r.warm.side_size("s", STREAM))
    m = c.retrieval.count[0]
    assert raw.size == lay.offset(m) and lay.parse(raw[HEADER_BYTES:]).shape[0] == m  # whole again
    r.close()


def test_meta_without_a_retrieval_entry_resumes(tmp_path, model):
    """Another writer's meta.json (no ``retrieval``): the first step attends sinks and window,
    its queries choose, and the session continues."""
    r = make_router(tmp_path, model)
    outs = generate_turns(model, r.cache("s", model), BEFORE, NEW)
    r.close()
    meta = tmp_path / "cold" / "sessions" / "s" / "meta.json"
    doc = json.loads(meta.read_text())
    del doc["retrieval"]
    meta.write_text(json.dumps(doc))
    (tmp_path / "cold" / "sessions" / "s" / STREAM).unlink()
    r = make_router(tmp_path, model, warm=tmp_path / "warm2")
    c = r.resume("s", model)
    assert c.retrieval.chosen[0] == () and c.retrieval.count[0] > 0
    continue_turns(model, c, conversation(BEFORE, outs), AFTER[:1])
    assert len(c.retrieval.chosen[0]) == c.retrieval.attend_for(c.retrieval.count[0]) >= 3
    r.close()


def test_the_attended_blocks_grow_with_the_session_up_to_their_most(tmp_path, model):
    """A share of the old blocks when it is more than the floor, never past the most: a
    function of the block count alone, reached by a live session step by step."""
    r = make_router(tmp_path, model)
    c = r.cache("s", model)
    ret = c.retrieval
    assert (ret.attend, ret.share, ret.most) == (3, GROW_SHARE, GROW_MOST)
    assert [ret.attend_for(n) for n in (0, 2, 3, 12, 13, 16, 20, 21, 24, 100)] == \
        [0, 2, 3, 3, 4, 4, 5, 6, 6, 6]
    outs = generate_turns(model, c, TURNS[:2], NEW)
    ids, seen = conversation(TURNS[:2], outs), [len(ret.chosen[0])]
    for t in TURNS[2:] + [prompt(200 + i, 12) for i in range(4)]:
        out = continue_turns(model, c, ids, [t])
        ids = torch.cat([ids, t, torch.tensor(out)], 1)
        seen.append(len(ret.chosen[0]))
        assert all(len(ch) == ret.attend_for(ret.count[0]) for ch in ret.chosen)
    assert seen[0] <= 3 and max(seen) > 3 and seen == sorted(seen)
    r.close()


def test_meta_choice_of_fewer_blocks_is_taken_back():
    """A step whose recalled rounds held some blocks chooses fewer: a saved choice of the
    same length on every layer fits; unequal lengths, too many blocks or bad indexes do not."""
    lay = BlockLayout(4, 4, geometry(tiny_llama(seed=0)))

    def saved(chosen):
        return {"block": 4, "origin": 4, "tokens": 40, "chosen": chosen}

    assert chosen_from_meta(saved([[1], [0]]), lay, 40, 6, 3, 2) == [(1,), (0,)]
    assert chosen_from_meta(saved([[1, 2], [0, 3]]), lay, 40, 6, 3, 2) == [(1, 2), (0, 3)]
    for bad in ([[1, 2], [0]], [[1, 2, 3, 4], [0, 1, 2, 3]], [[1, 6], [0, 1]], [[1, 1], [0, 2]]):
        assert chosen_from_meta(saved(bad), lay, 40, 6, 3, 2) == [(), ()]
    assert chosen_from_meta(saved([[1], [0]]), lay, 41, 6, 3, 2) == [(), ()]  # other tokens


def test_budget_moves_take_retrieved_blocks_and_bring_them_back(tmp_path, model):
    """Two sessions under a budget too small for both: the retrieved blocks of the idle one
    are moved out and read back before its next step; the tokens are those of a run
    without a budget."""
    probe = make_router(tmp_path / "probe", model)
    generate_turns(model, probe.cache("p", model), TURNS, NEW)
    one = probe.stats()["peak_hot_bytes"]  # one session's device bytes at its largest
    probe.close()
    r = make_router(tmp_path, model, device_budget_bytes=int(1.8 * one / 0.9))
    expected = uninterrupted(tmp_path, model, TURNS)
    got: dict[str, list] = {"a": [], "b": []}
    for t in TURNS:
        for sid in ("a", "b"):
            c = r.cache(sid, model)
            ids = torch.cat([*(x for pair in zip(TURNS, [torch.tensor([g]) for g in got[sid]],
                                                 strict=False) for x in pair)], 1) if got[sid] else None
            conv = t if ids is None else torch.cat([ids, t], 1)
            out = model.generate(conv, cache=c, max_new_tokens=NEW, do_sample=False)
            got[sid].append(out[0, -NEW:].tolist())
            c.end_round()
    assert got["a"] == expected and got["b"] == expected
    st = r.stats()
    assert st["watermark_moves"] > 0 and st["peak_hot_bytes"] <= r.limit
    assert sum(s["retrieval"]["fetched_blocks"] for s in st["per_session"].values()) > 0
    r.close()


@pytest.mark.parametrize("select", ["centroids", "int8-sum-fresh4"])
def test_many_idle_sessions_give_up_their_representatives_and_choose_alike(tmp_path, model,
                                                                          monkeypatch, select):
    """Six sessions under a budget that holds one and a half: once no window token is
    left to move, the idle sessions' representatives go too (rebuilt from the stored keys
    before their next step). The budget holds, and every session writes the tokens of a
    run without a budget."""
    monkeypatch.setattr("kvfs.torch.retrieval.DEFAULT_SELECTOR", select)
    probe = make_router(tmp_path / "probe", model)
    generate_turns(model, probe.cache("p", model), TURNS, NEW)
    one = probe.stats()["peak_hot_bytes"]
    probe.close()
    expected = uninterrupted(tmp_path, model, TURNS)
    r = make_router(tmp_path, model, device_budget_bytes=int(1.5 * one / 0.9))
    sids = [f"s{i}" for i in range(6)]
    got: dict[str, list] = {sid: [] for sid in sids}
    convs = {sid: torch.empty(1, 0, dtype=torch.long) for sid in sids}
    for t in TURNS:
        for sid in sids:
            c = r.cache(sid, model)
            out = model.generate(torch.cat([convs[sid], t], 1), cache=c, max_new_tokens=NEW,
                                 do_sample=False)
            convs[sid] = out
            got[sid].append(out[0, -NEW:].tolist())
            c.end_round()
    assert all(got[sid] == expected for sid in sids)
    st = r.stats()
    assert st["peak_hot_bytes"] <= r.limit
    assert sum(s["retrieval"]["reps_rebuilt"] for s in st["per_session"].values()) > 0
    r.close()


def test_a_slow_fetch_changes_nothing_but_the_wait(tmp_path, model, monkeypatch):
    from kvfs.torch.block_reads import BlockReads

    expected = uninterrupted(tmp_path, model, TURNS)
    slow = BlockReads.read

    def read(self, layer, blocks):
        time.sleep(0.05)
        return slow(self, layer, blocks)

    monkeypatch.setattr(BlockReads, "read", read)
    monkeypatch.setattr(BlockReads, "_in_ram", lambda *a: False)  # as if on the mount: a thread
    monkeypatch.setattr("kvfs.torch.retrieval.FRESH_BLOCKS", 0)  # every new block is read
    r = make_router(tmp_path, model)
    c = r.cache("s", model)
    got = [o[0].tolist() for o in generate_turns(model, c, TURNS, NEW)]
    assert got == expected
    st = c.stats()
    waits = st["retrieval"]["fetch_waits"]  # per layer; a step that waited is one miss
    assert st["retrieval"]["background_reads"] > 0
    assert waits > 0 and waits / c.num_layers <= st["misses"] <= waits
    r.close()


def test_a_live_session_moved_to_the_mount_reads_its_blocks_from_there(tmp_path, model):
    expected = uninterrupted(tmp_path, model, TURNS)
    r = make_router(tmp_path, model)
    c = r.cache("s", model)
    got = [o[0].tolist() for o in generate_turns(model, c, TURNS[:3], NEW)]
    r.save("s")
    r.warm.migrate(1)  # the RAM copy leaves: the blocks come from the mount now
    assert r.warm.where("s") == "cold"
    conv = torch.cat([x for t, o in zip(TURNS[:3], got, strict=True) for x in (t, torch.tensor([o]))], 1)
    got += continue_turns(model, c, conv, TURNS[3:])
    assert got == expected
    assert c.stats()["retrieval"]["background_reads"] > 0
    r.close()


def test_retrieval_refuses_what_it_cannot_serve(tmp_path, model):
    from kvfs.torch import attention

    warm = WarmTier(cold_root=None, root=str(tmp_path / "warm"), **WARM_OPTS)
    kw = {"warm": warm, "max_kv_len": 8, "retrieval": True, "retrieval_block": 4,
          "retrieval_bytes": budget(model, 2, 4)}
    with pytest.raises(ValueError, match="needs a warm tier"):
        TieredCache(model, **{**kw, "warm": None})
    fresh = tiny_llama(seed=3)
    with pytest.raises(ValueError, match="needs the model"):
        TieredCache(fresh.config, **kw)

    class Opaque(type(fresh)):  # attention that does not dispatch through the registry
        @classmethod
        def _can_set_attn_implementation(cls):
            return False

    fresh.__class__ = Opaque
    with pytest.raises(KVUnsupported, match="AttentionInterface"):
        TieredCache(fresh, **kw)
    fresh.__class__ = Opaque.__mro__[1]
    c = TieredCache(fresh, session_id="u", **kw)
    attention.uninstall(fresh)  # queries no longer reported
    with pytest.raises(KVUnsupported, match="queries of 0 of 2 layers"):
        generate_turns(fresh, c, TURNS, NEW)
    c.close()
    warm.close()

"""The pieces of kvfs.vllm that need no vLLM: the token-id file (and its damage), the session
store, the block-layout probe; and KVRouter.record_tokens."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from kvfs.session.files import read_ids, record_ids
from kvfs.session.names import TOKENS
from kvfs.session.tokens import common_prefix, decode, encode
from kvfs.torch.fingerprint import KVGeometry, KVUnsupported
from kvfs.vllm.paged import probe_layout
from kvfs.vllm.scheduler import SchedulerSide, parts_of, session_of
from kvfs.vllm.store import SessionStore, agreed, prefix_keys, server_key
from kvfs.warm.coldfiles import ColdStore

GEO = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
KEY = bytes(range(32))
NOBODY = 54321  # another local user


@pytest.fixture(autouse=True)
def _state_home(tmp_path, monkeypatch):
    """Server keys made by the tests go to the test's directory, not the user's home."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture
def root(tmp_path):
    (tmp_path / "sessions").mkdir()
    return tmp_path


def _req(rid, prompt, sid="s", salt=None, computed=0, out=()):
    """The fields of a vLLM request the scheduler half reads."""
    return NS(request_id=rid, prompt_token_ids=list(prompt), sampling_params=None,
              kv_transfer_params=None if sid is None else {"session": sid},
              num_computed_tokens=computed, all_token_ids=list(prompt) + list(out),
              cache_salt=salt)


_IDLE = NS(scheduled_new_reqs=[], scheduled_cached_reqs=NS(
    req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]))


def test_token_records_rebuild_an_edited_history(root) -> None:
    cold = ColdStore(str(root))
    assert record_ids(cold, "s", [1, 2, 3, 4]) == 0
    assert record_ids(cold, "s", [1, 2, 3]) == 3  # a prefix: nothing written
    assert record_ids(cold, "s", [1, 2, 3, 4, 5, 6]) == 4
    assert record_ids(cold, "s", [1, 2, 9, 9]) == 2  # edited at token 2
    assert read_ids(cold, "s").tolist() == [1, 2, 9, 9]
    raw = (root / "sessions" / "s" / TOKENS).read_bytes()
    assert decode(raw)[1] == len(raw)
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0


def test_damaged_token_files_give_a_shorter_prefix_never_a_wrong_id(root) -> None:
    raw = encode(0, [10, 11, 12]) + encode(3, [13, 14]) + encode(1, [21, 22, 23, 24])
    full = decode(raw)[0].tolist()
    assert full == [10, 21, 22, 23, 24]
    prefixes = {(), (10, 11, 12), (10, 11, 12, 13, 14), tuple(full)}
    for cut in range(len(raw)):  # torn / truncated anywhere
        assert tuple(decode(raw[:cut])[0].tolist()) in prefixes
    for i in range(len(raw)):  # one flipped bit in every byte
        bad = bytearray(raw)
        bad[i] ^= 0x10
        got = tuple(decode(bytes(bad))[0].tolist())
        assert got in prefixes and got != tuple(full)
    assert decode(encode(5, [1]))[0].size == 0  # a record past the ids before it


def test_appending_after_a_damaged_tail_cuts_it_first(root) -> None:
    cold = ColdStore(str(root))
    record_ids(cold, "s", [1, 2, 3])
    f = root / "sessions" / "s" / TOKENS
    f.write_bytes(f.read_bytes() + b"KVTK\x00garbage")
    assert read_ids(cold, "s").tolist() == [1, 2, 3]
    record_ids(cold, "s", [1, 2, 3, 4])
    assert read_ids(cold, "s").tolist() == [1, 2, 3, 4]
    assert decode(f.read_bytes())[1] == f.stat().st_size
    with pytest.raises(ValueError):
        record_ids(cold, "s", [-1])


def _kv(n: int, seed: int) -> list[np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 2, GEO.num_kv_heads, GEO.head_dim, generator=g).view(torch.uint8)
            .numpy().reshape(-1) for _ in range(GEO.num_layers)]


def test_session_store_turns_edits_and_other_models(root) -> None:
    st = SessionStore(str(root), "sha256:aa", GEO, summary_dim=8, key=KEY)
    ids = np.arange(100, 110)
    kv = _kv(10, 0)
    keys = np.ones((10, 2, 4), np.float32)
    assert st.append_turn("s", ids, kv, 0, keys) == 10
    got = st.lookup("s")
    assert got.tokens == 10 and got.ids.tolist() == ids.tolist()
    assert st.read("s", 1, 2, 5).tobytes() == kv[1][2 * 64:5 * 64].tobytes()
    more = np.concatenate([ids, [7, 8, 9]])
    kv2 = _kv(3, 1)
    assert st.append_turn("s", more, kv2, 10, keys[:3]) == 13
    meta = json.loads((root / "sessions" / "s" / "meta.json").read_text())
    assert meta["rounds"] == [[0, 10], [10, 13]] and meta["tokens"] == 13
    assert (root / "sessions" / "s" / "summaries.f32").stat().st_size == 2 * 8 * 4
    # an edited history: agrees up to token 4, then differs
    edit = np.concatenate([ids[:4], [55, 56]])
    assert agreed(st.lookup("s"), edit) == 4
    assert st.append_turn("s", edit, _kv(2, 2), 4, None) == 6
    meta = json.loads((root / "sessions" / "s" / "meta.json").read_text())
    assert meta["tokens"] == 6 and meta["rounds"] == [[0, 6]]
    assert st.lookup("s").ids.tolist() == edit.tolist()
    assert (root / "sessions" / "s" / "layer_0").stat().st_size == 6 * 64
    assert st.read("s", 0, 0, 4).tobytes() == kv[0][:4 * 64].tobytes()
    # another model: not reused, not written over
    other = SessionStore(str(root), "sha256:bb", GEO, summary_dim=8, key=KEY)
    assert other.lookup("s") is None
    with pytest.raises(ValueError, match="another model|written by model"):
        other.append_turn("s", edit, _kv(6, 3), 0, None)
    assert st.lookup("s").tokens == 6
    # ids missing or short: only what has ids is offered
    (root / "sessions" / "s" / TOKENS).write_bytes(encode(0, edit[:3]))
    assert st.lookup("s").tokens == 3


def test_prefix_entries_are_chained_salted_and_found_in_order(root) -> None:
    ids = list(range(40))
    keys = prefix_keys("sha256:aa", None, ids, 8, KEY)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert prefix_keys("sha256:aa", None, ids[:17], 8, KEY) == keys[:2]  # a prefix's names
    assert prefix_keys("sha256:aa", "tenant", ids, 8, KEY)[0] != keys[0]
    assert prefix_keys("sha256:bb", None, ids, 8, KEY)[0] != keys[0]
    assert prefix_keys("sha256:aa", None, [1] + ids[1:], 8, KEY)[3] != keys[3]  # chained
    assert prefix_keys("sha256:aa", None, ids, 8, b"k" * 32)[0] != keys[0]  # keyed
    st = SessionStore(str(root), "sha256:aa", GEO, summary_dim=8, key=KEY)
    for j in (0, 1, 3):
        st.append_turn(keys[j], np.array(ids[8 * j:8 * j + 8]), _kv(8, j), 0, None)
    assert st.present(keys) == 2  # the run stops at the first missing entry
    assert parts_of(keys, 8, 4, 20) == [(keys[0], 4, 4, 4), (keys[1], 0, 8, 8), (keys[2], 0, 16, 4)]
    assert parts_of("s", 8, 4, 20) == [("s", 4, 4, 16)]


def test_session_names_from_requests() -> None:
    class R:
        request_id = "r"
        sampling_params = None

        def __init__(self, params):
            self.kv_transfer_params = params
    assert session_of(R({"session": "agent-7"})) == "agent-7"
    assert session_of(R(None)) is None
    for bad in ("../x", ".hidden", "a/b", "prefix-abc", "tenant-abc", 7, "x" * 201):
        assert session_of(R({"session": bad})) is None


def _cpu_like_writer(k, v, cache, slots):
    """vLLM's CPU layout ('vec'): per block and head, K dimension-major then V token-major."""
    nb, h, n, d2 = cache.shape
    d = d2 // 2
    flat = cache.view(nb, h, 2 * n * d)
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, n)
        flat[b, :, torch.arange(d) * n + o] = k[i]
        flat[b, :, n * d + o * d + torch.arange(d)] = v[i]


def test_block_layout_probe_gather_scatter() -> None:
    lay = probe_layout(_cpu_like_writer, 4, 2, 8, torch.bfloat16)
    cache = torch.zeros((6, 2, 4, 16), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    tm = torch.randn(10, 2, 2, 8, generator=g).to(torch.bfloat16)
    k, v = tm[:, 0].contiguous(), tm[:, 1].contiguous()
    blocks = [3, 1, 5]
    slots = torch.tensor([blocks[t // 4] * 4 + t % 4 for t in range(10)])
    _cpu_like_writer(k, v, cache, slots)
    assert torch.equal(lay.gather(cache, blocks, 0, 10), tm)
    assert torch.equal(lay.gather(cache, blocks, 3, 9), tm[3:9])
    other = torch.zeros_like(cache)
    lay.scatter(other, blocks, 0, tm[:6])
    lay.scatter(other, blocks, 6, tm[6:])
    assert torch.equal(other, cache)

    def mixes_heads(k, v, cache, slots):
        _cpu_like_writer(k.flip(1), v, cache, slots)
    with pytest.raises(KVUnsupported):
        probe_layout(mixes_heads, 4, 2, 8, torch.float32)


def test_kvrouter_records_its_token_ids(root) -> None:
    from kvfs.torch import KVRouter
    from kvfs.torch.reference import prompt, tiny_llama

    model = tiny_llama(0)
    ids = prompt(1, 12)
    with KVRouter(mount=str(root), max_kv_len=None, warm_root=str(root / "warm")) as router:
        cache = router.cache("agent", model)
        full = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                              max_new_tokens=5, do_sample=False)
        cache.end_round()
        router.record_tokens("agent", full[0])
        router.flush()
    st = SessionStore(str(root), cache.fingerprint, cache.geo, key=KEY)
    got = st.lookup("agent")
    assert got.tokens == full.shape[1] - 1
    assert got.ids.tolist() == full[0, :-1].tolist()


def test_block_layout_probe_large_blocks() -> None:
    lay = probe_layout(_cpu_like_writer, 256, 1, 4, torch.bfloat16)
    cache = torch.zeros((3, 1, 256, 8), dtype=torch.bfloat16)
    tm = torch.randn(300, 2, 1, 4).to(torch.bfloat16)
    lay.scatter(cache, [2, 0], 0, tm)
    assert torch.equal(lay.gather(cache, [2, 0], 0, 300), tm)


def test_worker_loads_checks_ids_and_saves(root) -> None:
    """The worker half without vLLM: a CPU-layout cache, a session loaded into blocks, a
    load whose ids no longer agree refused, a finished request stored."""
    import time

    from kvfs.vllm.scheduler import LoadJob, SaveJob, StepPlan
    from kvfs.vllm.worker import WorkerSide

    st = SessionStore(str(root), "sha256:aa", GEO, summary_dim=8, key=KEY)
    ids = np.arange(500, 512)
    kv = _kv(12, 5)
    st.append_turn("s", ids, kv, 0, None)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros((8, 2, 4, 8)) for i in (1, 0)}
    w = WorkerSide(st)
    try:
        w.register(caches, 4, _cpu_like_writer)
        blocks = [6, 2, 4]
        w.start_loads(StepPlan(loads=[LoadJob("r", blocks, parts_of("s", 8, 0, 12),
                                              ids[:12].tolist())]))
        for name in caches:
            w.wait_layer(name)
        w.wait_loads()
        assert w.load_errors() == set()
        for i in range(2):
            got = w.layout.gather(caches[f"model.layers.{i}.self_attn.attn"], blocks, 0, 12)
            assert got.contiguous().view(torch.uint8).numpy().tobytes() == kv[i].tobytes()
        wrong = ids[:8].tolist()
        wrong[5] += 1
        w.start_loads(StepPlan(loads=[LoadJob("r2", [1, 3], parts_of("s", 8, 0, 8), wrong)]))
        w.wait_loads()
        assert w.load_errors() == {1, 3}
        # a finished request: its 12 tokens and 4 more stored as session "t"
        more = np.concatenate([ids, [1, 2, 3, 4]])
        w.start_loads(StepPlan(loads=[LoadJob("r3", [6, 2, 4, 7], parts_of("s", 8, 0, 12),
                                              ids.tolist())]))
        w.submit_saves(StepPlan(saves=[SaveJob("r3", "t", [6, 2, 4, 7], more.tolist())]))
        deadline = time.monotonic() + 30
        done: set[str] = set()
        while "r3" not in done and time.monotonic() < deadline:
            done |= w.finished_saves()
            time.sleep(0.05)
        assert "r3" in done
        got = st.lookup("t")
        assert got.tokens == 16 and got.ids.tolist() == more.tolist()
        assert st.read("t", 1, 0, 12).tobytes() == kv[1].tobytes()
    finally:
        w.close()


def test_worker_reads_ahead_and_fails_only_the_request_whose_layer_is_short(root) -> None:
    """Loads of more layers than the worker reads ahead: two requests, one session's layer 5
    cut short. That request's blocks are reported failed; the other's every layer is exact."""
    from kvfs.vllm.scheduler import LoadJob, StepPlan
    from kvfs.vllm.worker import READ_AHEAD, WorkerSide

    geo = KVGeometry(num_layers=READ_AHEAD + 3, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    st = SessionStore(str(root), "sha256:aa", geo, summary_dim=8, key=KEY)
    g = torch.Generator().manual_seed(3)
    kvs = {}
    for sid in ("good", "short"):
        kvs[sid] = [torch.randn(12, 2, 2, 4, generator=g).view(torch.uint8).numpy().reshape(-1)
                    for _ in range(geo.num_layers)]
        st.append_turn(sid, np.arange(500, 512), kvs[sid], 0, None)
    layer5 = root / "sessions" / st.session_dir("short", None) / "layer_5"
    os.truncate(layer5, layer5.stat().st_size // 2)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros((8, 2, 4, 8))
              for i in range(geo.num_layers)}
    w = WorkerSide(st)
    try:
        w.register(caches, 4, _cpu_like_writer)
        ids = list(range(500, 512))
        w.start_loads(StepPlan(loads=[LoadJob("a", [6, 2, 4], parts_of("good", 8, 0, 12), ids),
                                      LoadJob("b", [1, 3, 5], parts_of("short", 8, 0, 12), ids)]))
        for name in caches:
            w.wait_layer(name)
        w.wait_loads()
        assert w.load_errors() == {1, 3, 5}
        for i in range(geo.num_layers):
            got = w.layout.gather(caches[f"model.layers.{i}.self_attn.attn"], [6, 2, 4], 0, 12)
            assert got.contiguous().view(torch.uint8).numpy().tobytes() == kvs["good"][i].tobytes()
        assert w.loaded_tokens == 12
    finally:
        w.close()


def test_scheduler_offers_agreeing_blocks_and_plans_loads_and_saves(root) -> None:
    st = SessionStore(str(root), "sha256:aa", GEO, summary_dim=8, key=KEY)
    ids = list(range(100, 120))
    st.append_turn("s", np.array(ids), _kv(20, 0), 0, None)
    sch = SchedulerSide(st, block_size=4, chunk=8)
    req = _req
    edited = ids[:10] + [7] * 6
    assert sch.matched(req("a", ids + [1, 2]), 0) == (20, False)  # all 20 stored, whole blocks
    assert sch.matched(req("b", edited), 4) == (4, False)  # agrees on 10 -> 8, vLLM has 4
    assert sch.matched(req("c", ids[:9]), 0) == (8, False)  # the last prompt token is computed
    sch.after_alloc(req("a", ids + [1, 2]), 20)
    sch.after_alloc(req("b", edited), 4)
    out = NS(scheduled_new_reqs=[NS(req_id="a", block_ids=([5, 6, 7, 8, 9, 10],), num_computed_tokens=20)],
             scheduled_cached_reqs=NS(req_ids=["b"], resumed_req_ids={"b"},
                                      new_block_ids=[([1, 2, 3],)], num_computed_tokens=[8]))
    plan = sch.plan(out)
    a, b = plan.loads
    assert (a.req_id, a.start, a.end, a.expect, a.block_ids) == ("a", 0, 20, ids, [5, 6, 7, 8, 9, 10])
    assert (b.req_id, b.start, b.end, b.expect, b.block_ids) == ("b", 4, 8, ids[4:8], [1, 2, 3])
    delay, info = sch.finished(req("a", ids + [1, 2], computed=25, out=[3, 4, 5, 6]), [5, 6, 7, 8, 9, 10, 11])
    assert delay and info == {"session": "s", "kvfs_loaded_tokens": 20, "kvfs_stored_tokens": 25}
    (save,) = sch.plan(_IDLE).saves
    assert save.sid == "s" and save.ids == ids + [1, 2, 3, 4, 5] and save.entries == []
    # no session: prefix entries of whole 8-token runs
    delay, info = sch.finished(req("d", ids, sid=None, computed=19), [1, 2, 3, 4, 5])
    (save,) = sch.plan(_IDLE).saves
    assert delay and save.sid is None and save.ids == ids[:16] and len(save.entries) == 2
    assert info == {"kvfs_loaded_tokens": 0}


def test_tenants_see_and_change_only_their_own_sessions(root) -> None:
    """A request's cache_salt is its tenant: another tenant's request naming the same
    session is offered none of its KV, and its turn is stored apart, never over it."""
    st = SessionStore(str(root), "sha256:aa", GEO, summary_dim=8, key=KEY)
    ids = list(range(100, 132))
    st.append_turn("agent-7", np.array(ids), _kv(32, 0), 0, None)
    sch = SchedulerSide(st, block_size=4, chunk=8)
    assert sch.matched(_req("a", ids + [1], sid="agent-7"), 0) == (32, False)
    # tenant B, same name, a prompt agreeing on the first 16 tokens: nothing to guess from
    guess = ids[:16] + [9] * 8
    assert sch.matched(_req("b1", guess, sid="agent-7", salt="tenant-B"), 0) == (0, False)
    delay, info = sch.finished(_req("b1", guess, sid="agent-7", salt="tenant-B", computed=24),
                               [1, 2, 3, 4, 5, 6])
    assert delay and info["session"] == "agent-7" and info["kvfs_loaded_tokens"] == 0
    (save,) = sch.plan(_IDLE).saves
    assert save.sid.startswith("tenant-") and save.sid == st.session_dir("agent-7", "tenant-B")
    st.append_turn(save.sid, np.array(save.ids), _kv(24, 1), 0, None)
    got = st.lookup("agent-7")  # the default tenant's session is untouched
    assert got.tokens == 32 and got.ids.tolist() == ids
    assert st.read("agent-7", 0, 0, 32).tobytes() == _kv(32, 0)[0].tobytes()
    assert sch.matched(_req("a2", ids + [1], sid="agent-7"), 0) == (32, False)
    assert sch.matched(_req("b2", guess + [5], sid="agent-7", salt="tenant-B"), 0) == (24, False)
    assert sch.matched(_req("c", guess + [5], sid="agent-7", salt="tenant-C"), 0) == (0, False)
    # the directory is not the name's, and only the server's key tells which it is
    assert save.sid != st.session_dir("agent-7", "tenant-C")
    other = SessionStore(str(root), "sha256:aa", GEO, summary_dim=8, key=b"k" * 32)
    assert other.session_dir("agent-7", "tenant-B") != save.sid
    assert session_of(_req("x", [1], sid=save.sid)) is None  # no request names it directly
    assert sorted(p.name for p in (root / "sessions").iterdir()) == sorted(["agent-7", save.sid])


def _public_prefix_names(fp, salt, ids, chunk):
    """The names another user can compute from what a request shows: the chain of plain
    hashes over fingerprint, salt and ids (no secret)."""
    h = hashlib.sha256(f"{fp}\0{salt or ''}".encode()).digest()
    arr = np.asarray(ids, dtype="<u4")
    out = []
    for j in range(arr.size // chunk):
        h = hashlib.sha256(h + arr[j * chunk:(j + 1) * chunk].tobytes()).digest()
        out.append("prefix-" + h.hex()[:40])
    return out


def test_prefix_entries_cannot_be_squatted(root, caplog) -> None:
    """Another user pre-creates the directories a prefix would be stored under: the server
    stores it anyway (its names need its key), and a foreign directory at one of its own
    names is neither read nor written, only logged."""
    from kvfs.vllm.scheduler import SaveJob
    from kvfs.vllm.worker import WorkerSide

    st = SessionStore(str(root), "sha256:aa", GEO, summary_dim=8, key=KEY)
    sch = SchedulerSide(st, block_size=4, chunk=8)
    ids = list(range(300, 324))
    for name in _public_prefix_names("sha256:aa", None, ids, 8):
        d = root / "sessions" / name
        d.mkdir()
        os.chown(d, NOBODY, NOBODY)
    delay, _ = sch.finished(_req("p", ids, sid=None, computed=24), [1, 2, 3, 4, 5, 6])
    (save,) = sch.plan(_IDLE).saves
    assert delay and len(save.entries) == 3
    for j, name in enumerate(save.entries):
        st.append_turn(name, np.array(ids[8 * j:8 * j + 8]), _kv(8, j), 0, None)
    assert sch.matched(_req("q", ids + [1], sid=None), 0) == (24, False)
    # a foreign directory at the server's own name (a leaked key): skipped with a log line
    more = ids + list(range(900, 916))
    squat = st.prefix_entries(None, more, 8)[3]
    (root / "sessions" / squat).mkdir()
    os.chown(root / "sessions" / squat, NOBODY, NOBODY)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros((12, 2, 4, 8)) for i in (0, 1)}
    w = WorkerSide(st)
    try:
        w.register(caches, 4, _cpu_like_writer)
        with caplog.at_level(logging.WARNING, logger="kvfs.vllm"):
            w._save(SaveJob("r", None, list(range(10)), more, st.prefix_entries(None, more, 8)))
    finally:
        w.close()
    assert any(squat in r.getMessage() and "not stored" in r.getMessage() for r in caplog.records)
    assert st.lookup(squat) is None
    assert (root / "sessions" / squat).stat().st_uid == NOBODY and not os.listdir(root / "sessions" / squat)
    assert sch.matched(_req("q2", more + [1], sid=None), 0) == (24, False)


def test_server_key_is_made_once_and_kept_private(tmp_path) -> None:
    path = tmp_path / "state" / "kvfs" / "vllm.key"
    key = server_key()  # the default place: $XDG_STATE_HOME/kvfs/vllm.key
    assert len(key) == 32 and server_key(str(path)) == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.chmod(0o644)  # readable by others: names made with it could be pre-created
    with pytest.raises(PermissionError, match="not private"):
        server_key(str(path))
    path.chmod(0o600)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match="uid 54321"):
        server_key(str(path))
    other = tmp_path / "open" / "k"
    other.parent.mkdir(mode=0o777)
    other.parent.chmod(0o777)
    with pytest.raises(PermissionError, match="directory"):
        server_key(str(other))


def _through(body, headers=(), path="/v1/chat/completions", chunks=1, per_api_key=False):
    """The body and content-length vLLM's app gets from the session middleware."""
    import asyncio

    from kvfs.vllm.sessions import SessionNames

    got = {}

    async def app(scope, receive, send):
        msg = await receive()
        got["body"] = msg["body"]
        got["length"] = dict(scope["headers"]).get(b"content-length")

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    step = -(-len(raw) // chunks)
    parts = [{"type": "http.request", "body": raw[i:i + step], "more_body": i + step < len(raw)}
             for i in range(0, len(raw), step)]

    async def receive():
        return parts.pop(0)
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
             "headers": [(b"content-length", str(len(raw)).encode()), *headers]}
    asyncio.run(SessionNames(app, per_api_key)(scope, receive, None))
    assert got["length"] == str(len(got["body"])).encode()
    return got["body"]


def test_session_named_by_header_or_user() -> None:
    """Precedence: kv_transfer_params.session, then X-Session-Id, then user; other keys of
    kv_transfer_params are kept; other paths and unparsable bodies pass untouched."""
    hdr = [(b"X-Session-Id", b"from-header")]
    body = {"model": "m", "messages": [], "user": "from-user"}

    def session(raw):
        return json.loads(raw)["kv_transfer_params"]["session"]
    assert session(_through(body)) == "from-user"
    assert session(_through(body, hdr, chunks=3)) == "from-header"
    assert session(_through(body, hdr, path="/v1/completions")) == "from-header"
    explicit = {**body, "kv_transfer_params": {"session": "explicit", "x": 1}}
    assert json.loads(_through(explicit, hdr))["kv_transfer_params"] == {"session": "explicit", "x": 1}
    other = {**body, "kv_transfer_params": {"x": 1}}
    assert json.loads(_through(other))["kv_transfer_params"] == {"x": 1, "session": "from-user"}
    plain = {"model": "m", "messages": []}
    assert _through(plain) == json.dumps(plain).encode()  # nothing names a session
    assert _through(body, path="/v1/models") == json.dumps(body).encode()
    assert _through(b"{not json", hdr) == b"{not json"


def test_tenant_per_api_key(monkeypatch) -> None:
    """With a tenant per API key, the salt comes from the key: another key's requests, with
    any salt they send, are another tenant; the client's salt only splits its key's."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    body = {"model": "m", "prompt": "x", "user": "agent-7"}

    def salt(key, extra=None):
        b = {**body, **({"cache_salt": extra} if extra else {})}
        auth = [(b"authorization", f"Bearer {key}".encode())] if key else []
        return json.loads(_through(b, auth, path="/v1/completions", per_api_key=True))["cache_salt"]
    a = salt("key-a")
    assert a == salt("key-a") and a != salt("key-b") and a != salt(None)
    assert salt("key-b", a) not in (a, salt("key-b"))  # naming A's salt is not being A
    assert salt("key-a", "sub") != a
    assert len(a) <= 128 and not set(a) & set("@/\\\0")
    assert "cache_salt" not in json.loads(_through(body))  # off by default


def test_kvfs_serve_command(tmp_path) -> None:
    import configparser

    from kvfs.vllm.serve import command

    cmd, env = command(["MODEL", "--mount", str(tmp_path), "--dtype", "float32",
                        "--kvfs-config", '{"prefix_chunk": 0}'], python="py")
    assert env == {}
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "MODEL"]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"] == {"prefix_chunk": 0, "mount": str(tmp_path)}
    assert kv["kv_load_failure_policy"] == "recompute"
    assert cmd[cmd.index("--middleware") + 1] == "kvfs.vllm.sessions.SessionNames"
    assert cmd[cmd.index("--shutdown-timeout") + 1] == "60" and cmd[-2:] == ["--dtype", "float32"]
    mine, _ = command(["M", "--mount", str(tmp_path), "--shutdown-timeout=5"], python="py")
    assert [a for a in mine if a.startswith("--shutdown-timeout")] == ["--shutdown-timeout=5"]
    _, env = command(["M", "--mount", str(tmp_path), "--tenant-per-api-key", "--api-key", "a"])
    assert env == {"KVFS_TENANT_PER_API_KEY": "1"}
    for bad in (["M", "--mount", str(tmp_path / "none")],
                ["M", "--mount", str(tmp_path), "--kv-transfer-config", "{}"],
                ["M", "--mount", str(tmp_path), "--tenant-per-api-key"]):
        with pytest.raises(SystemExit):
            command(bad)
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(os.path.dirname(__file__), "..", "setup.cfg"))
    assert "kvfs-serve = kvfs.vllm.serve:main" in cfg["options.entry_points"]["console_scripts"]


def test_bench_vllm_imports_as_a_module_without_path_edits() -> None:
    import sys

    before = list(sys.path)
    import bench_vllm

    assert sys.path == before and callable(bench_vllm.main)

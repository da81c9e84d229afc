"""One session's trouble stays in that session: two routers over one mount (two nodes'
agents), each with its own RAM tier. When the other node writes a session on, this node's
RAM copy of it is stale: it is dropped and logged, that session's calls say so, and no
other session's turn, save or flush raises its error; a resume reads the mount's copy."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvfs.torch import KVRouter, SpillError
from kvfs.torch.reference import prompt, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def node(tmp_path: Path, name: str) -> KVRouter:
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True, exist_ok=True)
    return KVRouter(mount=str(cold), warm_root=str(tmp_path / name), max_kv_len=8,
                    warm_options={"shards": 16}, auto_recall=False, rope_rerotate=False,
                    retrieval=False)


def turn(model, cache, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """One greedy turn of 5 user tokens and 3 generated; the conversation so far."""
    ids = torch.cat([ids, prompt(seed, 5)], 1)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                         max_new_tokens=3, do_sample=False)
    cache.end_round()
    return out


EMPTY = torch.empty(1, 0, dtype=torch.long)


def test_a_stale_copy_of_one_session_never_fails_another(tmp_path, model, caplog):
    a = node(tmp_path, "warm-a")
    s_ids = turn(model, a.cache("chat-S", model), EMPTY, 1)
    t_ids = turn(model, a.cache("chat-S2", model), EMPTY, 2)
    a.flush()
    b = node(tmp_path, "warm-b")  # the other node writes chat-S on
    cb = b.resume("chat-S", model)
    turn(model, cb, s_ids, 3)
    grown = cb.seen
    b.close()

    s_ids = turn(model, a.cache("chat-S", model), s_ids, 4)  # on A's stale copy
    with caplog.at_level("WARNING"):
        a.flush()  # chat-S's copy is found stale: logged, the others flushed
        a.spiller.wait()
    assert "chat-S" in a.warm.lost() or "chat-S" in a.spiller.failed()
    assert any("'chat-S'" in r.getMessage() for r in caplog.records)
    s2 = a.cache("chat-S2", model)
    t_ids = turn(model, s2, t_ids, 5)  # another session: untouched
    a.save("chat-S2")
    a.flush()
    assert a.warm.get_meta("chat-S2")["tokens"] == s2.seen == t_ids.shape[1] - 1
    with pytest.raises(SpillError, match="chat-S'"):  # its own calls say so
        turn(model, a.cache("chat-S", model), s_ids, 6)
        a.save("chat-S")
    a.release("chat-S", flush=False)
    assert a.resume("chat-S", model).seen == grown  # the mount's copy, not the stale one
    turn(model, a.cache("chat-S2", model), t_ids, 7)
    a.close()


def test_a_stale_copy_held_since_before_is_dropped_at_resume(tmp_path, model):
    a = node(tmp_path, "warm-a")
    ids = turn(model, a.cache("chat-S2", model), EMPTY, 1)
    a.flush()
    a.release("chat-S2", flush=False)  # this node still holds its RAM copy
    b = node(tmp_path, "warm-b")
    cb = b.resume("chat-S2", model)
    turn(model, cb, ids, 2)
    grown = cb.seen
    b.close()
    c = a.resume("chat-S2", model)
    assert c.seen == grown == a.warm.get_meta("chat-S2")["tokens"]
    a.close()


class _Warm:
    """Appends that fail for one session only (its copy went stale)."""

    def __init__(self) -> None:
        self.sizes: dict[tuple[str, int], int] = {}

    def append(self, sid: str, layer: int, data) -> int:
        if sid == "bad":
            raise RuntimeError("session 'bad': its RAM copy was dropped")
        key = (sid, layer)
        self.sizes[key] = self.sizes.get(key, 0) + len(data)
        return self.sizes[key]

    def put_meta(self, sid: str, meta: dict) -> None:
        self.sizes[(sid, -1)] = meta["tokens"]


def test_a_spill_failure_is_raised_only_to_its_own_session():
    from kvfs.torch.spill import Spiller
    warm = _Warm()
    sp = Spiller(warm, linger_s=0.0, isolate=True)
    k = torch.zeros(1, 2, 3, 4)
    sp.submit_kv("bad", 0, 0, k, k)
    sp.submit_kv("good", 0, 0, k, k)
    sp.wait()  # every job ran; only the failing session's error is kept
    assert list(sp.failed()) == ["bad"]
    sp.submit_kv("good", 0, 192, k, k)
    sp.submit_call(warm.put_meta, "good", {"tokens": 6})
    sp.wait(sid="good")
    assert warm.sizes[("good", 0)] == 384 and warm.sizes[("good", -1)] == 6
    with pytest.raises(SpillError, match="'bad'"):
        sp.submit_call(warm.put_meta, "bad", {"tokens": 3})
    with pytest.raises(SpillError, match="'bad'"):
        sp.wait(sid="bad")
    assert sp.forget("bad") is not None  # resumed from the mount: its calls run again
    sp.submit_call(warm.put_meta, "bad", {"tokens": 3})
    sp.close()
    assert warm.sizes[("bad", -1)] == 3
    one = Spiller(_Warm(), linger_s=0.0)  # a standalone cache's: one session, every wait
    one.submit_kv("bad", 0, 0, k, k)
    with pytest.raises(SpillError):
        one.wait()
    with pytest.raises(SpillError):
        one.close()

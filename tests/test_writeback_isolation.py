"""A write-back failure of one session is that session's: a router over a real cold
directory where one session's layer file cannot be written (``chattr +i``: EPERM, even
for root). ``flush`` syncs the other sessions and raises nothing of the failing one's
error, acknowledges only what is durable, and the failing session's own ``save`` says
so."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvfs.torch import KVRouter
from kvfs.torch.reference import prompt, tiny_llama
from kvfs.warm import WarmError

EMPTY = torch.empty(1, 0, dtype=torch.long)


def turn(model, cache, ids: torch.Tensor, seed: int) -> torch.Tensor:
    ids = torch.cat([ids, prompt(seed, 5)], 1)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                         max_new_tokens=3, do_sample=False)
    cache.end_round()
    return out


def immutable(path: Path, on: bool) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i" if on else "-i", str(path)],
                          capture_output=True).returncode == 0


def test_one_sessions_write_back_error_never_fails_anothers_flush(tmp_path: Path, caplog):
    model = tiny_llama(seed=0)
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True)
    r = KVRouter(mount=str(cold), warm_root=str(tmp_path / "warm"), max_kv_len=8,
                 warm_options={"shards": 16}, auto_recall=False, rope_rerotate=False,
                 retrieval=False)
    a_ids = turn(model, r.cache("chat-A", model), EMPTY, 1)
    b_ids = turn(model, r.cache("chat-B", model), EMPTY, 2)
    r.flush()
    acked_a = (cold / "sessions" / "chat-A" / ".acked").read_bytes()
    layer = cold / "sessions" / "chat-A" / "layer_0"
    if not immutable(layer, True):
        r.close()
        pytest.skip("chattr +i is not supported here")
    try:
        turn(model, r.cache("chat-A", model), a_ids, 3)
        b = r.cache("chat-B", model)
        b_ids = turn(model, b, b_ids, 4)
        with caplog.at_level("WARNING"):
            r.flush()  # chat-A's layer cannot be written: logged, chat-B synced
        assert any("'chat-A'" in rec.getMessage() and "not synced" in rec.getMessage()
                   for rec in caplog.records)
        meta_b = json.loads((cold / "sessions" / "chat-B" / "meta.json").read_bytes())
        assert meta_b["tokens"] == b.seen
        assert json.loads((cold / "sessions" / "chat-B" / ".acked").read_bytes())["tokens"] == b.seen
        assert (cold / "sessions" / "chat-A" / ".acked").read_bytes() == acked_a  # not durable
        b_ids = turn(model, b, b_ids, 5)
        r.save("chat-B")  # the other session's own calls: nothing of chat-A's error
        with pytest.raises(WarmError, match="chat-A"):
            r.save("chat-A")  # its own call says so
    finally:
        immutable(layer, False)
    r.save("chat-A")  # writable again: it goes through
    r.close()

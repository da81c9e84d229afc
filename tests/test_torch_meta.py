"""Resume distrusts meta.json (``kvfs.torch.meta``): bounded, checked field by field, and
never the reason layer files are cut -- except a crash tail, recognised against the durable
record of what ``flush`` acknowledged.

Each hostile document here used to do damage: a smaller ``tokens`` (or ``true``) cut the
mount's layer files for good, 10 MB of rounds were read whole and accepted, ``rounds: 5``
raised TypeError, deep nesting RecursionError."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvfs.session.names import ACKED
from kvfs.torch import KVCorrupt, KVMismatch, KVRouter
from kvfs.torch.fingerprint import checked_meta as check
from kvfs.torch.reference import generate_turns, prompt, tiny_llama

SID = "m"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def make_router(tmp_path: Path) -> KVRouter:
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True, exist_ok=True)
    return KVRouter(mount=str(cold), warm_root=str(tmp_path / "warm"), max_kv_len=8,
                    warm_options={"shards": 16}, auto_recall=False, rope_rerotate=False)


def stored_session(tmp_path: Path, model) -> tuple[Path, dict, dict[str, bytes]]:
    """A session flushed (acknowledged), then a reboot: its directory on the mount, its
    meta.json and the bytes of every file there."""
    r = make_router(tmp_path)
    generate_turns(model, r.cache(SID, model), [prompt(1, 9), prompt(2, 7)], 4)
    r.flush()
    r.close()
    shutil.rmtree(tmp_path / "warm")  # a reboot: the RAM tier is gone, the mount holds all
    d = tmp_path / "cold" / "sessions" / SID
    files = {p.name: p.read_bytes() for p in d.iterdir() if p.name != "meta.json"}
    return d, json.loads((d / "meta.json").read_text()), files


def layers_unchanged(d: Path, files: dict[str, bytes]) -> bool:
    return all((d / n).read_bytes() == b for n, b in files.items())


def resume(tmp_path: Path, model):
    r = make_router(tmp_path)
    try:
        return r.resume(SID, model).seen
    finally:
        r.close()


def test_flush_records_what_it_acknowledged(tmp_path, model) -> None:
    d, meta, _ = stored_session(tmp_path, model)
    assert json.loads((d / ACKED).read_text()) == {"tokens": meta["tokens"]} and meta["tokens"] > 0
    assert resume(tmp_path, model) == meta["tokens"]


@pytest.mark.parametrize("tokens", [-5, "true"], ids=["fewer", "true"])
def test_meta_claiming_fewer_tokens_than_acknowledged_is_corrupt(tmp_path, model, tokens) -> None:
    d, meta, files = stored_session(tmp_path, model)
    meta["tokens"] = True if tokens == "true" else meta["tokens"] + tokens
    meta["rounds"] = [r for r in meta["rounds"] if meta["tokens"] is True or r[1] <= meta["tokens"]]
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(KVCorrupt, match="acknowledged|tokens=True"):
        resume(tmp_path, model)
    assert layers_unchanged(d, files)  # before: cut to the claimed tokens, for good


def test_crash_tail_after_the_last_meta_update_is_dropped_with_a_log_line(tmp_path, model, caplog):
    d, meta, files = stored_session(tmp_path, model)
    for n in files:
        if n.startswith("layer_"):
            with open(d / n, "ab") as f:  # appended, then the agent died before meta.json
                f.write(os.urandom(3 * 96 + 17))
    with caplog.at_level(logging.WARNING, "kvfs.torch"):
        assert resume(tmp_path, model) == meta["tokens"]
    assert "crash tail" in caplog.text
    assert layers_unchanged(d, files)  # exactly the tail went


@pytest.mark.parametrize("doc", [
    "rounds5", "deep", "huge", "format", "model", "num_layers_str", "head_dim_neg", "dtype_int",
    "round_str", "round_back", "round_past", "list", "tokens_float", "missing"])
def test_every_bad_field_is_kvcorrupt_and_changes_nothing(tmp_path, model, doc) -> None:
    d, meta, files = stored_session(tmp_path, model)
    bad = dict(meta)
    if doc == "rounds5":
        bad["rounds"] = 5  # before: TypeError
    elif doc == "deep":
        raw = "[" * 100_000 + "]" * 100_000  # before: RecursionError
    elif doc == "huge":  # before: 10 MB read whole and accepted (+290 MB)
        t = meta["tokens"]  # rounds the old check let through: inside [0, tokens]
        raw = json.dumps({**meta, "rounds": [[0, t]] + [[t, t]] * 10**6})
    elif doc == "format":
        bad["format"] = "kvfs-kv/9"
    elif doc == "model":
        bad["model"] = 42
    elif doc == "num_layers_str":
        bad["num_layers"] = "2"
    elif doc == "head_dim_neg":
        bad["head_dim"] = -16
    elif doc == "dtype_int":
        bad["dtype"] = 2
    elif doc == "round_str":
        bad["rounds"] = [[0, "9"]]
    elif doc == "round_back":
        bad["rounds"] = [[0, 9], [3, 12]]
    elif doc == "round_past":
        bad["rounds"] = [[0, meta["tokens"] + 1]]
    elif doc == "list":
        raw = json.dumps([meta])
    elif doc == "tokens_float":
        bad["tokens"] = float(meta["tokens"])
    elif doc == "missing":
        del bad["rounds"]
    if doc not in ("deep", "huge", "list"):
        raw = json.dumps(bad)
    (d / "meta.json").write_text(raw)
    with pytest.raises(KVCorrupt):
        resume(tmp_path, model)
    assert layers_unchanged(d, files)


def test_another_model_is_still_a_mismatch(tmp_path, model) -> None:
    stored_session(tmp_path, model)
    with pytest.raises(KVMismatch):
        resume(tmp_path, tiny_llama(seed=0, num_hidden_layers=3))


def test_check_accepts_what_kvfs_writes(tmp_path, model) -> None:
    _, meta, _ = stored_session(tmp_path, model)
    assert check(meta) is meta
    with pytest.raises(KVCorrupt, match="rounds"):
        check({**meta, "rounds": [[0, 1]] * (meta["tokens"] + 1)})


def test_unreadable_record_cuts_nothing(tmp_path, model) -> None:
    d, meta, files = stored_session(tmp_path, model)
    (d / ACKED).write_text("{not json")
    for n in files:
        if n.startswith("layer_"):
            with open(d / n, "ab") as f:
                f.write(b"x" * 100)
    with pytest.raises(KVCorrupt, match="nothing is cut"):
        resume(tmp_path, model)
    (d / ACKED).unlink()  # the operator's way out: resume trusts meta.json again
    assert resume(tmp_path, model) == meta["tokens"]

"""kvfs.session on its own: the small files' formats and checks, the token-id records'
update, and the commit order (through the plain-files backend over a directory laid out
like a volume; tests/test_cold_backends.py runs the same operations over every backend)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvfs.session import (
    RoundWrite,
    SessionCorrupt,
    SessionError,
    commit,
    files,
    formats,
    names,
    tokens,
)
from kvfs.warm.coldopen import open_cold

FMT = "kvfs-kv/1"


def _doc(**kw: object) -> dict:
    d = {"format": FMT, "model": "sha256:aa", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4,
         "dtype": "float32", "tokens": 10, "rounds": [[0, 4], [4, 10]]}
    d.update(kw)
    return d


def test_names_and_streams() -> None:
    assert names.layer_name(0) == "layer_0" and names.layer_name(names.SIDE_BASE) == names.KEY_CENTROIDS
    assert names.stream_number("layer_12") == 12 and names.stream_number(names.KEY_CENTROIDS) == names.SIDE_BASE
    assert names.stream_number("layer_01") is None and names.stream_number(names.META) is None
    assert names.side_stream(names.KEY_CENTROIDS) == names.SIDE_BASE
    with pytest.raises(ValueError):
        names.side_stream("layer_0")
    assert names.small_limit(names.SUMMARIES) is None and names.small_limit(names.META) == names.MAX_SMALL
    assert names.is_claim(names.META) and not names.is_claim(names.TOKENS)


def test_incarnation_and_acked_formats() -> None:
    raw = formats.incarnation_bytes(0xABC)
    assert raw == b"0000000000000abc\n" and formats.parse_incarnation(raw) == 0xABC
    for bad in (None, b"", b"abc\n", raw[:-1] + b"x", b"zzzzzzzzzzzzzzzz\n"):
        assert formats.parse_incarnation(bad) is None
    assert formats.parse_acked(formats.acked_bytes(7), "s") == 7
    assert formats.parse_acked(None, "s") is None
    for bad in (b"", b"{", b"[]", b'{"tokens": -1}', b'{"tokens": true}', b'{"n": 3}', b"[" * 100_000):
        with pytest.raises(SessionCorrupt, match="unreadable"):
            formats.parse_acked(bad, "s")


def test_a_lying_meta_json_is_an_error_never_a_shorter_session() -> None:
    assert formats.check_meta_doc(_doc(), FMT) == _doc()
    lies = [[], _doc(format="x"), _doc(tokens=-1), _doc(tokens=True), _doc(model=7),
            _doc(rounds=[[0, 11]]), _doc(rounds=[[4, 6], [0, 2]]), _doc(rounds=[[0, 1]] * 11),
            _doc(num_layers=0), {k: v for k, v in _doc().items() if k != "rounds"}]
    for doc in lies:
        with pytest.raises(SessionCorrupt):
            formats.check_meta_doc(doc, FMT, "s")
    with pytest.raises(SessionCorrupt):
        formats.load_meta(b"{not json", "s")
    with pytest.raises(SessionCorrupt):
        formats.load_meta(b"[" * 100_000, "s")  # nests too deep: an error, not a crash
    assert formats.load_meta(b"", "s") is None and formats.parse_meta(b"{bad", "s") is None
    # a claim more than the layers hold
    formats.check_claim("s", 10, {0: 40, 1: 40}, 2, 4)
    with pytest.raises(SessionCorrupt, match="layer_1"):
        formats.check_claim("s", 10, {0: 40, 1: 39}, 2, 4)
    with pytest.raises(SessionCorrupt, match="ids"):
        formats.check_claim("s", 10, {0: 40, 1: 40}, 2, 4, ids=9)
    assert formats.tokens_claimed(json.dumps(_doc()).encode()) == 10
    assert formats.tokens_claimed(b"junk") == 0


def test_summary_rows_and_token_updates() -> None:
    r = b"\1\1\1\1"
    assert formats.put_summary_row(b"", 2, r) == b"\0" * 8 + r  # skipped rounds: zeros
    assert formats.put_summary_row(b"\2" * 12, 1, r) == b"\2" * 4 + r  # later rows dropped
    raw = tokens.encode(0, [1, 2, 3])
    assert tokens.update(raw, "s", [1, 2, 3]) == (3, len(raw), None)
    p, good, rec = tokens.update(raw + b"KVTK", "s", [1, 2, 9])
    assert (p, good) == (2, len(raw)) and tokens.decode(raw + rec)[0].tolist() == [1, 2, 9]
    with pytest.raises(ValueError):
        tokens.update(b"", "s", [1 << 32])


@pytest.fixture
def cold(tmp_path: Path):
    (tmp_path / "sessions").mkdir()
    c = open_cold(str(tmp_path), native=False)
    yield c
    c.close()


def _round(sid: str, tokens_: int, have: int, meta: bytes) -> RoundWrite:
    plan = RoundWrite(sid, make_dir=True)
    for layer in range(2):
        plan.stream(layer, have, [np.full(4 * (tokens_ - have), layer, np.uint8)])
    plan.meta = meta
    return plan


def test_a_round_that_fails_before_its_claim_leaves_the_last_complete_one(cold) -> None:
    one = json.dumps({"tokens": 1}).encode()
    assert commit(cold, [_round("s", 1, 0, one)], claim_last=True)[0].error is None
    bad = _round("s", 3, 2, json.dumps({"tokens": 3}).encode())  # layer 0 holds 4 bytes, not 8
    with pytest.raises(SessionError):
        commit(cold, [bad], claim_last=True)
    assert files.read_meta_bytes(cold, "s") == one  # the claim is still the last complete round
    sizes = files.layer_sizes(cold, "s")
    assert sizes is not None and sizes[0] >= 4


def test_the_commit_order_is_one_for_every_writer() -> None:
    plan = RoundWrite("s", incarnation=1, meta=b"{}", summaries=(b"\0" * 4, b""))
    plan.stream(names.SIDE_BASE, 0, [b"c"])
    plan.stream(1, 0, [b"b"])
    plan.stream(0, 0, [b"a"])
    plan.ids = (0, tokens.encode(0, [5]))
    order = [c.name for c in plan.changes().items]
    assert order == [names.INCARNATION, "layer_0", "layer_1", names.KEY_CENTROIDS, names.TOKENS,
                     names.SUMMARIES, names.META]
    assert [c.name for c in plan.body().items] == order[:-1]
    assert [c.name for c in plan.claim().items] == [names.META]

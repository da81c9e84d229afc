"""One conformance suite for every ``ColdBackend``: the same calls, the same answers.

Backends: the plain files over a directory laid out like a volume (no mount), the FUSE
file face and the native channel of one real mount, and the file face of a mount whose
sessions the shared tier (a real Redis Cluster) holds -- the shared tier stores sessions
only behind a mount, so that is where it meets the protocol (skipped without
redis-server). Each test then checks the session layer's operations over it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvfs.mount_runner import HAVE_FUSE, Mount
from kvfs.session import (
    Changes,
    ColdBackend,
    RoundWrite,
    SessionError,
    commit,
    cut_history,
    files,
    fork,
)
from kvfs.session.formats import dump_meta
from kvfs.session.names import MAX_SMALL, META, SUMMARIES, TOKENS, layer_name
from kvfs.shared.local_cluster import HAVE_REDIS, Cluster
from kvfs.warm.coldopen import open_cold

KINDS = ["dir", "files", "channel", "shared"]


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    if not HAVE_FUSE:
        pytest.skip("/dev/fuse is absent")
    d = tmp_path_factory.mktemp("cold")
    m = Mount(d / "vol.kvfs", d / "mnt", "128M").start()
    yield m
    assert m.stop() == 0, m.log_text()


@pytest.fixture(scope="module")
def shared_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    if not HAVE_FUSE:
        pytest.skip("/dev/fuse is absent")
    if not HAVE_REDIS:
        pytest.skip("redis-server/redis-cli not installed: no shared tier to store sessions in")
    d = tmp_path_factory.mktemp("shared")
    with Cluster(masters=3, replicas=0, node_timeout_ms=1000) as c:
        m = Mount(d / "vol.kvfs", d / "mnt", "128M", tuple(c.mount_args())).start()
        yield m
        assert m.stop() == 0, m.log_text()


@pytest.fixture(params=KINDS)
def cold(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ColdBackend]:
    kind = request.param
    if kind == "dir":
        (tmp_path / "sessions").mkdir()
        backend = open_cold(str(tmp_path), native=False)
    elif kind == "shared":
        backend = open_cold(str(request.getfixturevalue("shared_mount").mountpoint))
        assert backend.shared and backend.kind == "files"
    else:
        backend = open_cold(str(request.getfixturevalue("mount").mountpoint), native=kind == "channel")
        assert backend.kind == ("channel" if kind == "channel" else "files")
    yield backend
    backend.close()


def _sid() -> str:
    return "c-" + uuid.uuid4().hex[:12]


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _read(cold: ColdBackend, sid: str, stream: int, off: int, n: int) -> bytes:
    out = np.empty(n, np.uint8)
    cold.read_ranges(sid, [(stream, off, out)])
    return out.tobytes()


def _on_disk(cold: ColdBackend, sid: str, name: str) -> bytes:
    return Path(cold.dir, sid, name).read_bytes()


# ---- the protocol -------------------------------------------------------------------------
def test_writes_apply_in_order_and_read_back(cold: ColdBackend) -> None:
    sid = _sid()
    assert not cold.exists(sid) and cold.state(sid) is None
    w = cold.write(sid, Changes(make_dir=True))
    assert w.made_dir and cold.exists(sid) and sid in cold.list()
    assert not cold.write(sid, Changes(make_dir=True)).made_dir
    a, b = _bytes(300_000, 1), _bytes(70_000, 2)
    ch = Changes()
    ch.append(layer_name(0), 0, [a[:100_000], a[100_000:]])
    ch.append(layer_name(1), 0, [b])
    ch.replace(META, b'{"x":1}')
    ch.truncate(layer_name(1), 5000)
    w = cold.write(sid, ch)
    assert w.sizes == {layer_name(0): 300_000, layer_name(1): 5000, META: 7}
    cold.sync([w])
    assert w.error is None
    assert cold.state(sid) == ({0: 300_000, 1: 5000}, None)
    assert cold.state(sid, incarnation=False)[0] == {0: 300_000, 1: 5000}
    assert _read(cold, sid, 0, 12_345, 100_000) == a[12_345:112_345].tobytes()
    outs = [np.empty(10, np.uint8), np.empty(5000, np.uint8)]
    cold.read_ranges(sid, [(0, 0, outs[0]), (1, 0, outs[1])])  # one batch, two files
    assert outs[0].tobytes() == a[:10].tobytes() and outs[1].tobytes() == b[:5000].tobytes()
    assert cold.read_small(sid, META) == b'{"x":1}'
    assert cold.read_small(sid, "absent") is None
    # both faces of the mount agree on the bytes
    assert _on_disk(cold, sid, layer_name(0)) == a.tobytes()
    assert cold.prefetch(sid, [0, 1], 0, 4096) >= 0


def test_reads_past_the_end_and_of_missing_files(cold: ColdBackend) -> None:
    sid = _sid()
    ch = Changes(make_dir=True)
    ch.append(layer_name(0), 0, [_bytes(1000, 3)])
    cold.write(sid, ch, durable=True)
    with pytest.raises(ValueError):
        _read(cold, sid, 0, 900, 200)
    with pytest.raises(ValueError):
        cold.read_ranges(sid, [(7, 0, np.empty(1, np.uint8))], missing_is_empty=True)
    with pytest.raises(SessionError):
        cold.read_ranges(sid, [(7, 0, np.empty(1, np.uint8))])


def test_an_append_at_the_wrong_size_is_refused(cold: ColdBackend) -> None:
    sid = _sid()
    ch = Changes(make_dir=True)
    ch.append(layer_name(0), 0, [b"abc"])
    cold.write(sid, ch, durable=True)
    bad = Changes()
    bad.append(layer_name(0), 1, [b"x"])
    with pytest.raises(SessionError):
        cold.write(sid, bad)
    assert cold.state(sid, incarnation=False)[0] == {0: 3}


def test_a_small_file_past_its_bound_is_refused(cold: ColdBackend) -> None:
    sid = _sid()
    big = Changes(make_dir=True)
    big.append(META, 0, [np.zeros(MAX_SMALL + 1, np.uint8)])
    big.append(SUMMARIES, 0, [np.zeros(MAX_SMALL + 8, np.uint8)])
    cold.sync([cold.write(sid, big)])
    with pytest.raises(SessionError):
        cold.read_small(sid, META)
    assert len(cold.read_small(sid, SUMMARIES) or b"") == MAX_SMALL + 8  # no bound there


def test_durable_writes_and_truncates_need_no_sync(cold: ColdBackend) -> None:
    sid = _sid()
    files.ensure_dir(cold, sid)
    assert files.write_small(cold, sid, META, b"one")
    assert not files.write_small(cold, sid, META, b"one")  # already there: nothing written
    ch = Changes()
    ch.append(layer_name(2), 0, [b"x" * 100])
    cold.write(sid, ch, durable=True)
    files.truncate_stream(cold, sid, 2, 40)
    assert files.stream_size(cold, sid, 2) == 40 and cold.read_small(sid, META) == b"one"
    with pytest.raises(SessionError):
        files.truncate(cold, sid, "absent", 0)  # a cut makes no file
    assert cold.read_small(sid, "absent") is None


def test_delete_and_holds(cold: ColdBackend) -> None:
    sid = _sid()
    assert cold.hold(sid) is None  # no directory yet: nothing to hold
    files.ensure_dir(cold, sid)
    h = cold.hold(sid)
    assert (h is not None) == cold.shared
    if h is not None:
        h.release()
    cold.reachable()
    assert cold.delete(sid) and not cold.exists(sid) and not cold.delete(sid)


# ---- the session's operations over it -----------------------------------------------------
def _meta(tokens: int, rounds: list[list[int]]) -> bytes:
    return dump_meta({"tokens": tokens, "rounds": rounds})


def test_rounds_commit_cut_and_fork(cold: ColdBackend) -> None:
    sid, tb = _sid(), 64
    kv = [_bytes(10 * tb, 10 + i) for i in range(2)]
    plan = RoundWrite(sid, make_dir=True, incarnation=0x1234)
    for layer in range(2):
        plan.stream(layer, 0, [kv[layer]])
    assert plan.set_ids(cold, list(range(100, 110))) == 0
    plan.summaries = (b"\1" * 16, b"")
    plan.meta = _meta(10, [[0, 10]])
    names = [c.name for c in plan.changes().items]
    assert names[-1] == META and names.index(TOKENS) > names.index(layer_name(1))
    (w,) = commit(cold, [plan], claim_last=True)
    assert w.error is None
    assert files.read_incarnation(cold, sid) == 0x1234
    assert files.read_ids(cold, sid).tolist() == list(range(100, 110))
    assert files.read_meta(cold, sid) == {"tokens": 10, "rounds": [[0, 10]]}
    assert files.layer_sizes(cold, sid) == {0: 10 * tb, 1: 10 * tb}
    # an edited history: the claim shrinks first, then the ids, then the layers
    cut = _meta(4, [])
    cut_history(cold, sid, cut, files.read_meta_bytes(cold, sid) or b"",
                [100, 101, 102, 103, 7, 7], range(2), 4 * tb, 0)
    assert files.read_meta_bytes(cold, sid) == cut
    assert files.read_ids(cold, sid).tolist() == [100, 101, 102, 103, 7, 7]
    assert files.layer_sizes(cold, sid) == {0: 4 * tb, 1: 4 * tb}
    assert files.read_summaries(cold, sid) == b""
    # a fork copies every file, the claim last
    dst = _sid()
    assert fork(cold, sid, dst) is not None
    assert files.read_meta_bytes(cold, dst) == cut
    assert _read(cold, dst, 0, 0, 4 * tb) == kv[0][:4 * tb].tobytes()
    assert files.read_ids(cold, dst).tolist() == [100, 101, 102, 103, 7, 7]
    with pytest.raises(FileExistsError):
        fork(cold, sid, dst)
    assert fork(cold, _sid(), _sid()) is None


def test_acknowledged_tokens_and_damaged_ids(cold: ColdBackend) -> None:
    sid = _sid()
    assert files.read_acked(cold, sid) is None
    files.ensure_dir(cold, sid)
    files.write_acked(cold, sid, 12)
    assert files.read_acked(cold, sid) == 12
    files.write_acked(cold, sid, 20, old=12)
    assert files.read_acked(cold, sid) == 20
    files.record_ids(cold, sid, [1, 2, 3])
    ch = Changes()
    ch.append(TOKENS, len(cold.read_small(sid, TOKENS) or b""), [b"KVTK\0torn"])
    cold.write(sid, ch, durable=True)
    assert files.read_ids(cold, sid).tolist() == [1, 2, 3]  # the torn tail ends the ids
    assert files.record_ids(cold, sid, [1, 2, 3, 4]) == 3
    assert files.read_ids(cold, sid).tolist() == [1, 2, 3, 4]


def test_the_mount_holds_the_same_names_as_ever(cold: ColdBackend) -> None:
    """The layout on disk is unchanged: a round writes exactly these files."""
    sid = _sid()
    plan = RoundWrite(sid, make_dir=True, incarnation=1)
    plan.stream(0, 0, [b"k" * 8])
    plan.set_ids(cold, [5])
    plan.summaries = (b"\0" * 4, b"")
    plan.meta = _meta(1, [[0, 1]])
    commit(cold, [plan], claim_last=False)
    assert sorted(os.listdir(Path(cold.dir, sid))) == [
        ".incarnation", "layer_0", "meta.json", "summaries.f32", "tokens"]
    assert _on_disk(cold, sid, ".incarnation") == b"0000000000000001\n"

"""Warm tier API: construction, bytes, summaries, concurrency (LRU, migration and cold round
trips: test_warm_migration.py)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from conftest import blob

from kvfs.warm import WarmError, WarmTier, summarize_keys


# ---- construction --------------------------------------------------------------------
def test_cold_root_missing_is_an_error_at_start(tmp_path):
    with pytest.raises(WarmError):
        WarmTier(str(tmp_path / "nope"), str(tmp_path / "warm"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(WarmError):
        WarmTier(str(tmp_path / "file"), str(tmp_path / "warm"))
    (tmp_path / "mnt").mkdir()  # a mountpoint with nothing mounted on it
    with pytest.raises(WarmError, match="mounted"):
        WarmTier(str(tmp_path / "mnt"), str(tmp_path / "warm"))
    assert os.listdir(tmp_path / "mnt") == []
    assert not (tmp_path / "warm").exists() or not any(n.endswith(".kvmap") for n in os.listdir(tmp_path / "warm"))


def test_no_cold_tier(tmp_path, caplog):
    with WarmTier(None, str(tmp_path / "w"), cap_bytes=10_000, shards=4) as w:
        for i in range(5):
            w.append(f"s{i}", 0, blob(i, 3000))  # over the cap: logged, not refused
        with pytest.raises(WarmError, match="no cold tier"):
            w.migrate()
        assert w.where("s0") == "warm" and w.usage()["ratio"] > 1
        assert "no cold tier" in caplog.text


def test_two_tiers_share_a_root_one_owner_per_session(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as a, WarmTier(cold, root, shards=4) as b:
        a.append("x", 0, b"from a")
        b.append("y", 0, b"from b")  # other sessions side by side
        with pytest.raises(WarmError, match=f"in use by process {os.getpid()}"):
            b.append("x", 0, b"no")
        assert a.usage()["dir"] != b.usage()["dir"]  # shards never shared
        a.release("x")
        assert bytes(b.read("x", 0, 0, 6)) == b"from a"
        with pytest.raises(WarmError, match="in use"):
            a.size("x", 0)
    WarmTier(cold, root, shards=4).close()


def test_reopen_with_other_settings_refused(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        w.append("s", 0, b"x")
    with pytest.raises(WarmError, match="shards=4"):
        WarmTier(cold, root, shards=8)
    with pytest.raises(WarmError):
        WarmTier(cold, root, shards=4, summary_dim=64)


# ---- bytes ---------------------------------------------------------------------------
def test_append_read_truncate_and_errors(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        assert w.size("s", 0) == 0 and w.where("s") is None
        assert w.read("s", 0, 0, 0).shape == (0,)
        with pytest.raises(ValueError):
            w.read("s", 0, 0, 1)
        data = blob(0, 50_000)
        assert w.append("s", 3, data[:10]) == 10
        assert w.append("s", 3, memoryview(data[10:20].tobytes())) == 20
        assert w.append("s", 3, data[20:].view(np.uint16) if len(data[20:]) % 2 == 0 else data[20:]) == 50_000
        assert np.array_equal(w.read("s", 3, 123, 45_678), data[123:45_678])
        v = w.read("s", 3, 0, 10)
        v[:] = 0  # a copy: the stored bytes do not change
        assert np.array_equal(w.read("s", 3, 0, 10), data[:10])
        with pytest.raises(ValueError):
            w.read("s", 3, 10, 50_001)
        with pytest.raises(ValueError):
            w.read("s", 3, 10, 5)
        with pytest.raises(ValueError):
            w.read("s", -1, 0, 0)
        with pytest.raises(TypeError):
            w.append("s", 3, "text")
        w.truncate("s", 3, 30_000)
        with pytest.raises(ValueError):
            w.truncate("s", 3, 30_001)
        assert w.append("s", 3, b"tail") == 30_004
        assert bytes(w.read("s", 3, 29_998, 30_004)) == data[29_998:30_000].tobytes() + b"tail"
        assert w.layers("s") == [3]
        w.delete("s")
        assert w.where("s") is None and w.sessions() == []


def test_meta_and_summaries_persist_across_reopen_and_tiers(dirs):
    cold, root = dirs
    keys = np.random.default_rng(5).standard_normal((3, 8, 4, 16)).astype(np.float16)
    vecs = [summarize_keys(k) for k in keys]
    with WarmTier(cold, root, shards=4) as w:
        for r, v in enumerate(vecs):
            w.put_summary("s", r, v)
        w.put_summary("s", 5, vecs[0])  # rounds 3, 4 skipped: zero vectors
        w.put_meta("s", {"tokens": 24, "rounds": [[0, 8]]})
        got = w.summaries("s")
    assert got.shape == (6, 128) and got.dtype == np.float32
    assert np.array_equal(got[:3], np.stack(vecs)) and not got[3:5].any()
    with WarmTier(cold, root, shards=4) as w:
        assert np.array_equal(w.summaries("s"), got)
        assert w.get_meta("s") == {"tokens": 24, "rounds": [[0, 8]]}
        w.migrate()
        assert w.where("s") == "cold"
        assert np.array_equal(w.summaries("s"), got)
        raw = open(os.path.join(cold, "sessions", "s", "summaries.f32"), "rb").read()
        assert raw == got.tobytes()
        assert w.get_meta("s") == {"tokens": 24, "rounds": [[0, 8]]}
        w.put_summary("s", 1, vecs[2])  # back in warm (meta/summaries loaded), then again cold
        w.truncate_summaries("s", 4)
        w.migrate()
        want = np.concatenate([got[:1], vecs[2][None], got[2:4]])
        assert np.array_equal(w.summaries("s"), want)
    with WarmTier(cold, root, shards=4) as w:
        assert np.array_equal(w.summaries("s"), want)


def test_summarize_keys_is_deterministic_and_unit_length():
    k = np.random.default_rng(0).standard_normal((8, 4, 16)).astype(np.float32)
    a, b = summarize_keys(k), summarize_keys(k.copy())
    assert a.dtype == np.float32 and a.shape == (128,) and np.array_equal(a, b)
    assert abs(float(np.linalg.norm(a)) - 1) < 1e-5
    assert not np.array_equal(a, summarize_keys(k, seed=1))
    assert summarize_keys(k, dim=32).shape == (32,)
    torch_layout = np.moveaxis(k, 0, 1)[None]  # [batch, heads, tokens, head_dim]
    assert np.allclose(summarize_keys(torch_layout, token_axis=-2),
                       summarize_keys(np.moveaxis(torch_layout, 2, 0)[:, 0]), atol=1e-6)
    assert not summarize_keys(np.zeros((4, 8))).any()


# ---- concurrency ---------------------------------------------------------------------
def pattern(seed: int, start: int, end: int) -> np.ndarray:
    return ((np.arange(start, end, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)


def test_concurrent_readers_and_one_writer_per_session(dirs):
    cold, root = dirs
    sids = ["a", "b", "c"]
    w = WarmTier(cold, root, cap_bytes=400_000, migrate_at=0.5, group=1, shards=2)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(k, sid):
        try:
            pos = 0
            for i in range(120):
                n = 1000 + 37 * i
                assert w.append(sid, 0, pattern(k, pos, pos + n)) == pos + n
                pos += n
                if i % 10 == 0:
                    w.put_summary(sid, i // 10, np.full(128, i, np.float32))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def reader(seed):
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                k = int(rng.integers(len(sids)))
                size = w.size(sids[k], 0)
                if size == 0:
                    continue
                a = int(rng.integers(size))
                b = size if rng.random() < 0.2 else int(rng.integers(a, size + 1))
                got = w.read(sids[k], 0, a, b)
                assert np.array_equal(got, pattern(k, a, b)), (sids[k], a, b)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    readers = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    writers = [threading.Thread(target=writer, args=(k, s)) for k, s in enumerate(sids)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[0]
    assert w.usage()["migrations"] > 0
    files = [sl.file for sl in w.store.slots() if sl.file is not None]
    held = sum(s.held for f in files for s in f.sessions.values())
    assert w.usage()["bytes"] == held == sum(f.total_bytes for f in files)  # accounting exact
    for k, sid in enumerate(sids):
        size = w.size(sid, 0)
        assert np.array_equal(w.read(sid, 0, 0, size), pattern(k, 0, size))
    w.close()


def test_a_shard_touched_once_is_not_remembered(dirs):
    """The tier keeps a lock per shard only while the shard has a file or a user: a day
    of sessions each touched once must not leave one behind per shard."""
    cold, root = dirs
    with WarmTier(cold, root, shards=4096) as w:
        store = w.store
        for i in range(300):
            assert w.where(f"never-{i}") is None  # a look at a session that is nowhere
        assert len(store.slots()) == 0
        for i in range(40):
            w.append(f"s{i}", 0, blob(i, 256))
        held = {s.shard for s in store.slots()}
        assert len(held) == store.count_files() > 30  # the shards with files, and only those
        for i in range(40):
            w.delete(f"s{i}")
        w.flush()
        assert store.count_files() == 0  # dropped at once (unlinked in the background)
        w.append("s0", 0, b"again")  # a forgotten shard comes back on use
        assert bytes(w.read("s0", 0, 0, 5)) == b"again"
        # a dropped file is unlinked in the background, its slot a user until then
        deadline = time.monotonic() + 10
        while len(store.slots()) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(store.slots()) == 1

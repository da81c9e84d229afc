"""Warm tier API: LRU, group migration, cold round trips, summaries, concurrency."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time

import numpy as np
import pytest

from kvfs.ops import metrics
from kvfs.warm import WarmError, WarmTier, summarize_keys
from kvfs.warm.cold import ColdStore


@pytest.fixture
def dirs(tmp_path):
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True)  # the layout of a mounted volume
    return str(cold), str(tmp_path / "warm")


@pytest.fixture
def append_only(monkeypatch, dirs):
    """Enforce the mount's rules on files under cold_root: writes only at the current end
    (EPERM there otherwise), truncate only shorter. Records what was written."""
    cold = os.path.realpath(dirs[0])
    log = []
    real_write, real_trunc, real_pwrite = os.write, os.ftruncate, os.pwrite

    def on_cold(fd):
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(cold + "/")
        except OSError:
            return False

    def write(fd, data):
        if on_cold(fd):
            pos, size = os.lseek(fd, 0, os.SEEK_CUR), os.fstat(fd).st_size
            assert pos == size, f"write at {pos} != size {size}: not an append"
            log.append(("write", os.readlink(f"/proc/self/fd/{fd}"), pos, len(data)))
        return real_write(fd, data)

    def ftruncate(fd, n):
        if on_cold(fd):
            assert n <= os.fstat(fd).st_size, "truncate may only shorten on the mount"
            log.append(("truncate", os.readlink(f"/proc/self/fd/{fd}"), n))
        return real_trunc(fd, n)

    def pwrite(fd, data, off):
        assert not on_cold(fd), "pwrite on the cold tier"
        return real_pwrite(fd, data, off)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "ftruncate", ftruncate)
    monkeypatch.setattr(os, "pwrite", pwrite)
    return log


def blob(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def ticks():
    c = itertools.count(1000)
    return lambda: float(next(c))


def fill(w, sid, seed, layers=2, n=10_000, rounds=2):
    ref = {}
    for layer in range(layers):
        parts = [blob(seed * 1000 + layer * 10 + r, n) for r in range(rounds)]
        for p in parts:
            w.append(sid, layer, p)
        ref[layer] = np.concatenate(parts)
    w.put_meta(sid, {"format": 1, "tokens": rounds * 4, "rounds": [[0, 4], [4, 8]][:rounds]})
    for r in range(rounds):
        w.put_summary(sid, r, summarize_keys(blob(seed + r, 64).reshape(8, 8).astype(np.float32)))
    return ref


def check(w, sid, ref):
    for layer, data in ref.items():
        assert w.size(sid, layer) == len(data)
        assert np.array_equal(w.read(sid, layer, 0, len(data), promote=False), data), (sid, layer)


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


# ---- LRU and migration ---------------------------------------------------------------
def test_lru_order_and_group_migration_at_threshold(dirs, append_only):
    cold, root = dirs
    count = metrics.REGISTRY.get_sample_value("kv_warm_evict_latency_ms_count") or 0
    migrated = metrics.REGISTRY.get_sample_value("kv_warm_migrations_total") or 0
    # each session ~40 KB + meta + summaries; threshold 0.75 * 250 KB: the 5th crosses it
    # group migration (write-behind off): copied to cold at the threshold, then dropped
    w = WarmTier(cold, root, cap_bytes=250_000, migrate_at=0.75, group=2, shards=4, clock=ticks(),
                 writebehind=False)
    refs = {f"s{i}": fill(w, f"s{i}", i) for i in range(4)}
    assert w.usage()["migrations"] == 0 and all(w.where(s) == "warm" for s in refs)
    w.read("s0", 0, 0, 10)  # s0 becomes the most recently used: s1, s2 are the LRU group
    refs["s4"] = fill(w, "s4", 4)
    assert [w.where(f"s{i}") for i in range(5)] == ["warm", "cold", "cold", "warm", "warm"]
    u = w.usage()
    assert u["migrations"] == 2 and u["sessions"] == 3 and u["bytes"] <= 0.75 * 250_000
    assert metrics.REGISTRY.get_sample_value("kv_warm_evict_latency_ms_count") == count + 1
    assert metrics.REGISTRY.get_sample_value("kv_warm_migrations_total") == migrated + 2
    for sid, ref in refs.items():
        check(w, sid, ref)
    assert sorted(os.listdir(os.path.join(cold, "sessions", "s1"))) == [
        ".incarnation", "layer_0", "layer_1", "meta.json", "summaries.f32"]
    assert w.migrate(1) == ["s0"]  # check() read s0 first: the least recently used now
    w.close()
    w = WarmTier(cold, root, cap_bytes=250_000, migrate_at=0.75, group=2, shards=4, clock=ticks(),
                 writebehind=False)
    assert w.migrate(1) == ["s3"]  # order restored from recorded last-use times
    for sid, ref in refs.items():
        check(w, sid, ref)
    w.close()


def test_group_migration_fsyncs_only_after_every_session_is_written(dirs, append_only, monkeypatch):
    """On the mount an fsync that runs while other files are still being written finds new
    bytes each time (a device flush each): the group's fsyncs wait until all is written,
    and layer files are fsync'd on the descriptor that wrote them."""
    cold, root = dirs
    events: list[str] = []
    real_append, real_close = ColdStore.append, ColdStore.fsync_close
    real_file, real_dir = ColdStore.fsync_file, ColdStore.sync_dir

    def append(self, sid, name, *a, **kw):
        events.append(f"write {sid}/{name}")
        return real_append(self, sid, name, *a, **kw)

    def fsync_close(self, sid, name, fd):
        events.append(f"fsync {sid}/{name} fd")
        return real_close(self, sid, name, fd)

    def fsync_file(self, sid, name):
        events.append(f"fsync {sid}/{name}")
        return real_file(self, sid, name)

    def sync_dir(self, sid):
        events.append(f"fsync {sid}/")
        return real_dir(self, sid)

    for name, fn in (("append", append), ("fsync_close", fsync_close),
                     ("fsync_file", fsync_file), ("sync_dir", sync_dir)):
        monkeypatch.setattr(ColdStore, name, fn)
    with WarmTier(cold, root, shards=4, writebehind=False) as w:
        refs = {f"s{i}": fill(w, f"s{i}", i, layers=3) for i in range(3)}
        assert sorted(w.migrate(3)) == ["s0", "s1", "s2"]
        writes = [i for i, e in enumerate(events) if e.startswith("write")]
        fsyncs = [i for i, e in enumerate(events) if e.startswith("fsync")]
        assert len(writes) >= 9 and fsyncs and max(writes) < min(fsyncs), events
        assert sum(e.endswith("fd") for e in events) == 9  # every layer file, on its own fd
        for sid, ref in refs.items():
            check(w, sid, ref)


def test_bytes_identical_warm_cold_warm(dirs, append_only):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        ref = fill(w, "s", 1, layers=3, n=70_000)
        assert w.migrate() == ["s"] and w.where("s") == "cold"
        for layer, data in ref.items():
            on_disk = open(os.path.join(cold, "sessions", "s", f"layer_{layer}"), "rb").read()
            assert on_disk == data.tobytes()
        check(w, "s", ref)  # partial reads from cold (promote=False)
        assert w.where("s") == "cold"
        w.promote("s")
        assert w.where("s") == "both" and w.usage()["bytes"] >= 3 * 140_000
        check(w, "s", ref)
        misses = w.usage()["misses"]
        check(w, "s", ref)
        assert w.usage()["misses"] == misses  # all from warm now
    with WarmTier(cold, root, shards=4) as w:
        check(w, "s", ref)
        assert w.where("s") == "both"


def test_whole_layer_read_promotes_partial_does_not(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        ref = fill(w, "s", 2)
        w.migrate()
        assert np.array_equal(w.read("s", 0, 5, 50), ref[0][5:50]) and w.where("s") == "cold"
        assert np.array_equal(w.read("s", 1, 0, len(ref[1])), ref[1]) and w.where("s") == "both"
        check(w, "s", ref)


def test_append_to_cold_session_keeps_tail_in_warm_and_migrates_only_it(dirs, append_only):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        ref = fill(w, "s", 3, n=30_000)
        w.migrate()
        extra = blob(99, 25_000)
        assert w.append("s", 0, extra) == 60_000 + 25_000
        w.append("s", 2, b"new layer")
        ref[0] = np.concatenate([ref[0], extra])
        ref[2] = np.frombuffer(b"new layer", np.uint8)
        assert w.where("s") == "both"
        assert os.path.getsize(os.path.join(cold, "sessions", "s", "layer_0")) == 60_000
        assert w.usage()["bytes"] < 30_000 + 2 * 128 * 4 + 200  # only the tail (+ summaries, meta)
        assert np.array_equal(w.read("s", 0, 59_000, 61_000, promote=False), ref[0][59_000:61_000])
        check(w, "s", ref)
        append_only.clear()
        w.migrate()
        writes = [e for e in append_only if e[0] == "write" and "layer_0" in e[1]]
        assert [(pos, n) for _, _, pos, n in writes] == [(60_000, 25_000)]
        assert not [e for e in append_only if "layer_1" in e[1]]  # unchanged: not touched
        check(w, "s", ref)
        w.promote("s")
        check(w, "s", ref)
        assert w.where("s") == "both" and w.usage()["promotions"] == 1


def test_truncate_reaches_into_cold(dirs, append_only):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        ref = fill(w, "s", 4, n=20_000)
        w.migrate()
        w.append("s", 0, blob(7, 5000))
        w.truncate("s", 0, 30_000)  # below the warm part: cold is cut, warm tail dropped
        assert w.size("s", 0) == 30_000
        assert os.path.getsize(os.path.join(cold, "sessions", "s", "layer_0")) == 30_000
        w.append("s", 0, b"redo")
        w.migrate()
        assert bytes(w.read("s", 0, 29_990, 30_004)) == ref[0][29_990:30_000].tobytes() + b"redo"
        w.promote("s")
        w.truncate("s", 1, 100)  # both tiers hold it: both are cut (cold stays a prefix)
        assert os.path.getsize(os.path.join(cold, "sessions", "s", "layer_1")) == 100
        w.truncate("s", 1, 0)
        assert w.size("s", 1) == 0


def test_delete_removes_both_tiers(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        fill(w, "a", 1)
        fill(w, "b", 2)
        w.migrate(1)
        w.append("a", 0, b"x")
        w.delete("a")
        w.delete("b")
        assert w.sessions() == [] and os.listdir(os.path.join(cold, "sessions")) == []
        assert not [n for n in os.listdir(root) if n.endswith(".kvmap")]


def test_failed_migration_keeps_the_session_in_warm(dirs, monkeypatch, caplog):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        ref = fill(w, "s", 5)

        def no_space(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(ColdStore, "append", no_space)
        with pytest.raises(WarmError, match="No space left"):
            w.migrate()  # an explicit call that moved nothing says why
        assert "failed" in caplog.text and w.usage()["sessions"] == 1
        check(w, "s", ref)
        monkeypatch.undo()
        assert w.migrate() == ["s"] and w.where("s") == "cold"
        check(w, "s", ref)


def test_session_changed_during_migration_stays_in_warm(dirs, monkeypatch):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        ref = fill(w, "s", 7)
        real, once, lock = ColdStore.fsync_file, [], threading.Lock()

        def writer_meanwhile(self, sid, name):  # between "written to cold" and "dropped"
            with lock:  # fsyncs run on several threads
                if not once:
                    once.append(w.append("s", 0, b"late"))
            return real(self, sid, name)

        monkeypatch.setattr(ColdStore, "fsync_file", writer_meanwhile)
        assert w.migrate() == [] and w.where("s") == "both"
        ref[0] = np.concatenate([ref[0], np.frombuffer(b"late", np.uint8)])
        check(w, "s", ref)
        monkeypatch.undo()
        assert w.migrate() == ["s"] and w.where("s") == "cold"
        check(w, "s", ref)


def test_read_layers_reads_one_round_of_every_layer(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        ref = fill(w, "s", 8, layers=4, n=4096, rounds=3)
        got = w.read_layers("s", range(4), 4096, 8192)
        assert got.shape == (4, 4096)
        assert all(np.array_equal(got[k], ref[k][4096:8192]) for k in range(4))
        w.migrate()
        w.append("s", 1, b"x")  # layer 1 partly warm, the others cold only
        got = w.read_layers("s", [3, 1], 0, 12288)
        assert np.array_equal(got[0], ref[3]) and np.array_equal(got[1], ref[1])
        with pytest.raises(ValueError):
            w.read_layers("s", [1], 0, 12290)
        w.read_layers("s", [0], 0, 10, promote=True)
        assert w.usage()["bytes"] > 4 * 12288


def test_cold_copy_lost_under_a_warm_tail_is_an_error_not_a_crash(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        fill(w, "s", 6)
        w.migrate()
        w.append("s", 0, b"tail")
        os.unlink(os.path.join(cold, "sessions", "s", "layer_0"))
        with pytest.raises(WarmError):
            w.read("s", 0, 0, 10)
        assert bytes(w.read("s", 0, 20_000, 20_004)) == b"tail"


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
    files = [sl.file for sl in w._slots.values() if sl.file is not None]
    held = sum(s.held for f in files for s in f.sessions.values())
    assert w.usage()["bytes"] == held == sum(f.total_bytes for f in files)  # accounting exact
    for k, sid in enumerate(sids):
        size = w.size(sid, 0)
        assert np.array_equal(w.read(sid, 0, 0, size), pattern(k, 0, size))
    w.close()


# ---- a cold tier that refuses: back off, hold the cap, say it once per period ----------
def test_full_cold_volume_backs_off_and_holds_the_cap(make_mount, tmp_path, caplog):
    m = make_mount(size="16M")
    failures = metrics.REGISTRY.get_sample_value("kv_warm_migration_failures_total") or 0
    cap = 3 << 20
    w = WarmTier(str(m.root), str(tmp_path / "warm"), cap_bytes=cap, migrate_at=0.5, group=2,
                 shards=4, retry_s=0.5, retry_max_s=1.0)
    chunk = blob(0, 256 << 10)
    refused, i = None, 0
    caplog.set_level(logging.INFO, logger="kvfs.warm")
    deadline = time.monotonic() + 120
    while refused is None:  # 1 MiB sessions until the volume is full and RAM at its cap
        assert time.monotonic() < deadline, w.usage()
        try:
            w.append(f"s{i // 4}", 0, chunk)
        except WarmError as e:
            refused = e
        i += 1
    assert "is full" in str(refused) and "No space left" in str(refused), refused
    assert "No space left" in w.usage()["cold_error"] and w.usage()["bytes"] <= cap
    # while it backs off: appends fail fast or succeed fast, no migration per append,
    # RAM never passes the cap, one log line (and one metric increment) per period
    caplog.clear()
    failed_before = metrics.REGISTRY.get_sample_value("kv_warm_migration_failures_total")
    lat, errors, t0 = [], 0, time.monotonic()
    while time.monotonic() - t0 < 2.5:
        a = time.perf_counter()
        try:
            w.append("late", 0, blob(1, 4096))
        except WarmError:
            errors += 1
        lat.append(time.perf_counter() - a)
        assert w.usage()["bytes"] <= cap
    lines = [r for r in caplog.records if "to cold tier" in r.message and "failed" in r.message]
    periods = metrics.REGISTRY.get_sample_value("kv_warm_migration_failures_total") - failed_before
    assert len(lat) > 200 and errors > 100 and np.median(lat) < 0.005, (len(lat), errors)
    assert 1 <= len(lines) == periods <= 4  # 0.5 s, then 1 s periods: not one per append
    assert periods + failed_before - failures >= 2
    assert w.usage()["bytes"] <= cap
    # every session is still readable, from RAM or from the cold copy
    for k in range(i // 4):
        n = w.size(f"s{k}", 0)
        assert n >= 256 << 10 and np.array_equal(w.read(f"s{k}", 0, 0, 256 << 10), chunk)
    with pytest.raises(WarmError, match="No space left"):
        w.migrate()  # an explicit call tries at once and says why it failed
    with pytest.raises(WarmError, match="No space left"):
        w.close()  # closed, and it says what the mount did not take

"""Warm tier migration: LRU order, group migration, cold round trips, failures, and a cold
tier that refuses."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time

import numpy as np
import pytest
from conftest import blob

from kvfs.ops import metrics
from kvfs.warm import WarmError, WarmTier, summarize_keys
from kvfs.warm.coldfiles import ColdStore


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
        # every layer file fsync'd on the descriptor that wrote it
        assert sum(e.endswith("fd") and "/layer_" in e for e in events) == 9
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

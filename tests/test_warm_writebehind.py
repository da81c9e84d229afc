"""Warm tier as a write-behind cache of a real mount: durability, deletion wins, volumes,
several processes, a full tmpfs, the agents' figures."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvfs.ops import metrics
from kvfs.warm import WarmError, WarmTier, read_agent_stats

REPO = Path(__file__).resolve().parents[1]


def blob(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def tier(m, tmp_path, **kw) -> WarmTier:
    kw.setdefault("shards", 16)
    return WarmTier(str(m.root), str(tmp_path / "warm"), **kw)


def wait_for(cond, timeout: float) -> float:
    """Seconds until ``cond()`` held; AssertionError after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - t0


# ---- durability ----------------------------------------------------------------------
def test_sync_puts_every_appended_byte_on_the_mount(kvfs, tmp_path):
    with tier(kvfs, tmp_path, writebehind_s=3600) as w:
        want = {}
        for layer in range(3):
            parts = [blob(10 * layer + k, 70_000 + 999 * k) for k in range(3)]
            for p in parts:
                w.append("s", layer, p)
            want[f"layer_{layer}"] = np.concatenate(parts).tobytes()
        w.put_meta("s", {"tokens": 9})
        w.put_summary("s", 0, np.full(128, 0.5, np.float32))
        w.put_summary("s", 2, np.full(128, 2.0, np.float32))
        assert not (kvfs.sessions / "s").exists()  # lag of an hour: nothing yet
        w.sync()
        want["meta.json"] = b'{"tokens":9}'
        want["summaries.f32"] = w.summaries("s").tobytes()
        for name, data in want.items():
            ref = tmp_path / f"want-{name}"
            ref.write_bytes(data)
            r = subprocess.run(["cmp", str(ref), str(kvfs.sessions / "s" / name)],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stdout + r.stderr
        inc = (kvfs.sessions / "s" / ".incarnation").read_bytes()
        assert len(inc) == 17 and int(inc, 16) > 0
        assert w.where("s") == "both" and w.usage()["dirty_sessions"] == 0
        w.append("s", 1, b"tail")  # only what is new is written: the cold files are appended to
        w.sync("s")
        assert (kvfs.sessions / "s" / "layer_1").read_bytes() == want["layer_1"] + b"tail"


def test_writebehind_reaches_the_mount_within_the_lag(kvfs, tmp_path):
    lag = 0.5
    with tier(kvfs, tmp_path, writebehind_s=lag) as w:
        data = blob(1, 300_000)
        w.append("s", 0, data)
        w.put_meta("s", {"tokens": 1})
        path = kvfs.sessions / "s" / "layer_0"
        took = wait_for(lambda: path.exists() and path.stat().st_size == len(data), lag + 1)
        assert took <= lag + 1
        wait_for(lambda: w.usage()["dirty_sessions"] == 0, 2)
        assert path.read_bytes() == data.tobytes() and w.where("s") == "both"
        assert 0 < w.usage()["writebehind_lag_s"] <= lag + 1


def test_bytes_threshold_writes_before_the_time_lag(kvfs, tmp_path):
    with tier(kvfs, tmp_path, writebehind_s=3600, writebehind_bytes=64 << 10) as w:
        w.append("s", 0, blob(2, 100 << 10))
        path = kvfs.sessions / "s" / "layer_0"
        wait_for(lambda: path.exists() and path.stat().st_size == 100 << 10, 3)


def test_close_leaves_complete_sessions_and_the_next_process_reads_them(kvfs, tmp_path):
    w = tier(kvfs, tmp_path, writebehind_s=3600)
    refs = {f"s{i}": blob(i, 50_000 + i) for i in range(3)}
    for sid, data in refs.items():
        w.append(sid, 0, data)
    w.close()
    for sid, data in refs.items():
        assert (kvfs.sessions / sid / "layer_0").read_bytes() == data.tobytes()
    shutil.rmtree(tmp_path / "warm")  # a reboot: the RAM tier is gone
    with tier(kvfs, tmp_path) as w:
        for sid, data in refs.items():
            assert np.array_equal(w.read(sid, 0, 0, len(data)), data)


def test_clean_sessions_are_dropped_at_the_threshold_without_copying(kvfs, tmp_path):
    count = metrics.REGISTRY.get_sample_value("kv_warm_evict_latency_ms_count") or 0
    with tier(kvfs, tmp_path, cap_bytes=1 << 20, migrate_at=0.5, group=3) as w:
        for i in range(4):
            w.append(f"s{i}", 0, blob(i, 100_000))
        w.sync()
        before = {p.name: p.stat().st_mtime_ns for p in kvfs.sessions.glob("*/layer_0")}
        w.append("big", 0, blob(9, 300_000))  # past 0.5 MiB: the three LRU (clean) go
        assert [w.where(f"s{i}") for i in range(4)] == ["cold", "cold", "cold", "both"]
        after = {p.name: p.stat().st_mtime_ns for p in kvfs.sessions.glob("*/layer_0")}
        assert all(after[k] == v for k, v in before.items() if k in after)
        assert metrics.REGISTRY.get_sample_value("kv_warm_evict_latency_ms_count") == count + 1
        for i in range(4):
            assert np.array_equal(w.read(f"s{i}", 0, 0, 100_000), blob(i, 100_000))


# ---- deletion wins ---------------------------------------------------------------------
def test_rm_r_on_the_mount_is_never_resurrected(kvfs, tmp_path):
    with tier(kvfs, tmp_path) as w:
        w.append("s", 0, blob(3, 40_000))
        w.put_meta("s", {"tokens": 4})
        w.sync()
        shutil.rmtree(kvfs.sessions / "s")
        assert w.size("s", 0) == 0 and w.get_meta("s") is None and w.where("s") is None
        w.append("s", 0, b"a new start")
        w.sync()
        assert (kvfs.sessions / "s" / "layer_0").read_bytes() == b"a new start"
        assert w.read("s", 0, 0, 11).tobytes() == b"a new start"


def test_cut_or_replaced_on_the_mount_drops_the_ram_copy(kvfs, tmp_path, caplog):
    with tier(kvfs, tmp_path) as w:
        for sid in ("cut", "new"):
            w.append(sid, 0, blob(4, 40_000))
        w.sync()
        os.truncate(kvfs.sessions / "cut" / "layer_0", 1000)
        w.append("cut", 0, b"x")  # the next pass sees the cut: the mount's copy wins
        w.sync("cut")
        assert w.size("cut", 0) == 1000 and "was cut to 1000 bytes" in caplog.text
        w.release("new")
        shutil.rmtree(kvfs.sessions / "new")  # made anew by someone else, another id
        d = kvfs.sessions / "new"
        d.mkdir(mode=0o700)
        (d / "layer_0").write_bytes(b"theirs")
        (d / ".incarnation").write_bytes(b"00000000000000aa\n")
        assert w.read("new", 0, 0, 6).tobytes() == b"theirs" and w.size("new", 0) == 6
        assert "another incarnation" in caplog.text


# ---- volumes and processes -------------------------------------------------------------
def test_two_volumes_on_one_host_never_cross(make_mount, tmp_path):
    m1, m2 = make_mount("one"), make_mount("two")
    root = str(tmp_path / "warm")
    with WarmTier(str(m1.root), root, shards=16, volume_id="vol-one") as a, \
            WarmTier(str(m2.root), root, shards=16, volume_id="vol-two") as b:
        a.append("s", 0, b"first volume")
        b.append("s", 0, b"second volume!")
        a.sync()
        b.sync()
        assert a.read("s", 0, 0, 12).tobytes() == b"first volume"
        assert b.read("s", 0, 0, 14).tobytes() == b"second volume!"
        assert a.usage()["dir"].startswith(os.path.join(root, "vol-one"))
    assert (m1.sessions / "s" / "layer_0").read_bytes() == b"first volume"
    assert (m2.sessions / "s" / "layer_0").read_bytes() == b"second volume!"
    assert sorted(os.listdir(root)) == ["vol-one", "vol-two"]


CHILD = textwrap.dedent("""
    import sys
    from kvfs.warm import WarmError, WarmTier
    cold, root, sid = sys.argv[1:4]
    w = WarmTier(cold, root, shards=16, volume_id="v", writebehind_s=3600)
    try:
        w.append(sid, 0, b"synced;")
        w.sync(sid)
        w.append(sid, 0, b"dirty tail")  # an hour of lag: only in RAM
    except WarmError as e:
        print("WarmError:", e, flush=True)
        sys.exit(3)
    print("ok", flush=True)
    sys.stdin.read()
    w.close()
""")


def child(m, root: Path, sid: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(m.root), str(root), sid], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    p.first = p.stdout.readline().strip()
    return p


def test_processes_share_a_volume_one_owner_per_session(kvfs, tmp_path):
    root = tmp_path / "warm"
    a, b = child(kvfs, root, "a"), child(kvfs, root, "b")
    try:
        assert a.first == "ok" and b.first == "ok"  # different sessions side by side
        c = child(kvfs, root, "a")
        out = c.first + c.communicate(timeout=30)[0]
        assert c.returncode == 3 and f"in use by process {a.pid}" in out, out
        def figures() -> dict:
            return {s["pid"]: s for s in read_agent_stats(str(root), "v")}

        wait_for(lambda: {p: s["dirty_bytes"] for p, s in figures().items()} == {a.pid: 10, b.pid: 10}, 3)
        stats = figures()
        assert stats[a.pid]["sessions"] == 1 and stats[a.pid]["volume_id"] == "v"
        assert stats[a.pid]["cap"] > 0 and "hits" in stats[a.pid]
        os.kill(a.pid, signal.SIGKILL)  # holding "a", its tail still dirty in RAM
        a.wait(10)
        # a new process takes over the dead one's RAM copies and writes their tails
        with WarmTier(str(kvfs.root), str(root), shards=16, volume_id="v") as w:
            w.sync()
            assert (kvfs.sessions / "a" / "layer_0").read_bytes() == b"synced;dirty tail"
            assert w.read("a", 0, 0, 17).tobytes() == b"synced;dirty tail"
            w.append("a", 0, b"+")
            assert a.pid not in {s["pid"] for s in read_agent_stats(str(root), "v")}
            with pytest.raises(WarmError, match=f"in use by process {b.pid}"):
                w.append("b", 0, b"no")
        b.communicate("", timeout=30)
        assert b.returncode == 0
        assert (kvfs.sessions / "b" / "layer_0").read_bytes() == b"synced;dirty tail"
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()


# ---- the mount goes away ---------------------------------------------------------------
def test_sync_raises_when_the_mount_is_gone(make_mount, tmp_path):
    m = make_mount()
    w = tier(m, tmp_path, writebehind_s=3600)
    w.append("s", 0, blob(5, 10_000))
    assert m.stop() == 0
    with pytest.raises(WarmError, match="mounted"):
        w.sync()
    assert np.array_equal(w.read("s", 0, 0, 10_000), blob(5, 10_000))  # RAM still serves
    with pytest.raises(WarmError):
        w.close()
    assert not (m.mountpoint / "sessions").exists()  # nothing written on the bare directory


# ---- a full tmpfs: eviction to the mount or a clear error, never SIGBUS ----------------
STREAM = textwrap.dedent("""
    import json, sys
    import numpy as np
    from kvfs.warm import WarmError, WarmTier
    cold, root = sys.argv[1] or None, sys.argv[2]
    w = WarmTier(cold, root, shards=16)
    refused = None
    for i in range(40):
        try:
            w.append(f"s{i}", 0, np.full(300_000, i % 251, np.uint8))
            w.put_meta(f"s{i}", {"tokens": i})
        except WarmError as e:
            refused = str(e)
            break
    cap = w.usage()["cap"]  # what the tmpfs allows after the stream
    ok = all(np.array_equal(w.read(f"s{i}", 0, 0, 300_000), np.full(300_000, i % 251, np.uint8))
             for i in range(40 if refused is None else 0))
    print(json.dumps({"cap": cap, "refused": refused, "ok": ok, "usage": w.usage()}))
    try:
        w.close()
    except WarmError:
        pass
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("with_mount", [True, False])
def test_a_4_mib_tmpfs_never_kills_the_process(make_mount, tmp_path, with_mount):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        cold = str(make_mount().root) if with_mount else ""
        p = subprocess.run([sys.executable, "-c", STREAM, cold, str(small / "warm")],
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert p.returncode == 0, (p.returncode, p.stderr[-3000:])  # -7 would be SIGBUS
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert 2 << 20 < out["cap"] <= 4 << 20, out  # the tmpfs's size, not the 16 GiB default
        if with_mount:
            assert out["refused"] is None and out["ok"], out
            assert out["usage"]["migrations"] > 0
            for i in range(40):
                got = (Path(cold) / "sessions" / f"s{i}" / "layer_0").read_bytes()
                assert got == bytes([i % 251]) * 300_000
        else:
            assert out["refused"] and "full" in out["refused"], out
    finally:
        subprocess.run(["umount", str(small)], check=True)

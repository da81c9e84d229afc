"""Warm tier, crash safety: a process SIGKILLed in the middle of a migration loses nothing.

Group migration (``writebehind=False``); the restarted tier takes over the killed
process's shard directory. Write-behind's crash tests are in test_warm_writebehind.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvfs.warm import WarmTier

SIDS = [f"s{i}" for i in range(5)]
CHILD = textwrap.dedent("""
    import sys
    from kvfs.warm import WarmTier
    w = WarmTier(sys.argv[1], sys.argv[2], shards=4, writebehind=False)
    w.migrate(3)
    print("finished", flush=True)
""")


def blob(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def make(w: WarmTier) -> dict:
    ref = {}
    for i, sid in enumerate(SIDS):
        for layer in range(3):
            ref[sid, layer] = blob(10 * i + layer, 40_000 + 1000 * layer)
            w.append(sid, layer, ref[sid, layer][:15_000])
            w.append(sid, layer, ref[sid, layer][15_000:])
        w.put_meta(sid, {"tokens": i})
        w.put_summary(sid, 0, np.full(128, i, np.float32))
    return ref


def run_until(point: str, cold: str, root: str, tmp) -> None:
    """Run the migrating child, SIGKILL it once it reports being at ``point``."""
    marker = tmp / "at-point"
    env = dict(os.environ, KVFS_WARM_TEST_PAUSE=point, KVFS_WARM_TEST_PAUSE_FILE=str(marker))
    root_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root_dir + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen([sys.executable, "-c", CHILD, cold, root], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not marker.exists():
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "child never reached the crash point"
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(10) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()


def verify(w: WarmTier, ref: dict) -> None:
    for (sid, layer), data in ref.items():
        assert w.size(sid, layer) == len(data), (sid, layer)
        assert np.array_equal(w.read(sid, layer, 0, len(data), promote=False), data), (sid, layer)
    for i, sid in enumerate(SIDS):
        assert w.get_meta(sid) == {"tokens": i}
        assert np.array_equal(w.summaries(sid), np.full((1, 128), i, np.float32))


@pytest.mark.parametrize("point,expect", [
    # killed after s0's first layer reached cold: s0 stays warm (and partly on cold)
    ("cold_partial", ["both", "warm", "warm", "warm", "warm"]),
    # killed when the group's cold copies were written and fsynced but before any left RAM:
    # the restart finishes the migration (cold copies complete)
    ("cold_written", ["cold", "cold", "cold", "warm", "warm"]),
    # the same, after s0 had already been dropped from RAM
    ("cold_written#2", ["cold", "cold", "cold", "warm", "warm"]),
    # killed while writing s2 (s0, s1 written, none dropped): s0, s1 finished, s2 kept
    ("cold_partial#3", ["cold", "cold", "both", "warm", "warm"]),
])
def test_kill_mid_migration_loses_nothing(tmp_path, point, expect):
    cold, root = str(tmp_path / "cold"), str(tmp_path / "warm")
    os.makedirs(os.path.join(cold, "sessions"))
    with WarmTier(cold, root, shards=4, writebehind=False) as w:
        ref = make(w)
    run_until(point, cold, root, tmp_path)
    with WarmTier(cold, root, shards=4, writebehind=False) as w:
        assert [w.where(s) for s in SIDS] == expect
        verify(w, ref)
        # finishing the interrupted work appends only what cold is missing
        w.migrate(len(SIDS))
        assert all(w.where(s) == "cold" for s in SIDS)
        verify(w, ref)
        for (sid, layer), data in ref.items():
            path = os.path.join(cold, "sessions", sid, f"layer_{layer}")
            assert open(path, "rb").read() == data.tobytes()
    with WarmTier(cold, root, shards=4, writebehind=False) as w:
        verify(w, ref)

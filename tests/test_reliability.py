"""Short versions of the reliability torture (``tools/torture.py``; full run and figures in
docs/reliability.md): kill -9 loop, power cuts and failpoints, bit flips through the mount,
full volume, bad input, load. Each calls the scenario with small counts and fails with the
scenario's own failure messages."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torture
import torture_common
from conftest import HAVE_FUSE

need_fuse = pytest.mark.skipif(not HAVE_FUSE, reason="/dev/fuse is absent")


def run(name: str, tmp_path: Path, seconds: float = 120.0) -> torture.Result:
    n = torture.QUICK[name]
    r = torture.scenarios()[name](tmp_path, n, time.monotonic() + seconds, random.Random(7))
    assert r.ok, f"{r.nfail} failures:\n" + "\n".join(r.failures)
    return r


@need_fuse
def test_kill_9_loop_keeps_fsynced_bytes_and_checks_clean(tmp_path: Path) -> None:
    r = run("kill9", tmp_path)
    assert r.done == r.counts["kills"] == r.counts["fsck_clean"] == torture.QUICK["kill9"]
    assert r.counts["fsynced_bytes_checked"] > 0 and r.counts["bytes_verified"] > 0


def test_power_cuts_torn_writes_and_failpoints_in_a_loop(tmp_path: Path) -> None:
    r = run("faults", tmp_path)
    assert r.done == torture.QUICK["faults"]
    assert r.counts["failpoints_fired"] > 0 and r.counts["torn_writes"] > 0
    assert r.counts["fsck_runs"] >= 2 and r.counts["ring_laps"] > 2


@need_fuse
def test_bit_flips_read_right_or_eio_through_the_mount(tmp_path: Path) -> None:
    r = run("flips", tmp_path)
    assert r.done == torture.QUICK["flips"]
    assert r.counts["live_flips_detected"] == r.counts["flips_live"] > 0
    assert r.counts["reads_eio"] > 0 and r.counts["reads_ok"] > 0


@need_fuse
def test_full_volume_enospc_then_eviction_of_whole_sessions(tmp_path: Path) -> None:
    r = run("full", tmp_path)
    assert r.counts["enospc"] >= 1 and r.counts["deleted_at_full"] == 2
    assert r.counts["sessions_evicted"] >= 1


@need_fuse
def test_bad_input_table(tmp_path: Path) -> None:
    r = run("badinput", tmp_path)
    assert r.counts["cases"] >= 30
    assert all(row[1] == row[2] for row in r.rows[:-1]), r.rows


@need_fuse
def test_64_sessions_under_load(tmp_path: Path) -> None:
    r = run("load", tmp_path)
    assert r.counts["ops"] > 1000 and "errors" not in r.counts and "mismatches" not in r.counts
    assert r.counts["rss_end_kib"] > 0


@need_fuse
def test_stale_handles_race_reads_and_buffer_bound_in_a_loop(tmp_path: Path) -> None:
    stale = run("stale", tmp_path / "stale")
    assert stale.done == torture.QUICK["stale"] and stale.counts["estale"] == 3 * stale.done
    race = run("race", tmp_path / "race")
    assert race.done > 100 and race.counts["bytes_verified"] > 0
    buf = run("buffers", tmp_path / "buffers")
    assert buf.counts["enospc_at_write"] > 0 and buf.counts["rss_growth_mib"] <= 80


@need_fuse
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_quota_floods_by_other_users_and_the_owner_remounts(tmp_path: Path) -> None:
    r = run("quota", tmp_path)
    assert r.done == torture.QUICK["quota"] and r.counts["fsck_clean"] == 1
    assert r.counts["edquot_sessions"] == r.counts["edquot_writes"] == r.done


@need_fuse
def test_metrics_port_flood_leaves_fuse_alone(tmp_path: Path) -> None:
    r = run("flood", tmp_path)
    assert r.done == torture.QUICK["flood"] and r.counts["mount_threads_max"] < 20
    assert r.counts["churn_connections"] > 0


# --- regressions for engine bugs the torture found (minimal reproducers) ----------------------

def test_append_whose_reclaim_reloads_the_session_keeps_its_copied_extents(tmp_path: Path) -> None:
    """Found by ``faults``: the append held its Session while reclaim evicted it from the hot
    LRU, reloaded a second copy from the tree and copied its entries forward in that copy;
    the append then re-pinned its stale copy, so the file pointed behind the tail (EIO,
    fsynced bytes lost for good at the next checkpoint)."""
    import os

    from kvfs.engine.store import Store
    from kvfs.engine.types import StoreConfig

    s = Store.create(str(tmp_path / "v.kvfs"), 8 << 20, StoreConfig(hot_sessions=1, compression="none"))
    for n in ("b", "a", "c"):
        s.create_session(n)
        s.create_file(n, "f")
    s.append("b", "f", 0, os.urandom(200_000))  # the tail: b's entry, then a's
    first = os.urandom(200_000)
    s.append("a", "f", 0, first)
    while s.ring.head < s.ring.size - (600 << 10):  # the rest of the lap: dead data of c
        s.truncate("c", "f", 0)
        s.append("c", "f", 0, os.urandom(250_000))
    s.checkpoint()
    s.session_stat("a")  # a is the hot session when its append starts
    more = os.urandom(200_000)
    s.append("a", "f", len(first), more)  # reclaim: loads b (evicting a), copies a forward
    assert s.counters["copied_forward"] > 0
    assert s.read("a", "f", 0, 1 << 30) == first + more
    s.close()
    s = Store.open(str(tmp_path / "v.kvfs"))
    assert s.read("a", "f", 0, 1 << 30) == first + more
    s.close()


def test_evict_when_full_never_evicts_the_session_being_written(tmp_path: Path) -> None:
    """Found by ``full``: with evict_when_full the reclaim run by an append could drop the
    very session appended to (its entries had reached the tail after a round of copying
    forward); the mount then answered ENOENT to a write on an open file."""
    from kvfs.engine.store import Store
    from kvfs.engine.types import StoreConfig

    rng = random.Random(1)
    s = Store.create(str(tmp_path / "v.kvfs"), 32 << 20, StoreConfig(evict_when_full=True))
    for i in range(40):
        n = f"ev-{i:04d}"
        s.create_session(n)
        for f in ("layer_0", "layer_1", "meta.json"):
            s.create_file(n, f)
            size = 1024 if f == "meta.json" else rng.randint(256 << 10, 3 << 19)
            data = torture_common.stream(torture_common.seed_of("ev", i, f), size)
            for o in range(0, size, 256 << 10):
                s.append(n, f, o, data[o:o + (256 << 10)])  # NotFound before the fix
            s.sync()
        assert n in s.list_sessions()
    assert s.counters["evicted_sessions"] > 0
    s.close()


def test_fsck_reports_a_damaged_tree_page_it_meets_after_open(tmp_path: Path) -> None:
    """Found by ``flips``: a flipped bit in a B+ tree leaf that recovery does not read (only
    session records, no bitmap) made ``check_volume`` raise PageCorrupt from
    ``list_sessions``: tools/fsck.py died with a traceback instead of reporting."""
    import os

    from kvfs.engine.fsck import check_volume
    from kvfs.engine.store import Store

    path = str(tmp_path / "v.kvfs")
    s = Store.create(path, 16 << 20)
    for i in range(60):  # a tree of several leaves
        s.create_session(f"s{i:02d}")
        s.create_file(f"s{i:02d}", "layer_0")
        s.append(f"s{i:02d}", "layer_0", 0, os.urandom(1000))
    s.close()
    s = Store.open(path, readonly=True)
    root, first = s.tree.root, s.sb.tree_offset + s.tree.root.half * (s.sb.tree_pages // 2) * 4096
    s.crash()
    assert root.height >= 2 and root.alloc >= 3
    fd = os.open(path, os.O_RDWR)
    try:
        for page in range(root.alloc):
            off = first + page * 4096 + 100
            b = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([b[0] ^ 1]), off)
            try:
                assert check_volume(path).status == 1, page
            finally:
                os.pwrite(fd, b, off)
    finally:
        os.close(fd)
    assert check_volume(path).status == 0


@need_fuse
def test_native_reads_racing_laps_cuts_and_removals_never_return_wrong_bytes(tmp_path: Path) -> None:
    r = run("nrace", tmp_path)
    assert r.done >= torture.QUICK["nrace"] and r.counts["ring_laps"] >= 3
    assert r.counts["bytes_verified"] > 0 and r.counts["truncates"] > 0
    assert r.counts["sessions_removed"] > 0


@need_fuse
def test_kill_9_during_native_rounds_keeps_every_acknowledged_round(tmp_path: Path) -> None:
    r = run("nkill9", tmp_path)
    assert r.done == r.counts["kills"] == r.counts["fsck_clean"] == torture.QUICK["nkill9"]
    assert r.counts["rounds_acked"] > 0 and r.counts["bytes_verified"] > 0

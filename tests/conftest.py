"""Shared fixtures: real kvfs mounts through /dev/fuse (see :mod:`kvfs.mount_runner`), the
warm-tier tests' directories and bytes, and the B+ tree tests' zeroed regions.

Every test that uses a mount fixture is marked ``mount``; the long ones (models run token
by token, thousands of bit flips, the benchmark smoke run, a local Redis Cluster) are
marked ``slow`` here, in one place. ``make test-unit`` (``pytest -m "not mount and not
slow"``) is the fast lane: well under 90 s on two cores. ``make test`` runs everything.
Mount tests are skipped only when /dev/fuse is absent.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvfs.engine.volume import VolumeFile
from kvfs.mount_runner import (  # noqa: F401 - re-exported for the test modules
    HAVE_FUSE,
    Mount,
    MountFailed,
    fusermount_u,
    run_mount,
    wait_unmounted,
)
from kvfs.shared.local_cluster import HAVE_REDIS, Cluster

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A real local Redis Cluster, 3 masters and 3 replicas, for one test module."""
    if not HAVE_REDIS:
        pytest.skip("redis-server/redis-cli not installed (apt-get install redis-server "
                    "redis-tools; tools/setup_env.sh does it as root)")
    with Cluster(masters=3, replicas=1, node_timeout_ms=1000) as c:
        yield c

MOUNT_FIXTURES = {"make_mount", "kvfs", "shared_mount"}
# modules whose tests start mounts themselves (kvfs.mount_runner.Mount, the torture scenarios)
MOUNT_MODULES = {"test_agent_day", "test_reliability"}
# the slow lane: whole modules (real models step by step, a Redis Cluster, the benchmark
# smoke run, model-based state machines) and single long tests (functions, any parameters)
SLOW_MODULES = {"test_torch_router", "test_torch_rope", "test_torch_cache", "test_smollm2",
                "test_bench_smoke", "test_engine_model", "test_shared", "test_shared_deploy"}
SLOW_TESTS = {"test_ten_thousand_bit_flips_never_return_wrong_bytes",
              "test_torn_last_entry_at_every_byte", "test_bit_flips_never_return_wrong_bytes",
              "test_btree.py::test_model", "test_full_volume_with_eviction_drops_oldest_sessions_whole",
              "test_reads_racing_writes_truncates_and_laps_return_right_bytes_only",
              "test_fuzz_crafted_volumes_for_a_fixed_budget"}


def _slow(item: pytest.Item, module: str) -> bool:
    name = getattr(item, "originalname", None) or item.name.partition("[")[0]
    parts = item.nodeid.split("::")[1:]  # a unittest case: its class, then runTest
    return (module in SLOW_MODULES or name in SLOW_TESTS
            or any(f"{module}.py::{p.partition('[')[0]}" in SLOW_TESTS for p in parts))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if (MOUNT_FIXTURES & set(getattr(item, "fixturenames", ()))
                or module.startswith("test_mount") or module in MOUNT_MODULES):
            item.add_marker(pytest.mark.mount)
        if _slow(item, module):
            item.add_marker(pytest.mark.slow)


need_fuse = pytest.mark.skipif(not HAVE_FUSE, reason="/dev/fuse is absent")


@pytest.fixture
def make_mount(tmp_path: Path) -> Iterator:
    """A factory of fresh mounts in tmp_path; each is unmounted (exit 0 checked) after."""
    if not HAVE_FUSE:
        pytest.skip("/dev/fuse is absent")
    mounts: list[Mount] = []

    def make(name: str = "vol", size: str | None = "64M", extra: tuple[str, ...] = (),
             start: bool = True) -> Mount:
        m = Mount(tmp_path / f"{name}.kvfs", tmp_path / f"{name}.mnt", size, extra)
        mounts.append(m)
        return m.start() if start else m

    yield make
    failures = []
    for m in mounts:
        if m.proc is not None:
            rc = m.stop()
            if rc != 0:
                failures.append(f"{m.volume}: exit {rc}\n{m.log_text()}")
    assert not failures, "\n".join(failures)


@pytest.fixture
def kvfs(make_mount) -> Mount:
    """A fresh 64 MiB volume mounted in the foreground."""
    return make_mount()


@pytest.fixture(scope="module")
def shared_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """One mount for a whole test module (each test uses its own session names)."""
    if not HAVE_FUSE:
        pytest.skip("/dev/fuse is absent")
    d = tmp_path_factory.mktemp("shared")
    m = Mount(d / "vol.kvfs", d / "mnt", "64M").start()
    yield m
    if m.proc is not None:
        rc = m.stop()
        assert rc == 0, m.log_text()


@pytest.fixture
def other_users_dir() -> Iterator[Path]:
    """A directory other uids can reach, for mounts they use (pytest's tmp tree is root's)."""
    d = Path(tempfile.mkdtemp(prefix="kvfs-uids-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[str, str]:
    """A cold root laid out like a mounted volume and a warm root (the warm-tier tests)."""
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True)  # the layout of a mounted volume
    return str(cold), str(tmp_path / "warm")


def blob(seed: int, n: int) -> np.ndarray:
    """``n`` random bytes, the same for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def warm(tmp_path: Path) -> Iterator:
    """A RAM tier over a directory laid out like a mounted volume (the hot-tier tests)."""
    from kvfs.warm import WarmTier

    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True, exist_ok=True)
    w = WarmTier(cold_root=str(cold), root=str(tmp_path / "warm"), shards=16)
    yield w
    w.close()


# ---- B+ tree regions (test_btree, test_btree_corrupt) ----

SMALL = 512  # page size that makes splits, merges and compaction cheap to reach
OFFSET = 3 * SMALL  # the region does not start at 0 in a volume either


def zeroed(path: str, size: int) -> VolumeFile:
    """A volume object over a zeroed file (the tree reads and writes through it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    return VolumeFile(path, fd, size, False)


@pytest.fixture
def region(tmp_path):
    """open(region_pages, page_size) -> volume of a zeroed file holding OFFSET + the region."""
    vols = []

    def open_(pages: int, page_size: int = SMALL) -> VolumeFile:
        vols.append(zeroed(str(tmp_path / f"vol{len(vols)}"), OFFSET + pages * page_size))
        return vols[-1]

    yield open_
    for v in vols:
        v.close()


def key(i: int) -> bytes:
    # varied lengths up to 64 bytes, ordered by i: long keys make branches split early
    return b"k%05d" % i + b"." * (i * 7 % 59)

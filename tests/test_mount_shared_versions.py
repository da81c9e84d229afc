"""Freshness by content version across two mounts (two nodes) over one real 3 + 3 Redis
Cluster: a file rewritten in place at the same size on one node is read on the other, a
node remounted after a kill -9 serves the other node's newer bytes (never its pre-crash
copy), and a version token that is torn or flipped in the cluster leads to a fetch of the
cluster's bytes, never to the local copy's."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfs.mount_runner import Mount
from kvfs.shared.chunks import SessionKeys
from kvfs.shared.local_cluster import Cluster

FAST = ("-o", "shared_lease_s=2s", "-o", "shared_fsync_wait_s=1s")
OLD, NEW = b'{"tokens": 1139}', b'{"tokens": 1187}'  # the same size
REFRESH = 1.2  # past remote.REFRESH_S: the next open checks the cluster again


@pytest.fixture
def node(make_mount: Callable[..., Mount], cluster: Cluster) -> Callable[..., Mount]:
    def make(name: str) -> Mount:
        return make_mount(name, extra=(*cluster.mount_args(), *FAST))
    return make


def rewrite(path: Path, data: bytes, timeout: float = 15.0) -> None:
    """Cut ``path`` to 0 and write ``data`` (an in-place rewrite), fsync'd; retries while
    another node's lease answers EBUSY."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            break
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def make_session(m: Mount, name: str, acked: bytes, layer: bytes) -> Path:
    s = m.sessions / name
    s.mkdir()
    rewrite(s / "layer_0", layer)
    rewrite(s / ".acked", acked)
    rewrite(s / "meta.json", json.dumps({"tokens": 1139}).encode())
    return s


def test_same_size_rewrite_on_a_is_read_on_b(node: Callable[..., Mount]) -> None:
    a, b = node("a"), node("b")
    layer = os.urandom(300_000)
    s = make_session(a, "same-size", OLD, layer)
    a.pushed(10.0)
    sb = b.sessions / "same-size"
    assert (sb / ".acked").read_bytes() == OLD  # read through: B holds a copy now
    assert (sb / "layer_0").read_bytes() == layer

    rewrite(s / ".acked", NEW)  # same size, other bytes
    layer2 = os.urandom(len(layer))
    rewrite(s / "layer_0", layer2)  # a retried turn: cut, then the same length again
    a.pushed(10.0)
    time.sleep(REFRESH)
    assert (sb / ".acked").read_bytes() == NEW
    assert (sb / "layer_0").read_bytes() == layer2
    # and back the other way: B rewrites, A reads
    time.sleep(REFRESH)
    rewrite(sb / ".acked", OLD)
    b.pushed(10.0)
    time.sleep(REFRESH)
    assert (s / ".acked").read_bytes() == OLD
    assert (s / "layer_0").read_bytes() == layer2


def test_remounted_node_serves_the_other_nodes_rewrite(node: Callable[..., Mount]) -> None:
    a, b = node("a"), node("b")
    layer = os.urandom(200_000)
    s = make_session(a, "after-crash", OLD, layer)
    mine = os.urandom(100_000)  # a file only A writes: its copy stays A's after the crash
    rewrite(s / "layer_1", mine)
    a.pushed(10.0)
    assert (s / ".acked").read_bytes() == OLD
    held = os.open(s / ".acked", os.O_WRONLY | os.O_APPEND)  # A holds the lease at the kill
    a.kill()  # kill -9 of A's mount: nothing of it unmounts cleanly
    try:
        os.close(held)
    except OSError:
        pass  # ENOTCONN: its mount is gone
    sb = b.sessions / "after-crash"
    rewrite(sb / ".acked", NEW)  # after A's lease expires: a takeover
    layer2 = os.urandom(150_000)  # shorter than A's copy: a cut made elsewhere
    rewrite(sb / "layer_0", layer2)
    b.pushed(10.0)

    a.start()  # the remount after the crash (recovery)
    assert (s / ".acked").read_bytes() == NEW
    assert os.stat(s / "layer_0").st_size == len(layer2)
    assert (s / "layer_0").read_bytes() == layer2
    assert (s / "layer_1").read_bytes() == mine
    # B's two files read through again; layer_1's version is A's own: served from A's volume
    assert a.stats()["shared"]["fetched_bytes"] == len(NEW) + len(layer2)
    log = a.log_text()
    assert "of another content version" in log, log[-3000:]


@pytest.mark.parametrize("damage", ["flip", "tear", "drop"])
def test_damaged_version_refetches_never_serves_stale(node: Callable[..., Mount],
                                                      cluster: Cluster, damage: str) -> None:
    """A version token with a flipped bit, torn short, or gone (as a session stored before
    versions were kept): B does not trust its copy by it, fetches the cluster's bytes."""
    a, b = node("a"), node("b")
    name = f"damaged-{damage}"
    s = make_session(a, name, OLD, os.urandom(1000))
    a.pushed(10.0)
    sb = b.sessions / name
    assert (sb / ".acked").read_bytes() == OLD
    rewrite(s / ".acked", NEW)
    a.pushed(10.0)
    k = SessionKeys(name)
    r = cluster.client(cluster.master_of_key(k.vers))
    raw = r.hget(k.vers, ".acked")
    assert raw is not None
    if damage == "flip":
        bad = bytearray(raw)
        bad[len(bad) // 2] ^= 0x10
        r.hset(k.vers, ".acked", bytes(bad))
    elif damage == "tear":
        r.hset(k.vers, ".acked", raw[:len(raw) - 5])
    else:
        r.hdel(k.vers, ".acked")
    time.sleep(REFRESH)
    assert (sb / ".acked").read_bytes() == NEW  # the cluster's bytes, never B's old copy
    time.sleep(REFRESH)
    assert (sb / ".acked").read_bytes() == NEW  # then compared by size: no refetch loop
    if damage != "drop":
        assert "content version does not verify" in b.log_text()

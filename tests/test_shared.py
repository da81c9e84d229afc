"""The shared tier against a real local Redis Cluster (3 masters, 3 replicas): chunked
round trips, checksums, meta-last visibility, leases across two nodes, failover without
losing a synced byte, an unreachable cluster, capacity and retention, bad input."""

from __future__ import annotations

import ast
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvfs.shared
from kvfs.shared import (
    BadName,
    BadRange,
    LeaseLost,
    NotAppend,
    NotFoundShared,
    SessionBusy,
    SharedCorrupt,
    SharedLost,
    SharedTier,
    SharedUnavailable,
)
from kvfs.shared.chunks import HEADER_SIZE, SessionKeys
from kvfs.shared.local_cluster import Cluster, free_ports

C = 4096   # small chunks: many boundaries with little data
SECRET = b"test cluster secret, 32 bytes or more"


@pytest.fixture
def tier(cluster: Cluster) -> Iterator[SharedTier]:
    t = SharedTier(cluster.urls, node_id="node-a", secret=SECRET, chunk_bytes=C, timeout_s=0.5)
    yield t
    t.close()


def _master(cluster: Cluster, session: str):
    return cluster.client(cluster.master_of_key(SessionKeys(session).files))


def _fill(t: SharedTier, session: str, file: str, data: bytes, steps: list[int]) -> None:
    pos = 0
    for n in steps:
        pos = t.append(session, file, pos, data[pos:pos + n])
    assert pos == len(data)


def test_imports_stay_light() -> None:
    """kvfs.shared uses only the engine's errors and the session's file names from kvfs,
    and loads no FUSE, trio or torch."""
    code = "import sys, kvfs.shared, kvfs.shared.local_cluster; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = {m.split(".")[0] for m in out.stdout.split()}
    assert not loaded & {"pyfuse3", "trio", "torch", "transformers"}
    pkg = Path(kvfs.shared.__file__).parent
    for f in pkg.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvfs"):
                assert node.module.startswith(("kvfs.shared", "kvfs.engine", "kvfs.session")), (
                        f.name, node.module)


def test_round_trip_across_chunk_boundaries(cluster: Cluster, tier: SharedTier) -> None:
    rng = random.Random(1)
    data = rng.randbytes(30 * C + 123)
    steps = [1, C - 1, 1, C, 17 * C + 5, 3, 2 * C]    # 17 C: more than one script call
    steps.append(len(data) - sum(steps))
    assert tier.acquire("rt") is True
    _fill(tier, "rt", "layer_0", data, steps)
    tier.append("rt", "layer_1", 0, b"x" * 10)
    assert tier.size("rt", "layer_0") == len(data)
    assert tier.list_files("rt") == {"layer_0": len(data), "layer_1": 10}
    cases = [(0, len(data)), (C - 1, 2), (C, C), (5 * C - 3, 7 * C), (len(data) - 1, 9),
             (len(data), 5), (len(data) + C, 5), (0, 0), (123, 0), (0, 1 << 40)]
    cases += [(rng.randrange(len(data)), rng.randrange(3 * C)) for _ in range(40)]
    for off, n in cases:
        assert tier.read("rt", "layer_0", off, n) == data[off:off + n], (off, n)
    # one session, one slot: every key sits on the same shard
    r = _master(cluster, "rt")
    keys = r.keys("kvfs:{rt}:*")
    assert len(keys) >= 31 and len({r.execute_command("CLUSTER", "KEYSLOT", k) for k in keys}) == 1
    # the default chunks (about 1 MiB)
    with SharedTier(cluster.urls, node_id="node-big", secret=SECRET, timeout_s=2.0) as big:
        cb = big.chunk_bytes
        blob = os.urandom(5 * cb // 2)
        big.acquire("rt-big")
        big.append("rt-big", "layer_0", 0, blob[:cb - 3])
        big.append("rt-big", "layer_0", cb - 3, blob[cb - 3:])
        assert big.read("rt-big", "layer_0", 0, len(blob)) == blob
        assert big.read("rt-big", "layer_0", cb - 7, 14) == blob[cb - 7:cb + 7]
        # a full chunk is stored exactly (trimmed), in the 1 MiB allocation class (+ key overhead)
        full = _master(cluster, "rt-big").memory_usage(SessionKeys("rt-big").chunk("layer_0", 0))
        assert full < (1 << 20) + 4096       # not the 1.25 MiB class, nor a doubled buffer
    st = tier.stats()
    assert st["hits"] >= len(cases) and st["bytes_in"] == len(data) + 10 and st["read_ms_p99"] > 0


def test_truncate_and_compaction(tier: SharedTier) -> None:
    tier.acquire("tr")
    data = os.urandom(3 * C + 100)
    _fill(tier, "tr", "layer_0", data, [len(data)])
    for cut in (2 * C + 50, 2 * C, 7, 0):
        tier.truncate("tr", "layer_0", cut)
        assert tier.size("tr", "layer_0") == cut
        assert tier.read("tr", "layer_0", 0, len(data)) == data[:cut]
    with pytest.raises(BadRange):
        tier.truncate("tr", "layer_0", 1)
    # many tiny appends: the chunk is rewritten as one piece, the bytes stay the same
    tiny = os.urandom(600)
    _fill(tier, "tr", "layer_0", tiny, [2] * 300)
    assert tier.stats()["compactions"] >= 1
    assert tier.read("tr", "layer_0", 0, 1000) == tiny
    tier.remove_file("tr", "layer_0")
    assert tier.list_files("tr") == {}
    with pytest.raises(NotFoundShared):
        tier.read("tr", "layer_0", 0, 1)


def test_released_session_is_stored_exactly(cluster: Cluster, tier: SharedTier) -> None:
    """Appends grow a value greedily; a full chunk, and at release the last partial one,
    are copied to an exact allocation (memory = bytes stored + small overhead)."""
    tier.acquire("ex")
    data = os.urandom(C + 3000)
    _fill(tier, "ex", "layer_0", data, [300] * 23 + [C + 3000 - 300 * 23])
    r, k = _master(cluster, "ex"), SessionKeys("ex")
    partial = k.chunk("layer_0", 1)
    def exact(key: str) -> bool:      # within jemalloc's size class (steps of 1/4) + key overhead
        return r.memory_usage(key, samples=0) < 1.25 * r.strlen(key) + 128

    assert not exact(partial) and exact(k.chunk("layer_0", 0))
    assert tier.release("ex")
    assert exact(partial)
    assert r.ttl(partial) > 0 and not r.exists(k.prefix + "tmp")
    assert tier.read("ex", "layer_0", 0, 2 * C) == data


def test_bad_chunk_is_never_served(cluster: Cluster, tier: SharedTier) -> None:
    data = os.urandom(3 * C)
    tier.acquire("bf")
    _fill(tier, "bf", "layer_0", data, [C + 10, 2 * C - 10])
    tier.put_meta("bf", b'{"tokens": 3}')
    r = _master(cluster, "bf")
    k = SessionKeys("bf")
    # a flipped payload bit, then a flipped header bit (the length field), then a lost chunk
    for key, pos in ((k.chunk("layer_0", 1), HEADER_SIZE + 100), (k.chunk("layer_0", 2), 13)):
        raw = bytearray(r.get(key))
        raw[pos] ^= 0x10
        r.set(key, bytes(raw), keepttl=True)
    before = tier.stats()
    for off in (C, 2 * C + 5):
        with pytest.raises(SharedCorrupt, match="chunk"):
            tier.read("bf", "layer_0", off, 10)
    with pytest.raises(SharedCorrupt):
        tier.read("bf", "layer_0", 0, 3 * C)
    assert tier.read("bf", "layer_0", 0, C) == data[:C]      # the good chunk still reads
    r.delete(k.chunk("layer_0", 0))
    with pytest.raises(SharedCorrupt, match="missing"):
        tier.read("bf", "layer_0", 0, 1)
    raw = bytearray(r.get(k.meta))
    raw[-2] ^= 1
    r.set(k.meta, bytes(raw), keepttl=True)
    with pytest.raises(SharedCorrupt, match="meta"):
        tier.get_meta("bf")
    after = tier.stats()
    assert after["corrupt"] - before["corrupt"] == 5 and after["refetches"] - before["refetches"] == 5


def test_bad_value_in_transit_is_fetched_again(tier: SharedTier) -> None:
    """A chunk that arrives bad once (a flipped bit on the way) is fetched again, and the
    good copy is served."""
    data = os.urandom(2 * C)
    tier.acquire("tx")
    _fill(tier, "tx", "layer_0", data, [2 * C])
    real = tier._c.on_master
    flipped = []

    def flipping(key, what, commands, transaction):
        out = real(key, what, commands, transaction)
        if not flipped and what.startswith("read"):
            bad = bytearray(out[1])
            bad[HEADER_SIZE + 1] ^= 1
            out[1] = bytes(bad)
            flipped.append(True)
        return out

    tier._c.on_master = flipping
    try:
        assert tier.read("tx", "layer_0", 0, 2 * C) == data
    finally:
        tier._c.on_master = real
    assert flipped and tier.stats()["refetches"] == 1 and tier.stats()["corrupt"] == 0


def test_meta_is_written_last(cluster: Cluster, tier: SharedTier) -> None:
    """A reader sees a session only once its meta is there, and then sees all the data
    written before the meta."""
    data = os.urandom(8 * C)
    seen: list[bytes] = []
    stop = threading.Event()
    reader = SharedTier(cluster.urls, node_id="reader", secret=SECRET, chunk_bytes=C,
                        timeout_s=0.5)

    def watch() -> None:
        while not stop.is_set():
            if reader.has_session("ml"):
                seen.append(reader.read("ml", "layer_0", 0, len(data)))
                return

    th = threading.Thread(target=watch)
    th.start()
    try:
        tier.acquire("ml")
        assert not tier.has_session("ml") and tier.get_meta("ml") is None
        _fill(tier, "ml", "layer_0", data, [C] * 8)
        assert not tier.has_session("ml")
        tier.put_meta("ml", b'{"tokens": 8}')
        th.join(timeout=5)
    finally:
        stop.set()
        th.join(timeout=5)
        reader.close()
    assert seen == [data] and tier.get_meta("ml") == b'{"tokens": 8}'


def test_one_lease_two_nodes(cluster: Cluster) -> None:
    a = SharedTier(cluster.urls, node_id="node-a", secret=SECRET, chunk_bytes=C, lease_ms=600,
                   auto_renew=False)
    b = SharedTier(cluster.urls, node_id="node-b", secret=SECRET, chunk_bytes=C, lease_ms=600)
    try:
        assert a.acquire("ls") is True and a.acquire("ls") is False
        with pytest.raises(SessionBusy, match="node-a") as busy:
            b.acquire("ls")
        assert busy.value.owner == "node-a"
        with pytest.raises(LeaseLost):
            b.append("ls", "layer_0", 0, b"b")
        assert a.append("ls", "layer_0", 0, b"aaaa") == 4
        with pytest.raises(SessionBusy):
            b.delete_session("ls")
        # a stops renewing (a dead host): once its lease expires b takes over
        assert b.acquire("ls", wait_s=3.0) is True
        assert b.stats()["lease_takeovers"] == 1
        with pytest.raises(LeaseLost, match="node-b") as lost:
            a.append("ls", "layer_0", 4, b"late")
        assert lost.value.owner == "node-b"
        with pytest.raises(LeaseLost):
            a.renew("ls")
        with pytest.raises(LeaseLost):
            a.put_meta("ls", b"{}")
        assert b.read("ls", "layer_0", 0, 100) == b"aaaa"
        assert b.append("ls", "layer_0", 4, b"bb") == 6
        # b renews on its own: well past its lease, a still cannot have it
        time.sleep(1.0)
        with pytest.raises(SessionBusy, match="node-b"):
            a.acquire("ls")
        # a clean hand-over is no takeover
        assert b.release("ls") and a.acquire("ls") is True
        assert a.stats()["lease_takeovers"] == 0
    finally:
        a.close()
        b.close()


def test_a_rewrite_by_the_next_owner_is_no_lost_write(cluster: Cluster) -> None:
    """Node a writes and hands the session over; b rewrites it shorter (as a session whose
    history changed is rewritten) and hands it back: a's next tenure syncs cleanly, for b's
    rewrite lost none of what a vouched for."""
    a = SharedTier(cluster.urls, node_id="node-a", secret=SECRET, chunk_bytes=C, timeout_s=1.0)
    b = SharedTier(cluster.urls, node_id="node-b", secret=SECRET, chunk_bytes=C, timeout_s=1.0)
    try:
        a.acquire("hand")
        a.append("hand", "layer_0", 0, b"x" * 100)
        a.put_meta("hand", b'{"tokens": 100}')
        a.sync("hand")
        assert a.release("hand") and b.acquire("hand") is True
        b.truncate("hand", "layer_0", 40)
        b.put_meta("hand", b'{"tokens": 40}')
        b.sync("hand")
        assert b.release("hand") and a.acquire("hand") is True
        a.append("hand", "layer_0", 40, b"y" * 10)
        a.sync("hand")  # no SharedLost: the shorter file and the new meta are b's, not a loss
        assert a.read("hand", "layer_0", 0, 1 << 10) == b"x" * 40 + b"y" * 10
        assert a.get_meta("hand") == b'{"tokens": 40}'
    finally:
        a.close()
        b.close()


def test_unreachable_cluster(cluster: Cluster, tier: SharedTier) -> None:
    port = free_ports(1)[0]
    t0 = time.monotonic()
    with pytest.raises(SharedUnavailable, match=f"127.0.0.1:{port}"):
        SharedTier(f"redis://127.0.0.1:{port}", node_id="x", secret=SECRET, timeout_s=0.5)
    assert time.monotonic() - t0 < 3
    with pytest.raises(ValueError, match="address"):
        SharedTier("redis://nohostport", node_id="x", secret=SECRET)
    # every node hangs (paused clients): calls fail within the bound, then fast
    tier.acquire("un")
    tier.append("un", "layer_0", 0, b"12345")
    for p in cluster.alive():
        with cluster.client(p) as c:
            c.execute_command("CLIENT", "PAUSE", 4000, "ALL")
    try:
        t0 = time.monotonic()
        with pytest.raises(SharedUnavailable):
            tier.read("un", "layer_0", 0, 5)
        first = time.monotonic() - t0
        t0 = time.monotonic()
        with pytest.raises(SharedUnavailable, match="not retried"):
            tier.append("un", "layer_0", 5, b"6")
        assert first < 2.5 and time.monotonic() - t0 < 0.1
        assert tier.healthy() is False
    finally:
        for p in cluster.alive():
            with cluster.client(p) as c:
                c.execute_command("CLIENT", "UNPAUSE")
    assert tier.healthy() is True
    assert tier.read("un", "layer_0", 0, 10) == b"12345"
    assert tier.stats()["unavailable"] >= 2


def test_failover_keeps_synced_bytes(cluster: Cluster) -> None:
    with SharedTier(cluster.urls, node_id="node-a", secret=SECRET, chunk_bytes=C,
                    timeout_s=0.5) as t:
        t.acquire("fo")
        data = os.urandom(40 * C)
        _fill(t, "fo", "layer_0", data[:20 * C], [C + 1] * 19 + [20 * C - 19 * (C + 1)])
        t.put_meta("fo", b'{"tokens": 1}')
        t.sync("fo")
        _fill_from(t, "fo", data, 20 * C, 40 * C)
        t.sync("fo")                                           # every byte acknowledged
        master = cluster.master_of_key(SessionKeys("fo").files)
        replica = cluster.replica_of(master)
        assert replica is not None
        cluster.kill(master)
        t0 = time.monotonic()
        with pytest.raises(SharedUnavailable):
            t.read("fo", "layer_0", 0, 10)
        assert time.monotonic() - t0 < 2.5
        cluster.wait_promoted(replica)
        assert _eventually(lambda: t.healthy())
        assert t.read("fo", "layer_0", 0, len(data)) == data
        assert t.get_meta("fo") == b'{"tokens": 1}'
        t.sync("fo")                                  # nothing lost; the new master has no replica
        t.append("fo", "layer_0", len(data), b"more")
        cluster.restart(master)                       # comes back as the new master's replica
        assert cluster.role(master) == "slave"


def test_lost_unsynced_write_is_reported(cluster: Cluster) -> None:
    """A write the master acknowledged but no replica received is lost when the master
    dies; ``sync`` says so instead of pretending, and the append offset follows the cluster."""
    with SharedTier(cluster.urls, node_id="node-a", secret=SECRET, chunk_bytes=C,
                    timeout_s=0.5) as t:
        t.acquire("ls2")
        synced = os.urandom(3 * C)
        t.append("ls2", "layer_0", 0, synced)
        t.sync("ls2")
        master = cluster.master_of_key(SessionKeys("ls2").files)
        replica = cluster.replica_of(master)
        assert replica is not None
        cluster.kill(replica)                          # the replica is gone...
        t.append("ls2", "layer_0", len(synced), b"unsynced")
        t0 = time.monotonic()
        with pytest.raises(SharedUnavailable, match="0 of 1 replica"):
            t.sync("ls2")                              # ...so the write is not durable
        assert time.monotonic() - t0 < 2.0
        cluster.kill(master)                           # then the master dies too
        cluster.restart(replica)                       # the replica, from its own AOF, takes over
        cluster.wait_promoted(replica)
        assert _eventually(lambda: t.healthy())
        with pytest.raises(SharedLost, match="layer_0") as lost:
            t.sync("ls2")
        assert lost.value.files == {"layer_0": (len(synced) + 8, len(synced))}
        assert t.read("ls2", "layer_0", 0, 1 << 20) == synced
        with pytest.raises(NotAppend) as na:
            t.append("ls2", "layer_0", len(synced) + 8, b"x")
        assert na.value.size == len(synced)
        t.append("ls2", "layer_0", len(synced), b"unsynced")  # re-sent from the local copy
        t.sync("ls2")
        cluster.restart(master)


def test_capacity_and_retention(cluster: Cluster) -> None:
    with SharedTier(cluster.urls, node_id="cap", secret=SECRET, chunk_bytes=C,
                    max_bytes=5 * 17 * 1024,
                    retention_s=30) as t:
        for i in range(8):
            s = f"cap-{i}"
            t.acquire(s)
            t.append(s, "layer_0", 0, os.urandom(16 * 1024))
            t.put_meta(s, b"{}")
            if i != 1:
                t.release(s)                    # cap-1 stays leased: never dropped
            time.sleep(0.002)
        present = [i for i in range(8) if t.has_session(f"cap-{i}")]
        assert present == [1, 4, 5, 6, 7]      # 5 fit; the oldest unleased went first
        assert t.stats()["evicted_sessions"] == 3
        r = _master(cluster, "cap-7")
        k = SessionKeys("cap-7")
        ttl_index, ttl_chunk, ttl_meta = (r.pttl(k.files), r.pttl(k.chunk("layer_0", 3)), r.pttl(k.meta))
        assert 25_000 < ttl_index <= 30_000 and ttl_chunk >= ttl_index - 5 and ttl_meta <= ttl_index + 5
    with SharedTier(cluster.urls, node_id="ret", secret=SECRET, chunk_bytes=C,
                    retention_s=1.0) as t:
        t.acquire("ret")
        t.append("ret", "layer_0", 0, os.urandom(2 * C))
        t.put_meta("ret", b"{}")
        t.release("ret")
        assert t.has_session("ret")
        assert _eventually(lambda: not t.has_session("ret"), timeout=3)
        with pytest.raises(NotFoundShared):
            t.read("ret", "layer_0", 0, 1)


def test_bad_input_changes_nothing(cluster: Cluster, tier: SharedTier) -> None:
    tier.acquire("bi")
    tier.append("bi", "layer_0", 0, b"abc")
    for name in ("a{b", "a}b", "{x}", "a/b", "", ".", "..", "n\0", "x" * 256, 7):
        with pytest.raises(BadName):
            tier.append(name, "layer_0", 0, b"z")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            tier.append("bi", name, 3, b"z")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            tier.read(name, "layer_0", 0, 1)  # type: ignore[arg-type]
    for off in (-1, 1.5, True, None):
        with pytest.raises(BadRange):
            tier.append("bi", "layer_0", off, b"z")  # type: ignore[arg-type]
        with pytest.raises(BadRange):
            tier.read("bi", "layer_0", off, 1)  # type: ignore[arg-type]
    with pytest.raises(BadRange):
        tier.read("bi", "layer_0", 0, -1)
    with pytest.raises(BadRange):
        tier.append("bi", "layer_0", 3, "text")  # type: ignore[arg-type]
    for off in (0, 2, 4, 100):
        with pytest.raises(NotAppend, match="holds 3 bytes") as e:
            tier.append("bi", "layer_0", off, b"z")
        assert e.value.size == 3
    with pytest.raises(NotAppend):
        tier.append("bi", "new_file", 5, b"z")
    assert tier.list_files("bi") == {"layer_0": 3}
    assert tier.read("bi", "layer_0", 0, 10) == b"abc"
    r = _master(cluster, "bi")
    assert sorted(r.keys("kvfs:{bi}:*")) == sorted(
        k.encode() for k in ("kvfs:{bi}:files", "kvfs:{bi}:vers", "kvfs:{bi}:lease",
                             "kvfs:{bi}:holder", "kvfs:{bi}:layer_0:0"))


def test_threads_share_one_tier(tier: SharedTier) -> None:
    blobs = {f"th-{i}": os.urandom(5 * C + i) for i in range(6)}
    errors: list[BaseException] = []

    def work(s: str) -> None:
        try:
            tier.acquire(s)
            _fill(tier, s, "layer_0", blobs[s], [C // 2 + 1] * 10 + [len(blobs[s]) - 10 * (C // 2 + 1)])
            assert tier.read(s, "layer_0", 0, 1 << 20) == blobs[s]
            tier.sync(s)
            assert tier.delete_session(s) and tier.list_files(s) == {}
        except BaseException as e:
            errors.append(e)

    ths = [threading.Thread(target=work, args=(s,)) for s in blobs]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=30)
    assert not errors, errors


def test_content_versions(cluster: Cluster, tier: SharedTier) -> None:
    """A version is made with a file and by every cut, kept by appends and compactions,
    names its node, and a long read never mixes two versions."""
    tier.acquire("cv")
    tier.append("cv", "f", 0, b"a" * 100)
    v1 = tier.file_versions("cv")["f"][1]
    assert v1 is not None and tier.made_here(v1) and tier.take_version("cv", "f") == v1
    tier.append("cv", "f", 100, b"b" * 100)
    assert tier.file_versions("cv") == {"f": (200, v1)}  # appends keep it
    tier.truncate("cv", "f", 0)
    tier.append("cv", "f", 0, b"c" * 200)  # the same size again, another version
    v2 = tier.file_versions("cv")["f"][1]
    assert v2 not in (None, v1)
    other = SharedTier(cluster.urls, node_id="node-b", secret=SECRET, chunk_bytes=C,
                       timeout_s=0.5)
    try:
        assert not other.made_here(v2) and other.file_versions("cv")["f"][1] == v2
        assert other.open_session("cv") is None  # no meta: not visible, versions aside
    finally:
        other.close()
    tier.remove_file("cv", "f")
    tier.append("cv", "f", 0, b"d")
    assert tier.file_versions("cv")["f"][1] not in (None, v1, v2)  # made again: new

    big, new = os.urandom(20 * C), os.urandom(20 * C)  # more than one read batch
    tier.append("cv", "g", 0, big)
    real = tier._c.on_master
    done = []

    def rewrite_midway(key, what, commands, transaction):
        out = real(key, what, commands, transaction)
        if what.startswith("read") and not done:
            done.append(True)  # between the first and the second batch: rewritten
            tier._c.on_master = real
            tier.truncate("cv", "g", 0)
            tier.append("cv", "g", 0, new)
            tier._c.on_master = rewrite_midway
        return out

    tier._c.on_master = rewrite_midway
    try:
        data, version = tier.read_versioned("cv", "g", 0, 20 * C)
    finally:
        tier._c.on_master = real
    assert done and data == new and version == tier.file_versions("cv")["g"][1]


def test_cluster_lost(cluster: Cluster, tier: SharedTier) -> None:
    """Last: every node killed -9; calls fail fast and clearly (the fixture then cleans up)."""
    tier.acquire("gone")
    tier.append("gone", "layer_0", 0, b"x")
    for p in list(cluster.procs):
        if cluster.procs[p].poll() is None:
            cluster.kill(p)
    for call in (lambda: tier.read("gone", "layer_0", 0, 1), lambda: tier.size("gone", "layer_0"),
                 lambda: tier.append("gone", "layer_0", 1, b"y"), lambda: tier.sync("gone")):
        t0 = time.monotonic()
        with pytest.raises(SharedUnavailable):
            call()
        assert time.monotonic() - t0 < 2.5
    assert tier.healthy() is False


def _fill_from(t: SharedTier, session: str, data: bytes, start: int, end: int) -> None:
    pos = start
    while pos < end:
        pos = t.append(session, "layer_0", pos, data[pos:min(end, pos + 3 * C + 7)])


def _eventually(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


"""Two mounts on two volumes as two nodes sharing one real Redis Cluster (3 masters,
3 replicas, started and stopped here): node B reads what node A wrote after A is killed
-9, one writer per session (EBUSY, takeover after the lease), a master killed -9 loses no
fsync-acknowledged byte, a corrupt chunk is EIO (never served), the cluster lost mid-run (local work goes on; fsync EIO past the
queue bound; re-push once it is back), and a cluster unreachable at mount is refused."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Mount, run_mount

from kvfs.shared.chunks import SessionKeys
from kvfs.shared.local_cluster import Cluster, free_ports, secret_file
from kvfs.shared.tier import CHUNK_BYTES

# short leases and fsync waits keep the takeover and outage cases quick
FAST = ("-o", "shared_lease_s=2s", "-o", "shared_fsync_wait_s=1s")


@pytest.fixture
def node(make_mount: Callable[..., Mount], cluster: Cluster) -> Callable[..., Mount]:
    def make(name: str, *extra: str) -> Mount:
        return make_mount(name, extra=(*cluster.mount_args(), *FAST, *extra))
    return make


def write(path: Path, data: bytes, step: int = 300_000, fsync: bool = True) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for i in range(0, len(data), step):
            os.write(fd, data[i:i + step])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def stats(m: Mount) -> dict:
    return json.loads((m.root / ".kvfs" / "stats").read_text())


def open_for_write(path: Path, timeout: float) -> tuple[int, int]:
    """(fd, EBUSY answers before it opened): retries while another node holds the lease."""
    deadline, busy = time.monotonic() + timeout, 0
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_APPEND), busy
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            busy += 1
            time.sleep(0.1)


def test_node_b_reads_what_a_wrote_after_a_is_killed(node: Callable[..., Mount],
                                                     tmp_path: Path) -> None:
    a, b = node("a"), node("b")
    rng = random.Random(7)
    big = rng.randbytes(3 * CHUNK_BYTES + 12345)  # several cluster chunks
    small = rng.randbytes(1000)
    meta = json.dumps({"format": 1, "tokens": 42}).encode()
    s = a.sessions / "s1"
    s.mkdir()
    write(s / "layer_0", big)
    write(s / "layer_1", small)
    write(s / "meta.json", meta)
    held = os.open(s / "layer_1", os.O_WRONLY | os.O_APPEND)  # A still holds the lease
    shared = stats(a)["shared"]
    assert shared["pushed_bytes"] >= len(big) + len(small) and shared["queued_bytes"] == 0
    a.kill()  # kill -9 of node A's mount process
    with pytest.raises(OSError):  # ENOTCONN: its mount is gone
        os.close(held)

    sb = b.sessions / "s1"
    assert sorted(os.listdir(sb)) == ["layer_0", "layer_1", "meta.json"]
    assert os.stat(sb / "layer_0").st_size == len(big)
    (tmp_path / "want").write_bytes(big)
    r = subprocess.run(["cmp", str(sb / "layer_0"), str(tmp_path / "want")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (sb / "layer_1").read_bytes() == small and (sb / "meta.json").read_bytes() == meta
    st = stats(b)["shared"]
    assert st["hits"] >= 1 and st["fetched_bytes"] >= len(big)

    # A's lease outlives it by at most shared_lease_s: B gets EBUSY, then takes over
    fd, busy = open_for_write(sb / "layer_1", timeout=10)
    try:
        os.write(fd, b"more")
        os.fsync(fd)
    finally:
        os.close(fd)
    assert (sb / "layer_1").read_bytes() == small + b"more"
    assert stats(b)["shared"]["tier_lease_takeovers"] >= 1, busy
    metrics = (b.root / ".kvfs" / "metrics").read_text()
    assert "kv_shared_lease_takeovers_total 1.0" in metrics
    out = subprocess.run([sys.executable, "-m", "kvfs.cli.stat", str(b.root)],
                         capture_output=True, text=True, check=True).stdout
    assert "shared" in out and "takeovers 1" in out, out


def test_one_writer_per_session(node: Callable[..., Mount]) -> None:
    a, b = node("a"), node("b")
    (a.sessions / "s2").mkdir()
    write(a.sessions / "s2" / "layer_0", b"x" * 5000)
    write(a.sessions / "s2" / "meta.json", b"{}")
    fd = os.open(a.sessions / "s2" / "layer_0", os.O_WRONLY | os.O_APPEND)
    try:
        assert (b.sessions / "s2" / "layer_0").read_bytes() == b"x" * 5000  # reads are fine
        with pytest.raises(OSError) as e:
            os.open(b.sessions / "s2" / "layer_0", os.O_WRONLY | os.O_APPEND)
        assert e.value.errno == errno.EBUSY
        with pytest.raises(OSError) as e:
            os.open(b.sessions / "s2" / "layer_9", os.O_WRONLY | os.O_CREAT, 0o600)
        assert e.value.errno == errno.EBUSY
        assert "EBUSY" in b.log_text() and stats(a)["shared"]["node"] in b.log_text()
    finally:
        os.write(fd, b"y" * 10)
        os.fsync(fd)
        os.close(fd)
    # A's last writer closed: once pushed, the lease is handed back; B writes at once
    fd, _ = open_for_write(b.sessions / "s2" / "layer_0", timeout=5)
    try:
        os.write(fd, b"z")
        os.fsync(fd)
    finally:
        os.close(fd)
    assert (b.sessions / "s2" / "layer_0").read_bytes() == b"x" * 5000 + b"y" * 10 + b"z"
    assert stats(b)["shared"]["tier_lease_takeovers"] == 0  # a hand-over, not a takeover


def test_corrupt_chunk_is_eio_never_served(node: Callable[..., Mount], cluster: Cluster) -> None:
    a, b = node("a"), node("b")
    data = random.Random(9).randbytes(10_000)
    (a.sessions / "s5").mkdir()
    write(a.sessions / "s5" / "layer_0", data)
    write(a.sessions / "s5" / "meta.json", b"{}")
    key = SessionKeys("s5").chunk("layer_0", 0)
    with cluster.client(cluster.master_of_key(key)) as r:
        good = r.get(key)
        r.set(key, good[:-1] + bytes([good[-1] ^ 1]))  # one flipped bit in the payload
        with pytest.raises(OSError) as e:
            (b.sessions / "s5" / "layer_0").read_bytes()
        assert e.value.errno == errno.EIO
        assert stats(b)["shared"]["fetched_bytes"] == 0  # nothing of it kept locally
        r.set(key, good)
    assert (b.sessions / "s5" / "layer_0").read_bytes() == data
    assert stats(b)["fs"]["corrupt_reads"] >= 1 and stats(b)["shared"]["tier_corrupt"] >= 1


def test_master_killed_loses_no_fsynced_byte(node: Callable[..., Mount],
                                             cluster: Cluster) -> None:
    a, b = node("a", "-o", "shared_fsync_wait_s=20s"), node("b")  # fsync spans the failover
    rng = random.Random(3)
    first, second = rng.randbytes(CHUNK_BYTES + 777), rng.randbytes(200_000)
    s = a.sessions / "s3"
    s.mkdir()
    write(s / "layer_0", first)
    write(s / "meta.json", b'{"n": 1}')
    master = cluster.master_of_key(SessionKeys("s3").files)
    replica = cluster.replica_of(master)
    assert replica is not None
    cluster.kill(master)
    cluster.wait_promoted(replica)
    write(s / "layer_0", second)  # acknowledged by the promoted replica's shard
    assert stats(a)["shared"]["local_only_fsyncs"] == 0
    assert (b.sessions / "s3" / "layer_0").read_bytes() == first + second
    assert (b.sessions / "s3" / "meta.json").read_bytes() == b'{"n": 1}'
    cluster.restart(master)  # rejoins as a replica


def test_cluster_lost_mid_run(node: Callable[..., Mount], cluster: Cluster) -> None:
    """The whole cluster killed: A's local reads and writes go on; fsync acknowledges
    locally while the session's bytes fit the queue (1 MiB here), EIO past it; once the
    cluster is back the session is re-pushed from A's volume and B reads every byte."""
    a = node("a", "-o", "shared_queue_bytes=1M")
    rng = random.Random(5)
    parts = [rng.randbytes(n) for n in (300_000, 100_000, 2_000_000)]
    s = a.sessions / "s4"
    s.mkdir()
    write(s / "layer_0", parts[0])
    write(s / "meta.json", b'{"n": 4}')
    ports = list(cluster.procs)
    for p in ports:
        cluster.kill(p)
    t0 = time.monotonic()
    write(s / "layer_0", parts[1])  # within the bound: acknowledged locally
    assert time.monotonic() - t0 < 15
    assert stats(a)["shared"]["local_only_fsyncs"] >= 1
    with pytest.raises(OSError) as e:
        write(s / "layer_0", parts[2])  # past the bound: EIO, the bytes are stored locally
    assert e.value.errno == errno.EIO
    assert (s / "layer_0").read_bytes() == b"".join(parts)
    (a.sessions / "local").mkdir()
    write(a.sessions / "local" / "f", b"still works")
    assert (a.sessions / "local" / "f").read_bytes() == b"still works"

    for p in ports:  # the cluster comes back from its append-only files
        cluster._spawn(p)
    cluster.wait_ok(timeout=30)
    deadline = time.monotonic() + 15
    while stats(a)["shared"]["down"] is not None:  # the replicator looks every second
        assert time.monotonic() < deadline, stats(a)["shared"]
        time.sleep(0.2)
    write(s / "layer_0", b"!", fsync=True)  # re-pushed, then replicated: acknowledged
    b = node("b")
    assert (b.sessions / "s4" / "layer_0").read_bytes() == b"".join(parts) + b"!"


def test_unreachable_cluster_at_mount(tmp_path: Path, make_mount: Callable[..., Mount]) -> None:
    dead = f"redis://127.0.0.1:{free_ports(1)[0]}"
    vol, mnt = tmp_path / "r.kvfs", tmp_path / "r.mnt"
    mnt.mkdir()
    secret = secret_file(tmp_path / "secret")
    r = run_mount(str(vol), str(mnt), "--size", "64M", "--shared", dead, "-o",
                  f"shared_secret_file={secret}")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0] and "--shared-optional" in lines[0], r.stderr
    assert not os.path.ismount(mnt) and not vol.exists()
    m = make_mount("opt", extra=("--shared", dead, "--shared-optional", "-o",
                                 f"shared_secret_file={secret}"))
    (m.sessions / "x").mkdir()
    write(m.sessions / "x" / "f", b"local only")
    assert (m.sessions / "x" / "f").read_bytes() == b"local only"
    assert "running local-only" in m.log_text() and stats(m)["shared"] is None

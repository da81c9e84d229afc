"""What the shared tier may be trusted with, through real mounts on one real Redis Cluster
(3 masters + 3 replicas, an ACL user with a password; a second one over TLS):

- ownership travels with the session: another uid reads nothing of a session through any
  node, cannot append to it or remove it there, and files a node makes by itself (the
  refresh of a session written elsewhere) belong to the session's owner, not to root;
- a chunk or lease value not sealed with the cluster's secret is detected: a forged or
  moved chunk reads as EIO, a forged or replayed lease is reported and replaced instead of
  obeyed for the hour its forger asked;
- the password shows nowhere: not in ps, the log, /.kvfs/stats or /.kvfs/metrics;
- a name the cluster cannot hold is refused when it is made (EINVAL);
- /.kvfs/stats shows no paths or session names to other users;
- over TLS (with values encrypted) an agent's session moves to another node and continues
  token-identically.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvfs.mount_runner import HAVE_FUSE, As, Mount, run_mount
from kvfs.shared.chunks import Codec, SessionKeys
from kvfs.shared.local_cluster import HAVE_REDIS, Cluster
from kvfs.shared.seal import Sealer

PASSWORD = "kv-Pa55word-for-tests"
FAST = ("-o", "shared_lease_s=3s", "-o", "shared_fsync_wait_s=2s")
ALICE, BOB = 5101, 5102

pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(not HAVE_REDIS, reason="redis-server/redis-cli not installed"),
    pytest.mark.skipif(not HAVE_FUSE or os.geteuid() != 0 or not shutil.which("setpriv"),
                       reason="needs /dev/fuse, root and setpriv"),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(masters=3, replicas=1, node_timeout_ms=1000, password=PASSWORD) as c:
        yield c


@pytest.fixture
def node(cluster: Cluster, other_users_dir: Path) -> Iterator[Callable[..., Mount]]:
    mounts: list[Mount] = []

    def make(name: str, *extra: str, c: Cluster = cluster, args: list[str] | None = None) -> Mount:
        m = Mount(other_users_dir / f"{name}.kvfs", other_users_dir / f"{name}.mnt", "64M",
                  (*(args or c.mount_args()), "--allow-other", *FAST, *extra))
        mounts.append(m)
        return m.start()

    yield make
    for m in mounts:
        if m.proc is not None:
            assert m.stop() == 0, m.log_text()


def write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def stats(m: Mount) -> dict:
    return json.loads((m.root / ".kvfs" / "stats").read_text())


def test_another_user_reads_nothing_through_any_node(node: Callable[..., Mount]) -> None:
    a, b, c = node("a"), node("b"), node("c")
    from kvfs.warm import mount_info

    assert mount_info(str(a.root))["shared"] is not None  # what tells an agent to take leases
    alice, bob = As(ALICE), As(BOB)
    try:
        s_a, s_b = f"{a.sessions}/al", f"{b.sessions}/al"
        assert alice(f"os.mkdir({s_a!r}, 0o700)") == "None"
        for name, data in (("layer_0", b"A" * 5000), ("meta.json", b'{"tokens": 1}')):
            f = f"{s_a}/{name}"
            assert alice(f"fds.update(w=os.open({f!r}, os.O_WRONLY | os.O_CREAT, 0o600))") == "None"
            assert alice(f"os.write(fds['w'], {data!r})") == str(len(data))
            assert alice("os.fsync(fds['w'])") == "None"
            assert alice("os.close(fds['w'])") == "None"
        # bob is the first to name it on B, and gets there what he gets on A: node B made
        # its copy from the cluster as alice's, 0700, not as his
        for s in (s_b, s_a):
            assert bob(f"os.open({s + '/layer_0'!r}, os.O_RDONLY)") == f"errno {errno.EACCES}"
            assert bob(f"os.listdir({s!r})") == f"errno {errno.EACCES}"
            assert bob(f"os.open({s + '/layer_0'!r}, os.O_WRONLY | os.O_APPEND)") \
                == f"errno {errno.EACCES}"
            assert bob(f"os.rmdir({s!r})") in (f"errno {errno.EACCES}", f"errno {errno.EPERM}")
        st = os.stat(s_b)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (ALICE, ALICE, 0o700)
        assert alice(f"os.pread(os.open({s_b + '/layer_0'!r}, os.O_RDONLY), 6000, 0)") \
            == repr(b"A" * 5000)
        for f in ("layer_0", "meta.json"):
            assert os.stat(f"{s_b}/{f}").st_uid == ALICE
        # a file alice makes on A later is made on B by the refresh: hers, not root's
        f = f"{s_a}/layer_1"
        assert alice(f"fds.update(w=os.open({f!r}, os.O_WRONLY | os.O_CREAT, 0o600))") == "None"
        assert alice("os.write(fds['w'], b'more')") == "4"
        assert alice("os.fsync(fds['w'])") == "None"
        assert alice("os.close(fds['w'])") == "None"
        time.sleep(1.1)  # a session read here but written elsewhere is checked once a second
        assert "layer_1" in os.listdir(s_b)
        assert os.stat(f"{s_b}/layer_1").st_uid == ALICE
        assert bob(f"os.open({s_b + '/layer_1'!r}, os.O_RDONLY)") == f"errno {errno.EACCES}"
        # bob removed nothing anywhere: node C still reads all of it
        assert (c.sessions / "al" / "layer_0").read_bytes() == b"A" * 5000
        assert os.stat(c.sessions / "al").st_uid == ALICE
    finally:
        alice.close()
        bob.close()


def test_forged_chunk_and_lease_are_detected(node: Callable[..., Mount], cluster: Cluster) -> None:
    a, b = node("a"), node("b")
    for s in ("fg", "other"):
        (a.sessions / s).mkdir()
        write(a.sessions / s / "layer_0", os.urandom(10_000))
        write(a.sessions / s / "meta.json", b"{}")
    k, o = SessionKeys("fg"), SessionKeys("other")
    stranger = Codec(Sealer.from_secret(b"not this cluster's secret, 32+ bytes"))
    with cluster.client(cluster.master_of_key(k.files)) as r:
        good = r.get(k.chunk("layer_0", 0))
        forged = (stranger.encode_piece("fg", "layer_0", 0, b"X" * 10_000),  # another secret
                  good[:-1] + bytes([good[-1] ^ 1]))                        # one flipped bit
        for value in forged:
            r.set(k.chunk("layer_0", 0), value, keepttl=True)
            with pytest.raises(OSError) as e:
                (b.sessions / "fg" / "layer_0").read_bytes()
            assert e.value.errno == errno.EIO
    with cluster.client(cluster.master_of_key(o.files)) as r2:
        moved = r2.get(o.chunk("layer_0", 0))  # a genuine piece, of another session
    with cluster.client(cluster.master_of_key(k.files)) as r:
        r.set(k.chunk("layer_0", 0), moved, keepttl=True)
        with pytest.raises(OSError) as e:
            (b.sessions / "fg" / "layer_0").read_bytes()
        assert e.value.errno == errno.EIO
        r.set(k.chunk("layer_0", 0), good, keepttl=True)
    assert len((b.sessions / "fg" / "layer_0").read_bytes()) == 10_000
    assert stats(b)["shared"]["tier_corrupt"] >= 3

    # a lease nobody sealed, set for an hour: reported and replaced, not obeyed
    lk = SessionKeys("fl").lease
    with cluster.client(cluster.master_of_key(lk)) as r:
        r.set(lk, "node-of-nobody|15000|" + "0" * 32, px=3_600_000)
    (a.sessions / "fl").mkdir()
    write(a.sessions / "fl" / "layer_0", b"mine")
    write(a.sessions / "fl" / "meta.json", b"{}")
    assert stats(a)["shared"]["tier_forged_leases"] >= 1
    assert "not set by a kvfs node" in a.log_text()
    out = subprocess.run([sys.executable, "-m", "kvfs.cli.stat", str(a.root)],
                         capture_output=True, text=True, check=True).stdout
    assert "forged leases 1" in out, out
    # a genuine lease value replayed with a long life: the same
    with cluster.client(cluster.master_of_key(lk)) as r:
        deadline = time.monotonic() + 10
        while (value := r.get(lk)) is not None:  # A hands the lease back after its close
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r.set(lk, Sealer.from_secret(cluster.secret).lease("fl", stats(a)["shared"]["node"],
                                                            3000), px=3_600_000)
    before = stats(b)["shared"]["tier_forged_leases"]
    write(b.sessions / "fl" / "layer_0", b"theirs")  # not EBUSY for an hour
    assert stats(b)["shared"]["tier_forged_leases"] == before + 1
    assert (b.sessions / "fl" / "layer_0").read_bytes() == b"mine" + b"theirs"


def test_password_shows_nowhere(node: Callable[..., Mount], cluster: Cluster) -> None:
    url = cluster.urls.replace(f"{cluster.user}@", f"{cluster.user}:{PASSWORD}@")
    args = cluster.mount_args(url=url)
    i = args.index(next(x for x in args if x.startswith("shared_password_file=")))
    del args[i - 1:i + 1]  # the password in the URL only: the worst case
    m = node("pw", args=args)
    (m.sessions / "s").mkdir()
    write(m.sessions / "s" / "layer_0", b"x" * 100)
    cmdline = Path(f"/proc/{m.proc.pid}/cmdline").read_bytes()
    assert PASSWORD.encode() not in cmdline and b":***@" in cmdline
    for text in (m.log_text(), (m.root / ".kvfs" / "stats").read_text(),
                 (m.root / ".kvfs" / "metrics").read_text()):
        assert PASSWORD not in text
    # a wrong password is refused in one line that does not echo it either
    bad = cluster.urls.replace(f"{cluster.user}@", f"{cluster.user}:wrong-{PASSWORD}@")
    vol, mnt = m.volume.parent / "bad.kvfs", m.volume.parent / "bad.mnt"
    mnt.mkdir()
    r = run_mount(str(vol), str(mnt), "--size", "64M", "--shared", bad, "-o",
                  f"shared_secret_file={cluster.secret_path}")
    assert r.returncode != 0 and PASSWORD not in r.stderr and "unreachable" in r.stderr, r.stderr
    assert not vol.exists()


def test_no_secret_no_mount(cluster: Cluster, other_users_dir: Path) -> None:
    place = other_users_dir
    vol, mnt = place / "ns.kvfs", place / "ns.mnt"
    mnt.mkdir()
    r = run_mount(str(vol), str(mnt), "--size", "64M", "--shared", cluster.urls)
    assert r.returncode != 0 and "shared_secret_file" in r.stderr and not vol.exists(), r.stderr
    loose = place / "loose-secret"
    loose.write_bytes(os.urandom(48))
    os.chmod(loose, 0o644)
    r = run_mount(str(vol), str(mnt), "--size", "64M", "--shared", cluster.urls, "-o",
                  f"shared_secret_file={loose}")
    assert r.returncode != 0 and "0600" in r.stderr and not vol.exists(), r.stderr


def test_names_the_cluster_cannot_hold_are_refused(node: Callable[..., Mount]) -> None:
    a = node("a")
    for name in ("{x}", "a}b", "a{b"):
        with pytest.raises(OSError) as e:
            (a.sessions / name).mkdir()
        assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:
        os.mkdir(os.fsencode(a.sessions) + b"/\xff\xfe")
    assert e.value.errno == errno.EINVAL
    (a.sessions / "ok").mkdir()
    with pytest.raises(OSError) as e:
        write(a.sessions / "ok" / "layer_{1}", b"x")
    assert e.value.errno == errno.EINVAL
    assert os.listdir(a.sessions / "ok") == [] and "cannot replicate" in a.log_text()


def test_stats_show_no_names_to_other_users(node: Callable[..., Mount]) -> None:
    a = node("a")
    bob = As(BOB)
    try:
        mine = stats(a)
        assert mine["store"]["volume"]["path"] == str(a.volume)
        theirs = json.loads(eval(bob(f"open({str(a.root / '.kvfs' / 'stats')!r}).read()")))
        assert theirs["store"]["volume"]["path"] is None
        assert isinstance(theirs["shared"]["sessions_lost"], int)
        assert theirs["profile"]["name"] == mine["profile"]["name"]  # agents still read it
        assert str(a.volume) not in json.dumps(theirs)
    finally:
        bob.close()


# ---------------------------------------------------------------- TLS, values encrypted
@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[Cluster]:
    with Cluster(masters=3, replicas=1, node_timeout_ms=1000, password=PASSWORD, tls=True) as c:
        yield c


def test_session_moves_across_nodes_over_tls(node: Callable[..., Mount], tls_cluster: Cluster,
                                             tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from kvfs.torch import KVRouter, TieredCache
    from kvfs.torch.reference import generate_turns, profile_rope, prompt, tiny_llama

    a = node("ta", "-o", "shared_encrypt=true", c=tls_cluster)
    b = node("tb", "-o", "shared_encrypt=true", c=tls_cluster)
    turns = [prompt(40 + i, 6) for i in range(4)]
    model = tiny_llama(seed=5)
    ref = generate_turns(model, TieredCache(model, max_kv_len=8, **profile_rope()), turns, 4)
    ra = KVRouter(mount=str(a.root), retrieval=False, warm_root=str(tmp_path / "wa"), max_kv_len=8,
                  warm_options={"shards": 16})
    try:
        outs = generate_turns(model, ra.cache("tls-1", model), turns[:2], 4)
        ra.flush()
    finally:
        ra.close()
    assert all(torch.equal(o, r) for o, r in zip(outs, ref[:2], strict=True))
    # the cluster holds ciphertext: no 64-byte run of the layer file is in any value
    layer = (a.sessions / "tls-1" / "layer_0").read_bytes()
    k = SessionKeys("tls-1")
    with tls_cluster.client(tls_cluster.master_of_key(k.files)) as r:
        stored = r.get(k.chunk("layer_0", 0))
    assert stored and layer[:64] not in stored and layer[-64:] not in stored
    rb = KVRouter(mount=str(b.root), retrieval=False, warm_root=str(tmp_path / "wb"), max_kv_len=8,
                  warm_options={"shards": 16})
    try:
        c = rb.resume("tls-1", model)
        ids = torch.cat([x for t, o in zip(turns[:2], outs, strict=True) for x in (t, o)], 1)
        for t, want in zip(turns[2:], ref[2:], strict=True):
            ids = torch.cat([ids, t], 1)
            full = model.generate(ids, attention_mask=torch.ones_like(ids), cache=c,
                                  max_new_tokens=4, do_sample=False)
            assert torch.equal(full[:, ids.shape[1]:], want)
            ids = full
            c.end_round()
        rb.flush()
    finally:
        rb.close()
    assert stats(b)["shared"]["tier_lease_takeovers"] == 0

"""The native channel against a hostile local user: real mounts, real sockets, crafted
frames, most of them sent from an unprivileged uid.

Each case was a reproduction: a header announcing 1 GiB made the mount allocate 1 GiB
before it looked at who sent it; a STAT naming one 1 MiB file 1,000 times built a 1 GB
reply and ran the mount out of memory, marking the volume needs-fsck; 64 idle connections
of one user locked the owner out; a guessable socket name let any user keep the mount
from serving; an append crossing the quota stored part of itself and answered "nothing";
a refused EXTENTS request updated atime. Now each limit answers a clear errno, changes
nothing, and the mount stays up (docs/reliability.md, "The native channel's limits")."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfs.channel import Channel, Item
from kvfs.channel import protocol as P
from kvfs.channel.client import channel_of
from kvfs.engine.store import Store
from kvfs.fuse import admission
from kvfs.fuse import channel as server
from kvfs.mount_runner import HAVE_FUSE, As, Mount, run_as

ROOTLY = HAVE_FUSE and os.geteuid() == 0 and shutil.which("setpriv") is not None
pytestmark = pytest.mark.skipif(not ROOTLY, reason="needs /dev/fuse, root and setpriv")
ALICE, BOB = 4311, 4312
MB = 1 << 20

# Run as another uid (``run_as``): raw frames on the mount's socket. ``ask`` sends one
# frame and returns (errno, body length) of the reply, or None when the mount closed the
# connection without one.
RAW = r"""
import socket, struct, time
REQ, REP = struct.Struct("<IB"), struct.Struct("<Ii")

def conn(name):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + name)
    s.settimeout(10)
    return s

def recv_all(s, n):
    b = b""
    while len(b) < n:
        k = s.recv(n - len(b))
        if not k:
            return None
        b += k
    return b

def reply(s):
    h = recv_all(s, REP.size)
    if h is None:
        return None
    n, code = REP.unpack(h)
    recv_all(s, n)
    return code, n

def ask(name, op, body, announce=None):
    s = conn(name)
    try:
        s.sendall(REQ.pack(len(body) if announce is None else announce, op) + body)
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        return reply(s)
    except ConnectionResetError:
        return None
    finally:
        s.close()
"""


def socket_name(m: Mount) -> str:
    info = channel_of(str(m.mountpoint))
    assert info is not None, m.log_text()
    return info["socket"].removeprefix("@")


def stats(m: Mount) -> dict:
    return json.loads((m.root / ".kvfs" / "stats").read_bytes())


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def frame(op: int, body: bytes) -> bytes:
    return P.REQ.pack(len(body), op) + body


def ask(name: str, data: bytes) -> tuple[int, bytes] | None:
    """One request as root (the owner): (errno, body) or None when closed unanswered."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect("\0" + name)
        s.settimeout(15)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)  # a body announced longer than sent ends here
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            head = P.recv_exact(s, P.REP.size)
        except (ConnectionError, OSError):
            return None
        n, code = P.REP.unpack(head)
        return code, bytes(P.recv_exact(s, n)) if n else b""


@pytest.fixture
def open_mount(other_users_dir: Path):
    """A ``--allow-other`` mount whose volume other users may read (so they get the
    channel), with ``extra`` options; unmounted (exit 0) after."""
    mounts: list[Mount] = []

    def make(*extra: str, name: str = "vol") -> Mount:
        m = Mount(other_users_dir / f"{name}.kvfs", other_users_dir / f"{name}.mnt", "64M",
                  ("--allow-other", *extra)).start()
        os.chmod(m.volume, 0o644)
        mounts.append(m)
        return m

    yield make
    for m in mounts:
        if m.proc is not None:
            assert m.stop() == 0, m.log_text()


# ---------------------------------------------------------------------- sizes, peers
def test_an_announced_body_is_checked_and_its_peer_known_before_any_allocation(make_mount,
                                                                                open_mount):
    private = make_mount("private")  # no --allow-other: only root's requests are served
    name = socket_name(private)
    before = rss(private.proc.pid)
    out = run_as(ALICE, RAW + f"""
print([ask({name!r}, {P.WRITE}, b"", announce=1 << 30) for _ in range(3)])
""")
    assert out == repr([(errno.EACCES, 0)] * 3)  # turned away before its body is read
    assert rss(private.proc.pid) - before < 64 * MB

    m = open_mount()
    name = socket_name(m)
    before = rss(m.proc.pid)
    out = run_as(ALICE, RAW + f"""
held = []
for _ in range(8):  # bodies announced at the limit, never sent: nothing is allocated
    s = conn({name!r})
    s.sendall(REQ.pack({P.BODY_MAX[P.WRITE]}, {P.WRITE}))
    held.append(s)
time.sleep(1.0)
print(ask({name!r}, {P.WRITE}, b"", announce={P.BODY_MAX[P.WRITE] + 1}),
      ask({name!r}, {P.STAT}, b"", announce=1 << 30), ask({name!r}, 99, b"x" * 10))
""")
    assert out == f"({errno.EMSGSIZE}, 0) ({errno.EMSGSIZE}, 0) ({errno.EPROTO}, 0)"
    assert rss(m.proc.pid) - before < 64 * MB, "announced bodies were allocated"
    assert stats(m)["needs_fsck"] is False


# ---------------------------------------------------------------------- names, repetitions
def test_stat_and_extents_bound_names_repetitions_and_replies(kvfs):
    s = kvfs.sessions / "big"
    s.mkdir()
    for i in range(24):
        (s / f"small_{i:02d}").write_bytes(bytes([i]) * MB)
    name = socket_name(kvfs)
    again = P.stat_request("big", ["small_00"] * 1000)  # one 1 MiB file named 1,000 times
    assert ask(name, frame(P.STAT, again)) == (errno.EINVAL, b"")
    ext = P.extents_request("big", [("small_00", 0, -1)] * 2)
    assert ask(name, frame(P.EXTENTS, ext)) == (errno.EINVAL, b"")
    many = [f"f{i}" for i in range(P.NAMES_MAX + 1)]
    assert ask(name, frame(P.STAT, P.stat_request("big", many))) == (errno.EINVAL, b"")
    assert ask(name, frame(P.EXTENTS, P.extents_request(
        "big", [(n, 0, -1) for n in many]))) == (errno.EINVAL, b"")
    # every distinct small file asked for: the reply carries at most SMALL_TOTAL of them
    names = [f"small_{i:02d}" for i in range(24)]
    code, body = ask(name, frame(P.STAT, P.stat_request("big", names)))
    assert code == 0 and len(body) < P.SMALL_TOTAL + 64 * 1024
    info = P.parse_stat_reply(memoryview(body), names)
    got = [n for n in names if info.small[n] is not None]
    assert len(got) == P.SMALL_TOTAL // MB and info.small["small_03"] == b"\3" * MB
    # the client keeps under the limits itself (names once, lists cut) and gets it all
    ch = Channel.open(str(kvfs.mountpoint))
    assert ch is not None
    try:
        assert ch.stat("big", ["small_00"] * 3).small["small_00"] == b"\0" * MB
        _, fes = ch.extents("big", [(f"n{i}", 0, -1) for i in range(P.NAMES_MAX + 5)] +
                            [("small_05", 0, -1)])
        assert fes[-1] is not None and fes[-1].size == MB
    finally:
        ch.close()
    st_ = stats(kvfs)
    assert st_["needs_fsck"] is False and st_["store"]["volume"]["needs_fsck"] is False
    assert st_["fs"]["channel"]["errors"] == 0


def test_needs_fsck_is_the_stores_mark_in_stats_and_kvfs_stat(make_mount):
    m = make_mount(start=False)
    m.size = None
    s = Store.create(str(m.volume), 64 * MB)
    s.create_session("s", uid=0)
    s.create_file("s", "f")
    s.append("s", "f", 0, os.urandom(4096))
    s.close()
    s = Store.open(str(m.volume), readonly=True)
    off = s.ring.phys(s._file("s", "f")[1].ext[0][0]) + 100  # inside the payload
    s.crash()
    fd = os.open(m.volume, os.O_RDWR)
    # flipped, not overwritten: a constant byte equals the random one it replaces 1 time in 256
    os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0xFF]), off)
    os.close(fd)
    m.start()
    with pytest.raises(OSError) as e:
        (m.sessions / "s" / "f").read_bytes()
    assert e.value.errno == errno.EIO
    doc = stats(m)
    assert doc["store"]["volume"]["needs_fsck"] is True
    assert doc["needs_fsck"] is True  # the top level says what the store says
    out = subprocess.run([sys.executable, "-m", "kvfs.cli.stat", str(m.mountpoint), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)["summary"]["needs_fsck"] is True, out.stderr
    out = subprocess.run([sys.executable, "-m", "kvfs.cli.stat", str(m.mountpoint)],
                         capture_output=True, text=True, timeout=60)
    assert "NEEDS FSCK" in out.stdout, out.stdout + out.stderr
    m.stop()
    m.proc = None  # a marked volume is refused until fsck: nothing to unmount after


# ---------------------------------------------------------------------- the socket's name
def test_a_squatted_name_cannot_keep_the_mount_from_serving(other_users_dir: Path):
    vol, mnt = other_users_dir / "sq.kvfs", other_users_dir / "sq.mnt"
    Store.create(str(vol), 64 * MB).close()
    uuid = Store.open(str(vol), readonly=True)
    vid = uuid.volume_id
    uuid.crash()
    # the old name was kvfs-<uuid>-<pid>: a user takes it for every pid coming next
    with open("/proc/sys/kernel/ns_last_pid") as f:
        last = int(f.read())
    squatter = As(ALICE)
    try:
        took = squatter(f"[fds.setdefault(p, __import__('socket').socket(1, 1)).bind('\\0kvfs-{vid}-' + str(p)) "
                        f"for p in range({last + 1}, {last + 600})] and len(fds)")
        assert took == "599"
        m = Mount(vol, mnt, None).start()
        try:
            name = socket_name(m)
            assert name != f"kvfs-{vid}-{m.proc.pid}"
            ch = Channel.open(str(mnt))
            assert ch is not None, m.log_text()
            ch.close()
        finally:
            assert m.stop() == 0, m.log_text()
    finally:
        squatter.close()


def test_a_mount_that_cannot_serve_its_channel_refuses_with_one_line(tmp_path, monkeypatch):
    from kvfs.fuse import mount as mount_mod

    vol, mnt = tmp_path / "v.kvfs", tmp_path / "mnt"
    mnt.mkdir()
    Store.create(str(vol), 64 * MB).close()
    s = Store.open(str(vol), readonly=True)
    vid = s.volume_id
    s.crash()
    monkeypatch.setattr(server.secrets, "token_hex", lambda n: "taken")
    squatter = As(ALICE)  # a user holds the one name this mount will try
    try:
        assert squatter(f"fds.setdefault(0, __import__('socket').socket(1, 1)).bind('\\0kvfs-{vid}-taken')") == "None"
        err = io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        rc = mount_mod.main([str(vol), str(mnt), "--foreground"])
    finally:
        squatter.close()
    assert rc == 1
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and "cannot serve the native channel" in lines[0], err.getvalue()
    assert not os.path.ismount(mnt)
    Store.open(str(vol)).close()  # closed cleanly: opens unmarked, unlocked


# ---------------------------------------------------------------------- connections
HOLD = r"""
import select, socket, struct, sys, time
held = []
for _ in range(64):  # as many connections as the mount serves, all idle
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + sys.argv[1])
    held.append(s)
time.sleep(0.5)
ready = select.select(held, [], [], 0)[0]  # turned away: an EUSERS answer waits there
codes = [struct.unpack("<Ii", s.recv(8))[1] for s in ready] if ready else []
print(len(held) - len(ready), sorted(set(codes)), flush=True)
sys.stdin.readline()
admitted = [s for s in held if s not in ready]
print(sum(1 for s in admitted if s.recv(1) == b""), flush=True)  # closed by the mount
"""


def _holders(name: str, n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["setpriv", f"--reuid={ALICE + 10 + k}", f"--regid={ALICE + 10 + k}",
                              "--clear-groups", sys.executable, "-c", HOLD, name],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for k in range(n)]


def _release(users: list[subprocess.Popen]) -> None:
    for u in users:
        u.kill()
        u.wait(timeout=10)


def test_one_user_cannot_fill_the_channel_and_the_owner_keeps_slots(open_mount):
    m = open_mount()
    users = _holders(socket_name(m), 5)
    try:
        got = [u.stdout.readline().split(maxsplit=1) for u in users]
        admitted = [int(n) for n, _ in got]
        assert max(admitted) == admission.PER_UID, got  # five users at once: each at most its share
        assert sum(admitted) == admission.MAX_CLIENTS - admission.OWNER_SLOTS, got  # the owner's stay free
        assert {x.strip() for _, x in got} == {f"[{errno.EUSERS}]"}, got
        ch = Channel.open(str(m.mountpoint))  # the owner still gets in, reads and writes
        assert ch is not None, m.log_text()
        try:
            (m.sessions / "own").mkdir()
            assert ch.write("own", [Item(P.APPEND, "layer_0", 0, b"x" * 100)], sync=True) == [100]
            buf = bytearray(100)
            ch.read("own", [("layer_0", 0, memoryview(buf))])
            assert bytes(buf) == b"x" * 100
        finally:
            ch.close()
    finally:
        _release(users)


def test_idle_connections_are_closed_and_clients_connect_again(open_mount):
    m = open_mount("-o", "channel_idle_s=2s")
    users = _holders(socket_name(m), 1)
    try:
        (n, _), = [u.stdout.readline().split(maxsplit=1) for u in users]
        ch = Channel.open(str(m.mountpoint))
        assert ch is not None, m.log_text()
        try:
            (m.sessions / "own").mkdir()
            assert ch.write("own", [Item(P.APPEND, "layer_0", 0, b"x" * 100)], sync=True) == [100]
            time.sleep(2.5)  # past the idle timeout: the mount closed every idle one, ours too
            assert stats(m)["fs"]["channel"]["idle_closed"] >= int(n)
            buf = bytearray(100)  # the client notices and connects again
            ch.read("own", [("layer_0", 0, memoryview(buf))])
            assert bytes(buf) == b"x" * 100
        finally:
            ch.close()
        users[0].stdin.write("\n")
        users[0].stdin.flush()
        assert int(users[0].stdout.readline()) == int(n) == admission.PER_UID
    finally:
        _release(users)


def test_a_client_at_its_users_limit_waits_for_its_own_connections(open_mount):
    m = open_mount()
    (m.sessions / "pub").mkdir(mode=0o755)
    (m.sessions / "pub").chmod(0o755)
    (m.sessions / "pub" / "layer_0").write_bytes(b"p" * 4096)
    (m.sessions / "pub" / "layer_0").chmod(0o644)
    out = run_as(ALICE, f"""
        import socket, threading
        from kvfs.channel import Channel
        from kvfs.fuse.admission import PER_UID
        held = []
        for _ in range(PER_UID - 1):  # all but one of this user's connections, idle
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\\0" + {socket_name(m)!r})
            held.append(s)
        ch = Channel.open({str(m.mountpoint)!r})  # takes the last one
        errors, done = [], []

        def reads():
            try:
                for _ in range(20):
                    buf = bytearray(4096)
                    ch.extents("pub", [("layer_0", 0, -1)])  # a request each time
                    ch.read("pub", [("layer_0", 0, memoryview(buf))])
                    done.append(bytes(buf) == b"p" * 4096)
            except OSError as e:
                errors.append(e.errno)

        ts = [threading.Thread(target=reads) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        print(len(done), all(done), errors)
    """)
    assert out == "80 True []"
    assert stats(m)["fs"]["channel"]["refused"] >= 1  # its second connection was turned away


# ---------------------------------------------------------------------- quota
def test_an_append_crossing_the_quota_stores_nothing_and_says_so(open_mount):
    m = open_mount("-o", "quota_bytes=4M")
    out = run_as(ALICE, f"""
        import errno, os
        from kvfs.channel import Channel, Item
        mnt = {str(m.mountpoint)!r}
        p = os.path.join(mnt, "sessions", "q")
        os.mkdir(p)
        ch = Channel.open(mnt)
        base = 4 * 2**20 - 300 * 1024  # 300 KiB under the quota
        print(ch.write("q", [Item(1, "layer_0", 0, b"a" * base)], sync=True))
        print(os.stat(os.path.join(p, "layer_0")).st_size)  # the kernel caches this size
        for _ in range(2):  # the retry gets the same answer
            try:
                ch.write("q", [Item(1, "layer_0", base, b"b" * 2**21)], sync=True)
            except OSError as e:
                print(e.errno, getattr(e, "size", "?"))
        print(os.stat(os.path.join(p, "layer_0")).st_size)
        print(ch.write("q", [Item(1, "layer_0", base, b"c" * 1000)], sync=True))
        ch.close()
    """)
    base = 4 * MB - 300 * 1024
    assert out.split("\n") == [f"[{base}]", str(base), f"{errno.EDQUOT} {base}",
                               f"{errno.EDQUOT} {base}", str(base), f"[{base + 1000}]"]
    assert (m.sessions / "q" / "layer_0").stat().st_size == base + 1000


# ---------------------------------------------------------------------- refusals, trailing bytes
def test_refusals_change_nothing_and_trailing_bytes_are_malformed(open_mount):
    m = open_mount()
    alice = As(ALICE)
    try:
        sess = str(m.sessions / "mine")
        assert alice(f"os.mkdir({sess!r})") == "None"  # 0700: bob may not search it
        assert alice(f"open({sess + '/layer_0'!r}, 'wb').write(b'A' * 100)") == "100"
    finally:
        alice.close()
    name = socket_name(m)
    f = m.sessions / "mine" / "layer_0"
    time.sleep(1.2)  # past the attribute timeout
    before = (os.stat(f).st_atime_ns, os.stat(m.sessions / "mine").st_atime_ns)
    time.sleep(0.05)
    ext = P.extents_request("mine", [("layer_0", 0, -1)])
    out = run_as(BOB, RAW + f"print(ask({name!r}, {P.EXTENTS}, {ext!r}), "
                            f"ask({name!r}, {P.STAT}, {P.stat_request('mine', [])!r}))")
    assert out == f"({errno.EACCES}, 0) ({errno.EACCES}, 0)"
    time.sleep(1.2)
    assert (os.stat(f).st_atime_ns, os.stat(m.sessions / "mine").st_atime_ns) == before
    # a frame with bytes past its last field is malformed: EPROTO, the connection closed
    for op, body in ((P.STAT, P.stat_request("mine", []) + b"x"),
                     (P.EXTENTS, ext + b"\0"),
                     (P.WRITE, P.write_request("mine", 0, [])[0] + b"x")):
        assert ask(name, frame(op, body)) == (errno.EPROTO, b""), op
    # a hello is 4 bytes: a longer one is over its size, refused before it is read
    assert ask(name, frame(P.HELLO, struct.pack("<I", P.VERSION) + b"x")) == (errno.EMSGSIZE, b"")
    assert ask(name, frame(P.STAT, P.stat_request("mine", [])))[0] == 0
    assert stats(m)["needs_fsck"] is False


# ---------------------------------------------------------------------- the fuzzer
NAMES = st.sampled_from(["layer_0", "layer_1", "meta.json", "nope", "", ".", "..", "a/b",
                         "x" * 256, "\udcff"])
SESSIONS = st.sampled_from(["fz", "none", "", "fz/..", "y" * 300])
u16 = st.integers(0, 0xFFFF)


def _name(s: str) -> bytes:
    b = s.encode("utf-8", "surrogateescape")
    return struct.pack("<H", len(b)) + b


@st.composite
def bodies(draw) -> tuple[int, bytes]:
    """A frame's (operation, body): well formed ones of every operation, then cut, grown,
    their counts lied about or their bytes flipped; and plain noise."""
    op = draw(st.sampled_from([P.HELLO, P.STAT, P.EXTENTS, P.WRITE, P.SYNC, 0, 6, 255]))
    sess = draw(SESSIONS)
    if op == P.HELLO:
        body = struct.pack("<I", draw(st.sampled_from([P.VERSION, 0, 2, 0xFFFFFFFF])))
    elif op == P.STAT:
        names = draw(st.lists(NAMES, max_size=6))
        body = P.stat_request(sess, []) [:-2] + struct.pack("<H", draw(st.sampled_from(
            [len(names), draw(u16)]))) + b"".join(_name(n) for n in names)
    elif op == P.EXTENTS:
        files = draw(st.lists(st.tuples(NAMES, st.integers(0, 2**64 - 1),
                                        st.integers(-(2**63), 2**63 - 1)), max_size=5))
        body = _name(sess) + struct.pack("<H", len(files)) + b"".join(
            _name(n) + struct.pack("<Qq", o, k) for n, o, k in files)
    elif op == P.WRITE:
        items = draw(st.lists(st.tuples(st.integers(0, 4), NAMES, st.integers(0, 2**20),
                                        st.binary(max_size=64)), max_size=4))
        body = _name(sess) + bytes([draw(st.integers(0, 255))]) + struct.pack("<H", len(items))
        body += b"".join(struct.pack("<BQQ", k, a, draw(st.sampled_from([len(d), draw(
            st.integers(0, 2**64 - 1))]))) + _name(n) for k, n, a, d in items)
        body += b"".join(d for _, _, _, d in items)
    else:
        body = draw(st.binary(max_size=64))
    how = draw(st.sampled_from(["as is", "cut", "grown", "flipped", "noise"]))
    if how == "cut" and body:
        body = body[:draw(st.integers(0, len(body) - 1))]
    elif how == "grown":
        body += draw(st.binary(min_size=1, max_size=16))
    elif how == "flipped" and body:
        i = draw(st.integers(0, len(body) - 1))
        body = body[:i] + bytes([body[i] ^ draw(st.integers(1, 255))]) + body[i + 1:]
    elif how == "noise":
        body = draw(st.binary(max_size=128))
    return op, body


CLEAN = {0, errno.EACCES, errno.ENOENT, errno.EINVAL, errno.EPROTO, errno.EMSGSIZE,
         errno.ENAMETOOLONG, errno.EPERM, errno.EEXIST, errno.ECANCELED, errno.EDQUOT,
         errno.ENOSPC, errno.EISDIR, errno.ENOTDIR}


def test_fuzzed_frames_get_clean_answers_and_the_mount_stays_up(kvfs):
    (kvfs.sessions / "fz").mkdir()
    (kvfs.sessions / "fz" / "layer_0").write_bytes(b"L" * 5000)
    (kvfs.sessions / "fz" / "meta.json").write_bytes(b"{}")
    name = socket_name(kvfs)
    seen: set[int] = set()

    @settings(derandomize=True, max_examples=1000, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies(), st.sampled_from(["exact", "short", "long"]))
    def one(req: tuple[int, bytes], length: str) -> None:
        op, body = req
        n = {"exact": len(body), "short": max(len(body) - 1, 0), "long": len(body) + 7}[length]
        got = ask(name, P.REQ.pack(n, op) + body)
        assert kvfs.proc.poll() is None, kvfs.log_text()
        if got is None:  # closed unanswered only when the body announced never came whole
            assert n > len(body), (op, n, body)
            return
        code, _ = got
        assert code in CLEAN, (op, n, body, os.strerror(code))
        seen.add(code)

    one()
    assert {0, errno.EPROTO, errno.EINVAL} <= seen, seen
    doc = stats(kvfs)
    assert doc["needs_fsck"] is False and doc["fs"]["channel"]["errors"] == 0, kvfs.log_text()
    ch = Channel.open(str(kvfs.mountpoint))  # still serving
    assert ch is not None
    ch.close()


def test_a_read_out_of_memory_does_not_mark_the_volume(tmp_path, monkeypatch):
    vol = str(tmp_path / "v.kvfs")
    s = Store.create(vol, 16 * MB)
    s.create_session("s")
    s.create_file("s", "f")
    s.append("s", "f", 0, b"x" * 5000)

    def no_memory(*a, **kw):  # noqa: ANN002, ANN003, ANN202 - what a huge request met
        raise MemoryError

    monkeypatch.setattr(type(s.reads), "_read_jobs", no_memory)
    with pytest.raises(MemoryError):
        s.read("s", "f", 0, 5000)
    assert not s.needs_fsck  # nothing on the volume is wrong
    monkeypatch.undo()
    assert s.read("s", "f", 0, 5000) == b"x" * 5000
    s.close()

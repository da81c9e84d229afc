"""The channel a process keeps (``kvfs.channel.kept``) through real mounts: one client per
(process, mount) shared by its callers, a forked child's own, a restarted mount reached
again without the caller knowing, and no connection left counted by a process gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from kvfs.channel import APPEND, Item, KeptChannel, kept
from kvfs.channel.client import channel_of
from kvfs.mount_runner import Mount
from kvfs.warm.coldopen import open_cold


def _read(ch: KeptChannel, sid: str, name: str, n: int, off: int = 0) -> bytes:
    out = bytearray(n)
    ch.read(sid, [(name, off, memoryview(out))])
    return bytes(out)


def _connections(m: Mount) -> int:
    stats = json.loads((m.mountpoint / ".kvfs" / "stats").read_bytes())
    return stats["fs"]["channel"]["connections"]


def _until(what, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _session(m: Mount, sid: str, data: bytes) -> None:
    (m.sessions / sid).mkdir()
    (m.sessions / sid / "layer_0").write_bytes(data)


def test_the_socket_is_found_on_the_roots_xattr(kvfs):
    got = json.loads(os.getxattr(kvfs.mountpoint, "user.kvfs.channel"))
    stats = json.loads((kvfs.mountpoint / ".kvfs" / "stats").read_bytes())
    assert got["socket"] == stats["fs"]["channel"]["socket"] and got["version"] == 1
    assert channel_of(str(kvfs.mountpoint)) == got


def test_a_second_open_in_one_process_reuses_the_client(kvfs):
    data = os.urandom(200_000)
    _session(kvfs, "a", data)
    h = kept(str(kvfs.mountpoint))
    assert h is not None
    try:
        assert _read(h, "a", "layer_0", len(data)) == data
        ch = h.channel()
        # the path spelled another way, and the warm tier's backend: the same client
        assert kept(str(kvfs.mountpoint) + "/") is h
        cold = open_cold(str(kvfs.mountpoint))
        assert cold.kind == "channel" and cold.ch is h  # type: ignore[attr-defined]
        cold.close()  # a caller letting go: the channel stays open for the next
        assert h.channel() is ch and h.opened == 1
        assert _read(h, "a", "layer_0", 1000, off=5000) == data[5000:6000]
        misses = h.cache.misses
        h.drop_extents("a")  # what removing the session does: the next read asks again
        assert _read(h, "a", "layer_0", 10) == data[:10] and h.cache.misses > misses
        clients = json.loads((kvfs.mountpoint / ".kvfs" / "stats").read_bytes())["fs"]["channel"]["clients"]
        assert clients == 1  # one connection served every request above
    finally:
        h.forget()


def test_threads_share_it(kvfs):
    data = os.urandom(100_000)
    _session(kvfs, "t", data)
    h = kept(str(kvfs.mountpoint))
    assert h is not None
    bad: list[object] = []

    def reader(k: int) -> None:
        try:
            for i in range(50):
                off = (k * 997 + i * 131) % (len(data) - 512)
                if _read(h, "t", "layer_0", 512, off) != data[off:off + 512]:
                    bad.append((k, i))
        except Exception as e:  # noqa: BLE001 -- reported below
            bad.append(e)

    try:
        ts = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not bad and h.opened == 1
    finally:
        h.forget()


def test_a_forked_child_gets_its_own_connection(kvfs):
    data = os.urandom(150_000)
    _session(kvfs, "f", data)
    h = kept(str(kvfs.mountpoint))
    assert h is not None
    try:
        assert _read(h, "f", "layer_0", len(data)) == data
        parent_ch = h.channel()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what it saw, never return into pytest
            os.close(r)
            try:
                ok = (_read(h, "f", "layer_0", 4096, off=777) == data[777:4873]
                      and h.channel() is not parent_ch
                      and h.write("f", [Item(APPEND, "layer_0", len(data), b"C" * 10)]) == [len(data) + 10])
                os.write(w, b"ok" if ok else b"wrong")
            except BaseException as e:  # noqa: BLE001 -- reported to the parent
                os.write(w, repr(e).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            said = f.read()
        os.waitpid(pid, 0)
        assert said == b"ok"
        # the parent's connection was never used by the child: it still answers
        assert h.channel() is parent_ch
        assert _read(h, "f", "layer_0", len(data) + 10) == data + b"C" * 10
    finally:
        h.forget()


def test_a_forked_child_holds_none_of_the_parents_connections(kvfs):
    _session(kvfs, "g", b"x" * 5000)
    base = _connections(kvfs)
    h = kept(str(kvfs.mountpoint))
    assert h is not None
    assert _read(h, "g", "layer_0", 10) == b"x" * 10
    assert _connections(kvfs) == base + 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # lives until the parent has closed its channel
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        h.forget()  # while the child lives: had it kept a copy, the mount would see no end
        assert _until(lambda: _connections(kvfs) == base), _connections(kvfs)
    finally:
        os.close(w)
        os.waitpid(pid, 0)


def test_a_restarted_mount_is_reconnected_to(kvfs):
    data = os.urandom(120_000)
    _session(kvfs, "r", data)
    h = kept(str(kvfs.mountpoint))
    assert h is not None
    try:
        assert _read(h, "r", "layer_0", len(data)) == data
        before = channel_of(str(kvfs.mountpoint))
        kvfs.remount()  # a new mount process: a new socket name
        assert channel_of(str(kvfs.mountpoint)) != before
        assert _read(h, "r", "layer_0", 1000, off=100) == data[100:1100]
        assert h.opened == 2
        # writes go to the new mount too, and the files show them
        assert h.write("r", [Item(APPEND, "layer_0", len(data), b"N" * 7)], sync=True) == [len(data) + 7]
        assert (kvfs.sessions / "r" / "layer_0").read_bytes() == data + b"N" * 7
        # the same twice over, with the client's connections idle in between
        kvfs.remount()
        h.write("r", [Item(APPEND, "layer_0", len(data) + 7, b"M")])
        assert h.opened == 3
        assert _read(h, "r", "layer_0", 8, off=len(data)) == b"N" * 7 + b"M"
    finally:
        h.forget()


def test_a_process_leaves_no_connection_counted_at_exit(kvfs):
    _session(kvfs, "e", b"y" * 8192)
    base = _connections(kvfs)
    code = textwrap.dedent(f"""
        import atexit, json, sys, threading
        mnt = {str(kvfs.mountpoint)!r}
        def after():  # registered first: runs after kvfs's own exit hook
            print(json.dumps({{"closed": h._ch is None,
                               "file": __import__("kvfs").__file__}}), flush=True)
        atexit.register(after)
        from kvfs.channel import kept
        h = kept(mnt)
        def one():
            for _ in range(30):
                out = bytearray(4096)
                h.read("e", [("layer_0", 0, memoryview(out))])
                assert out == b"y" * 4096
        ts = [threading.Thread(target=one) for _ in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        print(h.channel()._conns, flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    held, report = p.stdout.strip().splitlines()
    assert int(held) >= 1
    got = json.loads(report)
    assert got["closed"] is True
    assert Path(got["file"]).resolve().parent.parent == Path(__file__).resolve().parent.parent
    assert _until(lambda: _connections(kvfs) == base), _connections(kvfs)

"""The native channel through real mounts: both faces show the same bytes at once, the
mount checks the peer as the kernel would, and any client that may not use the channel
gets the plain files without being told."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kvfs.channel import APPEND, REPLACE, TRUNCATE, Channel, Item
from kvfs.mount_runner import HAVE_FUSE, As, Mount
from kvfs.warm import WarmTier
from kvfs.warm.coldopen import open_cold


def _read(ch: Channel, sid: str, name: str, n: int, off: int = 0) -> bytes:
    out = bytearray(n)
    ch.read(sid, [(name, off, memoryview(out))])
    return bytes(out)


@pytest.mark.parametrize("extra", [(), ("--page-cache",)])
def test_either_face_reads_what_the_other_wrote_at_once(make_mount, extra):
    m = make_mount(extra=extra)
    s = m.sessions / "a"
    s.mkdir()
    ch = Channel.open(str(m.mountpoint))
    assert ch is not None
    try:
        data = os.urandom(300_000)
        (s / "layer_0").write_bytes(data)  # through the kernel, closed
        assert _read(ch, "a", "layer_0", len(data)) == data
        os.stat(s / "layer_0")  # the kernel caches its size now
        more = os.urandom(98_304)
        assert ch.write("a", [Item(APPEND, "layer_0", len(data), more),
                              Item(APPEND, "layer_1", 0, more)], sync=True) == [len(data) + len(more), len(more)]
        assert os.stat(s / "layer_0").st_size == len(data) + len(more)  # not the cached size
        assert (s / "layer_0").read_bytes() == data + more
        assert (s / "layer_1").read_bytes() == more  # made by the channel: no cached "missing"
        # a handle writing through the kernel, not closed: its buffered bytes are seen
        with open(s / "layer_1", "ab", buffering=0) as f:
            f.write(b"K" * 1000)
            assert _read(ch, "a", "layer_1", len(more) + 1000) == more + b"K" * 1000
            # and an append through the channel lands after them, through its buffer
            assert ch.write("a", [Item(APPEND, "layer_1", len(more) + 1000, b"N" * 10)]) == [len(more) + 1010]
            f.write(b"F" * 5)
        assert (s / "layer_1").read_bytes() == more + b"K" * 1000 + b"N" * 10 + b"F" * 5
        # a reader with a handle open (read-ahead, small-read window) sees a cut at once
        with open(s / "layer_0", "rb", buffering=0) as r:
            assert r.read(4096) == data[:4096]
            ch.write("a", [Item(TRUNCATE, "layer_0", 5000)])
            r.seek(0)
            assert r.read(10_000) == data[:5000]
        assert _read(ch, "a", "layer_0", 5000) == data[:5000]
        ch.write("a", [Item(REPLACE, "meta.json", 0, b'{"tokens": 3}')], sync=True)
        assert (s / "meta.json").read_bytes() == b'{"tokens": 3}'
        info = ch.stat("a", ["meta.json"])
        assert info is not None and info.small["meta.json"] == b'{"tokens": 3}'
        assert info.files["layer_0"][0] == 5000
        with pytest.raises(ValueError):  # past the end
            _read(ch, "a", "layer_0", 100, off=4950)
        with pytest.raises(FileNotFoundError):
            _read(ch, "nope", "layer_0", 10)
        with pytest.raises(OSError) as e:  # appends only, as through the kernel
            ch.write("a", [Item(APPEND, "layer_0", 10, b"x")])
        assert e.value.errno == errno.EPERM
        assert ch.stat("nope") is None
    finally:
        ch.close()


@pytest.mark.skipif(not HAVE_FUSE or os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs /dev/fuse, root and setpriv")
def test_peers_are_checked_as_the_kernel_would():
    d = Path(tempfile.mkdtemp(prefix="kvfs-channel-uids-"))
    os.chmod(d, 0o755)
    m = Mount(d / "vol.kvfs", d / "mnt", "64M", ("--allow-other",)).start()
    alice, bob = As(4301), As(4302)
    ch = "__import__('kvfs.channel', fromlist=['Channel']).Channel"
    mnt = str(m.mountpoint)
    try:
        assert alice(f"os.mkdir({mnt + '/sessions/chat'!r})") == "None"
        assert alice(f"open({mnt + '/sessions/chat/layer_0'!r}, 'wb').write(b'A' * 100)") == "100"
        # the volume is 0600 root's: no other user may read it, so no channel: the files
        assert alice(f"{ch}.open({mnt!r}) is None") == "True"
        assert alice(f"__import__('kvfs.warm.coldopen', fromlist=['x']).open_cold({mnt!r}).kind") == "'files'"
        # a volume others may read: the channel, with the files' permissions
        os.chmod(m.volume, 0o644)
        assert alice(f"fds.update(c={ch}.open({mnt!r})) or fds['c'] is not None") == "True"
        assert bob(f"fds.update(c={ch}.open({mnt!r})) or fds['c'] is not None") == "True"
        read = "(lambda b: fds['c'].read('chat', [('layer_0', 0, memoryview(b))]) or bytes(b))(bytearray(100))"
        assert alice(read) == repr(b"A" * 100)
        assert bob(read) == f"errno {errno.EACCES}"  # 0700 alice's session
        item = "__import__('kvfs.channel', fromlist=['Item']).Item"
        assert bob(f"fds['c'].write('chat', [{item}(1, 'layer_0', 100, b'B')])") == f"errno {errno.EACCES}"
        assert bob(f"fds['c'].write('chat', [{item}(1, 'layer_9', 0, b'B')])") == f"errno {errno.EACCES}"
        assert bob("fds['c'].stat('chat')") == f"errno {errno.EACCES}"
        assert alice(f"fds['c'].write('chat', [{item}(1, 'layer_1', 0, b'C' * 7)], sync=True)") == "[7]"
        st = os.stat(m.sessions / "chat" / "layer_1")
        assert (st.st_uid, st.st_mode & 0o777) == (4301, 0o600)  # made as alice, private
        assert (m.sessions / "chat" / "layer_0").read_bytes() == b"A" * 100
    finally:
        alice.close()
        bob.close()
        assert m.stop() == 0, m.log_text()
        shutil.rmtree(d, ignore_errors=True)


def test_without_the_channel_the_warm_tier_uses_the_files(make_mount, tmp_path):
    m = make_mount(extra=("--no-channel",))
    assert Channel.open(str(m.mountpoint)) is None
    cold = open_cold(str(m.mountpoint))
    assert cold.kind == "files"
    cold.close()
    plain = tmp_path / "plain"
    (plain / "sessions").mkdir(parents=True)
    cold = open_cold(str(plain))  # a plain directory: no mount, no channel
    assert cold.kind == "files"
    cold.close()


def test_warm_tier_through_the_channel_keeps_every_byte(make_mount, tmp_path):
    m = make_mount(size="256M")
    w = WarmTier(str(m.mountpoint), str(tmp_path / "warm"), shards=4, cap_bytes=64 << 20)
    assert w.cold.kind == "channel"
    rng = np.random.default_rng(1)
    refs: dict[str, dict[int, np.ndarray]] = {}
    try:
        for i in range(4):
            sid = f"s{i}"
            refs[sid] = {}
            for r in range(4):
                for layer in range(3):
                    b = rng.integers(0, 255, 40_000, dtype=np.uint8)
                    w.append(sid, layer, b)
                    refs[sid][layer] = np.concatenate([refs[sid].get(layer, np.empty(0, np.uint8)), b])
                w.put_summary(sid, r, rng.standard_normal(128).astype(np.float32))
            w.put_meta(sid, {"tokens": 4, "i": i})
        w.sync()
        for sid, layers in refs.items():  # the mount's files hold it all, fsync'd
            for layer, ref in layers.items():
                assert (m.sessions / sid / f"layer_{layer}").read_bytes() == ref.tobytes()
        assert sorted(w.migrate(4)) == sorted(refs)
        for sid, layers in refs.items():
            assert w.where(sid) == "cold"
            got = w.read_layers(sid, sorted(layers), 0, 160_000)
            assert all(np.array_equal(got[k], layers[k]) for k in sorted(layers))
            assert w.get_meta(sid)["i"] == int(sid[1:])
            assert w.summaries(sid).shape == (4, 128)
        w.truncate("s1", 0, 1000)
        assert os.path.getsize(m.sessions / "s1" / "layer_0") == 1000
        w.delete("s2")
        assert sorted(os.listdir(m.sessions)) == ["s0", "s1", "s3"]
        assert w.cold.ch.reader.stats["reads"] > 0
    finally:
        w.close()
    assert m.stop() == 0, m.log_text()
    m.start()
    w = WarmTier(str(m.mountpoint), str(tmp_path / "warm2"), shards=4)
    try:
        got = w.read_layers("s0", [0, 1, 2], 0, 160_000)
        assert all(np.array_equal(got[k], refs["s0"][k]) for k in range(3))
    finally:
        w.close()


def test_a_file_of_more_extents_than_one_answer_holds_reads_whole(make_mount):
    """The mount answers at most 4096 extents per file: a read over more asks again for the
    rest, and the bytes come out whole."""
    m = make_mount()
    (m.sessions / "long").mkdir()
    ch = Channel.open(str(m.mountpoint))
    assert ch is not None
    try:
        pieces = [bytes([k % 251]) * 16 for k in range(4200)]  # one ring entry each
        size = 0
        for p in pieces:
            ch.write("long", [Item(APPEND, "layer_0", size, p)])
            size += len(p)
        (_, (fe,)) = ch.extents("long", [("layer_0", 0, -1)])
        assert len(fe.ext) == 4096 and fe.hi < size
        assert _read(ch, "long", "layer_0", size) == b"".join(pieces)
        assert _read(ch, "long", "layer_0", 64, off=size - 64) == b"".join(pieces)[-64:]
    finally:
        ch.close()

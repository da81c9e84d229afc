"""Warm tier, format layer: session ids, shard numbers, the .kvmap file and its recovery."""

from __future__ import annotations

import functools
import hashlib
import logging
import os

import crc32c
import numpy as np
import pytest

from kvfs.warm import WarmCorrupt, WarmError, device_id, shard_of
from kvfs.warm import WarmTier as _WarmTier
from kvfs.warm.extent import seal_of
from kvfs.warm.ids import shard_file_name
from kvfs.warm.kvmap_format import (
    ENTRY_SIZE,
    HEADER,
    HEADER_CRC,
    HEADER_SLOT,
    HEADER_SLOTS,
    K_LAYER,
    K_NAME,
    KEY_DEVICE,
)
from kvfs.warm.rootdir import RootDir
from kvfs.warm.shardload import load_shard

# The .kvmap file as the only copy of a session: write-behind off, so what a reopened tier
# finds is what the shard file says (tests/test_warm_writebehind.py covers the mount copy).
WarmTier = functools.partial(_WarmTier, writebehind=False)


@pytest.fixture
def dirs(tmp_path):
    cold = tmp_path / "cold"
    (cold / "sessions").mkdir(parents=True)  # the layout of a mounted volume
    return str(cold), str(tmp_path / "warm")


def blob(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def proc_dir(root: str) -> str:
    """This process's shard directory (a tier reopened in one process takes it again)."""
    return os.path.join(root, f"proc-{os.getpid()}")


def shard_path(root: str, sid: str, shards: int) -> str:
    return os.path.join(proc_dir(root), shard_file_name(shard_of(sid, shards), shards))


# ---- ids and shard numbers -----------------------------------------------------------
def test_md5_shard_ids_take_top_bits():
    for sid in ["sess-42", "a", "é" * 10, "x" * 255]:
        hexd = hashlib.md5(sid.encode()).hexdigest()
        assert shard_of(sid, 65536) == int(hexd[:4], 16)  # the article's "first 4 hex digits"
        assert shard_of(sid, 131072) == int(hexd[:5], 16) >> 3
        assert shard_of(sid, 262144) == int(hexd[:5], 16) >> 2
        assert shard_of(sid, 4) == int(hexd[0], 16) >> 2
        assert shard_of(sid, 1) == 0


def test_device_ids():
    assert device_id("4711") == 4711
    assert device_id("4711-cmd-9") == 4711
    assert device_id("0042.ping") == 42
    assert shard_of("4711-x", 262144, KEY_DEVICE) == 4711
    assert shard_of("300000", 262144, KEY_DEVICE) == 300000 % 262144
    for bad in ["dev-1", "", "x12", "1" * 21]:
        with pytest.raises(WarmError):
            device_id(bad)


def test_shard_count_must_suit_the_key(dirs):
    cold, root = dirs
    with pytest.raises(WarmError):
        WarmTier(cold, root, shards=1000)  # md5 bits need a power of two
    with pytest.raises(WarmError):
        WarmTier(cold, root, shard_key="user")
    WarmTier(cold, root, shards=1000, shard_key="device").close()


def test_device_sharding_places_sessions_by_device(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=8, shard_key="device") as w:
        w.append("13-a", 0, b"abc")
        w.append("21-b", 0, b"defg")  # 21 % 8 == 13 % 8: same shard file
        w.append("6", 0, b"h")
        with pytest.raises(WarmError):
            w.append("sensor-13", 0, b"x")
        names = sorted(n for n in os.listdir(proc_dir(root)) if n.endswith(".kvmap"))
        assert names == ["sess_0005.kvmap", "sess_0006.kvmap"]
    with WarmTier(cold, root, shards=8, shard_key="device") as w:
        assert bytes(w.read("13-a", 0, 0, 3)) == b"abc"
        assert bytes(w.read("21-b", 0, 0, 4)) == b"defg"


@pytest.mark.parametrize("sid", ["", ".", "..", "a/b", "/", "a\0b", "x" * 256, "é" * 128, "\ud800", 7, None])
def test_bad_session_ids_refused_and_nothing_changes(dirs, sid):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        before = sorted(os.listdir(root)), sorted(os.listdir(cold))
        for call in (lambda: w.append(sid, 0, b"x"), lambda: w.read(sid, 0, 0, 0),
                     lambda: w.size(sid, 0), lambda: w.put_meta(sid, {}), lambda: w.where(sid),
                     lambda: w.put_summary(sid, 0, np.zeros(128)), lambda: w.delete(sid),
                     lambda: w.truncate(sid, 0, 0)):
            with pytest.raises(WarmError):
                call()
        assert (sorted(os.listdir(root)), sorted(os.listdir(cold))) == before


def test_longest_valid_id(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=4) as w:
        sid = "é" * 127 + "x"  # 255 bytes
        w.append(sid, 0, b"ok")
        w.migrate()
        assert w.where(sid) == "cold" and bytes(w.read(sid, 0, 0, 2)) == b"ok"


# ---- shard files ---------------------------------------------------------------------
def test_md5_collisions_share_a_shard_correctly(dirs):
    cold, root = dirs
    sids = [f"agent-{i}" for i in range(40)]
    ref = {}
    with WarmTier(cold, root, shards=4) as w:
        for rnd in range(3):  # interleave sessions and layers so segments interleave in files
            for i, sid in enumerate(sids):
                for layer in range(2):
                    b = blob(i * 100 + rnd * 10 + layer, 3000 + 500 * rnd)
                    ref.setdefault((sid, layer), []).append(b)
                    w.append(sid, layer, b)
        assert len([n for n in os.listdir(proc_dir(root)) if n.endswith(".kvmap")]) <= 4
        for (sid, layer), parts in ref.items():
            assert np.array_equal(w.read(sid, layer, 0, w.size(sid, layer)), np.concatenate(parts))
    with WarmTier(cold, root, shards=4) as w:
        assert w.sessions() == sorted(sids)
        for (sid, layer), parts in ref.items():
            whole = np.concatenate(parts)
            assert np.array_equal(w.read(sid, layer, 0, len(whole)), whole)
            assert np.array_equal(w.read(sid, layer, 2900, 3100), whole[2900:3100])  # across segments


def test_appends_never_move_written_bytes(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=1) as w:
        w.append("s", 0, blob(1, 1000))
        f = w.store.file(0)
        offs = [g.off for g in f.sessions["s"].layers[0].segs]
        for i in range(50):
            w.append("s", 0, blob(i, 5000))
            w.append(f"other{i}", 0, blob(i, 100))
        segs = f.sessions["s"].layers[0].segs
        assert [g.off for g in segs[:len(offs)]] == offs
        caps = [g.cap for g in segs]
        assert all(b >= 2 * a or b == caps[-1] for a, b in zip(caps, caps[1:], strict=False))  # doubling


def test_index_table_grows_in_place_of_nothing(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=1) as w:
        for i in range(150):  # > 64 entries: the table is moved and doubled (twice)
            w.append(f"s{i}", 0, blob(i, 100))
            w.put_summary(f"s{i}", 0, np.full(128, i, np.float32))
        assert w.store.file(0).index_cap >= 512
    with WarmTier(cold, root, shards=1) as w:
        for i in range(150):
            assert np.array_equal(w.read(f"s{i}", 0, 0, 100), blob(i, 100))
            assert w.summaries(f"s{i}")[0, 0] == i


def test_freed_space_is_reused(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=1) as w:
        w.append("keep", 0, blob(0, 10))
        path = w.store.file(0).path
        for i in range(30):
            w.append(f"tmp{i}", 0, blob(i, 200_000))
            w.delete(f"tmp{i}")
        assert os.path.getsize(path) < 2 << 20
        assert np.array_equal(w.read("keep", 0, 0, 10), blob(0, 10))


def test_header_has_totals_and_two_slots(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=1, clock=lambda: 1234.5) as w:
        w.append("s", 0, blob(0, 700))
        w.put_meta("s", {"tokens": 9})
        path = w.store.file(0).path
    head = open(path, "rb").read(2 * HEADER_SLOT)
    slots = [HEADER.unpack(head[o:o + HEADER.size]) for o in (0, HEADER_SLOT)]
    newest = max(slots, key=lambda f: f[3])
    assert newest[0] == b"KVMAP\x00\r\n" and newest[4] == 1234.5
    assert newest[11] == 9 and newest[10] == 700 + len(b'{"tokens":9}') and newest[12] == 1


def test_torn_newest_header_slot_falls_back_to_the_other(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=1) as w:
        w.append("s", 0, blob(0, 5000))
        f = w.store.file(0)
        path, newest = f.path, (f.seq % 2) * HEADER_SLOT
    with open(path, "r+b") as fh:
        fh.seek(newest + 20)
        fh.write(b"\xff\xff")
    with WarmTier(cold, root, shards=1) as w:
        assert np.array_equal(w.read("s", 0, 0, 5000), blob(0, 5000))


@pytest.mark.parametrize("damage", ["magic", "entry"])
def test_corrupt_shard_means_missing_sessions_logged_no_crash(dirs, caplog, damage):
    cold, root = dirs
    sids = [f"s{i}" for i in range(12)]
    with WarmTier(cold, root, shards=4) as w:
        for i, sid in enumerate(sids):
            w.append(sid, 0, blob(i, 1000))
    victim = shard_path(root, "s0", 4)
    with open(victim, "r+b") as fh:
        if damage == "magic":
            for slot in (0, HEADER_SLOT):
                fh.seek(slot)
                fh.write(b"NOTKVMAP")
        else:  # flip a bit in the immutable part of the first entry
            rd = RootDir(proc_dir(root))
            f = load_shard(rd, os.path.basename(victim))
            off = f.index_off + 8
            f.unmap()
            rd.close()
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 1]))
    lost = {s for s in sids if shard_of(s, 4) == shard_of("s0", 4)}
    with caplog.at_level(logging.ERROR, logger="kvfs.warm"):
        w = WarmTier(cold, root, shards=4)
    with w:
        assert any("treated as missing" in r.message for r in caplog.records)
        assert set(w.sessions()) == set(sids) - lost
        assert w.size("s0", 0) == 0 and w.where("s0") is None
        with pytest.raises(ValueError):
            w.read("s0", 0, 0, 1)
        for i, sid in enumerate(sids):
            if sid not in lost:
                assert np.array_equal(w.read(sid, 0, 0, 1000), blob(i, 1000))
        w.append("s0", 0, b"fresh")  # the shard starts over; the bad file is kept aside
        assert bytes(w.read("s0", 0, 0, 5)) == b"fresh"
    assert any(".corrupt." in n for n in os.listdir(proc_dir(root)))


def test_unfinished_truncate_is_completed_on_load(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=1) as w:
        for i in range(10):  # 16 KiB, 32 KiB, 64 KiB... segments
            w.append("s", 0, blob(0, 100_000)[i * 10_000:(i + 1) * 10_000])
        f = w.store.file(0)
        segs = f.sessions["s"].layers[0].segs
        assert len(segs) >= 3
        # a kill right after the first store of truncate(s, 0, 20_000): cut segment updated,
        # later segments still live
        k = max(j for j, g in enumerate(segs) if g.start < 20_000)
        g = segs[k]
        f.tbl["seal"][g.idx] = seal_of(f.map(), g.off, g.cap, 20_000 - g.start)
    with WarmTier(cold, root, shards=1) as w:
        assert w.size("s", 0) == 20_000
        assert np.array_equal(w.read("s", 0, 0, 20_000), blob(0, 100_000)[:20_000])
        w.append("s", 0, b"more")
        assert bytes(w.read("s", 0, 20_000, 20_004)) == b"more"


def test_unfinished_drop_leaves_orphans_that_are_reclaimed(dirs):
    cold, root = dirs
    with WarmTier(cold, root, shards=1) as w:
        w.append("gone", 0, blob(0, 50_000))
        w.append("kept", 0, blob(1, 50_000))
        f = w.store.file(0)
        f.tbl["state"][f.sessions["gone"].idx] = 2  # killed the name entry, then "crashed"
    with WarmTier(cold, root, shards=1) as w:
        assert w.sessions() == ["kept"]
        f = w.store.file(0)
        t = f.tbl
        live = [i for i in range(f.index_cap) if t["state"][i] == 1]
        assert sorted(int(t["kind"][i]) for i in live) == [K_NAME, K_LAYER]
        assert np.array_equal(w.read("kept", 0, 0, 50_000), blob(1, 50_000))


def test_entry_size_matches_layout():
    assert ENTRY_SIZE == 64 and HEADER.size + 4 == HEADER_SLOT


# ---- checksums: a flipped bit is an error or the cold copy, never wrong bytes ----------
def _build_flip_fixture(cold: str, root: str) -> tuple[dict, dict]:
    """Three sessions in one shard: 'a' warm only (multi-block, multi-segment layers),
    'b' on cold with a warm tail, 'c' small. Returns (layers, meta) references."""
    layers: dict = {}
    meta = {}
    with WarmTier(cold, root, shards=1) as w:
        for k, sid in enumerate(["a", "b", "c"]):
            n = [150_000, 90_000, 700][k]
            for layer in range(2):
                data = blob(10 * k + layer, n)
                w.append(sid, layer, data[:n // 3])
                w.append(sid, layer, data[n // 3:])
                layers[sid, layer] = data
            meta[sid] = {"tokens": n, "sid": sid}
            w.put_meta(sid, meta[sid])
            w.put_summary(sid, 0, np.full(128, k, np.float32))
        w.migrate(3)  # all on cold, then 'b' gets a warm tail and 'a', 'c' come back
        w.append("b", 0, blob(77, 40_000))
        layers["b", 0] = np.concatenate([layers["b", 0], blob(77, 40_000)])
        w.promote("a")
        w.promote("c")
        w.delete("c")  # and again, warm only
        w.append("c", 0, layers["c", 0])
        w.append("c", 1, layers["c", 1])
        w.put_meta("c", meta["c"])
        w.put_summary("c", 0, np.full(128, 2, np.float32))
    return layers, meta


def _audit(w: WarmTier, layers: dict, meta: dict, tally: dict) -> None:
    """Read everything back; count right, short (session lost, logged) and refused reads;
    any other outcome -- wrong bytes, wrong meta, another exception -- fails the test."""
    for (sid, layer), data in layers.items():
        try:
            n = w.size(sid, layer)
            got = w.read(sid, layer, 0, n, promote=False)
        except WarmError:
            tally["error"] += 1
            continue
        assert n <= len(data) and np.array_equal(got, data[:n]), ("wrong bytes", sid, layer)
        tally["right" if n == len(data) else "short"] += 1
    for k, sid in enumerate(["a", "b", "c"]):
        try:
            assert w.get_meta(sid) in (meta[sid], None), ("wrong meta", sid)
            summ = w.summaries(sid)
        except WarmError:
            tally["error"] += 1
            continue
        assert np.array_equal(summ, np.full((len(summ), 128), k, np.float32)[:1]), sid


def _regions(path: str) -> dict[str, tuple[int, int]]:
    rd = RootDir(os.path.dirname(path))
    f = load_shard(rd, os.path.basename(path))
    t = f.tbl
    live = [i for i in range(f.index_cap) if t["state"][i] == 1]
    data_lo = min(int(t["off"][i]) for i in live if t["kind"][i] != K_NAME)
    out = {"header": (0, 2 * HEADER_SLOT), "index": (f.index_off, f.index_off + 64 * max(live) + 64),
           "data": (data_lo, f.end)}
    f.unmap()
    rd.close()
    return out


def test_ten_thousand_bit_flips_never_return_wrong_bytes(dirs, caplog):
    cold, root = dirs
    layers, meta = _build_flip_fixture(cold, root)
    name = shard_file_name(0, 1)
    path = os.path.join(proc_dir(root), name)
    orig = open(path, "rb").read()
    regions = _regions(path)
    rng = np.random.default_rng(2024)
    tally = {"right": 0, "short": 0, "error": 0}
    flips = 0
    caplog.set_level(logging.CRITICAL, logger="kvfs.warm")

    def restore() -> None:
        for n in os.listdir(proc_dir(root)):
            if n.startswith(name):
                os.unlink(os.path.join(proc_dir(root), n))
        with open(path, "wb") as fh:
            fh.write(orig)
        os.chmod(path, 0o600)

    def flip_at(fd: int, pos: int) -> None:
        b = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([b[0] ^ (1 << int(rng.integers(8)))]), pos)

    # at load: header, index and data flips, each on a fresh copy of the file
    for region, count in (("header", 600), ("index", 1000), ("data", 400)):
        lo, hi = regions[region]
        for _ in range(count):
            restore()
            fd = os.open(path, os.O_RDWR)
            flip_at(fd, int(rng.integers(lo, hi)))
            os.close(fd)
            with WarmTier(cold, root, shards=1) as w:
                _audit(w, layers, meta, tally)
            flips += 1
    # at run time: data and seal flips under a live tier, through its shared mapping
    restore()
    with WarmTier(cold, root, shards=1) as w:
        fd = os.open(path, os.O_RDWR)
        for region, count in (("data", 6500), ("index", 1500)):
            lo, hi = regions[region]
            for _ in range(count):
                pos = int(rng.integers(lo, hi))
                before = os.pread(fd, 1, pos)
                flip_at(fd, pos)
                _audit(w, layers, meta, tally)
                os.pwrite(fd, before, pos)
                flips += 1
        os.close(fd)
    assert flips == 10_000
    # most flips are caught (data) or harmless (padding, free space, last-use times)
    assert tally["error"] > 200 and tally["short"] > 200 and tally["right"] > 10_000, tally
    for (sid, layer), data in layers.items():  # cold copies were never damaged
        p = os.path.join(cold, "sessions", sid, f"layer_{layer}")
        if os.path.exists(p):
            assert open(p, "rb").read() == data.tobytes()[:os.path.getsize(p)]


def test_flipped_layer_bytes_are_read_from_cold_or_refused(dirs, caplog):
    cold, root = dirs
    layers, meta = _build_flip_fixture(cold, root)
    path = os.path.join(proc_dir(root), shard_file_name(0, 1))
    with WarmTier(cold, root, shards=1) as w:
        f = w.store.file(0)
        for sid in ("a", "b", "c"):
            g = f.sessions[sid].layers[0].segs[-1]
            fd = os.open(path, os.O_RDWR)
            os.pwrite(fd, b"\xff" * 32, g.off)  # 32 bytes of layer 0 overwritten
            os.close(fd)
        # 'a' has a complete cold copy (promoted): served from it, logged
        assert np.array_equal(w.read("a", 0, 0, len(layers["a", 0]), promote=False), layers["a", 0])
        assert "served from the cold copy" in caplog.text
        # 'b's damaged bytes are only in RAM, 'c' has no cold copy: errors, not wrong KV
        for sid in ("b", "c"):
            with pytest.raises(WarmCorrupt, match="checksum mismatch"):
                w.read(sid, 0, 0, len(layers[sid, 0]))
        assert np.array_equal(w.read("c", 1, 0, 700), layers["c", 1])  # other layers fine
        with pytest.raises(WarmCorrupt):
            w.append("c", 0, b"more")  # never seals damaged bytes as good
        # a migration never copies damaged bytes: a damaged session's warm copy is dropped
        # whole (it cannot be resumed without that layer), its cold copy kept as it was
        w.migrate(3)
        assert w.size("c", 0) == w.size("c", 1) == 0 and w.size("b", 0) == 90_000
        assert np.array_equal(w.read("b", 0, 0, 90_000), layers["b", 0][:90_000])
        assert "its warm copy is dropped" in caplog.text


def test_flipped_used_field_is_not_a_shorter_layer(dirs, caplog):
    cold, root = dirs
    with WarmTier(cold, root, shards=1) as w:
        w.append("s", 0, blob(1, 100_000))
        f = w.store.file(0)
        g = f.sessions["s"].layers[0].segs[-1]
        f.tbl["seal"][g.idx] ^= 1 << 3  # 'used' 8 bytes shorter, checksum unchanged
    with caplog.at_level(logging.ERROR, logger="kvfs.warm"), WarmTier(cold, root, shards=1) as w:
        assert w.where("s") is None  # dropped as damaged, said so; never 8 bytes short
        assert "fails its checksum" in caplog.text


def test_old_format_shards_are_discarded_with_a_log_line(dirs, caplog):
    cold, root = dirs
    with WarmTier(cold, root, shards=1) as w:
        w.append("s", 0, b"abc")
        w.migrate()
        w.append("s", 0, b"def")
        path = w.store.file(0).path
    raw = bytearray(open(path, "rb").read())
    for slot in HEADER_SLOTS:  # rewrite both header slots as version 1, valid checksums
        body = bytearray(raw[slot:slot + HEADER.size])
        body[8:12] = (1).to_bytes(4, "little")
        raw[slot:slot + HEADER_SLOT] = bytes(body) + HEADER_CRC.pack(crc32c.crc32c(bytes(body)))
    open(path, "wb").write(raw)
    with caplog.at_level(logging.WARNING, logger="kvfs.warm"), WarmTier(cold, root, shards=1) as w:
        assert "format version 1" in caplog.text and "discarded" in caplog.text
        assert not os.path.exists(path) and w.where("s") == "cold"
        assert bytes(w.read("s", 0, 0, 3)) == b"abc"

"""The catalog a mount publishes for its clients: records found or refused, never wrong;
through real mounts, a new client reads without asking, and no read returns bytes that
are not the file's while appends, cuts, deletes and ring laps race it."""

from __future__ import annotations

import json
import os
import random
import struct
import threading
import time
import zlib

import pytest

from kvfs.channel import APPEND, TRUNCATE, Channel, Item
from kvfs.engine import catalog as C
from kvfs.engine.catalog import Catalog, CatalogView, decode, decode_files, encode


def blob(name: str, n: int, nfiles: int = 2, tag: int = 0) -> bytes:
    files = [(f"layer_{k}", k + 1, (0o600, 5, 6), [i * 10 for i in range(n)],
              [(1000 * tag + i, 0, 10, 512) for i in range(n)]) for k in range(nfiles)]
    return encode(name, 7, 3, (0o700, 5, 6), files)


# ---------------------------------------------------------------------- the block
def test_a_record_reads_back_as_it_was_written():
    c = Catalog(slots=16, arena=1 << 14)
    v = CatalogView(c.reader_fd())
    try:
        c.put("sess", blob("sess", 3))
        attrs, fe = v.lookup("sess", "layer_1")
        assert attrs == (0o700, 5, 6)
        assert (fe.sno, fe.fno, fe.cuts, fe.mode, fe.uid, fe.gid) == (7, 2, 3, 0o600, 5, 6)
        assert fe.off == [0, 10, 20] and fe.ext == [(0, 0, 10, 512), (1, 0, 10, 512), (2, 0, 10, 512)]
        assert (fe.lo, fe.hi) == (0, 30)
        assert v.lookup("sess", "layer_9") == ((0o700, 5, 6), None)  # the session, no such file
        attrs, many = v.lookup_files("sess", ["layer_1", "layer_9", "layer_0"])
        assert attrs == (0o700, 5, 6) and set(many) == {"layer_0", "layer_1", "layer_9"}
        assert many["layer_9"] is None
        for name, fno in (("layer_0", 1), ("layer_1", 2)):
            assert many[name].fno == fno and many[name].ext == v.lookup("sess", name)[1].ext
        assert v.lookup_files("other", ["layer_0"]) is None
        assert v.lookup("other", "layer_0") is None
        c.withdraw("sess")
        assert v.lookup("sess", "layer_1") is None
        c.put("sess", blob("sess", 0))
        assert v.lookup("sess", "layer_0")[1].ext == []
        c.close()
        assert v.lookup("sess", "layer_0") is None  # a closed catalog holds nothing
    finally:
        v.close()


def test_slots_and_arena_under_churn_match_a_model(monkeypatch):
    """Colliding keys, shifts on removal, arena wraps and drops: every session the writer
    holds is found with its last record, every other is not found."""
    monkeypatch.setattr(C, "_key", lambda s: 1 + zlib.crc32(s.encode()) % 7)  # many collisions
    c = Catalog(slots=32, arena=1 << 13)
    v = CatalogView(c.reader_fd())
    rng = random.Random(5)
    last: dict[str, int] = {}
    try:
        for _ in range(4000):
            name = f"s{rng.randrange(40)}"
            if rng.random() < 0.25:
                c.withdraw(name)
            else:
                n = rng.choice((0, 1, 3, 9, 30))
                if c.put(name, blob(name, n, tag=n)):
                    last[name] = n
            for other in {name, f"s{rng.randrange(40)}"}:
                got = v.lookup(other, "layer_1")
                if other in c:
                    assert got is not None and len(got[1].ext) == last[other], other
                    assert got[1].ext[:1] == [(1000 * last[other], 0, 10, 512)][:last[other]]
                else:
                    assert got is None, other
        assert len(c) <= 16 and c.counts["dropped"] > 0  # held at half the slots, the arena wrapped
    finally:
        c.close()
        v.close()


def test_a_reader_racing_the_writer_gets_a_whole_record_or_none():
    c = Catalog(slots=64, arena=1 << 15)
    v = CatalogView(c.reader_fd())
    stop = threading.Event()
    seen = {"hits": 0, "misses": 0}

    def write() -> None:
        rng = random.Random(1)
        while not stop.is_set():
            n = rng.randrange(1, 60)
            c.put("s", blob("s", n, tag=n))  # in place, or moved when it grows
            if rng.random() < 0.05:
                c.withdraw("s")

    t = threading.Thread(target=write)
    t.start()
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            got = v.lookup("s", "layer_0")
            if got is None:
                seen["misses"] += 1
                continue
            fe = got[1]
            n = len(fe.ext)
            assert fe.ext == [(1000 * n + i, 0, 10, 512) for i in range(n)]  # one version, whole
            assert fe.off == [i * 10 for i in range(n)]
            seen["hits"] += 1
    finally:
        stop.set()
        t.join()
        c.close()
        v.close()
    assert seen["hits"] > 100, seen


def test_damaged_blobs_and_blocks_are_refused():
    b = blob("s", 4)
    assert decode(b, "s", "layer_0") is not None
    assert decode(b, "t", "layer_0") is None  # another session's record
    for cut in (0, 7, 8, 72, len(b) // 2, len(b) - 8):
        assert decode(b[:cut], "s", "layer_0") is None
    rng = random.Random(3)
    for _ in range(500):  # noise never raises; what parses is refused or a record of "s"
        junk = bytearray(b)
        for _ in range(rng.randrange(1, 6)):
            junk[rng.randrange(8, len(junk))] = rng.randrange(256)
        got = decode(bytes(junk), "s", "layer_0")
        if got is not None and got[1] is not None:  # parsed: whole, one offset per extent
            assert len(got[1].off) == len(got[1].ext) and all(len(e) == 4 for e in got[1].ext)
        many = decode_files(bytes(junk), "s", ["layer_0", "layer_1", "layer_7"])
        for fe in (many[1].values() if many is not None else ()):
            assert fe is None or len(fe.off) == len(fe.ext)
    fd = os.memfd_create("not-a-catalog")
    try:
        os.ftruncate(fd, 1 << 16)
        with pytest.raises(ValueError):
            CatalogView(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- through a mount
def _requests(m) -> int:
    doc = json.loads((m.root / ".kvfs" / "stats").read_bytes())
    return doc["fs"]["channel"]["extents"]


def _published(ch: Channel, sid: str, name: str, size: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = ch.locator.catalog.lookup(sid, name)
        if got is not None and got[1] is not None and got[1].hi >= size:
            return
        time.sleep(0.01)
    raise AssertionError(f"{sid}/{name} was not published")


def test_a_new_client_reads_published_sessions_without_asking(make_mount):
    m = make_mount()
    want = {}
    for i in range(20):
        d = m.sessions / f"s{i}"
        d.mkdir()
        for k in range(3):
            want[(f"s{i}", f"layer_{k}")] = data = os.urandom(5000 + 997 * k)
            (d / f"layer_{k}").write_bytes(data)
    ch = Channel.open(str(m.mountpoint))
    assert ch is not None and ch.locator.catalog is not None
    try:
        for (sid, name), data in want.items():
            _published(ch, sid, name, len(data))
        before = _requests(m)
        for (sid, name), data in want.items():
            out = bytearray(len(data) - 100)
            ch.read(sid, [(name, 100, memoryview(out))])
            assert bytes(out) == data[100:]
        bufs = [bytearray(len(want[("s3", f"layer_{k}")])) for k in range(3)]
        ch.read("s3", [(f"layer_{k}", 0, memoryview(b)) for k, b in enumerate(bufs)])
        assert [bytes(b) for b in bufs] == [want[("s3", f"layer_{k}")] for k in range(3)]
        assert _requests(m) == before  # not one extents request
        assert ch.locator.catalog_hits >= len(want)
        # several files of a session nothing is kept for: one catalog lookup finds them all
        ch.cache.drop("s4")
        hits = ch.locator.catalog_hits
        bufs = [bytearray(len(want[("s4", f"layer_{k}")])) for k in (2, 0, 1)]
        ch.read("s4", [(f"layer_{k}", 0, memoryview(b)) for k, b in zip((2, 0, 1), bufs, strict=True)])
        assert [bytes(b) for b in bufs] == [want[("s4", f"layer_{k}")] for k in (2, 0, 1)]
        assert ch.locator.catalog_hits == hits + 3 and _requests(m) == before
        # what the catalog does not show goes to the mount: past the published end, a
        # missing file, a missing session (its errors are the mount's)
        with open(m.sessions / "s0" / "layer_0", "ab") as f:
            f.write(b"tail")
        out = bytearray(5004)
        ch.read("s0", [("layer_0", 0, memoryview(out))])
        assert bytes(out) == want[("s0", "layer_0")] + b"tail"
        with pytest.raises(FileNotFoundError):
            ch.read("s0", [("layer_9", 0, memoryview(bytearray(4)))])
        with pytest.raises(FileNotFoundError):
            ch.read("nope", [("layer_0", 0, memoryview(bytearray(4)))])
        # a session this process may not read, by what the catalog shows, is asked for
        os.chmod(m.sessions / "s1", 0o700)
        _published(ch, "s1", "layer_0", 5000)
        hits = ch.locator.catalog_hits
        ch.locator.me = (4321, 4321, frozenset())
        ch.cache.drop("s1")
        ch.read("s1", [("layer_0", 0, memoryview(bytearray(10)))])  # the mount says yes (root)
        assert ch.locator.catalog_hits == hits
    finally:
        ch.close()


def test_a_client_of_a_killed_mount_never_reads_through_its_catalog(make_mount):
    """SIGKILLed, nothing marks the published blocks ended; the next mount rewrites the
    file at the same size. The old client's read fails (the mount's process is gone),
    a kept client's read returns the new bytes."""
    from kvfs.channel import kept

    m = make_mount()
    (m.sessions / "a").mkdir()
    old = os.urandom(8192)
    (m.sessions / "a" / "layer_0").write_bytes(old)
    os.sync()
    ch = Channel.open(str(m.mountpoint))
    k = kept(str(m.mountpoint))
    assert ch is not None and k is not None
    try:
        _published(ch, "a", "layer_0", len(old))
        out = bytearray(len(old))
        ch.read("a", [("layer_0", 0, memoryview(out))])
        k.read("a", [("layer_0", 0, memoryview(bytearray(len(old))))])
        assert bytes(out) == old
        m.kill()
        m.start()
        new = os.urandom(8192)
        (m.sessions / "a" / "layer_0").write_bytes(new)
        with pytest.raises(ConnectionError):
            ch.read("a", [("layer_0", 0, memoryview(out))])
        out = bytearray(len(new))
        k.read("a", [("layer_0", 0, memoryview(out))])
        assert bytes(out) == new
    finally:
        ch.close()
        k.forget()


CHUNK = 4096
_HEAD = struct.Struct("<16s16sQQI")  # session, file, offset, epoch, crc of the rest


def chunk(sid: str, name: str, off: int, epoch: int) -> bytes:
    body = random.Random(hash((sid, name, off, epoch))).randbytes(CHUNK - _HEAD.size)
    return _HEAD.pack(sid.encode(), name.encode(), off, epoch, zlib.crc32(body)) + body


def check_chunk(b: bytes, sid: str, name: str, off: int) -> int:
    s, f, o, epoch, crc = _HEAD.unpack(b[:_HEAD.size])
    assert (s.rstrip(b"\0"), f.rstrip(b"\0"), o) == (sid.encode(), name.encode(), off), \
        f"{sid}/{name}@{off}: bytes of {s!r}/{f!r}@{o}"
    assert zlib.crc32(b[_HEAD.size:]) == crc, f"{sid}/{name}@{off}: torn or damaged chunk"
    return epoch


def test_reads_through_the_catalog_race_appends_cuts_deletes_and_laps(make_mount):
    """A writer appends, truncates, deletes and recreates files of 6 sessions on a volume
    small enough that the ring laps many times (reclaim copies live entries forward);
    readers in threads, through the catalog first, read whole chunks. Every read is the
    file's own chunks at their offsets, never bytes a cut finished before the read began
    had removed, or a clear errno (a file or session gone, a range past the end)."""
    m = make_mount(size="24M")
    sids = [f"r{i}" for i in range(6)]
    for sid in sids:
        (m.sessions / sid).mkdir()
    w = Channel.open(str(m.mountpoint))
    readers = [Channel.open(str(m.mountpoint)) for _ in range(2)]
    assert w is not None and all(r is not None for r in readers)
    sizes: dict[tuple[str, str], int] = {}
    epochs: dict[tuple[str, str], int] = {}  # the epoch of the last cut finished
    cuts: dict[tuple[str, str], list[tuple[int, int]]] = {}  # (kept bytes, epoch) per cut
    lock = threading.Lock()
    stop = threading.Event()
    stats = {"reads": 0, "errors": 0, "cuts": 0}
    failures: list[str] = []

    def writer() -> None:
        rng = random.Random(11)
        epoch = 0
        while not stop.is_set():
            sid, name = rng.choice(sids), f"layer_{rng.randrange(3)}"
            key = (sid, name)
            size = sizes.get(key, 0)
            r = rng.random()
            try:
                if r < 0.7 or size == 0:
                    n = rng.randrange(1, 24)
                    e = epochs.get(key, 0)
                    data = b"".join(chunk(sid, name, size + i * CHUNK, e) for i in range(n))
                    w.write(sid, [Item(APPEND, name, size, data)])
                    with lock:
                        sizes[key] = size + len(data)
                else:
                    keep = rng.randrange(0, size // CHUNK) * CHUNK
                    epoch += 1
                    if r < 0.9:
                        w.write(sid, [Item(TRUNCATE, name, keep)])
                    else:
                        os.unlink(m.sessions / sid / name)
                        keep = 0
                    with lock:
                        sizes[key], epochs[key] = keep, epoch
                        cuts[key] = [*cuts.get(key, []), (keep, epoch)]
                    stats["cuts"] += 1
            except OSError as e:
                failures.append(f"writer: {e!r}")
                stop.set()

    def reader(ch: Channel, seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            sid, name = rng.choice(sids), f"layer_{rng.randrange(3)}"
            with lock:
                size, done = sizes.get((sid, name), 0), cuts.get((sid, name), [])
            if size < CHUNK:
                continue
            first = rng.randrange(size // CHUNK)
            n = min(rng.randrange(1, 12), size // CHUNK - first)
            out = bytearray(n * CHUNK)
            try:
                ch.read(sid, [(name, first * CHUNK, memoryview(out))])
            except (FileNotFoundError, ValueError):  # cut or gone since: a clear answer
                stats["errors"] += 1
                continue
            except OSError as e:
                failures.append(f"{sid}/{name}: {e!r}")
                continue
            try:
                for i in range(n):
                    at = (first + i) * CHUNK
                    got = check_chunk(bytes(out[i * CHUNK:(i + 1) * CHUNK]), sid, name, at)
                    # bytes a finished cut removed are never read again (those it kept may be)
                    floor = max((e for keep, e in done if keep <= at), default=0)
                    assert got >= floor, f"{sid}/{name}@{at}: epoch {got} read after cut {floor}"
            except AssertionError as e:
                failures.append(str(e))
            stats["reads"] += 1

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=reader, args=(r, 100 + i)) for i, r in enumerate(readers)]
    for t in threads:
        t.start()
    try:
        time.sleep(12)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    doc = json.loads((m.root / ".kvfs" / "stats").read_bytes())
    try:
        assert not failures, failures[:5]
        laps = doc["store"]["volume"]["head"] // doc["store"]["volume"]["capacity"]
        hits = sum(r.locator.catalog_hits for r in readers)
        assert stats["reads"] > 200 and stats["cuts"] > 20, stats
        assert laps >= 2, doc["store"]["volume"]
        assert hits > stats["reads"] // 10, (hits, stats)  # the catalog served many of them
    finally:
        for ch in (w, *readers):
            ch.close()


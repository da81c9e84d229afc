"""Quotas, usage records and the index budget (engine level; ``kvfs.engine.quota``).

One user filling the index region must end in EDQUOT/ENOSPC for that user, never in a
volume that cannot checkpoint, unmount or mount again; a volume whose index is already too
large for its tree region (written before the budget existed) mounts with every session."""

from __future__ import annotations

import os
import random

import pytest

from kvfs.engine import quota
from kvfs.engine.errors import IndexFull, NoSpace, QuotaExceeded
from kvfs.engine.faults import FaultyVolume, PowerCut
from kvfs.engine.format import NO_CKPT, SB_SLOT, Superblock
from kvfs.engine.fsck import CLEAN, PROBLEMS, check_volume
from kvfs.engine.quota import Ledger, session_use
from kvfs.engine.store import Store
from kvfs.engine.types import StoreConfig

MB = 1 << 20
LONG = 255


def long_name(i: int) -> str:
    return f"{i:06d}".ljust(LONG, "x")


def counted(store: Store) -> dict[int, tuple[int, int, int, int]]:
    """Usage counted from every session, as fsck does."""
    led = Ledger()
    for name in store.list_sessions():
        s = store.idx.find(name)
        led.add(s.uid, session_use(s))
    return {uid: led.of(uid) for uid in led.use}


def recorded(store: Store) -> dict[int, tuple[int, int, int, int]]:
    return {uid: store.quota.of(uid) for uid in store.quota.use}


@pytest.fixture
def vol(tmp_path) -> str:
    return str(tmp_path / "v.kvfs")


def test_session_quota_per_uid_root_exempt(vol) -> None:
    s = Store.create(vol, 16 * MB, StoreConfig(quota_sessions=3))
    for i in range(3):
        s.create_session(f"a{i}", uid=1000)
    with pytest.raises(QuotaExceeded, match="uid 1000 holds 3 sessions"):
        s.create_session("a3", uid=1000)
    assert "a3" not in s.list_sessions()
    s.create_session("b0", uid=1001)  # another user still has room
    for i in range(10):
        s.create_session(f"r{i}", uid=0)  # root has no quota
    s.delete_session("a0")
    s.create_session("a3", uid=1000)
    assert recorded(s) == counted(s)
    s.close()


def test_byte_quota_refuses_whole_write_and_follows_chown(vol) -> None:
    s = Store.create(vol, 32 * MB, StoreConfig(quota_bytes=1 * MB))
    s.create_session("a", uid=1000)
    s.create_file("a", "layer_0")
    s.append("a", "layer_0", 0, b"x" * (MB - 10))
    with pytest.raises(QuotaExceeded, match="quota"):
        s.append("a", "layer_0", MB - 10, b"y" * 100)
    assert s.file_stat("a", "layer_0").size == MB - 10  # nothing of the refused write
    s.truncate("a", "layer_0", MB // 2)  # frees room
    s.append("a", "layer_0", MB // 2, b"z" * 1000)
    s.set_session_attrs("a", uid=1001)  # chown: the usage moves with the session
    assert s.quota.of(1000) == quota.NONE and s.quota.of(1001)[quota.BYTES] == MB // 2 + 1000
    assert s.quota_room("a") == MB - (MB // 2 + 1000)
    assert recorded(s) == counted(s)
    s.close()


def test_index_share_quota(vol) -> None:
    s = Store.create(vol, 64 * MB, StoreConfig(quota_index_share=0.1))
    lim = s.quota.limits
    assert 0 < lim.index < lim.budget
    with pytest.raises(QuotaExceeded, match="share"):
        for i in range(10_000):
            s.create_session(long_name(i), uid=1000)
    assert quota.tree_bytes(s.quota.of(1000)[quota.INDEX], s.quota.of(1000)[0]) <= lim.index
    s.create_session("other", uid=1001)
    s.close()


def test_auto_quotas_only_on_a_shared_volume(vol) -> None:
    auto = dict(quota_sessions=quota.AUTO, quota_bytes=quota.AUTO, quota_index_share=quota.AUTO)
    s = Store.create(vol, 64 * MB, StoreConfig(**auto))
    assert (s.quota.limits.sessions, s.quota.limits.bytes, s.quota.limits.index) == (0, 0, 0)
    s.close()
    s = Store.open(vol, StoreConfig(**auto, shared=True))
    lim = s.quota.limits
    assert lim.bytes == s.ring.size // 4
    assert lim.index == lim.budget // 4 and lim.sessions == max(16, lim.index // 1024)
    s.close()


def test_index_budget_is_enospc_and_the_volume_stays_usable(vol) -> None:
    """The reproduction: long-named sessions until the index is full. Before the budget
    the checkpoint failed, closing failed and no later open succeeded."""
    s = Store.create(vol, 64 * MB)
    n = 0
    with pytest.raises(IndexFull) as e:
        for n in range(20_000):  # noqa: B007
            s.create_session(long_name(n), uid=1000)
    assert isinstance(e.value, NoSpace)
    s.checkpoint()
    s.close()
    s = Store.open(vol)
    assert len(s.list_sessions()) == n and not s.ring_only
    for i in range(0, n, 2):
        s.delete_session(long_name(i))
    s.create_session("after-delete", uid=1000)
    s.close()
    assert check_volume(vol).status == CLEAN


def test_usage_records_survive_close_crash_and_replay(vol) -> None:
    rng = random.Random(3)
    s = Store.create(vol, 32 * MB, StoreConfig(hot_sessions=2))
    for step in range(300):
        names = s.list_sessions()
        op = rng.random()
        if op < 0.2 or not names:
            s.create_session(f"s{step}", uid=rng.choice((0, 1000, 1001)))
        elif op < 0.3:
            s.delete_session(rng.choice(names))
        else:
            name = rng.choice(names)
            files = s.list_files(name)
            if op < 0.4 or not files:
                s.create_file(name, f"f{step}")
            elif op < 0.45:
                s.delete_file(name, rng.choice(files))
            elif op < 0.5:
                f = rng.choice(files)
                s.truncate(name, f, rng.randint(0, s.file_stat(name, f).size))
            elif op < 0.52:
                s.set_session_attrs(name, uid=rng.choice((1000, 1001)))
            else:
                f = rng.choice(files)
                s.append(name, f, s.file_stat(name, f).size, os.urandom(rng.randint(1, 5000)))
        if step == 150:
            s.checkpoint()
    want = counted(s)
    assert recorded(s) == want
    s.sync()
    s.crash()  # replay after the checkpoint at step 150 moves its records on
    s = Store.open(vol, StoreConfig(hot_sessions=2))
    assert s.counters["full_scans"] == 0
    assert recorded(s) == counted(s) == want
    s.close()
    s = Store.open(vol)
    assert recorded(s) == want
    s.close()
    assert check_volume(vol).status == CLEAN


def test_power_cuts_keep_usage_records_right(tmp_path) -> None:
    rng = random.Random(11)
    path = str(tmp_path / "f.kvfs")
    Store.create(path, 8 * MB, StoreConfig(hot_sessions=2)).close()
    for trial in range(25):
        s = Store.open(path, StoreConfig(hot_sessions=2, write_buffer=8 << 10), volume=FaultyVolume)
        try:
            for k in range(rng.randint(1, 30)):
                names = s.list_sessions()
                if not names or rng.random() < 0.2:
                    s.create_session(f"t{trial}-{k}", uid=rng.choice((0, 7, 8)))
                    s.create_file(f"t{trial}-{k}", "l0")
                elif rng.random() < 0.15:
                    s.delete_session(rng.choice(names))
                else:
                    n = rng.choice(names)
                    for f in s.list_files(n):
                        s.append(n, f, s.file_stat(n, f).size, os.urandom(rng.randint(1, 60_000)))
                if rng.random() < 0.2:
                    s.sync()
                if rng.random() < 0.1:
                    s.checkpoint()
        except PowerCut:
            pass
        s.vol.power_cut(keep=rng.randint(0, 3), tear=rng.randint(0, 4000) if rng.random() < 0.5 else None)
        s.crash()
        s = Store.open(path, StoreConfig(hot_sessions=2))
        assert recorded(s) == counted(s), trial
        s.close()


def test_checkpoint_without_usage_records_is_counted_by_a_full_scan(vol) -> None:
    """A volume of a kvfs before usage records: the first open counts them."""
    s = Store.create(vol, 16 * MB)
    for i in range(5):
        s.create_session(f"s{i}", uid=1000 + i % 2)
        s.create_file(f"s{i}", "l")
        s.append(f"s{i}", "l", 0, b"k" * (1000 * i))
    s.checkpoint()
    want = counted(s)
    s.tree.commit({k: None for k, _ in s.tree.scan(b"U")})  # as an older kvfs wrote it
    s.checkpoint()  # (its own records stay dirty only when they changed: none did)
    s.vol.sync()
    sb = s.sb
    s.crash()
    assert sb.ckpt_pos != NO_CKPT
    s = Store.open(vol, readonly=True)
    assert s.full_scan_why == "no usage records" and recorded(s) == want
    s.crash()
    assert check_volume(vol, repair=True).status == PROBLEMS
    s = Store.open(vol)
    assert s.counters["full_scans"] == 0 and recorded(s) == want
    s.close()


def test_wrong_usage_records_are_found_and_repaired(vol) -> None:
    s = Store.create(vol, 16 * MB)
    s.create_session("a", uid=1000)
    s.create_file("a", "l")
    s.append("a", "l", 0, b"q" * 5000)
    s.quota.add(1000, (3, 0, 0, 0))  # a bug's miscount, checkpointed
    s.close()
    res = check_volume(vol)
    assert res.status == PROBLEMS and any("usage of uid 1000" in p for p in res.problems)
    assert check_volume(vol, repair=True).status == PROBLEMS
    assert check_volume(vol).status == CLEAN


# ------------------------------------------------------------------ ring-only fallback
def overflowing(path: str, n: int, monkeypatch) -> list[str]:
    """A 64 MiB volume whose index does not fit its tree region, as a kvfs without the
    index budget wrote it."""
    with monkeypatch.context() as m:
        m.setattr(quota.Ledger, "admit", lambda self, uid, **kw: None)
        s = Store.create(path, 64 * MB)
        names = [long_name(i) for i in range(n)]
        for i, name in enumerate(names):
            s.create_session(name, uid=1000 + i % 3)
        s.create_file(names[0], "layer_0")
        s.append(names[0], "layer_0", 0, b"kv" * 50_000)
        s.close()  # the old kvfs failed here: "index region full, cannot checkpoint"
    return names


def test_an_index_too_large_for_its_region_stays_in_the_ring(vol, monkeypatch) -> None:
    names = overflowing(vol, 4000, monkeypatch)
    s = Store.open(vol)
    assert s.ring_only and s.full_scan_why == "ring-only"
    assert s.list_sessions() == sorted(names)
    assert s.read(names[0], "layer_0", 0, 10**6) == b"kv" * 50_000
    with pytest.raises(IndexFull):
        s.create_session("new")
    s.close()
    res = check_volume(vol)
    assert res.status == PROBLEMS and res.sessions == len(names)
    assert any("kept in the ring only" in p for p in res.problems)
    rep = check_volume(vol, repair=True)  # fsck and repair agree: problems, never unusable
    assert rep.status == PROBLEMS and any("mounts with every session" in r for r in rep.repaired)
    s = Store.open(vol)
    assert s.list_sessions() == sorted(names)
    for name in names[:3000]:  # the owner deletes; the checkpoint comes back
        s.delete_session(name)
    s.checkpoint()
    assert not s.ring_only
    s.close()
    assert check_volume(vol).status == CLEAN
    s = Store.open(vol)
    assert s.counters["full_scans"] == 0 and s.list_sessions() == sorted(names[3000:])
    assert recorded(s) == counted(s)
    s.close()


def test_ring_only_superblock_torn_and_truncated(vol, monkeypatch) -> None:
    names = overflowing(vol, 4000, monkeypatch)
    fd = os.open(vol, os.O_RDWR)
    try:
        slots = [Superblock.unpack(os.pread(fd, SB_SLOT, i * SB_SLOT)) for i in (0, 1)]
        newest = max(range(2), key=lambda i: slots[i].seq)
        assert slots[newest].ckpt_pos == NO_CKPT
        raw = bytearray(os.pread(fd, SB_SLOT, newest * SB_SLOT))
        raw[100] ^= 0x10  # a flipped bit: the other slot is used
        os.pwrite(fd, bytes(raw), newest * SB_SLOT)
        s = Store.open(vol, readonly=True)
        assert s.list_sessions() == sorted(names)
        s.crash()
        os.pwrite(fd, bytes(200), newest * SB_SLOT)  # torn to zeros
        s = Store.open(vol, readonly=True)
        assert s.list_sessions() == sorted(names)
        s.crash()
        size = os.fstat(fd).st_size
        os.ftruncate(fd, size - MB)  # a truncated file: its layout no longer fits
        res = check_volume(vol)
        assert res.status == 2 and "the file's size" in res.problems[0], res.problems
    finally:
        os.close(fd)


def test_usage_record_flipped_or_crafted_falls_back_to_the_ring(vol) -> None:
    import crc32c

    from kvfs.engine.btree_page import CRC, CRC_OFF, HDR

    s = Store.create(vol, 16 * MB)
    s.create_session("a", uid=1000)
    s.create_file("a", "l")
    s.append("a", "l", 0, b"d" * 3000)
    s.close()
    s = Store.open(vol, readonly=True)
    want = recorded(s)
    r = s.tree.root
    page_off = s.tree.region_offset + (r.half * s.tree.half_pages + r.root) * s.tree.page_size
    s.crash()
    fd = os.open(vol, os.O_RDWR)
    try:
        page = bytearray(os.pread(fd, 4096, page_off))
        i = page.find(b"U\x00\x00\x03\xe8")  # the key of uid 1000
        assert i > 0
        page[i + 5 + 0] ^= 0x01  # bit flip in its value: the page checksum catches it
        os.pwrite(fd, bytes(page), page_off)
        s = Store.open(vol, readonly=True)
        assert s.counters["full_scans"] == 1 and recorded(s) == want
        s.crash()
        page[CRC_OFF:HDR.size] = b"\0\0\0\0"
        CRC.pack_into(page, CRC_OFF, crc32c.crc32c(bytes(page)))  # crafted: checksum right
        os.pwrite(fd, bytes(page), page_off)
        s = Store.open(vol, readonly=True)
        assert s.counters["full_scans"] == 1 and recorded(s) == want
        s.crash()
    finally:
        os.close(fd)
    assert check_volume(vol, repair=True).status == PROBLEMS
    assert check_volume(vol).status == CLEAN

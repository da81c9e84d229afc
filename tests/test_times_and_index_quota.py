"""Index space and file times: nothing a user does can fill the index with nothing, and no
time a user sets can fail a record or a checkpoint (``kvfs.engine.index``, ``quota``,
``records``).

Deleting a session must give back every byte of index budget it took, also after a
remount and after recovery; the live-session bitmap once kept a chunk per 8,000 session
numbers ever used, so mkdir/rmdir pairs alone filled the budget (ENOSPC for everyone).
Times are signed nanoseconds since the epoch: the whole range is stored exactly, and a
time outside it is refused (EOVERFLOW) before anything changes."""

from __future__ import annotations

import pytest

from kvfs.engine.errors import BadId, IndexFull, QuotaExceeded, RecordFull, TimeRange
from kvfs.engine.format import HDR_SIZE, SMETA_FMT, TIME_MAX, TIME_MIN, U32_MAX
from kvfs.engine.fsck import CLEAN, PROBLEMS, UNUSABLE, check_volume
from kvfs.engine.index import BITMAP_CHUNK, BITS
from kvfs.engine.quota import BITMAP_BYTES
from kvfs.engine.records import MAX_RECORD, chunk_key, session_key_sno
from kvfs.engine.store import Store
from kvfs.engine.types import StoreConfig

MB = 1 << 20
# a 16 MiB volume's index budget scaled down to about 5 KiB: five bitmap chunks fill it
SMALL = StoreConfig(index_fill=0.01)


@pytest.fixture
def vol(tmp_path) -> str:
    return str(tmp_path / "v.kvfs")


def churn(s: Store, n: int, uid: int) -> None:
    for _ in range(n):
        s.create_session("d", uid=uid)
        s.delete_session("d")


def test_deleted_sessions_give_back_their_index_budget(vol) -> None:
    s = Store.create(vol, 16 * MB, SMALL)
    base = s.quota.estimate()
    churn(s, 6 * BITS, uid=4301)  # six chunks' worth of session numbers, none left alive
    assert s.quota.estimate() == base and not s.idx.chunks
    s.create_session("other", uid=4302)  # another user is not refused for nothing
    s.checkpoint()
    s.close()
    s = Store.open(vol, SMALL)
    assert sorted(s.idx.chunks) == [6]  # only the chunk of "other"
    s.crash()
    r = check_volume(vol)
    assert r.status == CLEAN, r.problems
    assert r.index_used <= base + BITMAP_BYTES + 200 and r.index_budget > r.index_used


def test_recovery_replaying_deletes_holds_no_empty_chunk(vol) -> None:
    s = Store.create(vol, 16 * MB, SMALL)
    s.checkpoint()
    churn(s, BITS + 10, uid=4301)  # only in the ring: the open replays every pair
    s.ring.sync()
    s.crash()
    s = Store.open(vol, SMALL)
    assert not s.idx.chunks and s.list_sessions() == []
    s.create_session("after", uid=4301)
    s.close()


def test_a_checkpoint_full_of_empty_chunks_is_flagged_and_released(vol) -> None:
    s = Store.create(vol, 16 * MB, SMALL)
    s.create_session("kept", uid=4301)
    for i in range(1, 5):  # what older kvfs left after mkdir/rmdir churn
        s.idx.chunks[i] = bytearray(BITMAP_CHUNK)
        s.idx.bitmap_dirty.add(i)
    s.next_sno = 5 * BITS
    s.checkpoint()
    s.crash()
    r = check_volume(vol)
    assert r.status == PROBLEMS
    assert any("4 bitmap chunks" in p and "held by nothing" in p for p in r.problems), r.problems
    r = check_volume(vol, repair=True)
    assert "4 empty bitmap chunks deleted" in r.repaired
    r = check_volume(vol)
    assert r.status == CLEAN, r.problems
    assert r.index_by_uid == {4301: r.index_by_uid[4301]} and r.index_by_uid[4301] > 0
    s = Store.open(vol, SMALL)
    assert sorted(s.idx.chunks) == [0] and s.list_sessions() == ["kept"]
    s.close()


def test_index_quota_per_uid_others_still_create_across_a_remount(vol) -> None:
    cfg = StoreConfig(index_fill=0.05, quota_index_share=0.25)
    s = Store.create(vol, 16 * MB, cfg)
    churn(s, 2 * BITS, uid=4301)
    made = 0
    with pytest.raises(QuotaExceeded, match="uid 4301 uses"):
        for made in range(10_000):
            s.create_session(f"a{made:04d}".ljust(200, "x"), uid=4301)
    assert made > 5
    s.create_session("b", uid=4302)  # the other user is under its own share
    s.close()
    s = Store.open(vol, cfg)
    with pytest.raises(QuotaExceeded):
        s.create_session("late".ljust(200, "x"), uid=4301)
    s.create_session("b2", uid=4302)
    s.delete_session(f"a{0:04d}".ljust(200, "x"))  # deleting gives the share back
    s.create_session("late".ljust(200, "x"), uid=4301)
    for i in range(1, made):
        s.delete_session(f"a{i:04d}".ljust(200, "x"))
    assert s.quota.of(4301)[0] == 1
    s.close()
    r = check_volume(vol)
    assert r.status == CLEAN, r.problems
    assert set(r.index_by_uid) == {4301, 4302}


def test_the_budget_never_refuses_for_nothing(vol) -> None:
    s = Store.create(vol, 16 * MB, SMALL)
    try:
        churn(s, 8 * BITS, uid=0)
    except IndexFull as e:  # what empty bitmap chunks did
        pytest.fail(f"index budget full of deleted sessions: {e}")
    s.close()


# ---------------------------------------------------------------------------- times
EXTREMES = [TIME_MIN, -(10**18) - 123_456_789, -1, 0, 1, 1_700_000_000_123_456_789, TIME_MAX]


def times_of(s: Store) -> list[tuple]:
    out = []
    for name in sorted(s.list_sessions()):
        st = s.session_stat(name)
        out.append((name, st.mode, st.uid, st.gid, st.mtime_ns, st.atime_ns))
        for f in s.list_files(name):
            ft = s.file_stat(name, f)
            out.append((name, f, ft.mode, ft.uid, ft.gid, ft.mtime_ns, ft.atime_ns))
    return out


def test_every_time_a_record_holds_is_stored_exactly(vol) -> None:
    s = Store.create(vol, 16 * MB)
    for i, ns in enumerate(EXTREMES):
        s.create_session(f"s{i}", uid=4301)
        s.create_file(f"s{i}", "f", uid=4301)
        # a mode change writes the attributes to the ring too (T_SMETA / T_FMETA)
        s.set_session_attrs(f"s{i}", mode=0o750, uid=U32_MAX - 1, gid=U32_MAX - 1,
                            atime_ns=ns, mtime_ns=ns)
        s.set_file_attrs(f"s{i}", "f", mode=0o7777, uid=U32_MAX - 1, gid=0, atime_ns=ns,
                         mtime_ns=ns)
    want = times_of(s)
    assert [w[4] for w in want if len(w) == 6] == EXTREMES
    s.checkpoint()
    s.close()
    s = Store.open(vol)
    assert times_of(s) == want
    s.checkpoint()  # and checkpoints again
    s.close()
    assert check_volume(vol).status == CLEAN


@pytest.mark.parametrize("bad", [TIME_MAX + 1, TIME_MIN - 1, 1 << 70, -(1 << 70)])
def test_a_time_no_record_holds_is_refused_before_anything_changes(vol, bad) -> None:
    s = Store.create(vol, 16 * MB)
    s.create_session("a", uid=4301)
    s.create_file("a", "f", uid=4301)
    before = times_of(s)
    with pytest.raises(TimeRange):
        s.set_session_attrs("a", mode=0o700, atime_ns=0, mtime_ns=bad)
    with pytest.raises(TimeRange):
        s.set_file_attrs("a", "f", mode=0o600, atime_ns=bad)
    assert times_of(s) == before
    s.checkpoint()  # the checkpoint and the other users' writes go on
    s.append("a", "f", 0, b"x" * 100)
    after = times_of(s)
    s.close()
    s = Store.open(vol)
    assert times_of(s) == after and s.read("a", "f", 0, 100) == b"x" * 100
    s.close()


@pytest.mark.parametrize("bad", [1e19, -1e19, float("inf"), float("nan"), 1e300])
def test_float_times_out_of_range_are_refused(vol, bad) -> None:
    s = Store.create(vol, 16 * MB)
    s.create_session("a")
    with pytest.raises(TimeRange):
        s.set_session_attrs("a", mtime=bad)
    s.set_session_attrs("a", mtime=-1.5)  # before 1970 is a time
    assert s.session_stat("a").mtime_ns == -1_500_000_000
    s.close()


@pytest.mark.parametrize("field,bad", [("uid", U32_MAX + 1), ("gid", -1), ("mode", 1 << 32),
                                       ("uid", -5)])
def test_ids_that_do_not_fit_are_refused(vol, field, bad) -> None:
    s = Store.create(vol, 16 * MB)
    s.create_session("a")
    s.create_file("a", "f")
    with pytest.raises(BadId):
        s.set_session_attrs("a", **{field: bad})
    with pytest.raises(BadId):
        s.set_file_attrs("a", "f", **{field: bad})
    with pytest.raises(BadId):
        s.create_session("b", **{field: bad})
    with pytest.raises(BadId):
        s.create_file("a", "g", **{field: bad})
    assert s.list_sessions() == ["a"] and s.list_files("a") == ["f"]
    s.close()
    assert check_volume(vol).status == CLEAN


def _negative_time_volume(vol: str) -> tuple[int, list]:
    """A volume whose ring (past the checkpoint) holds attribute entries with negative
    times; returns the volume offset of the session's entry and what a clean open sees."""
    s = Store.create(vol, 16 * MB)
    s.checkpoint()
    s.create_session("neg", uid=4301)
    s.create_file("neg", "f", uid=4301)
    s.set_file_attrs("neg", "f", mode=0o640, mtime_ns=-(10**18))
    s.set_session_attrs("neg", mode=0o750, mtime_ns=-(10**18))
    off = s.ring.phys(s.idx.find("neg").meta_pos)
    s.create_session("later")  # the entry is inside the ring, not its torn tail
    s.ring.sync()
    s.crash()
    return off, []


def test_negative_time_entries_replay(vol) -> None:
    _negative_time_volume(vol)
    s = Store.open(vol)
    assert s.session_stat("neg").mode == 0o750 and s.file_stat("neg", "f").mode == 0o640
    s.close()
    assert check_volume(vol).status == CLEAN


@pytest.mark.parametrize("how", ["flip", "tear", "truncate"])
def test_negative_time_entries_torn_truncated_or_flipped(vol, how) -> None:
    off, _ = _negative_time_volume(vol)
    with open(vol, "r+b") as fh:
        if how == "truncate":  # the volume file cut inside the entry: refused, not a crash
            fh.truncate(off + 40)
        else:
            fh.seek(off)
            raw = bytearray(fh.read(HDR_SIZE + SMETA_FMT.size + 3))
            if how == "flip":
                for i in range(HDR_SIZE, HDR_SIZE + SMETA_FMT.size):  # the times' bytes too
                    raw[i] ^= 0x80
            else:
                raw[HDR_SIZE // 2:] = bytes(len(raw) - HDR_SIZE // 2)
            fh.seek(off)
            fh.write(raw)
    r = check_volume(vol)
    assert r.status in (PROBLEMS, UNUSABLE) and r.problems
    if how != "truncate":
        s = Store.open(vol, force=True)
        assert "later" in s.list_sessions()
        for name in s.list_sessions():  # whatever survived is readable and checkpoints
            st = s.session_stat(name)
            assert TIME_MIN <= st.mtime_ns <= TIME_MAX
        s.create_session("after")
        s.close()


def test_one_session_record_never_grows_past_what_its_keys_number(vol) -> None:
    """A record over ``MAX_RECORD`` (65,535 chunks) has no key for its last chunks: every
    checkpoint would fail. Scaled down here; files and extents both grow a record."""
    s = Store.create(vol, 16 * MB)
    s.max_record = 3000
    s.create_session("big", uid=4301)
    made = 0
    with pytest.raises(RecordFull):
        for made in range(1000):
            s.create_file("big", f"f{made:03d}".ljust(100, "x"), uid=4301)
    assert 10 < made < 30
    with pytest.raises(RecordFull):
        for i in range(1000):
            s.append("big", "f000".ljust(100, "x"), i, b"y")
    s.create_session("small", uid=4301)  # other sessions of the same user go on
    s.create_file("small", "f", uid=4301)
    s.checkpoint()
    assert len(s.idx.find("big").encode()) <= 3000
    s.close()
    s = Store.open(vol)
    assert len(s.list_files("big")) == made
    s.close()
    assert check_volume(vol).status == CLEAN
    assert MAX_RECORD == 1000 * 0xFFFF
    with pytest.raises(OverflowError):  # what the limit keeps away from the checkpoint
        chunk_key(0, 1, MAX_RECORD // 1000 + 1)


def test_records_of_sessions_that_are_gone_are_flagged_and_purged(vol) -> None:
    s = Store.create(vol, 16 * MB)
    for name in ("gone", "kept"):
        s.create_session(name, uid=4301)
    s.checkpoint()
    sno = s.idx.find("gone").sno
    s.idx.set_live(sno, False)  # the bit cleared but its record left in the tree
    s.checkpoint()
    s.crash()
    r = check_volume(vol)
    assert r.status == PROBLEMS
    assert any("1 session records of sessions that no longer exist" in p for p in r.problems)
    r = check_volume(vol, repair=True)
    assert "1 records of deleted sessions purged" in r.repaired
    r = check_volume(vol)
    assert r.status == CLEAN, r.problems
    s = Store.open(vol)
    assert s.list_sessions() == ["kept"]
    assert [session_key_sno(k) for k, _ in s.tree.scan(b"S")] == [s.idx.find("kept").sno]
    s.close()


def test_kvfs_fsck_prints_the_index_budget_per_uid(vol, capsys) -> None:
    from kvfs.cli import fsck as fsck_cli

    s = Store.create(vol, 16 * MB, StoreConfig(quota_index_share=0.25))
    s.create_session("a", uid=4301)
    s.create_session("b", uid=4302)
    s.close()
    assert fsck_cli.main([vol, "-q"]) == CLEAN
    out = capsys.readouterr().out
    assert "index: about " in out and " bytes of its budget" in out
    assert "  uid 4301: " in out and "  uid 4302: " in out

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

from kvfs.engine.errors import IndexFull, QuotaExceeded
from kvfs.engine.fsck import CLEAN, PROBLEMS, check_volume
from kvfs.engine.index import BITMAP_CHUNK, BITS
from kvfs.engine.quota import BITMAP_BYTES
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

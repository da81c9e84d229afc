"""Giving the C heap's free pages back (kvfs.ops.heap): the trimmer's rate limit, and the
router trimming after releases."""

from __future__ import annotations

import pytest

from kvfs.ops import heap
from kvfs.ops.heap import HeapTrimmer


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_trims_at_most_once_per_interval() -> None:
    calls: list[int] = []
    clock = FakeClock()
    t = HeapTrimmer(10.0, trim=lambda pad: calls.append(pad) or 1, clock=clock)
    assert t.maybe_trim()  # the first ask trims
    for _ in range(40):  # a burst of releases within the interval: no more trims
        clock.t += 0.1
        assert not t.maybe_trim()
    clock.t += 6.5  # 10.5 s after the first
    assert t.maybe_trim()
    assert calls == [0, 0] and t.trims == 2 and t.stats()["trims"] == 2


def test_zero_interval_or_no_glibc_never_trims() -> None:
    calls: list[int] = []
    assert not HeapTrimmer(0, trim=lambda pad: calls.append(pad) or 1).maybe_trim()
    off = HeapTrimmer(10.0, trim=None)
    assert not off.enabled and not off.maybe_trim()
    assert calls == []


@pytest.mark.skipif(not heap.available(), reason="no glibc malloc_trim here")
def test_real_trim_runs_and_counts() -> None:
    t = HeapTrimmer(10.0)
    blocks = [bytearray(4096) for _ in range(2000)]  # freed below: holes for malloc to keep
    del blocks[::2]
    assert t.maybe_trim()
    assert t.trims == 1 and t.trim_s >= 0 and t.returned_bytes >= 0
    assert heap.resident_bytes()


def test_router_trims_after_releases_at_most_once_per_interval(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvfs.torch import KVRouter
    from kvfs.torch.reference import tiny_llama

    model = tiny_llama(seed=0)
    calls: list[int] = []
    clock = FakeClock()
    (tmp_path / "cold" / "sessions").mkdir(parents=True)  # the layout of a mounted volume
    r = KVRouter(mount=str(tmp_path / "cold"), warm_root=str(tmp_path / "warm"),
                 warm_options={"shards": 16}, retrieval=False)
    assert r.heap.enabled == heap.available() and r.heap.interval_s == heap.DEFAULT_INTERVAL_S
    r.heap = HeapTrimmer(5.0, trim=lambda pad: calls.append(pad) or 1, clock=clock)
    ids = torch.arange(8).view(1, -1)
    try:
        for i in range(6):  # six sessions released within one interval: one trim
            c = r.cache(f"s{i}", model)
            with torch.no_grad():
                model(input_ids=ids, cache=c, use_cache=True)
            c.end_round()
            r.release(f"s{i}")
            clock.t += 0.5
        assert len(calls) == 1
        clock.t += 5.0
        r.release("nobody")  # not live: nothing freed, nothing to trim
        assert len(calls) == 1
        c = r.cache("s0", model)
        r.release("s0")
        assert len(calls) == 2 and r.stats()["heap"]["trims"] == 2
    finally:
        r.close()

"""kvfs.btree: the on-disk copy-on-write B+ tree (index checkpoint)."""

from __future__ import annotations

import os
import random
import tempfile

import pytest
from conftest import OFFSET, SMALL, key, zeroed
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfs.engine import btree
from kvfs.engine.btree import TREE_ROOT_SIZE, BTree, TreeFull, TreeRoot
from kvfs.engine.errors import Corrupt, KVFSError


def dump(t: BTree) -> dict[bytes, bytes]:
    return dict(t.scan())


# ---- the root record ----

def test_root_pack_roundtrip_and_padding():
    r = TreeRoot(root=7, height=3, count=1234, half=1, alloc=99, prev_half=0, generation=42)
    raw = r.pack()
    assert len(raw) == TREE_ROOT_SIZE <= 64
    assert TreeRoot.unpack(raw) == r
    assert TreeRoot.unpack(raw.ljust(64, b"\0")) == r  # as stored in the superblock area
    assert TreeRoot.unpack(TreeRoot.empty().pack()) == TreeRoot.empty()


@pytest.mark.parametrize("raw", [b"", b"\0" * 10, b"\xff" * TREE_ROOT_SIZE,
                                 TreeRoot(5, 0, 0, 0, 9, -1, 1).pack(),
                                 TreeRoot(5, 1, 1, 0, 5, -1, 1).pack()])
def test_root_unpack_rejects_garbage(raw):
    with pytest.raises(Corrupt):
        TreeRoot.unpack(raw)


# ---- model-based ----

KEYS = 150


class TreeMachine(RuleBasedStateMachine):
    """Random puts/deletes/commits vs a dict, in 80 pages of 512 bytes (40 per half)."""

    PAGES = 80

    def __init__(self):
        super().__init__()
        fd, self.path = tempfile.mkstemp(prefix="kvfs-btree-")
        os.close(fd)
        self.vol = zeroed(self.path, OFFSET + self.PAGES * SMALL)
        self.tree = self._open(TreeRoot.empty())
        self.model: dict[bytes, bytes] = {}
        self.pending: dict[bytes, bytes | None] = {}
        self.prev: tuple[TreeRoot, dict[bytes, bytes]] | None = None

    def _open(self, root: TreeRoot) -> BTree:
        return BTree(self.vol, OFFSET, self.PAGES, root, page_size=SMALL, cache_pages=8)

    def teardown(self):
        self.vol.close()
        os.unlink(self.path)

    @rule(i=st.integers(0, KEYS), n=st.integers(0, 120))
    def put(self, i, n):
        self.pending[key(i)] = bytes([i]) * n

    @rule(i=st.integers(0, KEYS))
    def delete(self, i):
        self.pending[key(i)] = None

    @rule(a=st.integers(0, KEYS), n=st.integers(1, 80), size=st.integers(0, 30),
          now=st.booleans())
    def put_range(self, a, n, size, now):
        self.pending.update({key(i): b"r%d" % i * size for i in range(a, a + n)})
        if now:
            self.commit()

    @rule(a=st.integers(0, KEYS), n=st.integers(1, 80), step=st.integers(1, 3),
          now=st.booleans())
    def delete_range(self, a, n, step, now):
        self.pending.update({key(i): None for i in range(a, a + n, step)})
        if now:
            self.commit()

    @rule()
    def commit(self):
        before, expect = self.tree.root, dict(self.model)
        for k, v in self.pending.items():
            if v is None:
                expect.pop(k, None)
            else:
                expect[k] = v
        try:
            root = self.tree.commit(self.pending)
        except TreeFull:
            assert self.tree.root == before
        else:
            assert root == self.tree.root
            if root != before:
                assert root.generation == before.generation + 1
                self.prev = (before, self.model)
            self.model = expect
        self.pending = {}

    @rule(i=st.integers(0, KEYS + 10))
    def get(self, i):
        assert self.tree.get(key(i)) == self.model.get(key(i))

    @rule(prefix=st.sampled_from([b"", b"k", b"k0001", b"k0004", b"k00050", b"x"]),
          start=st.none() | st.integers(0, KEYS + 10).map(key))
    def scan(self, prefix, start):
        want = [(k, v) for k, v in sorted(self.model.items())
                if k.startswith(prefix) and (start is None or k >= start)]
        assert list(self.tree.scan(prefix, start)) == want

    @rule()
    def reopen(self):
        self.tree = self._open(TreeRoot.unpack(self.tree.root.pack()))

    @precondition(lambda self: self.prev is not None)
    @rule()
    def previous_root_still_reads(self):
        root, model = self.prev
        old = self._open(root)
        assert dump(old) == model
        assert old.check() == []

    @invariant()
    def consistent(self):
        assert self.tree.root.count == len(self.model)
        assert self.tree.check() == []
        assert dump(self.tree) == self.model


TreeMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_model = TreeMachine.TestCase


def test_random_long_run_covers_all_paths(region):
    """Deterministic long walk; asserts that splits, merges and compactions all happened."""
    vol = region(60)
    t = BTree(vol, OFFSET, 60, TreeRoot.empty(), page_size=SMALL, cache_pages=16)
    rng = random.Random(7)
    model: dict[bytes, bytes] = {}
    halves, heights, full = set(), set(), 0
    for _ in range(300):
        changes: dict[bytes, bytes | None] = {}
        for _ in range(rng.choice([1, 3, 20])):
            i = rng.randrange(150)
            changes[key(i)] = None if rng.random() < 0.45 else os.urandom(rng.randrange(90))
        prev_root, prev_model = t.root, dict(model)
        try:
            t.commit(changes)
        except TreeFull:
            full += 1
            assert t.root == prev_root
            continue
        for k, v in changes.items():
            if v is None:
                model.pop(k, None)
            else:
                model[k] = v
        halves.add(t.root.half)
        heights.add(t.root.height)
        assert dump(BTree(vol, OFFSET, 60, prev_root, page_size=SMALL)) == prev_model
        assert t.check() == []
    assert dump(t) == model
    assert halves == {0, 1} and max(heights) >= 3 and min(heights) <= 2


# ---- scans ----

def test_scan_prefix_and_start(region):
    vol = region(64, 4096)
    t = BTree(vol, OFFSET, 64, TreeRoot.empty())
    names = [b"a", b"ab", b"abc", b"abd", b"b", b"ba", b"bb\xff", b"c"]
    t.commit({k: k.upper() for k in names})
    keys = lambda **kw: [k for k, _ in t.scan(**kw)]  # noqa: E731
    assert keys() == names
    assert keys(prefix=b"ab") == [b"ab", b"abc", b"abd"]
    assert keys(prefix=b"ab", start=b"abc") == [b"abc", b"abd"]
    assert keys(prefix=b"ab", start=b"a") == [b"ab", b"abc", b"abd"]  # start before prefix
    assert keys(prefix=b"ab", start=b"ac") == []  # start past the prefix
    assert keys(start=b"abz") == [b"b", b"ba", b"bb\xff", b"c"]
    assert keys(prefix=b"bb") == [b"bb\xff"]
    assert keys(prefix=b"zz") == [] and keys(start=b"d") == []
    assert list(t.scan(prefix=b"c")) == [(b"c", b"C")]


def test_scan_across_many_leaves(region):
    vol = region(400)
    t = BTree(vol, OFFSET, 400, TreeRoot.empty(), page_size=SMALL)
    t.commit({b"%04d" % i: b"v" * 20 for i in range(2000)})
    assert t.root.height >= 3
    assert [k for k, _ in t.scan(prefix=b"12")] == [b"%04d" % i for i in range(1200, 1300)]
    assert [k for k, _ in t.scan(start=b"1995")] == [b"%04d" % i for i in range(1995, 2000)]
    assert len(list(t.scan())) == 2000


# ---- commits, compaction, TreeFull ----

def test_empty_and_noop_commits_keep_the_root(region):
    vol = region(20)
    t = BTree(vol, OFFSET, 20, TreeRoot.empty(), page_size=SMALL)
    assert t.commit({}) == TreeRoot.empty()
    assert t.commit({b"absent": None}) == TreeRoot.empty()
    r = t.commit({b"a": b"1"})
    assert (r.count, r.height, r.generation, r.prev_half) == (1, 1, 1, -1)
    assert t.commit({b"a": b"1", b"zz": None}) is r  # same value, absent delete
    r2 = t.commit({b"a": None})
    assert (r2.root, r2.height, r2.count, r2.prev_half) == (-1, 0, 0, 0)
    assert t.get(b"a") is None and list(t.scan()) == [] and t.check() == []


def test_commit_writes_few_pages_in_one_pwrite(region, monkeypatch):
    vol = region(2000)
    t = BTree(vol, OFFSET, 2000, TreeRoot.empty(), page_size=SMALL)
    t.commit({key(i): b"x" * 30 for i in range(3000)})
    writes = []
    real = vol.pwrite
    monkeypatch.setattr(vol, "pwrite", lambda d, o: writes.append(len(d)) or real(d, o))
    before = t.root.alloc
    t.commit({key(1500): b"new", key(10): None, key(2999): b"y"})
    assert len(writes) == 1  # the new pages are one contiguous run
    assert writes[0] == (t.root.alloc - before) * SMALL
    assert t.root.alloc - before <= 3 * (t.root.height + 1)  # O(k log n), not the tree
    assert t.get(key(1500)) == b"new" and t.get(key(10)) is None


def test_compaction_switches_half_and_keeps_data(region):
    vol = region(40)
    t = BTree(vol, OFFSET, 40, TreeRoot.empty(), page_size=SMALL)
    model = {key(i): b"v%d" % i for i in range(30)}
    t.commit(model)
    for n in range(40):  # rewrite one key at a time: garbage piles up in half 0
        k = key(n % 30)
        model[k] = b"w%d" % n
        before = t.root
        t.commit({k: model[k]})
        if t.root.half != before.half:
            break
    else:
        pytest.fail("never compacted")
    r = t.root
    assert (r.half, r.prev_half) == (1, 0)
    assert r.alloc < 20  # dense: the live tree only
    assert dump(t) == model and t.check() == []
    assert dump(BTree(vol, OFFSET, 40, before, page_size=SMALL)) != model  # old state, intact
    assert BTree(vol, OFFSET, 40, before, page_size=SMALL).check() == []


def test_tree_full_when_previous_root_holds_other_half(region):
    vol = region(40)
    t = BTree(vol, OFFSET, 40, TreeRoot.empty(), page_size=SMALL)
    t.commit({key(i): b"v" * 20 for i in range(30)})
    # a root in half 0 whose previous root also lives in half 1: no room to compact
    r = t.root
    stuck = TreeRoot(r.root, r.height, r.count, 0, 20, 1, r.generation)
    t2 = BTree(vol, OFFSET, 40, stuck, page_size=SMALL)
    with pytest.raises(TreeFull):
        t2.commit({key(1): b"changed"})
    assert t2.root == stuck and t2.get(key(1)) == b"v" * 20 and t2.check() == []


def test_tree_full_when_it_does_not_fit_a_half(region):
    vol = region(20)
    t = BTree(vol, OFFSET, 20, TreeRoot.empty(), page_size=SMALL)
    t.commit({key(i): b"v" * 10 for i in range(20)})
    before = t.root
    with pytest.raises(TreeFull) as e:
        t.commit({key(i): b"w" * 300 for i in range(100)})
    assert isinstance(e.value, KVFSError)
    assert t.root == before
    assert dump(t) == {key(i): b"v" * 10 for i in range(20)}
    assert t.check() == []
    t.commit({key(0): b"small"})  # still usable afterwards
    assert t.get(key(0)) == b"small"


# ---- scale and laziness ----

def test_100k_keys_then_one_get_reads_height_pages(region, monkeypatch):
    pages = 2400
    vol = region(pages, 4096)
    t = BTree(vol, OFFSET, pages, TreeRoot.empty())
    n = 100_000
    t.commit({b"sess/%08d" % i: b"%016d" % i for i in range(n)})
    root = TreeRoot.unpack(t.root.pack())
    assert root.count == n and root.height == 3

    reads = []
    real = vol.pread
    monkeypatch.setattr(vol, "pread", lambda n, o: reads.append(o) or real(n, o))
    t2 = BTree(vol, OFFSET, pages, root)
    assert reads == []  # opening is lazy
    assert t2.get(b"sess/%08d" % 76543) == b"%016d" % 76543
    assert len(reads) == root.height
    assert t2.get(b"sess/%08d" % 76544) == b"%016d" % 76544  # same path, all cached
    assert len(reads) == root.height
    assert t2.get(b"nope") is None
    assert t2.stats()["count"] == n and t2.stats()["height"] == 3


# ---- argument checks ----

@pytest.mark.parametrize("changes, exc", [
    ({b"": b"v"}, ValueError),
    ({b"k" * 65: b"v"}, ValueError),
    ({b"ok": b"v", b"big": b"x" * 1025}, ValueError),
    ({b"ok": b"v", "str": b"v"}, TypeError),
    ({b"ok": "v"}, TypeError),
])
def test_bad_sizes_change_nothing(region, changes, exc):
    vol = region(20, 4096)
    t = BTree(vol, OFFSET, 20, TreeRoot.empty())
    r = t.commit({b"a": b"1"})
    with pytest.raises(exc):
        t.commit(changes)
    assert t.root == r and dump(t) == {b"a": b"1"} and t.root.alloc == r.alloc
    assert t.commit({b"k" * 64: b"x" * 1024}).count == 2  # the limits themselves are fine
    with pytest.raises(ValueError):
        t.get(b"")


def test_small_pages_cap_value_size(region):
    vol = region(20)
    t = BTree(vol, OFFSET, 20, TreeRoot.empty(), page_size=SMALL)
    assert t.max_value < 1024
    t.commit({b"k" * 64: b"x" * t.max_value})
    with pytest.raises(ValueError):
        t.commit({b"k": b"x" * (t.max_value + 1)})


def test_bad_geometry(region):
    with pytest.raises(ValueError):
        BTree(region(20), OFFSET, 20, TreeRoot.empty(), page_size=100)
    with pytest.raises(ValueError):
        BTree(region(20), OFFSET, 1, TreeRoot.empty())


def test_stats(region):
    vol = region(40)
    t = BTree(vol, OFFSET, 40, TreeRoot.empty(), page_size=SMALL)
    t.commit({key(i): b"v" for i in range(10)})
    s = t.stats()
    assert s["pages_used"] + s["pages_free"] == 20
    assert (s["count"], s["height"], s["half"]) == (10, 1, 0)


def _full(r: TreeRoot, half_pages: int, prev_half: int = -1) -> TreeRoot:
    """The same tree, but claiming its half is used up: the next commit must compact."""
    return TreeRoot(r.root, r.height, r.count, r.half, half_pages, prev_half, r.generation)


def test_large_compaction_streams_in_chunks(region, monkeypatch):
    vol = region(400)
    t = BTree(vol, OFFSET, 400, TreeRoot.empty(), page_size=SMALL)
    model = {b"%05d" % i: b"v" * (i % 50) for i in range(1500)}
    t.commit(model)
    t = BTree(vol, OFFSET, 400, _full(t.root, 200), page_size=SMALL)
    monkeypatch.setattr(btree, "COMPACT_CHUNK", 4)
    writes = []
    real = vol.pwrite
    monkeypatch.setattr(vol, "pwrite", lambda d, o: writes.append(len(d)) or real(d, o))
    t.commit({b"00007": None, b"99999": b"new"})
    del model[b"00007"]
    model[b"99999"] = b"new"
    assert t.root.half == 1 and t.root.height >= 3
    assert len(writes) > 10 and max(writes) <= 4 * SMALL
    assert sum(writes) == t.root.alloc * SMALL
    assert dump(t) == model and t.check() == []


def test_scan_refuses_to_read_a_half_compacted_over(region):
    vol = region(40)
    t = BTree(vol, OFFSET, 40, TreeRoot.empty(), page_size=SMALL)
    t.commit({key(i): b"v" for i in range(30)})
    it = t.scan()
    next(it)
    t.root = _full(t.root, 20)
    t.commit({key(0): b"w"})  # compacts into half 1: the scan's half 0 is untouched
    assert t.root.half == 1
    next(it)
    t.root = _full(t.root, 20)
    t.commit({key(1): b"w"})  # compacts back over half 0
    with pytest.raises(RuntimeError):
        list(it)
    assert t.get(key(0)) == t.get(key(1)) == b"w" and t.check() == []

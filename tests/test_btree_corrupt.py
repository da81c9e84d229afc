"""kvfs.btree under corruption: flipped bytes, garbage, zeroed and lying pages are
``PageCorrupt`` (and reported by ``check``), never a crash or a wrong value."""

from __future__ import annotations

import bisect
import random

import crc32c
import pytest
from conftest import OFFSET, SMALL, key

from kvfs.engine.btree import BTree, PageCorrupt, TreeRoot
from kvfs.engine.volume import VolumeFile


def flip_byte(vol: VolumeFile, off: int) -> None:
    b = vol.pread(1, off)
    vol.pwrite(bytes([b[0] ^ 0x40]), off)


def test_corrupt_page_raises_and_check_reports(region):
    vol = region(200)
    t = BTree(vol, OFFSET, 200, TreeRoot.empty(), page_size=SMALL)
    t.commit({key(i): b"v%d" % i for i in range(300)})
    assert t.root.height >= 2
    target = key(150)
    # find the leaf holding target by walking down, then flip a byte in its body
    fresh = BTree(vol, OFFSET, 200, t.root, page_size=SMALL)
    node, page = fresh._read(t.root, t.root.root, t.root.height - 1), t.root.root
    while node.level:
        page = node.kids[bisect.bisect_right(node.keys, target)]
        node = fresh._read(t.root, page, node.level - 1)
    flip_byte(vol, OFFSET + (t.root.half * 100 + page) * SMALL + 40)
    bad = BTree(vol, OFFSET, 200, t.root, page_size=SMALL)
    with pytest.raises(PageCorrupt):
        bad.get(target)
    with pytest.raises(PageCorrupt):
        list(bad.scan())
    problems = bad.check()
    assert problems and any("checksum" in p for p in problems)
    assert bad.get(key(0)) == b"v0"  # other leaves still read


@pytest.mark.parametrize("mutate", ["garbage", "zero", "header", "pointer"])
def test_garbage_pages_never_crash(region, mutate):
    vol = region(20)
    t = BTree(vol, OFFSET, 20, TreeRoot.empty(), page_size=SMALL)
    t.commit({key(i): b"v" for i in range(40)})
    root = t.root
    off = OFFSET + root.root * SMALL
    if mutate == "garbage":
        vol.pwrite(random.Random(1).randbytes(SMALL), off)
    elif mutate == "zero":
        vol.pwrite(bytes(SMALL), off)
    elif mutate == "header":
        flip_byte(vol, off + 5)  # level byte
    else:  # a root pointing at a never-written (zero) page
        root = TreeRoot(root.root + 1, root.height, root.count, 0, 20, -1, root.generation)
    bad = BTree(vol, OFFSET, 20, root, page_size=SMALL)
    with pytest.raises(PageCorrupt):
        bad.get(key(3))
    assert bad.check()


def test_checksummed_garbage_is_corrupt_not_a_crash(region):
    """Mutate valid pages and fix up the crc: structure checks must catch what crc cannot."""
    vol = region(100)
    t = BTree(vol, OFFSET, 100, TreeRoot.empty(), page_size=SMALL)
    t.commit({key(i): bytes(i % 30) for i in range(150)})
    pages = [vol.pread(SMALL, OFFSET + p * SMALL) for p in range(t.root.alloc)]
    rng = random.Random(3)
    for _ in range(1500):
        p = rng.randrange(len(pages))
        buf = bytearray(pages[p])
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(4, 80 if rng.random() < 0.7 else SMALL)
            if not 20 <= i < 24:
                buf[i] = rng.randrange(256)
        buf[20:24] = bytes(4)
        buf[20:24] = crc32c.crc32c(bytes(buf)).to_bytes(4, "little")
        try:
            node = t._decode(bytes(buf), p)
        except PageCorrupt:
            continue
        assert node.keys == sorted(set(node.keys))  # whatever decodes is well-formed


def test_pointer_beyond_alloc_is_corrupt(region):
    vol = region(20)
    t = BTree(vol, OFFSET, 20, TreeRoot.empty(), page_size=SMALL)
    t.commit({b"a": b"1"})
    r = t.root
    lying = BTree(vol, OFFSET, 20, TreeRoot(r.root, 1, 1, 0, 0, -1, 1), page_size=SMALL)
    with pytest.raises(PageCorrupt):
        lying.get(b"a")
    assert lying.check()
    wrong_count = BTree(vol, OFFSET, 20, TreeRoot(r.root, 1, 5, 0, r.alloc, -1, 1),
                        page_size=SMALL)
    assert any("count" in p or "keys" in p for p in wrong_count.check())

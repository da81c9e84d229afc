"""On-disk copy-on-write B+ tree: the engine's periodic index checkpoint (sorted bytes -> bytes).

Owns the pages of one fixed region of the volume file: their format, append-only allocation
inside the active half, compaction into the other half, a small LRU of decoded pages, and
fsck-style verification (``BTree.check``). Reads and writes go through the volume object
(``pread(n, off)`` / ``pwrite(data, off)``), the same one the ring uses, so fault injection
sees tree pages too. Never fsyncs, never touches the superblock, never opens or closes the
volume, never writes outside its region, and never rewrites a page that the current or the
previous root can reach. The caller fsyncs after ``commit`` and then persists
``TreeRoot.pack()`` before the next commit; until it does, the old root is the durable truth.
Not thread-safe: one caller at a time (the engine serialises).

    tree = BTree(vol, region_offset, region_pages, TreeRoot.unpack(sb.tree_root))
    root = tree.commit({b"k": b"v", b"gone": None})   # then fsync, then superblock
    tree.get(b"k"); list(tree.scan(prefix=b"s/")); tree.check()

The page layout, the root record and the halves/compaction rule are specified in
docs/format.md ("B+ tree pages"); keep the two in step.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import struct
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Protocol

import crc32c

from kvfs.engine.errors import Corrupt, KVFSError

log = logging.getLogger(__name__)

MAGIC = b"KVB1"
LEAF, BRANCH = 1, 2
MAX_KEY = 64
MAX_VALUE = 1024
MIN_PAGE_SIZE = 256
MAX_PAGE_SIZE = 65536  # entry lengths and nkeys are u16
COMPACT_CHUNK = 256  # pages per pwrite while compacting, to bound memory

_HDR = struct.Struct("<4sBBHIQI")  # magic, kind, level, nkeys, self page, generation, crc
_CRC = struct.Struct("<I")
_CRC_OFF = struct.calcsize("<4sBBHIQ")
_LEAF_ENT = struct.Struct("<BH")  # key length, value length; key and value follow
_KLEN = struct.Struct("<B")
_CHILD = struct.Struct("<I")
_ROOT = struct.Struct("<qIbbxxQQQ")  # root, height, half, prev_half, count, alloc, generation
assert _HDR.size == 24 and _CRC_OFF == 20
assert _LEAF_ENT.size == 3 and _KLEN.size == 1 and _CHILD.size == 4
assert _ROOT.size == 40
TREE_ROOT_SIZE = _ROOT.size
_key0 = itemgetter(0)


class PageIO(Protocol):
    """What the tree needs of a volume (``kvfs.engine.volume.VolumeFile`` is one)."""

    def pread(self, n: int, off: int) -> bytes: ...

    def pwrite(self, data: bytes | memoryview, off: int) -> None: ...


class TreeFull(KVFSError):
    """A commit cannot fit in the region; the tree stays at its old root.

    Right after a compaction the other half still holds the previous root, so a commit too big
    for what is left of the new half fails until a smaller commit lands: split the batch.
    """


class PageCorrupt(Corrupt):
    """A page fails its checksum or structure check."""


class _NoRoom(Exception):
    """Internal: the copy-on-write pages do not fit the active half; compact instead."""


@dataclass(frozen=True)
class TreeRoot:
    root: int
    height: int
    count: int
    half: int
    alloc: int
    prev_half: int
    generation: int

    def pack(self) -> bytes:
        return _ROOT.pack(self.root, self.height, self.half, self.prev_half,
                          self.count, self.alloc, self.generation)

    @classmethod
    def unpack(cls, b: bytes) -> TreeRoot:
        """Parse a packed root; trailing bytes (the superblock's zero padding) are ignored."""
        if len(b) < _ROOT.size:
            raise Corrupt(f"tree root: {len(b)} bytes, need {_ROOT.size}")
        root, height, half, prev, count, alloc, gen = _ROOT.unpack_from(b)
        r = cls(root, height, count, half, alloc, prev, gen)
        if (half not in (0, 1) or prev not in (-1, 0, 1) or root < -1 or height > 64
                or (root == -1) != (height == 0) or (root == -1 and count)
                or (root >= 0 and root >= alloc)):
            raise Corrupt(f"tree root inconsistent: {r}")
        return r

    @classmethod
    def empty(cls) -> TreeRoot:
        return cls(root=-1, height=0, count=0, half=0, alloc=0, prev_half=-1, generation=0)


class _Node:
    """A decoded page. Leaf: keys + vals. Branch: keys (separators) + kids (page numbers)."""

    __slots__ = ("level", "keys", "vals", "kids", "gen")

    def __init__(self, level: int, keys: list[bytes], vals: list[bytes] | None = None,
                 kids: list[int] | None = None, gen: int = 0) -> None:
        self.level, self.keys, self.vals, self.kids, self.gen = level, keys, vals, kids, gen


# A node's place in its parent while a commit rebuilds it: (lower bound or None, page or node).
_Item = tuple[bytes | None, "int | _Node"]


def _ranges(sizes: list[int], cap: int) -> list[tuple[int, int]]:
    """Cut items into consecutive pieces of at most ``cap`` bytes, as even as it can."""
    total = sum(sizes)
    target = total / max(1, -(-total // cap))
    out, start, cur = [], 0, 0
    for i, s in enumerate(sizes):
        if i > start and (cur + s > cap or cur + s / 2 > target):
            out.append((start, i))
            start, cur = i, 0
        cur += s
    out.append((start, len(sizes)))
    return out


def _entry_size(k: bytes, v: bytes) -> int:
    return _LEAF_ENT.size + len(k) + len(v)


class _Writer:
    """Append-only allocator for one commit: encodes nodes in order and batches their bytes."""

    def __init__(self, tree: BTree, half: int, start: int, gen: int, chunk: int = 0) -> None:
        self.tree, self.half, self.gen, self.chunk = tree, half, gen, chunk
        self.start = self.next = start  # first page not yet written / next page to hand out
        self.pages: list[bytes] = []
        self.nodes: dict[int, _Node] = {}  # kept for the cache when not streaming
        self.delta = 0  # change in key count

    def alloc(self, node: _Node) -> int:
        t = self.tree
        if self.next >= t.half_pages:
            raise _NoRoom
        page, self.next = self.next, self.next + 1
        node.gen = self.gen
        self.pages.append(t._encode(node, self.half * t.half_pages + page, self.gen))
        if not self.chunk:
            self.nodes[page] = node
        elif len(self.pages) >= self.chunk:
            self.flush()
        return page

    def flush(self) -> None:
        if self.pages:
            t = self.tree
            off = t.region_offset + (self.half * t.half_pages + self.start) * t.page_size
            t.vol.pwrite(b"".join(self.pages), off)  # contiguous run: one write
            self.start += len(self.pages)
            self.pages = []


class BTree:
    """A persistent sorted map in one region of ``vol``; ``root`` is the committed root."""

    def __init__(self, vol: PageIO, region_offset: int, region_pages: int, root: TreeRoot,
                 page_size: int = 4096, cache_pages: int = 512) -> None:
        if not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size {page_size} not in {MIN_PAGE_SIZE}..{MAX_PAGE_SIZE}")
        if not 2 <= region_pages < 2**33:
            raise ValueError(f"region_pages {region_pages}: need two halves of < 2**32 pages")
        self.vol, self.region_offset, self.page_size = vol, region_offset, page_size
        self.half_pages = region_pages // 2
        self.root = root
        self._room = page_size - _HDR.size  # body bytes per page
        # one leaf entry must fit a page; small test pages cap the value size below 1024
        self.max_value = min(MAX_VALUE, self._room - _LEAF_ENT.size - MAX_KEY)
        self._cache: OrderedDict[tuple[int, int], _Node] = OrderedDict()
        self._cache_pages = max(1, cache_pages)
        self._epoch = [0, 0]  # bumped when a half is overwritten by compaction
        self.page_reads = 0  # nothing is read until the first lookup

    # ---- pages ----

    def _encode(self, node: _Node, abs_page: int, gen: int) -> bytes:
        if node.level == 0:
            parts = []
            for k, v in zip(node.keys, node.vals, strict=True):
                parts += (_LEAF_ENT.pack(len(k), len(v)), k, v)
        else:
            parts = [_CHILD.pack(node.kids[0])]
            for k, c in zip(node.keys, node.kids[1:], strict=True):
                parts += (_KLEN.pack(len(k)), k, _CHILD.pack(c))
        body = b"".join(parts)
        assert len(body) <= self._room, "node packed over a page"
        buf = bytearray(self.page_size)
        _HDR.pack_into(buf, 0, MAGIC, BRANCH if node.level else LEAF, node.level,
                       len(node.keys), abs_page, gen, 0)
        buf[_HDR.size:_HDR.size + len(body)] = body
        _CRC.pack_into(buf, _CRC_OFF, crc32c.crc32c(buf))
        return bytes(buf)

    def _decode(self, buf: bytes, abs_page: int) -> _Node:
        where = f"tree page {abs_page}"
        if len(buf) != self.page_size:
            raise PageCorrupt(f"{where}: short read ({len(buf)} bytes)")
        magic, kind, level, n, self_no, gen, crc = _HDR.unpack_from(buf)
        if magic != MAGIC:
            raise PageCorrupt(f"{where}: bad magic {magic!r}")
        if crc32c.crc32c(buf[:_CRC_OFF] + b"\0\0\0\0" + buf[_HDR.size:]) != crc:
            raise PageCorrupt(f"{where}: checksum mismatch")
        if kind not in (LEAF, BRANCH) or (kind == LEAF) != (level == 0) or self_no != abs_page:
            raise PageCorrupt(f"{where}: bad header kind={kind} level={level} self={self_no}")
        try:
            return self._parse(buf, level, n, gen)
        except (struct.error, IndexError, ValueError) as e:  # checksummed garbage: still no
            raise PageCorrupt(f"{where}: {e}") from e

    def _parse(self, buf: bytes, level: int, n: int, gen: int) -> _Node:
        keys: list[bytes] = []
        off, end = _HDR.size, self.page_size
        if level == 0:
            vals: list[bytes] = []
            for _ in range(n):
                klen, vlen = _LEAF_ENT.unpack_from(buf, off)
                off += _LEAF_ENT.size
                if not 1 <= klen <= MAX_KEY or off + klen + vlen > end:
                    raise ValueError(f"entry {len(keys)} out of bounds")
                keys.append(buf[off:off + klen])
                vals.append(buf[off + klen:off + klen + vlen])
                off += klen + vlen
            node = _Node(0, keys, vals=vals, gen=gen)
        else:
            kids = [_CHILD.unpack_from(buf, off)[0]]
            off += _CHILD.size
            for _ in range(n):
                klen = buf[off]
                if not 1 <= klen <= MAX_KEY or off + 1 + klen + _CHILD.size > end:
                    raise ValueError(f"separator {len(keys)} out of bounds")
                keys.append(buf[off + 1:off + 1 + klen])
                kids.append(_CHILD.unpack_from(buf, off + 1 + klen)[0])
                off += 1 + klen + _CHILD.size
            if max(kids) >= self.half_pages:
                raise ValueError("child pointer outside the half")
            node = _Node(level, keys, kids=kids, gen=gen)
        if any(a >= b for a, b in zip(keys, keys[1:], strict=False)):
            raise ValueError("keys out of order")
        return node

    def _read(self, r: TreeRoot, page: int, level: int, cached: bool = True) -> _Node:
        """Page ``page`` of root ``r``'s half, which must be a node at ``level``."""
        ck = (r.half, page)
        node = self._cache.get(ck) if cached else None
        if node is not None:
            self._cache.move_to_end(ck)
        else:
            if not 0 <= page < r.alloc:
                raise PageCorrupt(f"tree pointer to page {page}, half {r.half} has {r.alloc}")
            abs_page = r.half * self.half_pages + page
            self.page_reads += 1
            buf = self.vol.pread(self.page_size, self.region_offset + abs_page * self.page_size)
            node = self._decode(buf, abs_page)
            if cached:
                self._cache_put(ck, node)
        if node.level != level:
            raise PageCorrupt(f"tree page {page}: level {node.level}, expected {level}")
        return node

    def _cache_put(self, ck: tuple[int, int], node: _Node) -> None:
        self._cache[ck] = node
        self._cache.move_to_end(ck)
        while len(self._cache) > self._cache_pages:
            self._cache.popitem(last=False)

    # ---- reads ----

    def get(self, key: bytes) -> bytes | None:
        _check_key(key)
        r = self.root
        if r.root < 0:
            return None
        node = self._read(r, r.root, r.height - 1)
        while node.level:
            node = self._read(r, node.kids[bisect.bisect_right(node.keys, key)], node.level - 1)
        i = bisect.bisect_left(node.keys, key)
        return node.vals[i] if i < len(node.keys) and node.keys[i] == key else None

    def scan(self, prefix: bytes = b"", start: bytes | None = None
             ) -> Iterator[tuple[bytes, bytes]]:
        """Keys in order from max(prefix, start) while they start with ``prefix``.

        Reads the root current when iteration starts; raises RuntimeError if a compaction
        overwrote that root's half meanwhile (two commits later), rather than read it.
        """
        r = self.root
        if r.root < 0:
            return
        lo = prefix if start is None or start < prefix else start
        for k, v in self._walk(r, r.root, r.height - 1, lo, self._epoch[r.half]):
            if not k.startswith(prefix):
                return  # keys >= lo >= prefix: the first miss ends the prefix's range
            yield k, v

    def _walk(self, r: TreeRoot, page: int, level: int, lo: bytes, epoch: int
              ) -> Iterator[tuple[bytes, bytes]]:
        if self._epoch[r.half] != epoch:
            raise RuntimeError("tree compacted over this scan's root")
        node = self._read(r, page, level)
        if level == 0:
            i = bisect.bisect_left(node.keys, lo)
            yield from zip(node.keys[i:], node.vals[i:], strict=True)
        else:  # lo only bites in the first child visited: later ones hold bigger keys
            for kid in node.kids[bisect.bisect_right(node.keys, lo):]:
                yield from self._walk(r, kid, level - 1, lo, epoch)

    # ---- commit ----

    def commit(self, changes: Mapping[bytes, bytes | None]) -> TreeRoot:
        """Apply puts (bytes) and deletes (None) copy-on-write; adopt and return the root."""
        if not changes:
            return self.root
        items = sorted(self._validate(changes), key=_key0)
        old = self.root
        w = _Writer(self, old.half, old.alloc, old.generation + 1)
        try:
            new = self._cow(items, w)
        except _NoRoom:
            new = self._compact(items)
        else:
            if new is None:  # every change was a no-op
                return old
            w.flush()
            for page, node in w.nodes.items():
                self._cache_put((new.half, page), node)
        self.root = new
        return new

    def _validate(self, changes: Mapping[bytes, bytes | None]) -> list[tuple[bytes, bytes | None]]:
        for k, v in changes.items():
            _check_key(k)
            if v is not None:
                if not isinstance(v, bytes):
                    raise TypeError(f"value for {k!r} must be bytes or None")
                if len(v) > self.max_value:
                    raise ValueError(f"value for {k!r}: {len(v)} bytes > {self.max_value}")
        return list(changes.items())

    def _cow(self, items: list, w: _Writer) -> TreeRoot | None:
        old = self.root
        if old.root < 0:
            res = self._apply_leaf(_Node(0, [], vals=[]), items, w)
            level = 0
        else:
            top = self._read(old, old.root, old.height - 1)
            res = self._apply(top, items, 0, len(items), w)
            level = top.level
        if res is None:
            return None
        while len(res) > 1:  # the root split: grow a level
            res = self._pack_branch([(lo, w.alloc(n)) for lo, n in res], level + 1)
            level += 1
        if not res:
            return TreeRoot(-1, 0, 0, old.half, w.next, self._prev(old), old.generation + 1)
        node, page = res[0][1], -1  # page -1: node is new and not yet allocated
        while node.level and not node.keys:  # a root with one child: drop a level
            page = node.kids[0]
            node = w.nodes.get(page) or self._read(old, page, node.level - 1)
        if page < 0:
            page = w.alloc(node)
        return TreeRoot(page, node.level + 1, old.count + w.delta, old.half, w.next,
                        self._prev(old), old.generation + 1)

    @staticmethod
    def _prev(old: TreeRoot) -> int:
        return old.half if old.root >= 0 else -1  # an empty root has no pages to protect

    def _apply(self, node: _Node, items: list, lo: int, hi: int, w: _Writer
               ) -> list[_Item] | None:
        """Apply items[lo:hi] under ``node``: its replacement nodes, or None if unchanged."""
        if node.level == 0:
            return self._apply_leaf(node, items[lo:hi], w)
        lst: list[_Item] = []
        changed = False
        for c, page in enumerate(node.kids):
            low = node.keys[c - 1] if c else None
            j = (bisect.bisect_left(items, node.keys[c], lo, hi, key=_key0)
                 if c < len(node.keys) else hi)
            res = None
            if j > lo:
                res = self._apply(self._read(self.root, page, node.level - 1), items, lo, j, w)
            if res is None:
                lst.append((low, page))
            else:
                changed = True
                if res:  # an empty list: every key under this child is gone, drop it
                    lst.append((low, res[0][1]))
                    lst.extend(res[1:])
            lo = j
        if not changed:
            return None
        self._rebalance(lst, node.level - 1)
        return self._pack_branch(
            [(lw, ref if isinstance(ref, int) else w.alloc(ref)) for lw, ref in lst], node.level)

    def _apply_leaf(self, node: _Node, items: list, w: _Writer) -> list[_Item] | None:
        ok, ov = node.keys, node.vals
        keys: list[bytes] = []
        vals: list[bytes] = []
        a, changed = 0, False
        for k, v in items:
            b = bisect.bisect_left(ok, k, a)
            keys += ok[a:b]
            vals += ov[a:b]
            exists = b < len(ok) and ok[b] == k
            a = b + 1 if exists else b
            if v is None:
                changed |= exists
                w.delta -= exists
                continue
            if not exists or ov[b] != v:
                changed = True
                w.delta += not exists
            keys.append(k)
            vals.append(v)
        if not changed:
            return None
        return self._pack_leaf(keys + ok[a:], vals + ov[a:])

    def _pack_leaf(self, keys: list[bytes], vals: list[bytes]) -> list[_Item]:
        sizes = list(map(_entry_size, keys, vals))
        if not sizes:
            return []
        return [(keys[s] if s else None, _Node(0, keys[s:e], vals=vals[s:e]))
                for s, e in _ranges(sizes, self._room)]

    def _pack_branch(self, pairs: list[tuple[bytes | None, int]], level: int) -> list[_Item]:
        # a node's first child is costed like the rest (klen, key, child): a small overestimate
        sizes = [1 + len(lw or b"") + _CHILD.size for lw, _ in pairs]
        if not sizes:
            return []
        return [(pairs[s][0] if s else None,
                 _Node(level, [lw for lw, _ in pairs[s + 1:e]], kids=[p for _, p in pairs[s:e]]))
                for s, e in _ranges(sizes, self._room)]

    def _underfull(self, node: _Node) -> bool:
        if node.level == 0:
            size = sum(map(_entry_size, node.keys, node.vals))
        elif not node.keys:
            return True  # a branch with one child is a wasted level
        else:
            size = _CHILD.size + sum(1 + len(k) + _CHILD.size for k in node.keys)
        return size < self._room // 4

    def _rebalance(self, lst: list[_Item], level: int) -> None:
        """Merge each new underfull child with a sibling (copied too), then re-split evenly."""
        i = 0
        while i < len(lst):
            ref = lst[i][1]
            if len(lst) < 2 or isinstance(ref, int) or not self._underfull(ref):
                i += 1
                continue
            a = i if i + 1 < len(lst) else i - 1
            (low_a, ra), (low_b, rb) = lst[a], lst[a + 1]
            na = ra if isinstance(ra, _Node) else self._read(self.root, ra, level)
            nb = rb if isinstance(rb, _Node) else self._read(self.root, rb, level)
            if level == 0:
                merged = self._pack_leaf(na.keys + nb.keys, na.vals + nb.vals)
            else:
                pairs = ([(None, na.kids[0])] + list(zip(na.keys, na.kids[1:], strict=True))
                         + [(low_b, nb.kids[0])] + list(zip(nb.keys, nb.kids[1:], strict=True)))
                merged = self._pack_branch(pairs, level)
            merged[0] = (low_a, merged[0][1])
            lst[a:a + 2] = merged
            i = a + len(merged)

    def _compact(self, items: list) -> TreeRoot:
        """Bulk-load live entries merged with ``items`` into the other half; TreeFull if not."""
        old = self.root
        dst = 1 - old.half
        if old.prev_half == dst:
            log.warning("btree: commit needs compaction into half %d, which holds the "
                        "previous root; TreeFull", dst)
            raise TreeFull(f"tree half {old.half} full and half {dst} holds the previous root")
        self._epoch[dst] += 1  # whatever was cached or being scanned there is gone
        for ck in [ck for ck in self._cache if ck[0] == dst]:
            del self._cache[ck]
        w = _Writer(self, dst, 0, old.generation + 1, chunk=COMPACT_CHUNK)
        count, pairs = 0, []
        keys, vals, size = [], [], 0
        try:
            touched = {k for k, _ in items}
            for k, v in heapq.merge(((k, v) for k, v in self.scan() if k not in touched),
                                    (kv for kv in items if kv[1] is not None), key=_key0):
                keys.append(k)
                vals.append(v)
                size += _entry_size(k, v)
                count += 1
                if size >= COMPACT_CHUNK * self._room:  # pack a batch; its last leaf waits
                    *done, (_, last) = self._pack_leaf(keys, vals)
                    pairs += [(n.keys[0], w.alloc(n)) for _, n in done]
                    keys, vals = last.keys, last.vals
                    size = sum(map(_entry_size, keys, vals))
            pairs += [(n.keys[0], w.alloc(n)) for _, n in self._pack_leaf(keys, vals)]
            level = 0
            while len(pairs) > 1:
                level += 1
                pairs = [(lw, w.alloc(n)) for lw, n in self._pack_branch(pairs, level)]
            w.flush()
        except _NoRoom:
            log.warning("btree: compacted tree does not fit %d pages; TreeFull", self.half_pages)
            raise TreeFull(f"tree of {count}+ keys does not fit a half of "
                           f"{self.half_pages} pages") from None
        log.info("btree: compacted %d keys into half %d (%d pages)", count, dst, w.next)
        return TreeRoot(pairs[0][1] if pairs else -1, level + 1 if pairs else 0, count, dst,
                        w.next, self._prev(old), old.generation + 1)

    # ---- fsck ----

    def check(self) -> list[str]:
        """Verify every reachable page from disk (not the cache); problems, [] when clean."""
        r, problems = self.root, []
        if r.half not in (0, 1) or not 0 <= r.alloc <= self.half_pages:
            return [f"tree root {r}: half/alloc outside the region ({self.half_pages} per half)"]
        if r.root < 0:
            return [] if r.count == 0 and r.height == 0 else [f"empty tree root {r} not empty"]
        seen: set[int] = set()
        count = 0
        stack: list[tuple[int, int, bytes | None, bytes | None]] = [
            (r.root, r.height - 1, None, None)]
        while stack:
            page, level, lo, hi = stack.pop()
            if page in seen:
                problems.append(f"tree page {page} reached twice")
                continue
            seen.add(page)
            try:
                node = self._read(r, page, level, cached=False)
            except (PageCorrupt, OSError) as e:
                problems.append(str(e))
                continue
            if node.gen > r.generation:
                problems.append(f"tree page {page}: generation {node.gen} > {r.generation}")
            if node.keys and ((lo is not None and node.keys[0] < lo)
                              or (hi is not None and node.keys[-1] >= hi)):
                problems.append(f"tree page {page}: keys outside separator bounds")
            if level == 0:
                count += len(node.keys)
            else:
                bounds = [lo, *node.keys, hi]
                stack += [(kid, level - 1, bounds[c], bounds[c + 1])
                          for c, kid in enumerate(node.kids)]
        if count != r.count:
            problems.append(f"tree holds {count} keys, root says {r.count}")
        return problems

    def stats(self) -> dict:
        r = self.root
        return {"half": r.half, "pages_used": r.alloc, "pages_free": self.half_pages - r.alloc,
                "half_pages": self.half_pages, "height": r.height, "count": r.count,
                "generation": r.generation, "cached_pages": len(self._cache),
                "page_reads": self.page_reads}


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, not {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY:
        raise ValueError(f"key length {len(key)} not in 1..{MAX_KEY}")


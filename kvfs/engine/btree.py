"""On-disk copy-on-write B+ tree: the engine's periodic index checkpoint (sorted bytes -> bytes).

Owns the pages of one fixed region of the volume file (their format is in ``btree_page``):
append-only allocation inside the active half, compaction into the other half, a small LRU of decoded pages, and
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
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from operator import itemgetter

from kvfs.engine.btree_page import (
    CHILD,
    HDR,
    LEAF_ENT,
    MAX_KEY,
    MAX_PAGE_SIZE,
    MAX_VALUE,
    MIN_PAGE_SIZE,
    TREE_ROOT_SIZE,
    Node,
    PageCorrupt,
    PageIO,
    TreeFull,
    TreeRoot,
    decode_page,
    encode_page,
)

__all__ = ["TREE_ROOT_SIZE", "BTree", "PageCorrupt", "PageIO", "TreeFull", "TreeRoot"]

log = logging.getLogger(__name__)
COMPACT_CHUNK = 256  # pages per pwrite while compacting, to bound memory
_key0 = itemgetter(0)


class _NoRoom(Exception):
    """Internal: the copy-on-write pages do not fit the active half; compact instead."""

# A node's place in its parent while a commit rebuilds it: (lower bound or None, page or node).
_Item = tuple[bytes | None, "int | Node"]  # (low key, a page kept as it is or a new node)
_New = tuple[bytes | None, "Node"]  # (low key, a new node)


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
    return LEAF_ENT.size + len(k) + len(v)


class _Writer:
    """Append-only allocator for one commit: encodes nodes in order and batches their bytes."""

    def __init__(self, tree: BTree, half: int, start: int, gen: int, chunk: int = 0) -> None:
        self.tree, self.half, self.gen, self.chunk = tree, half, gen, chunk
        self.start = self.next = start  # first page not yet written / next page to hand out
        self.pages: list[bytes] = []
        self.nodes: dict[int, Node] = {}  # kept for the cache when not streaming
        self.delta = 0  # change in key count

    def alloc(self, node: Node) -> int:
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
        self._room = page_size - HDR.size  # body bytes per page
        # one leaf entry must fit a page; small test pages cap the value size below 1024
        self.max_value = min(MAX_VALUE, self._room - LEAF_ENT.size - MAX_KEY)
        self._cache: OrderedDict[tuple[int, int], Node] = OrderedDict()
        self._cache_pages = max(1, cache_pages)
        self._epoch = [0, 0]  # bumped when a half is overwritten by compaction
        self.page_reads = 0  # nothing is read until the first lookup

    # ---- pages ----

    def _encode(self, node: Node, abs_page: int, gen: int) -> bytes:
        return encode_page(node, abs_page, gen, self.page_size)

    def _decode(self, buf: bytes, abs_page: int) -> Node:
        return decode_page(buf, abs_page, self.page_size, self.half_pages)

    def _read(self, r: TreeRoot, page: int, level: int, cached: bool = True) -> Node:
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

    def _cache_put(self, ck: tuple[int, int], node: Node) -> None:
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
        for k, v in self._walk(r, r.root, r.height - 1, lo, self._epoch[r.half], set()):
            if not k.startswith(prefix):
                return  # keys >= lo >= prefix: the first miss ends the prefix's range
            yield k, v

    def _walk(self, r: TreeRoot, page: int, level: int, lo: bytes, epoch: int, seen: set[int]
              ) -> Iterator[tuple[bytes, bytes]]:
        if self._epoch[r.half] != epoch:
            raise RuntimeError("tree compacted over this scan's root")
        if page in seen:  # a tree reaches each page once: a shared child is a crafted loop
            raise PageCorrupt(f"tree page {page} of half {r.half} reached twice")
        seen.add(page)
        node = self._read(r, page, level)
        if level == 0:
            i = bisect.bisect_left(node.keys, lo)
            yield from zip(node.keys[i:], node.vals[i:], strict=True)
        else:  # lo only bites in the first child visited: later ones hold bigger keys
            for kid in node.kids[bisect.bisect_right(node.keys, lo):]:
                yield from self._walk(r, kid, level - 1, lo, epoch, seen)

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
            res = self._apply_leaf(Node(0, [], vals=[]), items, w)
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

    def _apply(self, node: Node, items: list, lo: int, hi: int, w: _Writer
               ) -> list[_New] | None:
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

    def _apply_leaf(self, node: Node, items: list, w: _Writer) -> list[_New] | None:
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

    def _pack_leaf(self, keys: list[bytes], vals: list[bytes]) -> list[_New]:
        sizes = list(map(_entry_size, keys, vals))
        if not sizes:
            return []
        return [(keys[s] if s else None, Node(0, keys[s:e], vals=vals[s:e]))
                for s, e in _ranges(sizes, self._room)]

    def _pack_branch(self, pairs: list[tuple[bytes | None, int]], level: int) -> list[_New]:
        # a node's first child is costed like the rest (klen, key, child): a small overestimate
        sizes = [1 + len(lw or b"") + CHILD.size for lw, _ in pairs]
        if not sizes:
            return []
        return [(pairs[s][0] if s else None,
                 Node(level, [_separator(lw) for lw, _ in pairs[s + 1:e]],
                      kids=[p for _, p in pairs[s:e]]))
                for s, e in _ranges(sizes, self._room)]

    def _underfull(self, node: Node) -> bool:
        if node.level == 0:
            size = sum(map(_entry_size, node.keys, node.vals))
        elif not node.keys:
            return True  # a branch with one child is a wasted level
        else:
            size = CHILD.size + sum(1 + len(k) + CHILD.size for k in node.keys)
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
            na = ra if isinstance(ra, Node) else self._read(self.root, ra, level)
            nb = rb if isinstance(rb, Node) else self._read(self.root, rb, level)
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
        count, pairs = 0, list[tuple[bytes | None, int]]()
        keys: list[bytes] = []
        vals: list[bytes] = []
        size = 0
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


def _separator(low: bytes | None) -> bytes:
    """The low key of a child after a branch's first: only the first child has none."""
    assert low is not None, "a branch child after the first without a low key"
    return low

"""Where a file's bytes lie, found without asking the mount: what this process kept, then
the mount's catalog.

A channel client reads the volume itself once it holds a file's extents. ``Locator.find``
is where it looks before it asks: the extents it kept from earlier answers
(``ExtentCache``), then the catalog the mount publishes (``kvfs.engine.catalog``). Both
are used only while the session's published count of cuts is what it was when they were
made (every truncate, deletion and reclaim drop bumps it), and catalog records only when
they cover the range and show that this process may read the file; the read after them
checks the rest (``kvfs.engine.direct``). None means: ask the mount, whose answer
decides, errors included. No sockets here.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable

import kvfs.channel.protocol as P
from kvfs.engine.catalog import CatalogView
from kvfs.engine.direct import FileExtents
from kvfs.engine.published import PublishedView

CACHE_EXTENTS = 1 << 17  # extents kept in the cache (about 100 bytes each)

# (session, its (mode, uid, gid), [(name, FileExtents | None)]): raises to refuse the answer
Check = Callable[[str, tuple[int, int, int], list], None]


class ExtentCache:
    """(session, file) -> ``FileExtents``, least recently used out past ``CACHE_EXTENTS``
    extents in all. An entry is used only while its session's published cut count is
    what it was when fetched (``get``)."""

    def __init__(self, view: PublishedView, limit: int = CACHE_EXTENTS) -> None:
        self.view, self.limit = view, limit
        self._d: OrderedDict[tuple[str, str], FileExtents] = OrderedDict()
        self._n = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, sid: str, name: str, a: int, b: int) -> FileExtents | None:
        with self._lock:
            fe = self._d.get((sid, name))
            if fe is None or not fe.covers(a, b) or self.view.cuts(fe.sno) != fe.cuts:
                self.misses += 1
                return None
            self._d.move_to_end((sid, name))
            self.hits += 1
            return fe

    def put(self, sid: str, name: str, fe: FileExtents) -> None:
        with self._lock:
            old = self._d.pop((sid, name), None)
            if old is not None:
                self._n -= len(old.ext)
            self._d[(sid, name)] = fe
            self._n += len(fe.ext)
            while self._n > self.limit and len(self._d) > 1:
                _, gone = self._d.popitem(last=False)
                self._n -= len(gone.ext)

    def drop(self, sid: str, name: str | None = None) -> None:
        with self._lock:
            keys = [k for k in self._d if k[0] == sid and (name is None or k[1] == name)]
            for k in keys:
                self._n -= len(self._d.pop(k).ext)


class Locator:
    """A client's extents without a request (module doc): ``cache`` first, then the
    catalog (None: the mount handed none, or this machine may not use it). ``me``: the
    process's (euid, egid, groups), checked against what the catalog shows as the mount
    would check them."""

    def __init__(self, view: PublishedView, catalog: CatalogView | None) -> None:
        self.view, self.catalog = view, catalog
        self.cache = ExtentCache(view)
        self.me = (os.geteuid(), os.getegid(), frozenset(os.getgroups()))
        self.catalog_hits = 0

    def find(self, sid: str, name: str, a: int, b: int, check: Check | None
             ) -> FileExtents | None:
        """Extents of ``sid``/``name`` covering ``[a, b)``, kept or published; None: ask."""
        return self.find_many(sid, [(name, a, b)], check)[0]

    def find_many(self, sid: str, ranges: list[tuple[str, int, int]], check: Check | None
                  ) -> list[FileExtents | None]:
        """``find`` for several ranges of one session: what is not kept is looked up in
        the catalog together (the session's record read once)."""
        out = [self.cache.get(sid, name, a, b) for name, a, b in ranges]
        missing = {name for (name, _, _), fe in zip(ranges, out, strict=True) if fe is None}
        cat = self.catalog
        if not missing or cat is None:
            return out
        got = cat.lookup_files(sid, missing)
        if got is None:
            return out
        attrs, published = got
        uid, gid, groups = self.me
        if not P.permits(uid, gid, groups, *attrs, P.X, is_dir=True):
            return out
        for k, (name, a, b) in enumerate(ranges):
            if out[k] is None:
                out[k] = self._usable(sid, attrs, name, published[name], a, b, check)
        return out

    def _usable(self, sid: str, attrs: tuple[int, int, int], name: str, fe: FileExtents | None,
                a: int, b: int, check: Check | None) -> FileExtents | None:
        """A published record of a file, if it covers ``[a, b)``, is current and this
        process may read it (kept for the next reads); else None."""
        if fe is None or not fe.covers(a, b) or self.view.cuts(fe.sno) != fe.cuts:
            return None
        uid, gid, groups = self.me
        if not P.permits(uid, gid, groups, fe.mode, fe.uid, fe.gid, P.R):
            return None
        if check is not None:
            try:
                check(sid, attrs, [(name, fe)])
            except Exception:  # the caller's rules refuse it: let the mount's answer say so
                return None
        self.cache.put(sid, name, fe)
        self.catalog_hits += 1
        return fe

    def close(self) -> None:
        if self.catalog is not None:
            self.catalog.close()
            self.catalog = None

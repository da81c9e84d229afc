"""The engine's append path: ``Store.append`` (``Store`` holds one ``AppendPath``).

An append runs under the store's writer lock and takes its state lock only to reserve
ring space and to publish each written entry: room for the whole write is found first
(a write that cannot fit fails before any of it is stored), compression runs with no lock
(only this writer touches the codec and the file's end), and a large entry is written
with readers running, published once it is on the volume, so a concurrent read sees a
prefix of the append, never unwritten bytes. Never imports pyfuse3 or torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from .blocks import Encoded, encode_entries
from .codec import Codec
from .errors import NotAppend
from .format import BLOCK, BLOCK_ENTRY
from .index import Index
from .quota import EXTENT_BYTES, Ledger
from .records import FileRec, Session
from .ring import Ring
from .types import Observer


class Admit(Protocol):
    """The store's admission check (quotas, the index budget) before a change grows the index."""

    def __call__(self, uid: int, session: Session | None = None, **more: int) -> None: ...


class AppendPath:
    """A store's appends: admission and ring room come from the store (``admit``,
    ``ensure_room``, called under ``lock``, its state lock)."""

    def __init__(self, lock: threading.RLock, ring: Ring, codec: Codec, max_entry_raw: int,
                 counters: dict[str, int], quota: Ledger, idx: Index, observer: Observer,
                 admit: Admit, ensure_room: Callable[[int, Session | None], None]) -> None:
        self._lock, self.ring, self.codec, self.max_entry_raw = lock, ring, codec, max_entry_raw
        self.counters, self.quota, self.idx, self.observer = counters, quota, idx, observer
        self._admit, self._ensure_room = admit, ensure_room

    def append(self, s: Session, f: FileRec, offset: int, data: bytes | memoryview) -> None:
        """The writer lock held: append ``data`` at ``offset`` (the file's size)."""
        session, name = s.name, f.name
        if offset != f.size:
            raise NotAppend(f"{session}/{name}: write at {offset} is not an append (size {f.size})")
        mv = memoryview(data).cast("B")
        if not mv:
            return
        t0 = time.perf_counter()
        step = self.max_entry_raw
        # Room for the whole write first (raw size plus tables bounds the stored size): a
        # write that cannot fit fails before any of it is stored.
        need = sum(self.ring.cost(min(step, len(mv) - i) + BLOCK_ENTRY.size * (step // BLOCK + 1) + 64)
                   for i in range(0, len(mv), step))
        with self._lock:
            self._admit(s.uid, s, nbytes=len(mv), index=EXTENT_BYTES * len(range(0, len(mv), step)))
            self._ensure_room(need, s)
        # Compressing needs no lock: only this writer touches the codec and the file's end.
        encs = encode_entries(self.codec, mv, step, (s.sno, f.fno))
        last = len(encs) - 1
        for k, enc in enumerate(encs):
            with self._lock:
                self._ensure_room(self.ring.cost(enc.stored_len), s)
                pos, esize, job = self.ring.append_data(0, s.name_hash, s.sno, f.fno, f.size, enc,
                                                         defer=True)
                if job is None:
                    self._appended(s, f, pos, esize, enc, k == last)
            if job is not None:  # a large entry: written with readers running
                try:
                    self.ring.write_reserved(job)
                except BaseException:
                    with self._lock:
                        self.ring.cancel(pos)
                    raise
                with self._lock:
                    self._appended(s, f, pos, esize, enc, k == last)
        self.observer.cold_write((time.perf_counter() - t0) * 1e3)

    def _appended(self, s: Session, f: FileRec, pos: int, esize: int, enc: Encoded, last: bool) -> None:
        """Under the state lock: publish one written entry of an append."""
        f.add(pos, 0, enc.raw_len, esize)
        self.quota.add(s.uid, (0, 0, enc.raw_len, EXTENT_BYTES))
        c = self.counters
        c["raw_written"] += enc.raw_len
        c["stored_written"] += enc.stored_len
        if last:
            f.mtime = s.mtime = time.time_ns()
            c["appends"] += 1
            self.idx.dirty(s)


"""The cold tier through the mount's native channel: ``NativeCold``, a ``ColdBackend``.

Picked by ``cold.open_cold`` when the mount serves a channel this process may use
(``kvfs.channel``: same machine, may read the volume, not a shared mount). Sizes, small
files and extents come from the mount in one request per session; layer bytes are read
from the volume directly (several layers in one ``read_ranges``: one request for their
extents, then reads that run together); a pass's changes of a session go as one request
and ``sync`` is one durability point for every session written. The same ownership rules
as the plain files hold (cold.py ``refusal``): the mount answers with each file's mode and
owner, and a session or file that is not ours, or that others may write, is refused.

What is about names -- making, listing, removing a session, checking it still exists --
and the shared tier's hold go through the files (a ``coldfiles.ColdStore`` kept here):
the kernel's view of names stays the one every other program has.
"""

from __future__ import annotations

import errno
import logging
import stat
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvfs.channel import Channel, FileExtents
from kvfs.channel import protocol as P

from .cold import (
    APPEND,
    HOLD_WAIT_S,
    INCARNATION,
    MAX_SMALL,
    META,
    SUMMARIES,
    TRUNCATE,
    Changes,
    Written,
    cold_errors,
    layer_name,
    mount_info,
    parse_incarnation,
    parse_meta,
    refusal,
    stream_number,
)
from .coldfiles import ColdStore
from .ids import WarmCorrupt, WarmError

log = logging.getLogger("kvfs.warm")


class NativeCold:
    """The native channel for bytes, the files for names (module doc)."""

    kind = "channel"

    def __init__(self, files: ColdStore, ch: Channel) -> None:
        self.files, self.ch = files, ch
        self.root, self.dir, self.uid, self.shared = files.root, files.dir, files.uid, files.shared
        ch.check = self._check_extents

    @classmethod
    def open(cls, files: ColdStore) -> NativeCold | None:
        """Over the mount at ``files.root`` when it serves a channel this process may use."""
        if files.shared:
            return None
        try:
            info = mount_info(files.root)
        except OSError:
            return None
        channel = ((info or {}).get("fs") or {}).get("channel")
        if not channel:
            return None
        ch = Channel.open(files.root, channel)
        return cls(files, ch) if ch is not None else None

    def close(self) -> None:
        self.ch.close()
        self.files.close()

    # ---- through the files: names and the lease --------------------------------------
    def hold(self, sid: str, wait_s: float = HOLD_WAIT_S) -> Any:
        return self.files.hold(sid, wait_s)

    def unhold(self, h: Any) -> None:
        self.files.unhold(h)

    def lease_owner(self, sid: str) -> str | None:
        return self.files.lease_owner(sid)

    def path(self, sid: str, name: str | None = None) -> str:
        return self.files.path(sid, name)

    def reachable(self) -> None:
        self.files.reachable()

    def exists(self, sid: str) -> bool:
        return self.files.exists(sid)

    def list(self) -> list[str]:
        return self.files.list()

    def ensure_dir(self, sid: str) -> bool:
        return self.files.ensure_dir(sid)

    def delete(self, sid: str) -> bool:
        self.ch.cache.drop(sid)
        return self.files.delete(sid)

    def prefetch(self, sid: str, layers: Iterable[int], start: int, end: int) -> int:
        return 0  # reads of several layers are one batch already (``read_ranges``)

    # ---- ownership --------------------------------------------------------------------
    def _refuse(self, path: str, mode: int, uid: int, want_dir: bool) -> None:
        why = refusal(path, (stat.S_IFDIR if want_dir else stat.S_IFREG) | mode, uid,
                      want_dir, self.uid)
        if why is not None:
            raise WarmError(why)

    def _check_extents(self, sid: str, attrs: tuple[int, int, int],
                       files: list[tuple[str, FileExtents | None]]) -> None:
        self._refuse(self.path(sid), attrs[0], attrs[1], True)
        for name, fe in files:
            if fe is not None:
                self._refuse(self.path(sid, name), fe.mode, fe.uid, False)

    def _stat(self, sid: str, small: list[str]) -> P.SessionInfo | None:
        info = self.ch.stat(sid, small)
        if info is None:
            return None
        self._refuse(self.path(sid), info.mode, info.uid, True)
        for name, (_, mode, uid, _) in info.files.items():
            if stream_number(name) is not None or name in small:
                self._refuse(self.path(sid, name), mode, uid, False)
        return info

    # ---- sizes and reads --------------------------------------------------------------
    @cold_errors
    def state(self, sid: str) -> tuple[dict[int, int], int | None] | None:
        info = self._stat(sid, [INCARNATION])
        if info is None:
            self.files.reachable()  # an unmounted volume is an error, not a removed session
            return None
        sizes = {num: f[0] for n, f in info.files.items() if (num := stream_number(n)) is not None}
        return sizes, parse_incarnation(info.small.get(INCARNATION))

    def layer_sizes(self, sid: str) -> dict[int, int] | None:
        cs = self.state(sid)
        return None if cs is None else cs[0]

    def size(self, sid: str, layer: int) -> int:
        cs = self.state(sid)
        return 0 if cs is None else cs[0].get(layer, 0)

    @cold_errors
    def read_into(self, sid: str, layer: int, off: int, out: np.ndarray,
                  missing_is_empty: bool = False) -> None:
        self._read(sid, [(layer, off, out)], missing_is_empty)

    @cold_errors
    def read_ranges(self, sid: str, ranges: list[tuple[int, int, np.ndarray]],
                    missing_is_empty: bool = False) -> None:
        """Several layers' ranges: one request for their extents, reads run together."""
        self._read(sid, ranges, missing_is_empty)

    def _read(self, sid: str, ranges: list[tuple[int, int, np.ndarray]], missing_is_empty: bool) -> None:
        jobs = [(layer_name(layer), off, memoryview(out).cast("B")) for layer, off, out in ranges]
        try:
            self.ch.read(sid, jobs)
        except FileNotFoundError as e:
            if missing_is_empty:
                layer, off, out = ranges[0]
                raise ValueError(f"read [{off}, {off + len(out)}) past the end (0) of "
                                 f"{sid}/{layer_name(layer)}") from e
            raise WarmError(f"cold {sid}: a layer file is missing ({e.strerror or e})") from e

    @cold_errors
    def read_small(self, sid: str, name: str) -> bytes | None:
        """A small file's bytes (one STAT); meta.json and the like only up to ``MAX_SMALL``
        (a larger one is none kvfs wrote: WarmCorrupt), summaries.f32 of any size (a long
        session's: read from the volume like a layer)."""
        info = self._stat(sid, [name])
        if info is None or name not in info.files:
            return None
        raw = info.small.get(name)
        if raw is not None:
            return raw
        size = info.files[name][0]
        if name != SUMMARIES:
            raise WarmCorrupt(f"cold {sid}/{name} is over {MAX_SMALL} bytes: not one kvfs "
                              "writes; refused")
        out = bytearray(size)
        self.ch.read(sid, [(name, 0, memoryview(out))])
        return bytes(out)

    def read_meta(self, sid: str) -> dict | None:
        return parse_meta(self.read_small(sid, META), sid)

    def read_incarnation(self, sid: str) -> int | None:
        return parse_incarnation(self.read_small(sid, INCARNATION))

    # ---- writes -----------------------------------------------------------------------
    @cold_errors
    def write(self, sid: str, changes: Changes, w: Written | None = None) -> Written:
        """One request for all of ``changes`` (not durable until ``sync``), recorded into
        ``w`` (names tried, sizes of what was done, also when a change fails)."""
        items: list[P.Item] = []
        for c in changes.items:
            if c.kind == APPEND:
                at = c.arg
                for piece in c.pieces:
                    mv = memoryview(piece).cast("B")
                    items.append(P.Item(P.APPEND, c.name, at, mv))
                    at += len(mv)
                if not c.pieces:  # an empty file made
                    items.append(P.Item(P.APPEND, c.name, at, b""))
            elif c.kind == TRUNCATE:
                items.append(P.Item(P.TRUNCATE, c.name, c.arg))
            else:
                items.append(P.Item(P.REPLACE, c.name, 0, b"".join(bytes(p) for p in c.pieces)))
        w = w if w is not None else Written(sid)
        w.names |= {c.name for c in changes.items}
        if items:
            try:
                sizes = self.ch.write(sid, items)
            except OSError as e:
                sizes = getattr(e, "done", [])
                for it, size in zip(items, sizes, strict=False):
                    w.sizes[it.name] = size
                raise
            for it, size in zip(items, sizes, strict=True):
                w.sizes[it.name] = size
        return w

    def forget(self, written: Written) -> None:
        pass  # nothing held between a write and its sync

    def sync(self, written: list[Written]) -> None:
        """One durability point for every session written (the mount's fsync covers all)."""
        if not any(w.names or w.made_dir for w in written):
            return
        try:
            self.ch.sync()
        except OSError as e:
            err = WarmError(f"cold {self.dir!r}: sync: {e.strerror or e}")
            for w in written:
                w.error = w.error or err

    @cold_errors
    def write_meta(self, sid: str, raw: bytes, sync: bool = True, old: bytes | None = None,
                   name: str = META) -> bool:
        """Replace a small file unless it holds ``raw`` already (one request; durable with
        ``sync``). True if it changed."""
        if (old if old is not None else self.read_small(sid, name)) == raw:
            return False
        self.ch.write(sid, [P.Item(P.REPLACE, name, 0, raw)], sync=sync)
        return True

    @cold_errors
    def truncate(self, sid: str, name: str, length: int) -> None:
        """Cut a file shorter, durable when this returns."""
        try:
            self.ch.write(sid, [P.Item(P.TRUNCATE, name, length)], sync=True, create=False)
        except FileNotFoundError:
            raise
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise WarmError(f"cold {self.path(sid, name)!r}: cannot cut to {length}") from e
            raise

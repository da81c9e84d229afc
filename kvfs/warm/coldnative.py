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

import logging
import stat
from collections.abc import Iterable, Sequence

from kvfs.channel import FileExtents, KeptChannel, kept
from kvfs.channel import protocol as P
from kvfs.session.backend import (
    APPEND,
    HOLD_WAIT_S,
    TRUNCATE,
    Changes,
    ColdState,
    Range,
    Written,
    byte_view,
)
from kvfs.session.formats import parse_incarnation
from kvfs.session.names import INCARNATION, MAX_SMALL, layer_name, small_limit, stream_number

from .cold import cold_errors, refusal
from .coldfiles import ColdStore, FdHold
from .ids import WarmCorrupt, WarmError

log = logging.getLogger("kvfs.warm")


class NativeCold:
    """The native channel for bytes, the files for names (module doc)."""

    kind = "channel"

    def __init__(self, files: ColdStore, ch: KeptChannel) -> None:
        self.files, self.ch = files, ch
        self.root, self.dir, self.uid, self.shared = files.root, files.dir, files.uid, files.shared

    @classmethod
    def open(cls, files: ColdStore) -> NativeCold | None:
        """Over the mount at ``files.root`` when it serves a channel this process may use
        (the process's kept one: opened by the first backend, shared by the next)."""
        if files.shared:
            return None
        ch = kept(files.root)
        return cls(files, ch) if ch is not None else None

    def close(self) -> None:
        self.ch.close()  # the process keeps the channel for its next user
        self.files.close()

    # ---- through the files: names and the lease --------------------------------------
    def hold(self, sid: str, wait_s: float = HOLD_WAIT_S) -> FdHold | None:
        return self.files.hold(sid, wait_s)

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

    def delete(self, sid: str) -> bool:
        self.ch.drop_extents(sid)
        return self.files.delete(sid)

    def prefetch(self, sid: str, streams: Iterable[int], start: int, end: int) -> int:
        return 0  # reads of several layers are one batch already (``read_ranges``)

    # ---- ownership --------------------------------------------------------------------
    def _refuse(self, path: str, mode: int, uid: int, want_dir: bool) -> None:
        why = refusal(path, (stat.S_IFDIR if want_dir else stat.S_IFREG) | mode, uid,
                      want_dir, self.uid)
        if why is not None:
            raise WarmError(why)

    def _check_extents(self, sid: str, attrs: tuple[int, int, int],
                       files: Sequence[tuple[str, FileExtents | None]]) -> None:
        self._refuse(self.path(sid), attrs[0], attrs[1], True)
        for name, fe in files:
            if fe is not None:
                self._refuse(self.path(sid, name), fe.mode, fe.uid, False)

    def _stat(self, sid: str, small: Sequence[str]) -> P.SessionInfo | None:
        info = self.ch.stat(sid, tuple(small))
        if info is None:
            return None
        self._refuse(self.path(sid), info.mode, info.uid, True)
        for name, (_, mode, uid, _) in info.files.items():
            if stream_number(name) is not None or name in small:
                self._refuse(self.path(sid, name), mode, uid, False)
        return info

    # ---- sizes and reads --------------------------------------------------------------
    @cold_errors
    def state(self, sid: str, incarnation: bool = True,
              streams: Sequence[int] | None = None) -> ColdState | None:
        info = self._stat(sid, [INCARNATION] if incarnation else [])
        if info is None:
            self.files.reachable()  # an unmounted volume is an error, not a removed session
            return None
        sizes = {num: f[0] for n, f in info.files.items() if (num := stream_number(n)) is not None}
        return sizes, parse_incarnation(info.small.get(INCARNATION)) if incarnation else None

    @cold_errors
    def read_ranges(self, sid: str, ranges: Sequence[Range], missing_is_empty: bool = False) -> None:
        """Several layers' ranges: one request for their extents, reads run together."""
        self._read(sid, ranges, missing_is_empty)

    def _read(self, sid: str, ranges: Sequence[Range], missing_is_empty: bool) -> None:
        jobs = [(layer_name(layer), off, out.data.cast("B")) for layer, off, out in ranges]
        try:
            self.ch.read(sid, jobs, self._check_extents)
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
        if small_limit(name) is not None:
            raise WarmCorrupt(f"cold {sid}/{name} is over {MAX_SMALL} bytes: not one kvfs "
                              "writes; refused")
        out = bytearray(size)
        self.ch.read(sid, [(name, 0, memoryview(out))], self._check_extents)
        return bytes(out)

    # ---- writes -----------------------------------------------------------------------
    @cold_errors
    def write(self, sid: str, changes: Changes, w: Written | None = None,
              durable: bool = False) -> Written:
        """One request for all of ``changes`` (durable with ``durable``, else not until
        ``sync``), recorded into ``w`` (names tried, sizes of what was done, also when a
        change fails). Truncates alone make no file."""
        w = w if w is not None else Written(sid)
        if changes.make_dir:
            w.made_dir = self.files.ensure_dir(sid) or w.made_dir
        items: list[P.Item] = []
        for c in changes.items:
            if c.kind == APPEND:
                at = c.arg
                for piece in c.pieces:
                    mv = byte_view(piece)
                    items.append(P.Item(P.APPEND, c.name, at, mv))
                    at += len(mv)
                if not c.pieces:  # an empty file made
                    items.append(P.Item(P.APPEND, c.name, at, b""))
            elif c.kind == TRUNCATE:
                items.append(P.Item(P.TRUNCATE, c.name, c.arg))
            else:
                items.append(P.Item(P.REPLACE, c.name, 0, b"".join(bytes(p) for p in c.pieces)))
        if not durable:
            w.names |= {c.name for c in changes.items}
        if items:
            try:
                sizes = self.ch.write(sid, items, sync=durable,
                                      create=any(it.kind != P.TRUNCATE for it in items))
            except OSError as e:
                sizes = getattr(e, "done", [])
                for it, size in zip(items, sizes, strict=False):
                    w.sizes[it.name] = size
                raise
            for it, size in zip(items, sizes, strict=True):
                w.sizes[it.name] = size
        return w

    def sync(self, written: Sequence[Written]) -> None:
        """One durability point for every session written (the mount's fsync covers all)."""
        if not any(w.names or w.made_dir for w in written):
            return
        try:
            self.ch.sync()
        except OSError as e:
            err = WarmError(f"cold {self.dir!r}: sync: {e.strerror or e}")
            for w in written:
                w.error = w.error or err

"""The order of a session's writes: what makes a crash leave the last complete round.

A round is written in one order everywhere (the warm tier's write-behind and migration,
kvfs.vllm's turns): the incarnation id (the first bytes of a copy), the layer files and
side streams, the token ids, the round summaries, and ``meta.json`` last -- it claims the
bytes, so a reader that believes it finds them all. ``claim_last``: the claim is made
durable only after everything before it is (kvfs.vllm); without it every file of a pass
is made durable together in one sync and the mount keeps the write order (the warm tier,
whose RAM copy stays until that sync returned). A history edited at token ``start`` is
cut before its new tail is written (``cut_history``): ``meta.json`` first (the claim
shrinks), then the new ids (a reader that checks the ids around its read of the layers
sees the rewrite), then the layers and summaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .backend import TRUNCATE, Changes, ColdBackend, Piece, Written
from .files import ids_changes, read_summaries, truncate, write_meta
from .formats import incarnation_bytes
from .names import INCARNATION, META, SUMMARIES, TOKENS, layer_name


@dataclass
class RoundWrite:
    """One session's part of a pass: what to write, in no particular order; ``changes``
    puts it in the commit order (module doc)."""

    sid: str
    make_dir: bool = False
    incarnation: int | None = None  # written when set (a copy without one)
    streams: list[tuple[int, int, list[Piece]]] = field(default_factory=list)  # (stream, size before, pieces)
    ids: tuple[int, bytes] | None = None  # (size before, a record) appended to the ids
    ids_cut: int | None = None  # cut the ids to this first (a damaged tail)
    summaries: tuple[bytes, bytes] | None = None  # (new, what the copy holds)
    meta: bytes | None = None  # meta.json's new bytes (the claim)

    def stream(self, stream: int, expect: int, pieces: Sequence[Piece]) -> None:
        self.streams.append((stream, expect, list(pieces)))

    def set_ids(self, cold: ColdBackend, ids: Sequence[int] | np.ndarray) -> int:
        """Write what makes the stored ids start with ``ids``; the first that differs."""
        ch = Changes()
        p = ids_changes(cold, self.sid, ids, ch)
        for c in ch.items:
            if c.name == TOKENS and c.kind == TRUNCATE:
                self.ids_cut = c.arg
            else:
                self.ids = (c.arg, b"".join(bytes(x) for x in c.pieces))
        return p

    def body(self) -> Changes:
        """Everything but the claim, in order."""
        ch = Changes(make_dir=self.make_dir)
        if self.incarnation is not None:
            ch.replace(INCARNATION, incarnation_bytes(self.incarnation))
        for stream, expect, pieces in sorted(self.streams, key=lambda t: t[0]):
            ch.append(layer_name(stream), expect, pieces)
        if self.ids_cut is not None:
            ch.truncate(TOKENS, self.ids_cut)
        if self.ids is not None:
            ch.append(TOKENS, self.ids[0], [np.frombuffer(self.ids[1], np.uint8)])
        if self.summaries is not None:
            ch.rewrite(SUMMARIES, *self.summaries)
        return ch

    def claim(self) -> Changes:
        ch = Changes()
        if self.meta is not None:
            ch.replace(META, self.meta)
        return ch

    def changes(self) -> Changes:
        """The whole round in the commit order (one batch)."""
        ch = self.body()
        ch.items += self.claim().items
        return ch


def commit(cold: ColdBackend, rounds: list[RoundWrite], claim_last: bool) -> list[Written]:
    """Write ``rounds`` in the commit order and make them durable (module doc). A failure
    of one session's sync is its ``Written.error``; a failed write raises."""
    if not claim_last:
        done = [cold.write(r.sid, r.changes()) for r in rounds]
        cold.sync(done)
        return done
    done = []
    for r in rounds:
        done.append(cold.write(r.sid, r.body()))
    cold.sync(done)
    for r, w in zip(rounds, done, strict=True):
        if w.error is None and r.meta is not None:
            cold.write(r.sid, r.claim(), w, durable=True)
    return done


def cut_history(cold: ColdBackend, sid: str, cut_meta: bytes, old_meta: bytes,
                ids: Sequence[int] | np.ndarray, streams: Sequence[int], start_bytes: int,
                summary_bytes: int) -> None:
    """Cut a stored history back to ``cut_meta``'s claim before a new tail is written:
    meta.json first, then the new ids, then each of ``streams`` to ``start_bytes`` and the
    summaries to ``summary_bytes`` (module doc). Each step is durable before the next."""
    write_meta(cold, sid, cut_meta, old=old_meta)
    plan = RoundWrite(sid, make_dir=True)
    if plan.set_ids(cold, ids) < len(ids):
        cold.sync([cold.write(sid, plan.body())])
    for stream in streams:
        truncate(cold, sid, layer_name(stream), start_bytes)
    old = cold.read_small(sid, SUMMARIES)
    if old and len(old) > summary_bytes:
        truncate(cold, sid, SUMMARIES, summary_bytes)


COPY_STEP = 8 << 20  # bytes per read while forking a session's streams


def fork(cold: ColdBackend, src: str, dst: str) -> Written | None:
    """Copy session ``src`` to a new ``dst`` in the commit order (streams, ids, summaries,
    then meta.json: a crash leaves ``dst`` without a claim, or whole). None when ``src`` is
    not there; FileExistsError when ``dst`` is."""
    st = cold.state(src, incarnation=False)
    if st is None:
        return None
    if cold.exists(dst):
        raise FileExistsError(f"session {dst!r} exists: a fork makes a new session")
    plan = RoundWrite(dst, make_dir=True)
    for stream, size in sorted(st[0].items()):
        pieces = []
        for off in range(0, size, COPY_STEP):
            buf = np.empty(min(COPY_STEP, size - off), np.uint8)
            cold.read_ranges(src, [(stream, off, buf)])
            pieces.append(buf)
        plan.stream(stream, 0, pieces)
    ids = cold.read_small(src, TOKENS)
    if ids:
        plan.ids = (0, ids)
    plan.summaries = (read_summaries(cold, src), b"")
    plan.meta = cold.read_small(src, META)
    return commit(cold, [plan], claim_last=True)[0]

"""Typed operations on one session's files over a ``ColdBackend``.

Reads (``layer_sizes``, ``read_layer``, ``read_meta``, ``read_ids``...), the small writes
(``write_small``, ``truncate``, ``record_ids``, ``write_acked``), ``ensure_dir``, ``fork``
and ``delete``. The order of a round's writes is ``commit``'s. Callers name files only
through ``names`` (and mostly not at all).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .backend import Changes, ColdBackend
from .formats import acked_bytes, load_meta, parse_acked, parse_incarnation, parse_meta
from .names import ACKED, INCARNATION, META, SUMMARIES, TOKENS, layer_name
from .tokens import decode, update


# ---- reads --------------------------------------------------------------------------------
def layer_sizes(cold: ColdBackend, sid: str) -> dict[int, int] | None:
    """{stream: size} of the session's copy (layers and side streams); None without one."""
    st = cold.state(sid, incarnation=False)
    return None if st is None else st[0]


def stream_size(cold: ColdBackend, sid: str, stream: int) -> int:
    """Bytes of one stream of the session's copy (0 when it has none)."""
    st = cold.state(sid, incarnation=False, streams=(stream,))
    return 0 if st is None else st[0].get(stream, 0)


def read_layer(cold: ColdBackend, sid: str, layer: int, off: int, out: np.ndarray,
               missing_is_empty: bool = False) -> None:
    """Fill ``out`` (uint8) from stream ``layer`` at ``off`` (ValueError past its end)."""
    cold.read_ranges(sid, [(layer, off, out)], missing_is_empty)


def read_meta_bytes(cold: ColdBackend, sid: str) -> bytes | None:
    return cold.read_small(sid, META)


def read_meta(cold: ColdBackend, sid: str) -> dict | None:
    """meta.json, the warm tier's reading (``formats.parse_meta``)."""
    return parse_meta(cold.read_small(sid, META), sid)


def load_meta_doc(cold: ColdBackend, sid: str) -> tuple[bytes, dict | None]:
    """meta.json's bytes (b"" when absent) and its document, strictly (``formats.load_meta``)."""
    raw = cold.read_small(sid, META) or b""
    return raw, load_meta(raw, sid)


def read_incarnation(cold: ColdBackend, sid: str) -> int | None:
    """The copy's incarnation id; None when it has none (or not one we can read)."""
    return parse_incarnation(cold.read_small(sid, INCARNATION))


def read_summaries(cold: ColdBackend, sid: str) -> bytes:
    return cold.read_small(sid, SUMMARIES) or b""


def read_acked(cold: ColdBackend, sid: str) -> int | None:
    """Tokens a flush acknowledged as durable (None: no record; SessionCorrupt: a record
    that does not read as one)."""
    return parse_acked(cold.read_small(sid, ACKED), sid)


def read_ids(cold: ColdBackend, sid: str) -> np.ndarray:
    """The stored token ids of the session (uint32; empty when it has none)."""
    raw = cold.read_small(sid, TOKENS)
    return decode(raw, f"session {sid!r} {TOKENS}")[0] if raw else np.empty(0, np.uint32)


# ---- small writes -------------------------------------------------------------------------
def ensure_dir(cold: ColdBackend, sid: str) -> bool:
    """Make the session's directory unless it is there; True when made."""
    return cold.write(sid, Changes(make_dir=True)).made_dir


def truncate(cold: ColdBackend, sid: str, name: str, length: int) -> None:
    """Cut file ``name`` to ``length`` bytes, durable when this returns."""
    ch = Changes()
    ch.truncate(name, length)
    cold.write(sid, ch, durable=True)


def truncate_stream(cold: ColdBackend, sid: str, stream: int, length: int) -> None:
    truncate(cold, sid, layer_name(stream), length)


def write_small(cold: ColdBackend, sid: str, name: str, raw: bytes, old: bytes | None = None,
                durable: bool = True) -> bool:
    """Replace small file ``name`` unless it holds ``raw`` already (``old``: what it holds,
    when the caller knows; else it is read). True if it changed."""
    if (old if old is not None else cold.read_small(sid, name)) == raw:
        return False
    ch = Changes()
    ch.replace(name, raw)
    cold.write(sid, ch, durable=durable)
    return True


def write_meta(cold: ColdBackend, sid: str, raw: bytes, old: bytes | None = None) -> bool:
    """Replace meta.json, durably (the claim: ``commit`` says when it may be written)."""
    return write_small(cold, sid, META, raw, old)


def write_acked(cold: ColdBackend, sid: str, tokens: int, old: int | None = None) -> None:
    """Record, durably, that ``tokens`` are acknowledged (``old``: the record before)."""
    write_small(cold, sid, ACKED, acked_bytes(tokens),
                None if old is None else acked_bytes(old))


def ids_changes(cold: ColdBackend, sid: str, ids: Sequence[int] | np.ndarray,
                ch: Changes) -> int:
    """Add to ``ch`` what makes the stored ids start with ``ids`` (a damaged tail is cut
    off first, so the new record is readable). Returns the first position that differs."""
    raw = cold.read_small(sid, TOKENS) or b""
    p, good, record = update(raw, sid, ids)
    if record is not None:
        if good < len(raw):
            ch.truncate(TOKENS, good)
        ch.append(TOKENS, good, [np.frombuffer(record, np.uint8)])
    return p


def record_ids(cold: ColdBackend, sid: str, ids: Sequence[int] | np.ndarray,
               sync: bool = True) -> int:
    """Make the session's stored ids start with ``ids``: nothing when they already do,
    else one record from the first id that differs. Returns that position."""
    ch = Changes(make_dir=True)
    p = ids_changes(cold, sid, ids, ch)
    if not ch:
        return p
    written = cold.write(sid, ch)
    if sync:
        cold.sync([written])
    else:
        written.forget()
    return p


# ---- whole sessions -----------------------------------------------------------------------
def delete(cold: ColdBackend, sid: str) -> bool:
    return cold.delete(sid)


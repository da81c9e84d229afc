"""The small files' formats: ``.incarnation``, ``.acked``, ``meta.json``, ``summaries.f32``.

Trust, file by file (docs/format.md has the bytes):

* ``.incarnation`` -- exactly 16 hex digits and a newline; anything else reads as "none"
  (the warm tier then never writes a RAM copy over the session: deletion wins);
* ``.acked`` -- ``{"tokens": N}``, a lower bound on what ``meta.json`` may claim; an
  unreadable one is ``SessionCorrupt`` (what was acknowledged is unknown: nothing is cut);
* ``meta.json`` -- read bounded (``names.MAX_SMALL``), parsed without recursion errors
  escaping, and every field checked (``check_meta_doc``) before anything is believed: a
  document that lies (bad fields, rounds outside its tokens, more tokens than the layers
  or the ids hold) is ``SessionCorrupt``, never read as a shorter session;
* ``summaries.f32`` -- ``row`` bytes per round; rows past the claimed rounds mean nothing.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .errors import SessionCorrupt
from .names import ACKED, META, layer_name

log = logging.getLogger("kvfs.session")

MAX_ROUNDS = 1 << 20
_INTS = ("num_layers", "num_kv_heads", "head_dim", "tokens")
META_KEYS = ("format", "model", "num_layers", "num_kv_heads", "head_dim", "dtype", "tokens", "rounds")
#: the ``format`` of the meta.json documents kvfs writes
META_FORMAT = "kvfs-kv/1"


def meta_doc(model: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, tokens: int,
             rounds: list[list[int]]) -> dict[str, Any]:
    """The ``meta.json`` document (exactly ``META_KEYS``, docs/format.md): the model's
    fingerprint and KV geometry, the tokens claimed, the rounds as ``[start, end)``."""
    return {"format": META_FORMAT, "model": model, "num_layers": int(num_layers),
            "num_kv_heads": int(num_kv_heads), "head_dim": int(head_dim), "dtype": dtype,
            "tokens": int(tokens), "rounds": [[int(a), int(b)] for a, b in rounds]}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---- .incarnation -------------------------------------------------------------------------
def incarnation_bytes(inc: int) -> bytes:
    return f"{inc:016x}\n".encode()


def parse_incarnation(raw: bytes | None) -> int | None:
    try:
        return int(raw, 16) if raw and len(raw) == 17 and raw.endswith(b"\n") else None
    except ValueError:
        return None


# ---- .acked -------------------------------------------------------------------------------
def acked_bytes(tokens: int) -> bytes:
    return json.dumps({"tokens": int(tokens)}).encode()


def parse_acked(raw: bytes | None, sid: str) -> int | None:
    """Tokens acknowledged as durable; None without a record; SessionCorrupt for a record
    that does not read as one."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        n = doc["tokens"] if isinstance(doc, dict) else None
    except (ValueError, RecursionError, KeyError):
        n = None
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise SessionCorrupt(f"session {sid!r}: {ACKED} is unreadable; what was acknowledged is "
                             "unknown, so nothing is cut (remove the file to resume from "
                             f"{META})")
    return int(n)


# ---- meta.json ----------------------------------------------------------------------------
def dump_meta(meta: dict[str, Any]) -> bytes:
    """meta.json's bytes as kvfs.vllm writes them (compact)."""
    return json.dumps(meta, separators=(",", ":")).encode()


def parse_meta(raw: bytes | None, sid: str) -> dict[str, Any] | None:
    """The warm tier's reading: a document or None (no file, or one that is not a JSON
    object: logged, and the session has no claim). ``load_meta`` is the strict reading."""
    if not raw:
        return None
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        log.warning("cold %s/%s is not JSON; ignored", sid, META)
        return None
    return meta if isinstance(meta, dict) else None


def load_meta(raw: bytes | None, sid: str) -> dict[str, Any] | None:
    """meta.json strictly: None when there is none (absent or empty: a session without a
    claim), else the JSON object or SessionCorrupt. Fields are ``check_meta_doc``'s."""
    if not raw:
        return None
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise SessionCorrupt(f"session {sid!r}: {META} does not parse ({e})") from None
    if not isinstance(meta, dict):
        raise SessionCorrupt(f"session {sid!r}: {META} is not a JSON object")
    return meta


def tokens_claimed(raw: bytes) -> int:
    """The ``tokens`` a meta.json's bytes claim, 0 when they do not say (the warm tier's
    index of its RAM copies; the document is checked where it is used)."""
    try:
        t = json.loads(raw).get("tokens", 0)
    except (ValueError, AttributeError, RecursionError):
        return 0
    return t if isinstance(t, int) and t >= 0 else 0


def check_meta_doc(meta: object, fmt: str, sid: str = "?") -> dict[str, Any]:
    """``meta`` if it is a meta.json document kvfs writes in format ``fmt``, else
    SessionCorrupt naming the first bad field. Checks shape only: whether it is this
    model's is the caller's (the hot tier compares the model and the KV geometry)."""
    where = f"session {sid!r}: {META}"
    if not isinstance(meta, dict):
        raise SessionCorrupt(f"{where} is not a JSON object")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise SessionCorrupt(f"{where} lacks {missing}")
    if meta["format"] != fmt:
        raise SessionCorrupt(f"{where} format {meta['format']!r}, expected {fmt!r}")
    for k in ("model", "dtype"):
        if not isinstance(meta[k], str) or len(meta[k]) > 256:
            raise SessionCorrupt(f"{where} {k} is not a short string")
    for k in _INTS:
        v = meta[k]
        if not _is_int(v) or v < (0 if k == "tokens" else 1) or v >= 1 << 48:
            raise SessionCorrupt(f"{where} {k}={v!r}")
    rounds, tokens = meta["rounds"], meta["tokens"]
    most = min(MAX_ROUNDS, tokens)  # a round holds one token at least
    if not isinstance(rounds, list) or len(rounds) > most:
        raise SessionCorrupt(f"{where} rounds is not a list of at most {most} [start, end] pairs")
    prev = 0
    for r in rounds:
        if (not isinstance(r, list) or len(r) != 2 or not all(_is_int(x) for x in r)
                or not prev <= r[0] <= r[1] <= tokens):
            raise SessionCorrupt(f"{where} round {r!r} is not inside [{prev}, {tokens}]")
        prev = r[1]
    return meta


def check_claim(sid: str, tokens: int, layer_bytes: dict[int, int], layers: int,
                token_bytes: int, ids: int | None = None) -> None:
    """SessionCorrupt unless every layer file (and the ids, when given) holds the
    ``tokens`` meta.json claims: they are written before it, so less is a lie."""
    for layer in range(layers):
        have = layer_bytes.get(layer, 0)
        if have < tokens * token_bytes:
            raise SessionCorrupt(
                f"session {sid!r} {layer_name(layer)}: {have} bytes, {META} says {tokens} tokens x "
                f"{token_bytes} B = {tokens * token_bytes} B: the layer file is truncated")
    if ids is not None and ids < tokens:
        raise SessionCorrupt(f"session {sid!r}: {ids} token ids stored, {META} says {tokens}")


# ---- summaries.f32 ------------------------------------------------------------------------
def put_summary_row(old: bytes, idx: int, row: bytes) -> bytes:
    """``old`` with round ``idx``'s vector ``row`` set (rows of later rounds dropped,
    rounds skipped over zero: they rank last)."""
    n = len(row)
    keep = old[: min(len(old) // n, idx) * n]
    return keep + b"\0" * (idx * n - len(keep)) + row

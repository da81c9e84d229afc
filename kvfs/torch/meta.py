"""``meta.json``, distrusted: read bounded, every field checked, reconciled with the layer
files only where the difference is a crash tail.

A session's ``meta.json`` says how many tokens its layer files hold. Resume used to believe
it and cut the layer files down to whatever it said -- for good, on the mount. Now:

* it is read at most ``MAX_SMALL`` bytes (the warm tier's ``ColdStore``), parsed without
  recursion errors escaping, and every field is checked (``check``): :class:`KVCorrupt`
  for each bad one, :class:`KVMismatch` for another model;
* every ``flush``/``save`` of the router records, durably, the tokens it acknowledged:
  ``sessions/<id>/.acked`` on the mount (``{"tokens": N}``, written and fsynced after the
  flush that made those tokens durable);
* on resume (``reconcile``) layer bytes past ``meta.json``'s tokens are a crash tail only
  if ``meta.json`` claims at least what was acknowledged: bytes appended after the last
  acknowledged ``meta.json`` update, never acknowledged, so they are dropped (with a log
  line). A ``meta.json`` that claims fewer tokens than were acknowledged is corrupt: resume
  refuses and the files stay as they are.

Without a mount (a warm tier alone) there is no record; the RAM tier's own checksums guard
its copy. Only the router and the cache's resume call this module.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any, TypeGuard

from kvfs.torch.fingerprint import FORMAT, KVCorrupt, KVGeometry, check_meta
from kvfs.torch.seams import WarmStore

log = logging.getLogger("kvfs.torch")

ACKED = ".acked"  # the durable record of acknowledged tokens, beside meta.json
MAX_ROUNDS = 1 << 20
_INTS = ("num_layers", "num_kv_heads", "head_dim", "tokens")
_KEYS = ("format", "model", "num_layers", "num_kv_heads", "head_dim", "dtype", "tokens", "rounds")


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def check(meta: Any, sid: str = "?") -> dict:
    """``meta`` if it is a ``meta.json`` document kvfs writes, else KVCorrupt naming the
    first bad field. Checks shape only: ``check_meta`` compares it with a model."""
    where = f"session {sid!r}: meta.json"
    if not isinstance(meta, dict):
        raise KVCorrupt(f"{where} is not a JSON object")
    missing = [k for k in _KEYS if k not in meta]
    if missing:
        raise KVCorrupt(f"{where} lacks {missing}")
    if meta["format"] != FORMAT:
        raise KVCorrupt(f"{where} format {meta['format']!r}, expected {FORMAT!r}")
    for k in ("model", "dtype"):
        if not isinstance(meta[k], str) or len(meta[k]) > 256:
            raise KVCorrupt(f"{where} {k} is not a short string")
    for k in _INTS:
        v = meta[k]
        if not _is_int(v) or v < (0 if k == "tokens" else 1) or v >= 1 << 48:
            raise KVCorrupt(f"{where} {k}={v!r}")
    rounds, tokens = meta["rounds"], meta["tokens"]
    most = min(MAX_ROUNDS, tokens)  # a round holds one token at least
    if not isinstance(rounds, list) or len(rounds) > most:
        raise KVCorrupt(f"{where} rounds is not a list of at most {most} [start, end] pairs")
    prev = 0
    for r in rounds:
        if (not isinstance(r, list) or len(r) != 2 or not all(_is_int(x) for x in r)
                or not prev <= r[0] <= r[1] <= tokens):
            raise KVCorrupt(f"{where} round {r!r} is not inside [{prev}, {tokens}]")
        prev = r[1]
    return meta


def stored(warm: WarmStore, sid: str) -> dict | None:
    """The session's ``meta.json`` from the warm tier (or the mount below it), checked; None
    when there is none. KVCorrupt when it cannot be read or is not one kvfs writes."""
    from kvfs.warm import WarmCorrupt  # noqa: PLC0415 - the warm tier's own error

    try:
        meta = warm.get_meta(sid)
    except WarmCorrupt as e:
        raise KVCorrupt(f"session {sid!r}: {e}") from None
    except RecursionError:
        raise KVCorrupt(f"session {sid!r}: meta.json nests too deep to be one") from None
    return None if meta is None else check(meta, sid)


def acknowledged(warm: WarmStore, sid: str) -> int:
    """Tokens a flush acknowledged as durable (0 without a record or a mount)."""
    cold = warm.cold
    if cold is None:
        return 0
    raw = cold.read_small(sid, ACKED)
    if raw is None:
        return 0
    try:
        doc = json.loads(raw)
        n = doc["tokens"] if isinstance(doc, dict) else None
    except (ValueError, RecursionError):
        n = None
    if not _is_int(n) or n < 0:
        raise KVCorrupt(f"session {sid!r}: {ACKED} is unreadable; what was acknowledged is "
                        "unknown, so nothing is cut (remove the file to resume from meta.json)")
    return n


def acknowledge(warm: WarmStore, sids: Iterable[str], done: dict[str, int]) -> None:
    """After a flush made them durable: record the tokens of each session's ``meta.json``
    as acknowledged (only those changed since ``done``, which is updated)."""
    cold = warm.cold
    if cold is None:
        return
    for sid in sids:
        meta = warm.get_meta(sid)
        n = meta.get("tokens") if isinstance(meta, dict) else None
        if not _is_int(n) or done.get(sid) == n:
            continue
        old = None if sid not in done else json.dumps({"tokens": done[sid]}).encode()
        cold.write_meta(sid, json.dumps({"tokens": n}).encode(), sync=True, old=old, name=ACKED)
        done[sid] = n


def reconcile(warm: WarmStore, sid: str, meta: dict, fp: str, geo: KVGeometry, layers: int) -> int:
    """Check ``meta`` against the model and the layer files; drop a crash tail. Returns
    the session's tokens. KVCorrupt (nothing changed) when the files hold fewer tokens than
    meta.json claims, or meta.json claims fewer than were acknowledged."""
    check_meta(check(meta, sid), fp, geo, sid)
    tokens, tb = meta["tokens"], geo.token_bytes
    acked = acknowledged(warm, sid)
    if tokens < acked:
        raise KVCorrupt(f"session {sid!r}: meta.json claims {tokens} tokens, {acked} were "
                        "acknowledged as durable: meta.json is corrupt; the layer files are "
                        "left as they are")
    sizes = warm.layer_sizes(sid)
    tails = {}
    for layer in range(layers):
        have = sizes.get(layer, 0)
        if have < tokens * tb:
            raise KVCorrupt(
                f"session {sid!r} layer_{layer}: {have} bytes, meta.json says {tokens} tokens x "
                f"{tb} B = {tokens * tb} B: the layer file is truncated")
        if have > tokens * tb:
            tails[layer] = have - tokens * tb
    if tails:
        most = max(tails.values())
        log.warning("session %r: a crash tail of up to %d bytes (%.1f tokens) in %d layer files, "
                    "appended after the last meta.json update (%d tokens; %d acknowledged): "
                    "dropped", sid, most, most / tb, len(tails), tokens, acked)
        for layer in tails:
            warm.truncate(sid, layer, tokens * tb)
    return tokens


"""``meta.json``, distrusted: read bounded, every field checked, reconciled with the layer
files only where the difference is a crash tail.

A session's ``meta.json`` says how many tokens its layer files hold. Resume used to believe
it and cut the layer files down to whatever it said -- for good, on the mount. Now:

* it is read bounded (``kvfs.session``), parsed without recursion errors escaping, and
  every field is checked (``checked_meta``: the session's format, ``kvfs.session.formats``):
  :class:`KVCorrupt` for each bad one, :class:`KVMismatch` for another model;
* every ``flush``/``save`` of the router records, durably, the tokens it acknowledged
  beside it on the mount (``kvfs.session.files.write_acked``, after the flush that made
  those tokens durable);
* on resume (``reconcile``) layer bytes past ``meta.json``'s tokens are a crash tail only
  if ``meta.json`` claims at least what was acknowledged: bytes appended after the last
  acknowledged ``meta.json`` update, never acknowledged, so they are dropped (with a log
  line). A ``meta.json`` that claims fewer tokens than were acknowledged is corrupt: resume
  refuses and the files stay as they are.

Without a mount (a warm tier alone) there is no record; the RAM tier's own checksums guard
its copy. Only the router and the cache's resume call this module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvfs.session import SessionCorrupt, files
from kvfs.session.formats import check_claim
from kvfs.torch.fingerprint import KVCorrupt, KVGeometry, check_meta, checked_meta
from kvfs.torch.seams import WarmStore

log = logging.getLogger("kvfs.torch")


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
    return None if meta is None else checked_meta(meta, sid)


def acknowledged(warm: WarmStore, sid: str) -> int:
    """Tokens a flush acknowledged as durable (0 without a record or a mount)."""
    cold = warm.cold
    if cold is None:
        return 0
    try:
        n = files.read_acked(cold, sid)
    except SessionCorrupt as e:
        raise KVCorrupt(str(e)) from None
    return 0 if n is None else n


def acknowledge(warm: WarmStore, sids: Iterable[str], done: dict[str, int]) -> None:
    """After a flush made them durable: record the tokens of each session's ``meta.json``
    as acknowledged (only those changed since ``done``, which is updated)."""
    cold = warm.cold
    if cold is None:
        return
    for sid in sids:
        meta = warm.get_meta(sid)
        n = meta.get("tokens") if isinstance(meta, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or done.get(sid) == n:
            continue
        files.write_acked(cold, sid, n, done.get(sid))
        done[sid] = n


def reconcile(warm: WarmStore, sid: str, meta: dict, fp: str, geo: KVGeometry, layers: int) -> int:
    """Check ``meta`` against the model and the layer files; drop a crash tail. Returns
    the session's tokens. KVCorrupt (nothing changed) when the files hold fewer tokens than
    meta.json claims, or meta.json claims fewer than were acknowledged."""
    check_meta(meta, fp, geo, sid)  # its shape, then the model's
    tokens, tb = meta["tokens"], geo.token_bytes
    acked = acknowledged(warm, sid)
    if tokens < acked:
        raise KVCorrupt(f"session {sid!r}: meta.json claims {tokens} tokens, {acked} were "
                        "acknowledged as durable: meta.json is corrupt; the layer files are "
                        "left as they are")
    sizes = warm.layer_sizes(sid)
    try:
        check_claim(sid, tokens, sizes, layers, tb)
    except SessionCorrupt as e:
        raise KVCorrupt(str(e)) from None
    tails = {}
    for layer in range(layers):
        have = sizes.get(layer, 0)
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


"""Exactness for the agent tools: a per-session record of every K/V byte the model produced,
fed from the cache's layers, and the comparisons of recalled, windowed and stored bytes with it.

Never imports torch at module level (only the helpers that need it, when called).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np


def token_major(k: Any, v: Any) -> np.ndarray:
    """The layer-file bytes of ``[1, H, T, D]`` K/V tensors (per token K then V), as uint8."""
    import torch  # noqa: PLC0415 - callers have it loaded already

    tm = torch.stack((k[0].transpose(0, 1), v[0].transpose(0, 1)), dim=1).contiguous().cpu()
    return tm.reshape(-1).view(torch.uint8).numpy()


class KVRecord:
    """Every K/V byte a session's model produced, per layer, token-major (the reference).

    :func:`record_into` makes a cache feed it from each layer's ``update`` (the states the
    attention layers hand to the cache, before any tiering), so it is independent of what the
    tiers store and read back. One buffer for all layers, grown by doubling from ``tokens``
    (few, same-sized allocations: a long-running generator must not fragment its own heap).
    """

    def __init__(self, num_layers: int, token_bytes: int, tokens: int = 64) -> None:
        self.token_bytes = token_bytes
        self.buf = np.empty((num_layers, max(1, tokens) * token_bytes), np.uint8)
        self.ends = [0] * num_layers

    @classmethod
    def of(cls, layers: Sequence[np.ndarray], token_bytes: int) -> KVRecord:
        """A record holding ``layers`` (uint8, one per layer, equal lengths)."""
        rec = cls(len(layers), token_bytes, max(1, len(layers[0]) // token_bytes))
        for i, data in enumerate(layers):
            rec.buf[i, :len(data)] = data
            rec.ends[i] = len(data)
        return rec

    @property
    def tokens(self) -> int:
        return self.ends[0] // self.token_bytes

    def add(self, layer: int, k: Any, v: Any) -> None:
        data, end = token_major(k, v), self.ends[layer]
        if end + len(data) > self.buf.shape[1]:
            grown = np.empty((self.buf.shape[0], max(2 * self.buf.shape[1], end + len(data))), np.uint8)
            grown[:, :self.buf.shape[1]] = self.buf
            self.buf = grown
        self.buf[layer, end:end + len(data)] = data
        self.ends[layer] = end + len(data)

    def span(self, layer: int, start: int, end: int) -> np.ndarray:
        """Bytes of tokens ``[start, end)`` of ``layer`` (a view)."""
        return self.buf[layer, start * self.token_bytes:end * self.token_bytes]

    def layer(self, layer: int) -> np.ndarray:
        """Every byte of ``layer`` so far (a view)."""
        return self.buf[layer, :self.ends[layer]]


def record_into(cache: Any, rec: KVRecord) -> None:
    """Wrap each layer's ``update`` of a ``TieredCache`` so its inputs go to ``rec`` too.

    The wrapper holds its layer and ``rec`` weakly (the caller keeps ``rec``): a cache's
    layers and the cache refer to each other, so anything they hold lives until the cyclic
    collector runs, and a busy day would pile up the records of finished sessions.
    """
    for lay in cache.layers:
        lay.update = _recording_update(weakref.ref(lay), type(lay).update, lay.idx, weakref.ref(rec))


def _recording_update(layer: Any, cls_update: Any, idx: int, rec: Any) -> Any:
    def update(k: Any, v: Any, *a: Any, **kw: Any) -> Any:
        r = rec()
        if r is not None:
            r.add(idx, k, v)
        return cls_update(layer(), k, v, *a, **kw)

    return update


def recall_exact(cache: Any, rec: KVRecord, rounds: list[int], attended_start: int) -> bool | None:
    """Whether the recalled copies of ``rounds`` (what ``cache.recall`` just returned, with the
    window's ``attended_start`` at that moment) are the produced bytes; None: nothing was read."""
    p = min(cache.sink_tokens, cache.seen)  # the sinks are attended already: never recalled
    spans = [(max(a, p), min(b, attended_start)) for a, b in (cache.rounds[r] for r in rounds)]
    spans = [(a, b) for a, b in spans if b > a]
    if not spans:
        return None
    tb = rec.token_bytes
    for lay in cache.layers:
        got, at, checked = token_major(lay.recall_keys, lay.recall_values), 0, []
        if len(got) != sum(b - a for a, b in spans) * tb:
            return False
        for a, b in spans:
            want = rec.span(lay.idx, a, b)
            shift = cache.recall_shifts[len(checked)]
            checked.append(shift)
            if shift:  # re-rotated: the keys moved by the cache's own rotation
                want = _rotated(cache, want, b - a, shift)
            if not np.array_equal(got[at:at + (b - a) * tb], want):
                return False
            at += (b - a) * tb
    return True


def _rotated(cache: Any, produced: np.ndarray, tokens: int, shift: int) -> np.ndarray:
    """Token-major bytes of ``tokens`` produced tokens with their keys moved ``shift``
    positions by the cache's own rotation (what a re-rotating cache holds)."""
    from kvfs.torch.fingerprint import kv_from_bytes

    k, v = kv_from_bytes(produced, cache.geo, tokens)
    return token_major(cache.rope.rotate(k, shift), v)


def window_exact(cache: Any, rec: KVRecord) -> bool:
    """Whether the cache has seen what ``rec`` holds and what its device holds (the sinks,
    then the window) is those bytes."""
    def held(lay: Any) -> np.ndarray:
        p = lay.pinned
        sinks = rec.span(lay.idx, 0, p)
        if lay.sink_shift:  # re-rotating: the sinks' keys sit just before the window
            sinks = _rotated(cache, sinks, p, lay.sink_shift)
        return np.concatenate([sinks, rec.span(lay.idx, lay.window_start, lay.seen)])

    return rec.tokens == cache.seen and all(
        np.array_equal(token_major(lay.keys, lay.values), held(lay))
        for lay in cache.layers if lay.stored)


def stored_layers(warm: Any, sid: str, num_layers: int, token_bytes: int, tokens: int) -> list[np.ndarray]:
    """The first ``tokens`` tokens of every layer as stored (warm and/or cold; no promotion)."""
    return [warm.read(sid, layer, 0, tokens * token_bytes, promote=False) for layer in range(num_layers)]


def digests(layers: Sequence[np.ndarray]) -> list[bytes]:
    """SHA-256 of each layer's bytes (what a session keeps while it waits for a return visit)."""
    return [hashlib.sha256(np.ascontiguousarray(data)).digest() for data in layers]

"""Round summaries and reading stored rounds back as tensors (recall and resume).

Owns: the use of the per-round summary vector (the mean key of a round, projected by a
fixed seeded matrix and L2-normalised: ``kvfs.warm.summarize_keys``, one definition for
both tiers), ranking rounds by similarity to a query, and
reading token ranges of a session's layer files from the warm tier into K/V tensors with
every length checked (a short file raises :class:`KVCorrupt`, never yields garbage). Reads
go through the warm tier's API only, never a path under the mount.

Which key feeds a summary: the keys of the model's *last* layer, flattened per token to
``num_kv_heads * head_dim`` values (post-RoPE, as cached). Summaries guide recall only;
the model never attends to them.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvfs.torch.fingerprint import KVCorrupt, KVGeometry, kv_from_bytes
from kvfs.torch.seams import WarmStore
from kvfs.warm import summarize_keys as warm_summarize_keys

log = logging.getLogger("kvfs.torch.recall")

GROUP_BYTES = 8 << 20  # layer bytes read_spans reads in one batch (the next while this one is laid out)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def layer_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(2, thread_name_prefix="kvfs-read")
        return _pool


def summarize_keys(keys: np.ndarray, dim: int = 128) -> np.ndarray:
    """Summary of ``keys`` (``[tokens, features]``): :func:`kvfs.warm.summarize_keys`, the one
    definition the warm tier, the hot tier and recall share."""
    k = np.asarray(keys, dtype=np.float32)
    k = k.reshape(1, -1) if k.ndim <= 1 else k.reshape(k.shape[0], -1)
    return np.asarray(warm_summarize_keys(k, dim), dtype=np.float32).reshape(dim)


def query_summary(query: torch.Tensor | np.ndarray, geo: KVGeometry, dim: int) -> np.ndarray:
    """A query in summary space.

    Accepts a summary itself (``[dim]``), key-space vectors (``[..., H*D]`` or
    ``[1, H, T, D]`` keys, averaged over tokens), and returns an L2-normalised ``[dim]`` vector.
    """
    q = query.detach().float().cpu().numpy() if isinstance(query, torch.Tensor) else np.asarray(query, np.float32)
    feat = geo.num_kv_heads * geo.head_dim
    if q.ndim == 4:  # [B, H, T, D] keys
        q = np.transpose(q[0], (1, 0, 2)).reshape(-1, feat)
    if q.size == dim and q.ndim <= 1:
        n = float(np.linalg.norm(q))
        return (q / n if n > 0 else q).astype(np.float32)
    if q.shape[-1] != feat:
        raise ValueError(f"query of shape {q.shape}: expected [{dim}] (a summary) or [..., {feat}] keys")
    return summarize_keys(q.reshape(-1, feat), dim)


def rank_rounds(summaries: np.ndarray, query: np.ndarray, among: list[int] | None = None) -> list[int]:
    """Round indices by descending cosine similarity of their summary to ``query``."""
    if summaries.size == 0:
        return []
    s = np.asarray(summaries, np.float32)
    norms = np.linalg.norm(s, axis=1)
    sims = (s @ query) / np.where(norms > 0, norms, 1.0)
    idx = list(range(len(s))) if among is None else [i for i in among if 0 <= i < len(s)]
    return sorted(idx, key=lambda i: (-float(sims[i]), i))


SCRATCH_MAX = 16 << 20  # reads up to this size go through a reused per-thread buffer
_scratch = threading.local()


def _read(warm: WarmStore, sid: str, layer: int, a: int, b: int, promote: bool | None) -> np.ndarray:
    """Layer bytes [a, b): into this thread's reused buffer up to ``SCRATCH_MAX`` bytes
    (its pages are faulted in once, not per read: 4 MiB of fresh memory costs about a
    millisecond of page faults), else a new array. The bytes are valid until this
    thread's next read: the caller copies them out (``kv_from_bytes`` does)."""
    kw = {} if promote is None else {"promote": promote}
    n = b - a
    if n > SCRATCH_MAX:
        return warm.read(sid, layer, a, b, **kw)
    out = _scratch_bytes(n)
    warm.read_into(sid, layer, a, b, out, **kw)
    return out


def _scratch_bytes(n: int) -> np.ndarray:
    """``n`` bytes of this thread's reused read buffer (valid until its next read)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(max(n, 1 << 20), np.uint8)
    return buf[:n]


def read_tokens(warm: WarmStore, sid: str, layer: int, geo: KVGeometry, start: int, end: int,
                device: torch.device | str, promote: bool | None = None,
                checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[start, end)`` of (sid, layer) as K/V ``[1,H,T,D]`` on ``device`` (exact bytes).

    ``promote`` is passed to the warm tier's read (None: its default policy). ``checked``:
    the caller has checked that the layer holds ``end`` tokens (a read past its end still
    raises :class:`KVCorrupt`, with the warm tier's words).
    """
    tb = geo.token_bytes
    if not checked:
        have = warm.size(sid, layer)
        if have < end * tb:
            raise KVCorrupt(
                f"session {sid!r} layer_{layer}: holds {have} bytes ({have // tb} whole tokens), "
                f"needs tokens [{start}, {end}) = {end * tb} bytes: the layer file is truncated")
    try:
        buf = _read(warm, sid, layer, start * tb, end * tb, promote)
    except ValueError as e:
        raise KVCorrupt(f"session {sid!r} layer_{layer}: cannot read tokens [{start}, {end}): {e}") from e
    return kv_from_bytes(buf, geo, end - start, device)


def read_runs(warm: WarmStore, sid: str, layer: int, geo: KVGeometry, runs: list[tuple[int, int]],
              device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of ``runs`` (``[start, end)`` pairs, in the order given) of (sid, layer), one
    after another, as one K/V ``[1,H,T,D]`` on ``device`` (exact bytes): one call of the warm
    tier for all of them (its lookup and lock once, not once a run), never promoting the
    session (the reads of old blocks that retrieval chose). The layer must hold the last
    run's end (a read past it raises :class:`KVCorrupt`)."""
    tb = geo.token_bytes
    n = sum(e - a for a, e in runs) * tb
    buf = _scratch_bytes(n) if n <= SCRATCH_MAX else np.empty(n, np.uint8)
    try:
        warm.read_many(sid, _read_jobs([layer], runs, tb, buf), promote=False)
    except ValueError as e:
        raise KVCorrupt(f"session {sid!r} layer_{layer}: cannot read tokens {runs}: {e}") from e
    return kv_from_bytes(buf, geo, n // tb, device)


def read_spans(warm: WarmStore, sid: str, geo: KVGeometry, spans: list[tuple[int, int]],
               device: torch.device | str, promote: bool | None = None, checked: bool = False
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each layer, K/V of the concatenated token ``spans`` (in the order given).

    Layers are read in batches of about ``GROUP_BYTES`` (``WarmTier.read_many``: what is on
    the cold tier comes in one request per batch, its reads running together), the next
    batch coming in while this one is laid out as K and V (a copy); both release the GIL.
    ``checked``: see :func:`read_tokens`."""
    spans = [(a, b) for a, b in spans if b > a]
    tb = geo.token_bytes
    per_layer = sum(b - a for a, b in spans) * tb
    if not spans:
        empty = torch.empty(1, geo.num_kv_heads, 0, geo.head_dim, dtype=geo.dtype, device=device)
        return [(empty, empty.clone()) for _ in range(geo.num_layers)]
    if not checked:
        end = max(b for _, b in spans)
        sizes = warm.layer_sizes(sid)
        for layer in range(geo.num_layers):
            have = sizes.get(layer, 0)
            if have < end * tb:
                raise KVCorrupt(
                    f"session {sid!r} layer_{layer}: holds {have} bytes ({have // tb} whole "
                    f"tokens), needs tokens up to {end} = {end * tb} bytes: the layer file is "
                    "truncated")
    per_group = max(1, GROUP_BYTES // per_layer)
    groups = [range(i, min(geo.num_layers, i + per_group)) for i in range(0, geo.num_layers, per_group)]

    def fetch(k: int) -> np.ndarray:
        buf = _buffer(k % 2, len(groups[k]) * per_layer)
        try:
            warm.read_many(sid, _read_jobs(groups[k], spans, tb, buf), promote=promote)
        except ValueError as e:
            raise KVCorrupt(f"session {sid!r}: cannot read layers {groups[k].start}.."
                            f"{groups[k].stop - 1} tokens {spans}: {e}") from e
        return buf

    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    pool = layer_pool()
    ahead = pool.submit(fetch, 0) if len(groups) > 1 else None
    for k, group in enumerate(groups):
        buf = ahead.result() if ahead is not None else fetch(k)
        ahead = pool.submit(fetch, k + 1) if k + 1 < len(groups) else None
        tokens = per_layer // tb
        for j in range(len(group)):
            out.append(kv_from_bytes(buf[j * per_layer:(j + 1) * per_layer], geo, tokens, device))
    return out


def _read_jobs(layers: list[int] | range, spans: list[tuple[int, int]], tb: int,
               buf: np.ndarray) -> list[tuple[int, int, int, np.ndarray]]:
    """The warm tier's read jobs (layer, start, end, out) of token ``spans`` of each of
    ``layers``, their bytes one after another in ``buf``."""
    jobs, o = [], 0
    for layer in layers:
        for a, b in spans:
            n = (b - a) * tb
            jobs.append((layer, a * tb, b * tb, buf[o:o + n]))
            o += n
    return jobs


def _buffer(which: int, n: int) -> np.ndarray:
    """One of two reused scratch buffers of the calling thread's reads (its pages faulted
    in once, not per read: 4 MiB of fresh memory costs about a millisecond of page
    faults); a new array past ``SCRATCH_MAX``."""
    if n > SCRATCH_MAX:
        return np.empty(n, np.uint8)
    bufs = getattr(_scratch, "pair", None)
    if bufs is None:
        bufs = _scratch.pair = [np.empty(0, np.uint8), np.empty(0, np.uint8)]
    if bufs[which].size < n:
        bufs[which] = np.empty(max(n, 1 << 20), np.uint8)
    return bufs[which][:n]

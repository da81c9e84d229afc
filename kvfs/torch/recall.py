"""Round summaries and reading stored rounds back as tensors (recall and resume).

Owns: the use of the per-round summary vector (the mean key of a round, projected by a
fixed seeded matrix and L2-normalised: ``kvfs.warm.summarize_keys``, one definition for
both tiers), ranking rounds by similarity to a query, and
reading token ranges of a session's layer files from the warm tier into K/V tensors with
every length checked (a short file raises :class:`KVCorrupt`, never yields garbage), and a
read-ahead hint for the cold copies a resume is about to read. Reads go through the warm
tier only; the hint is the one place that names a cold file (advisory ``fadvise``).

Which key feeds a summary: the keys of the model's *last* layer, flattened per token to
``num_kv_heads * head_dim`` values (post-RoPE, as cached). Summaries guide recall only;
the model never attends to them.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvfs.torch.fingerprint import KVCorrupt, KVGeometry, kv_from_bytes
from kvfs.warm import summarize_keys as warm_summarize_keys

log = logging.getLogger("kvfs.torch.recall")

PIPELINE_MIN = 256 << 10  # bytes per layer from which read_spans reads layers two at a time
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


def _read(warm: Any, sid: str, layer: int, a: int, b: int, promote: bool | None) -> Any:
    """Layer bytes [a, b): into this thread's reused buffer up to ``SCRATCH_MAX`` bytes
    (its pages are faulted in once, not per read: 4 MiB of fresh memory costs about a
    millisecond of page faults), else a new array. The bytes are valid until this
    thread's next read: the caller copies them out (``kv_from_bytes`` does)."""
    kw = {} if promote is None else {"promote": promote}
    n = b - a
    if n > SCRATCH_MAX:
        return warm.read(sid, layer, a, b, **kw)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(max(n, 1 << 20), np.uint8)
    out = buf[:n]
    warm.read_into(sid, layer, a, b, out, **kw)
    return out


def read_tokens(warm: Any, sid: str, layer: int, geo: KVGeometry, start: int, end: int,
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


def read_spans(warm: Any, sid: str, geo: KVGeometry, spans: list[tuple[int, int]],
               device: torch.device | str, promote: bool | None = None, checked: bool = False
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each layer, K/V of the concatenated token ``spans`` (in the order given).

    From ``PIPELINE_MIN`` bytes per layer, layers are read two at a time: one layer's bytes
    come in (a read that waits on the disk or the mount) while the previous one is laid
    out as K and V (a copy); both release the GIL. ``checked``: see :func:`read_tokens`."""
    def one(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = [], []
        for a, b in spans:
            if b > a:
                k, v = read_tokens(warm, sid, layer, geo, a, b, device, promote, checked)
                ks.append(k)
                vs.append(v)
        if not ks:
            empty = torch.empty(1, geo.num_kv_heads, 0, geo.head_dim, dtype=geo.dtype, device=device)
            return empty, empty.clone()
        return (torch.cat(ks, dim=-2) if len(ks) > 1 else ks[0],
                torch.cat(vs, dim=-2) if len(vs) > 1 else vs[0])

    per_layer = sum(max(0, b - a) for a, b in spans) * geo.token_bytes
    if geo.num_layers > 1 and per_layer >= PIPELINE_MIN:
        return list(layer_pool().map(one, range(geo.num_layers)))
    return [one(layer) for layer in range(geo.num_layers)]


def prefetch_cold(cold_root: str | None, sid: str, layers: int, start: int, end: int) -> int:
    """Ask the kernel to read ``[start, end)`` of each cold layer file ahead, all at once.

    ``posix_fadvise(WILLNEED)`` on ``cold_root/sessions/<sid>/layer_<n>`` (the layout the warm
    tier's contract names): the reads that follow, one layer at a time, then find the bytes
    in the page cache instead of waiting for the disk layer by layer. Advisory only: missing
    files (a session in the warm tier) and errors are ignored. Returns the files advised.
    """
    if not cold_root or end <= start or not hasattr(os, "posix_fadvise"):
        return 0
    n = 0
    base = os.path.join(cold_root, "sessions", sid)
    for layer in range(layers):
        try:
            fd = os.open(os.path.join(base, f"layer_{layer}"), os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n

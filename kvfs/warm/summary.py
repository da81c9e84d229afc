"""Round summaries: one small float32 vector per round so recall can rank rounds unread."""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=16)
def _projection(features: int, dim: int, seed: int) -> np.ndarray:
    # RandomState, not default_rng: its stream is frozen by NumPy's compatibility policy
    # (NEP 19), so a summary written today ranks the same against a query next year.
    m = np.random.RandomState(seed).standard_normal((features, dim))
    m /= np.sqrt(dim)
    m.setflags(write=False)
    return m


def summarize_keys(keys: np.ndarray, dim: int = 128, seed: int = 0, token_axis: int = 0) -> np.ndarray:
    """Mean key of a round, projected by a fixed seeded random matrix, L2-normalised.

    ``keys``: the round's keys with tokens along ``token_axis`` (token-major
    ``[tokens, heads, head_dim]`` by default; ``token_axis=-2`` for torch's
    ``[batch, heads, tokens, head_dim]``). The mean over tokens is flattened to one feature
    vector, multiplied by a ``features x dim`` Gaussian matrix fixed by ``seed``, and scaled
    to unit length (an all-zero mean stays zero). Returns float32[dim]. The hot tier and
    recall call this same function, so their vectors are comparable by dot product.
    """
    k = np.asarray(keys)
    if k.ndim < 1 or k.shape[token_axis] == 0:
        raise ValueError("summarize_keys needs at least one token")
    mean = k.astype(np.float64, copy=False).mean(axis=token_axis).reshape(-1)
    v = mean @ _projection(mean.size, dim, seed)
    n = float(np.linalg.norm(v))
    if n > 0 and np.isfinite(n):
        v /= n
    return v.astype(np.float32)

"""Model identity and the on-disk layout of one session's KV (``meta.json`` + layer bytes).

Owns: the model fingerprint (a hash of the model config and a digest of its weights), the
KV geometry read from a config (layers, KV heads, head dim) and the refusal of models whose
attention the cache cannot serve, the ``meta.json`` document and its checks, the
conversion between K/V tensors and token-major layer bytes, and the errors the hot tier
raises on purpose (:class:`KVMismatch`, :class:`KVCorrupt`, :class:`KVUnsupported`).

Layer byte layout (docs/format.md): for each token, K then V, each
``num_kv_heads x head_dim`` values in the model dtype, little-endian. Token ``t`` of a
layer file therefore starts at byte ``t * token_bytes`` with
``token_bytes = 2 * num_kv_heads * head_dim * itemsize``.

Never touches disk, threads or the warm tier: pure functions over tensors and dicts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvfs.session import SessionCorrupt
from kvfs.session.formats import META_FORMAT, check_meta_doc, meta_doc

#: config keys that do not change what the KV bytes mean (bookkeeping, runtime switches)
_VOLATILE_KEYS = frozenset({
    "transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "_experts_implementation", "use_cache", "output_attentions", "output_hidden_states",
    "return_dict", "architectures", "_commit_hash", "torchscript", "use_return_dict",
    "chunk_size_feed_forward", "problem_type", "tie_word_embeddings", "pad_token_id",
    "bos_token_id", "eos_token_id", "id2label", "label2id", "finetuning_task",
    "tokenizer_class", "prefix", "task_specific_params",
})

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("kvfs.torch writes little-endian KV bytes and needs a little-endian host")


class KVMismatch(ValueError):
    """Stored KV was written by another model (fingerprint, dtype or shape differ)."""


class KVUnsupported(NotImplementedError):
    """The model's attention is not one the cache can serve (raised when a cache is built)."""


class KVCorrupt(ValueError):
    """Stored KV is unusable: a layer file shorter than meta.json says, bad meta, bad bytes."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype} (supported: {', '.join(_DTYPES)})")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise KVCorrupt(f"meta.json: unknown dtype {name!r}") from None


def config_of(model_or_config: Any) -> Any:
    """The (text decoder) config of a model or config."""
    cfg = getattr(model_or_config, "config", model_or_config)
    get_text = getattr(cfg, "get_text_config", None)
    return get_text(decoder=True) if callable(get_text) else cfg


#: elements sampled from each parameter tensor for the weight digest
WEIGHT_SAMPLES = 256

_FP_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_digest(model: Any) -> str:
    """A cheap digest of a model's weights: name, shape, dtype and ``WEIGHT_SAMPLES`` evenly
    spaced elements of every parameter tensor (sorted by name).

    A fine-tune (full or merged low-rank) changes most matrices everywhere, so a strided
    sample of every tensor tells two fine-tunes of one base apart for a few ms of work.
    """
    h = hashlib.sha256()
    params = sorted(model.named_parameters(), key=lambda kv: kv[0])
    with torch.no_grad():
        for name, p in params:
            flat = p.detach().reshape(-1)
            n = flat.numel()
            if n > WEIGHT_SAMPLES:
                idx = torch.arange(WEIGHT_SAMPLES, device=flat.device) * (n // WEIGHT_SAMPLES)
                flat = flat.index_select(0, idx)
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:".encode())
            h.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(model_or_config: Any) -> str:
    """``"sha256:<32 hex>"`` over the model config (volatile keys dropped) and, given a model
    (anything with ``named_parameters``), a digest of its weights (:func:`weights_digest`).

    Two fine-tunes of one base with one config get different fingerprints, so a session
    written by one is refused by the other. A bare config hashes the config only (it
    cannot resume a session written by a model). Computed once per model object: weights
    changed in place afterwards are not seen.
    """
    is_model = hasattr(model_or_config, "named_parameters")
    if is_model:
        try:
            return _FP_CACHE[model_or_config]
        except (KeyError, TypeError):
            pass
    cfg = config_of(model_or_config)
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    clean = {k: v for k, v in d.items() if k not in _VOLATILE_KEYS and not k.startswith("_")}
    blob = json.dumps(clean, sort_keys=True, default=str, separators=(",", ":"))
    h = hashlib.sha256(blob.encode())
    if is_model:
        h.update(b"\0weights:" + weights_digest(model_or_config).encode())
    fp = "sha256:" + h.hexdigest()[:32]
    if is_model:
        try:
            _FP_CACHE[model_or_config] = fp
        except TypeError:  # not weak-referenceable: recomputed next time
            pass
    return fp


def check_supported(model_or_config: Any) -> None:
    """Raise :class:`KVUnsupported` for attention the cache cannot serve exactly.

    The cache stores one full-attention K and V per token and layer. Refused: multi-latent
    attention (``kv_lora_rank``: the cache holds a compressed latent, not per-head K/V),
    sliding-window attention (``sliding_window``: the model drops keys itself) and hybrid
    stacks (``layer_types`` with anything but ``full_attention``).
    """
    cfg = config_of(model_or_config)
    name = getattr(cfg, "model_type", type(cfg).__name__)
    if getattr(cfg, "kv_lora_rank", None):
        raise KVUnsupported(
            f"kvfs.torch cannot serve {name}: multi-latent attention (kv_lora_rank="
            f"{cfg.kv_lora_rank}) caches a compressed latent, not per-head K/V")
    if getattr(cfg, "sliding_window", None) is not None:
        raise KVUnsupported(
            f"kvfs.torch cannot serve {name}: sliding-window attention (sliding_window="
            f"{cfg.sliding_window}); the cache keeps full-attention K/V only")
    types = getattr(cfg, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        raise KVUnsupported(
            f"kvfs.torch cannot serve {name}: layer types {sorted(set(types))}; the cache keeps "
            "full-attention K/V only")


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one session's KV: what a layer file's bytes mean."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @functools.cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @functools.cached_property
    def token_bytes(self) -> int:
        """Bytes of one token in one layer file (K and V)."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @functools.cached_property
    def session_token_bytes(self) -> int:
        """Bytes of one token over all layers."""
        return self.num_layers * self.token_bytes


def geometry(model_or_config: Any, dtype: torch.dtype | None = None) -> KVGeometry:
    """KV geometry of a decoder model; only full-attention, per-token-KV models are accepted."""
    check_supported(model_or_config)
    cfg = config_of(model_or_config)
    n_layers = int(cfg.num_hidden_layers)
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    if dtype is None:
        param = next(iter(model_or_config.parameters()), None) if hasattr(
            model_or_config, "parameters") else None
        dtype = param.dtype if param is not None else getattr(cfg, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = dtype_from_name(dtype)
    return KVGeometry(n_layers, n_kv, int(head_dim), dtype)


def build_meta(fp: str, geo: KVGeometry, tokens: int, rounds: list[list[int]]) -> dict:
    """The ``meta.json`` document of a session of this model (:func:`kvfs.session.formats.meta_doc`)."""
    return meta_doc(fp, geo.num_layers, geo.num_kv_heads, geo.head_dim, dtype_name(geo.dtype), tokens, rounds)


def checked_meta(meta: Any, sid: str = "?") -> dict:
    """``meta`` if it is a ``meta.json`` document kvfs writes (its shape: the session
    package's check), else :class:`KVCorrupt` naming the first bad field."""
    try:
        return check_meta_doc(meta, META_FORMAT, sid)
    except SessionCorrupt as e:
        raise KVCorrupt(str(e)) from None


def check_meta(meta: Any, fp: str, geo: KVGeometry, sid: str = "?") -> None:
    """Raise :class:`KVCorrupt` for a malformed document, :class:`KVMismatch` for another model."""
    checked_meta(meta, sid)
    if meta["model"] != fp:
        raise KVMismatch(
            f"session {sid!r} was written by model {meta['model']}, not by this model ({fp}); "
            "refusing to resume with another model's KV")
    stored = (meta["num_layers"], meta["num_kv_heads"], meta["head_dim"], meta["dtype"])
    mine = (geo.num_layers, geo.num_kv_heads, geo.head_dim, dtype_name(geo.dtype))
    if tuple(stored) != mine:
        raise KVMismatch(
            f"session {sid!r}: stored KV is (layers, kv_heads, head_dim, dtype)={tuple(stored)}, "
            f"this model needs {mine}")


# --- tensors <-> token-major bytes ---------------------------------------------------------

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_rows(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same bytes with each head row (the last dimension) as the widest integers that
    tile it: permuting copies of bf16/fp16 take a slow path, and one that moves 8 bytes per
    element runs several times faster than one moving 2 (a 4 MiB layer: ~1 ms -> ~0.2 ms).
    Falls back to the element's own width where a wider view is not allowed (a row that is
    not contiguous, an odd offset)."""
    row = ts[0].shape[-1] * ts[0].element_size()
    for size in (8, 4, 2, 1):
        if size > ts[0].element_size() and row % size == 0:
            try:
                return tuple(t.view(_INT_OF_SIZE[size]) for t in ts)
            except RuntimeError:
                continue
    return tuple(t.view(_INT_OF_SIZE[t.element_size()]) for t in ts)


def kv_to_token_major(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, D]`` K and V -> a contiguous ``[T, 2, H, D]`` tensor (same dtype/device)."""
    if k.dim() != 4 or k.shape[0] != 1:
        raise ValueError(f"kvfs.torch stores batch size 1 per session; got K of shape {tuple(k.shape)}")
    ik, iv = _as_rows(k, v)
    return torch.stack((ik[0].transpose(0, 1), iv[0].transpose(0, 1)), dim=1).view(k.dtype)


def token_major_bytes(tm: torch.Tensor) -> np.ndarray:
    """A CPU ``[T, 2, H, D]`` tensor -> its bytes as a flat uint8 array (no copy)."""
    return tm.reshape(-1).view(torch.uint8).numpy()


def kv_from_bytes(buf: np.ndarray | bytes | memoryview, geo: KVGeometry, tokens: int,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major bytes of ``tokens`` tokens -> ``([1,H,T,D], [1,H,T,D])`` K and V on ``device``.

    Raises :class:`KVCorrupt` when the byte count is not exactly ``tokens * token_bytes``.
    """
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    arr = arr.reshape(-1)
    want = tokens * geo.token_bytes
    if arr.size != want:
        raise KVCorrupt(f"expected {want} bytes for {tokens} tokens, got {arr.size}")
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr, dtype=np.uint8, copy=True)  # own the memory
    t = torch.from_numpy(arr)
    dev = torch.device(device)
    if dev.type == "cuda":  # one pinned host->device copy, then the transpose on the device
        t = t.pin_memory().to(dev, non_blocking=True)
    (rows,) = _as_rows(t.view(-1, geo.head_dim * geo.itemsize))
    tm = rows.view(tokens, 2, geo.num_kv_heads, -1)
    # always a copy (a permute that is already contiguous, e.g. one token, would be a view
    # of ``buf``, which the caller may reuse): [2, H, T, D], K then V
    kv = tm.permute(1, 2, 0, 3).clone(memory_format=torch.contiguous_format).view(geo.dtype)
    return kv[0:1], kv[1:2]

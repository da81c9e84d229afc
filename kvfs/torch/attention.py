"""Query states for retrieval: a transformers attention function that reports them.

Retrieval ranks old blocks against the queries of the step being run, but a cache's
``update`` sees only keys and values. transformers 5 picks each attention layer's function
from its ``AttentionInterface`` registry by ``config._attn_implementation``;
:func:`install` registers ``kvfs_<impl>``, a wrapper of the model's own function (``sdpa``,
``eager``, ``flash_attention_2``, ...) with the same mask function, and switches the model
to it. The wrapper computes exactly what the wrapped function computes; it only hands the
query states to the cache layer whose ``update`` ran last on this thread (:func:`expect`),
after the attention of that layer; in a step of several tokens the layer may first splice
in the blocks that step's own queries choose (same length: the mask is built already).
With any other cache, or none, nothing is handed over.

The model's config changes (``_attn_implementation``: a runtime switch the model
fingerprint ignores) and the registry gains an entry; :func:`uninstall` switches back.
Models whose attention layers do not go through the registry (transformers' heuristic
``_can_set_attn_implementation``) are refused with :class:`KVUnsupported`.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from kvfs.torch.fingerprint import KVUnsupported, config_of

log = logging.getLogger("kvfs.torch.attention")

PREFIX = "kvfs_"
_local = threading.local()
_lock = threading.Lock()


Observer = Callable[[int, torch.Tensor], None]
#: ``(layer, query, key, value) -> (key, value)``: the attended keys and values, changed
#: before the attention runs (same length: the mask is built already)
Splice = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def expect(observer: Observer, layer: int, splice: Splice | None = None) -> None:
    """Hand the next attention call of layer ``layer`` on this thread to ``observer`` (after
    it ran) and to ``splice`` (before it runs)."""
    _local.pending = (observer, layer, splice)


def _wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        pending = getattr(_local, "pending", None)
        if pending is None or pending[1] != getattr(module, "layer_idx", None):
            return inner(module, query, key, value, attention_mask, *args, **kwargs)
        observer, layer, splice = pending
        if splice is not None:
            key, value = splice(layer, query, key, value)
        out = inner(module, query, key, value, attention_mask, *args, **kwargs)
        _local.pending = None
        observer(layer, query)
        return out

    attention.kvfs_inner = inner  # type: ignore[attr-defined]
    return attention


def _register(impl: str, model: Any) -> str:
    """Register ``kvfs_<impl>`` (once per process) and return its name. ``eager`` is each
    model family's own function (its modeling module's ``eager_attention_forward``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules.get(type(model).__module__), "eager_attention_forward", None)
    name = PREFIX + impl
    if impl == "eager":
        if eager is None:
            raise KVUnsupported(f"retrieval cannot serve {type(model).__name__} with eager attention: "
                                "its modeling module has no eager_attention_forward")
        name += "@" + type(model).__module__
    with _lock:
        if name in ALL_ATTENTION_FUNCTIONS:
            return name
        # transformers types the default as a function; None is what the next line tests for
        inner = eager if impl == "eager" else ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)  # type: ignore[arg-type]
        if inner is None:
            raise KVUnsupported(f"attention implementation {impl!r} is not registered")
        AttentionInterface.register(name, _wrap(inner))
        if impl in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    return name


def installed(model_or_config: Any) -> bool:
    impl = getattr(config_of(model_or_config), "_attn_implementation", None)
    return isinstance(impl, str) and impl.startswith(PREFIX)


def install(model: Any) -> None:
    """Make ``model``'s attention layers report their queries (idempotent).

    Raises :class:`KVUnsupported` for a model whose attention layers do not dispatch
    through transformers' ``AttentionInterface``."""
    cfg = config_of(model)
    if installed(cfg):
        return
    name = getattr(cfg, "model_type", type(model).__name__)
    can = getattr(type(model), "_can_set_attn_implementation", None)
    if not hasattr(model, "named_parameters") or not callable(can) or not can():
        raise KVUnsupported(
            f"retrieval cannot serve {name}: its attention layers do not go through "
            "transformers' AttentionInterface, so their queries cannot be observed; "
            "pass retrieval=False (sinks and window only)")
    impl = cfg._attn_implementation or "eager"
    new = _register(impl, model)
    cfg._attn_implementation = new
    top = getattr(model, "config", None)
    if top is not None and top is not cfg:
        top._attn_implementation = new
    log.info("%s: attention %s -> %s (queries observed for retrieval)", name, impl, new)


def uninstall(model: Any) -> None:
    """Switch ``model`` back to the attention function it had before :func:`install`."""
    for cfg in {id(c): c for c in (config_of(model), getattr(model, "config", None)) if c is not None}.values():
        impl = getattr(cfg, "_attn_implementation", None)
        if isinstance(impl, str) and impl.startswith(PREFIX):
            cfg._attn_implementation = impl[len(PREFIX):].split("@")[0]

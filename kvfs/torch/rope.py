"""Re-rotation of cached keys for rotary (RoPE) models: keep what a step attends close.

With a window, a long session attends its sinks (tokens ``[0, S)``) from a query at
position ``P`` -- relative distance ``P``, which passes anything the model was trained on
once ``P`` passes ``max_position_embeddings``. RoPE attention depends only on the
difference of the two positions, so rotating a cached key by ``t`` positions moves it
``t`` positions later as far as every query is concerned. :class:`RopeShift` does that
rotation; the hot tier uses it (``rope_rerotate``) to keep the sinks just before the
window and recalled rounds just before the sinks, the way transformers' former
``SinkCache`` kept every cached position inside the window. Values are never rotated, and
the bytes handed to the warm and cold tiers are always the model's own (unrotated) keys.

Only position-linear RoPE in the ``rotate_half`` layout (Llama and the families that copy
its attention) is re-rotated; anything else raises :class:`KVUnsupported` when the cache is
built, never a wrong rotation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvfs.torch.fingerprint import KVUnsupported, config_of

#: model types whose attention applies RoPE as ``k * cos + rotate_half(k) * sin`` over the
#: first ``partial_rotary_factor * head_dim`` dimensions (transformers' Llama layout)
ROTATE_HALF_MODELS = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
    "granite", "olmo", "olmo2", "phi", "phi3", "stablelm", "starcoder2",
})

#: RoPE types whose angle is ``position * inv_freq`` with fixed frequencies (the ones a
#: rotation by a position difference reproduces exactly)
LINEAR_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def _rope_params(cfg: Any) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return dict(params) if isinstance(params, dict) else {}


def _head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _inv_freq_of(model_or_config: Any, rope_type: str) -> torch.Tensor:
    """The model's own rotary frequencies when it has a rotary module, else the config's."""
    modules = getattr(model_or_config, "modules", None)
    if callable(modules):
        for m in modules():
            f = getattr(m, "original_inv_freq", None)
            if f is None:
                f = getattr(m, "inv_freq", None)
            if isinstance(f, torch.Tensor):
                return f.detach().to("cpu", torch.float64)
    cfg = config_of(model_or_config)
    if rope_type == "default":
        params = _rope_params(cfg)
        base = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        dim = int(_head_dim(cfg) * float(params.get("partial_rotary_factor",
                                                     getattr(cfg, "partial_rotary_factor", 1.0))))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv_freq.to(torch.float64)


class RopeShift:
    """Rotates cached keys (``[..., tokens, head_dim]``) by a number of positions."""

    def __init__(self, inv_freq: torch.Tensor, head_dim: int) -> None:
        self.inv_freq = inv_freq.to(torch.float64)
        self.rot_dim = 2 * self.inv_freq.numel()
        if self.rot_dim > head_dim or self.rot_dim == 0:
            raise KVUnsupported(f"rotary dimension {self.rot_dim} does not fit head_dim {head_dim}")
        self.head_dim = head_dim
        self._cs: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def of(cls, model_or_config: Any) -> RopeShift:
        """The rotation of a model (or config); :class:`KVUnsupported` when it has none the
        cache can reproduce."""
        cfg = config_of(model_or_config)
        mtype = getattr(cfg, "model_type", "?")
        if mtype not in ROTATE_HALF_MODELS:
            raise KVUnsupported(f"rope_rerotate: model type {mtype!r} is not one whose rotary "
                                f"layout kvfs reproduces ({', '.join(sorted(ROTATE_HALF_MODELS))})")
        rope_type = str(_rope_params(cfg).get("rope_type", _rope_params(cfg).get("type", "default")))
        if rope_type not in LINEAR_ROPE_TYPES:
            raise KVUnsupported(f"rope_rerotate: RoPE type {rope_type!r} changes its frequencies "
                                f"with the sequence length; supported: {', '.join(sorted(LINEAR_ROPE_TYPES))}")
        return cls(_inv_freq_of(model_or_config, rope_type), _head_dim(cfg))

    def _cos_sin(self, shift: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (shift, device)
        got = self._cs.get(key)
        if got is None:
            ang = torch.remainder(self.inv_freq * float(shift), 2 * math.pi)  # float64: exact enough
            got = (ang.cos().to(device, torch.float32), ang.sin().to(device, torch.float32))
            if len(self._cs) > 256:
                self._cs.clear()
            self._cs[key] = got
        return got

    def rotate(self, k: torch.Tensor, shift: int) -> torch.Tensor:
        """``k`` moved ``shift`` positions later (a new tensor in ``k``'s dtype)."""
        if shift == 0:
            return k.clone()
        cos, sin = self._cos_sin(int(shift), k.device)
        kf = k.float()
        half = self.rot_dim // 2
        x1, x2 = kf[..., :half], kf[..., half:self.rot_dim]
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.rot_dim < k.shape[-1]:
            parts.append(kf[..., self.rot_dim:])
        return torch.cat(parts, dim=-1).to(k.dtype)

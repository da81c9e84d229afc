"""The kvfs model fingerprint and KV geometry of the checkpoint vLLM serves.

kvfs.torch fingerprints a transformers model (its config, and a sample of every parameter
tensor: :func:`kvfs.torch.fingerprint.fingerprint`). vLLM's model has other parameter names
(fused QKV, gate/up), so the fingerprint is taken from the checkpoint instead: the config
as transformers reads it, and the checkpoint's tensors (safetensors) cast to the dtype vLLM
serves in, i.e. exactly what a transformers model loaded from that directory in that dtype
hashes to. A session stored behind vLLM is therefore resumable by ``KVRouter`` with
``AutoModelForCausalLM.from_pretrained(dir, dtype=...)``, and the other way round.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from kvfs.torch.fingerprint import KVGeometry, fingerprint, geometry

log = logging.getLogger("kvfs.vllm.identity")


class CheckpointWeights:
    """A stand-in for a transformers model that :func:`fingerprint` accepts: the config and
    ``named_parameters()`` read tensor by tensor from the checkpoint's safetensors files."""

    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from transformers import AutoConfig  # noqa: PLC0415 - heavy, only when serving

        self.config = AutoConfig.from_pretrained(model_dir)
        self.dtype = dtype
        self.files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
        if not self.files:
            raise FileNotFoundError(
                f"{model_dir}: no *.safetensors checkpoint to fingerprint; give the model's "
                "kvfs fingerprint as model_fingerprint in kv_connector_extra_config")

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open  # noqa: PLC0415

        for f in self.files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, st.get_tensor(name).to(self.dtype)

    def parameters(self) -> Iterator[torch.Tensor]:
        for _, p in self.named_parameters():
            yield p


def resolve_model_dir(model: str) -> str:
    """A local directory for vLLM's ``model`` (a path, or a hub name already in the cache)."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415

        return snapshot_download(model, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means: not here
        raise FileNotFoundError(f"kvfs.vllm: model {model!r} is not a local directory or a "
                                f"cached hub snapshot ({e})") from e


def served_model(model: str, dtype: torch.dtype,
                 override: str | None = None) -> tuple[str, KVGeometry, Any]:
    """``(fingerprint, geometry, config)`` of the model vLLM serves from ``model`` in
    ``dtype``; ``override`` replaces the computed fingerprint (a checkpoint without
    safetensors)."""
    d = resolve_model_dir(model)
    if override:
        from transformers import AutoConfig  # noqa: PLC0415

        cfg = AutoConfig.from_pretrained(d)
        return override, geometry(cfg, dtype), cfg
    weights = CheckpointWeights(d, dtype)
    fp = fingerprint(weights)
    log.info("kvfs.vllm: model %s (%s) has kvfs fingerprint %s", d, dtype, fp)
    return fp, geometry(weights.config, dtype), weights.config

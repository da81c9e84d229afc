"""The hot tier for PyTorch / transformers: windowed KV caches over the warm and cold tiers.

``from kvfs.torch import TieredCache, KVRouter``. This subpackage is the only part of kvfs
that imports torch and transformers; ``import kvfs`` never imports it.

* :class:`TieredCache` (``cache.py``): a transformers ``Cache`` keeping the first
  ``sink_tokens`` tokens (attention sinks) and the last ``max_kv_len`` tokens per layer on
  the device (one :class:`TieredLayer` per layer, ``layer.py``); what falls out goes to the
  warm tier on a background thread (``spill.py``); rounds, recall (explicit and automatic),
  refill after budget moves, resume, forks; its recall and re-rotation methods live in
  ``cache_recall.py``, its budget moves, refill and resume in ``cache_moves.py``.
* :class:`KVRouter` (``router.py``): session id -> cache, device budget and watermark,
  metrics, flush/close, resume after a restart, ``fork``; the budget's checks and moves
  out live in ``router_budget.py``.
* ``fingerprint.py``: model fingerprint (config + weights digest), refusal of attention the
  cache cannot serve (:class:`KVUnsupported`), ``meta.json`` and the token-major layout.
* ``recall.py``: ranking rounds by summary and reading stored tokens back.
* ``rope.py``: moving cached keys along RoPE positions (``rope_rerotate``).
* ``testing.py``: tiny random Llamas, the SmolLM2 loader and the exactness references.

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

"""The hot tier for PyTorch / transformers: windowed KV caches over the warm and cold tiers.

``from kvfs.torch import TieredCache, KVRouter``. This subpackage is the only part of kvfs
that imports torch and transformers; ``import kvfs`` never imports it.

* :class:`TieredCache` (``cache.py``): a transformers ``Cache`` keeping the last
  ``max_kv_len`` tokens per layer on the device (one :class:`TieredLayer` per layer,
  ``layer.py``); what falls out goes to the warm tier on a background thread
  (``spill.py``); rounds, recall, refill after budget moves, resume.
* :class:`KVRouter` (``router.py``): session id -> cache, device budget and watermark,
  metrics, flush/close, resume after a restart.
* ``fingerprint.py``: model fingerprint, ``meta.json`` and the token-major byte layout.
* ``recall.py``: round summaries, ranking and reading stored tokens back.
"""

from kvfs.torch.cache import TieredCache
from kvfs.torch.fingerprint import KVCorrupt, KVMismatch, fingerprint, geometry
from kvfs.torch.layer import TieredLayer
from kvfs.torch.router import KVRouter, load_profile
from kvfs.torch.spill import Spiller, SpillError

__all__ = [
    "KVCorrupt", "KVMismatch", "KVRouter", "SpillError", "Spiller", "TieredCache", "TieredLayer",
    "fingerprint", "geometry", "load_profile",
]

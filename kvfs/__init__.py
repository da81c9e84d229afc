"""kvfs: a tiered KV-cache store for long-running LLM agents.

Layers, each importing only those below it:

* ``kvfs.engine``  the storage engine: one preallocated volume, a ring of checksummed
  entries, the index and its B+ tree checkpoint, recovery, fsck. No pyfuse3, no torch.
* ``kvfs.fuse``    KVFS, the filesystem over the engine (pyfuse3 + trio) and its mount.
* ``kvfs.warm``    the RAM tier: ``.kvmap`` shards on tmpfs, a cache of the mount.
* ``kvfs.torch``   the hot tier: a transformers ``Cache`` and a router over sessions.
* ``kvfs.ops``     profiles, alert rules, the Prometheus registry.
* ``kvfs.cli``     the console scripts (``kvfs-mount``, ``kvfs-fsck``, ``kvfs-stat``...).

This package root imports nothing heavy: neither torch nor pyfuse3.
"""

__version__ = "0.2.0"

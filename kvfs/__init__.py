"""kvfs: a tiered KV-cache store for long-running LLM agents.

Tiers: hot (torch, ``kvfs.torch``), warm (RAM mmap shards, ``kvfs.warm``), cold (a ring
volume, ``kvfs.engine``, mounted as a filesystem by ``kvfs.fs``). This package root
imports nothing heavy: neither torch nor pyfuse3.
"""

__version__ = "0.1.0"

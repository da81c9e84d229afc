"""kvfs.engine: the storage engine of the cold tier.

Owns one preallocated volume (``volume``: superblocks and the file lock), the ring of
checksummed entries (``ring``, ``format``, ``codec``), the session records and index
(``records``, ``index``, ``btree``), recovery and reclaim, the consistency checker
(``fsck``) and fault injection for tests (``faults``). ``store.Store`` is the API.

Never imports pyfuse3 or torch: the filesystem and the hot tier are built on top of it.
"""

from .errors import FormatError, KVFSError, VolumeBusy
from .store import Store
from .types import FileStat, SessionStat, StoreConfig, Usage
from .volume import VolumeFile

__all__ = ["FileStat", "FormatError", "KVFSError", "SessionStat", "Store", "StoreConfig",
           "Usage", "VolumeBusy", "VolumeFile"]

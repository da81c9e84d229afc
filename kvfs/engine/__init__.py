"""kvfs.engine: the storage engine of the cold tier.

Owns one preallocated volume (``volume``: superblocks and the file lock), the ring of
checksummed entries (``ring``, ``format``; data entries hold independently checked and
compressed blocks: ``blocks``, ``codec``), the session records and index (``records``,
``index``, ``btree``, ``btree_page``), recovery and reclaim, the needs-fsck mark
(``failsafe``), the consistency checker (``fsck``) and fault injection for tests
(``faults``). ``store.Store`` is the API; what it depends on is passed in (the volume
class, an ``Observer`` for latencies and errors), never patched.

Never imports anything above it (pyfuse3, trio, torch, prometheus_client, kvfs.ops):
the filesystem and the hot tier are built on top of it.
"""

from .errors import FormatError, KVFSError, NeedsFsck, VolumeBusy
from .store import Store
from .types import FileStat, NullObserver, Observer, SessionStat, StoreConfig, Usage
from .volume import VolumeFile

__all__ = ["FileStat", "FormatError", "KVFSError", "NeedsFsck", "NullObserver", "Observer",
           "SessionStat", "Store", "StoreConfig", "Usage", "VolumeBusy", "VolumeFile"]

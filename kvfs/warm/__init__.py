"""kvfs.warm: the RAM tier between the device window and the SSD volume.

Owns ``.kvmap`` shard files under a RAM-backed directory (default ``/dev/shm/kvfs-warm``,
one sub-directory per volume, one per process): per session and layer a byte "file"
(token-major KV bytes; callers convert), the session's ``meta.json`` content and one
float32 summary vector per round. It is a write-behind cache of the cold tier -- plain
files under ``cold_root/sessions/<sid>/`` (normally a mounted KVFS volume): a background
thread appends every byte there within ``writebehind_s`` and fsyncs it, ``sync`` is the
durable point, and a global LRU over sessions drops clean sessions (cold copy complete)
from RAM when usage passes the threshold, bringing them back on demand. A session removed
or replaced through the mount is never brought back from RAM (its incarnation id). One
process at a time has a session open (a flock per session).

Modules: ``format`` (the .kvmap byte format, one page), ``ids`` (session ids, shard
numbers, errors), ``rootdir`` (checked, private directories and file calls relative to
them), ``owners`` (volume / process / session-lock layout, agents' figures), ``space``
(allocation inside a shard, reservations on tmpfs), ``extent`` (extent checksums),
``records`` (in-memory index of a shard), ``shard`` (writing and checking one shard file),
``shardload`` (opening, validating and repairing one), ``cold`` (checked file calls on the
cold tier), ``tier`` (WarmTier: the API, locks, LRU, writes), ``reads`` (its reads),
``writeback`` (write-behind passes, eviction of clean sessions), ``validate`` (session
ownership, validation against the mount), ``migrate`` (group migration, promotion,
back-off, start-up reconciliation), ``lifecycle`` (sync, release, usage, close),
``summary`` (round summaries).

Safety: the root is 0700 and ours, files 0600, nothing is followed through a symlink;
every byte read back is checked against CRC32C checksums (a mismatch is served from the
cold copy when it has the bytes, else ``WarmCorrupt``); every range is reserved before it
is written through a mapping (a full tmpfs is a WarmError, never SIGBUS); every failure
is a ``WarmError`` naming the path and the reason.

Never imports torch; never touches engine internals (the cold tier is used through
ordinary file calls only: open, os.pread/preadv, os.write, os.fsync, os.ftruncate,
os.listdir).
"""

from kvfs.ops.agents import read as read_agent_stats

from .cold import mount_info
from .ids import WarmBusy, WarmCorrupt, WarmError, WarmFull, WarmLost, device_id, shard_of
from .summary import summarize_keys
from .tier import WarmTier

__all__ = ["WarmBusy", "WarmCorrupt", "WarmError", "WarmFull", "WarmLost", "WarmTier",
           "device_id", "mount_info", "read_agent_stats", "shard_of", "summarize_keys"]

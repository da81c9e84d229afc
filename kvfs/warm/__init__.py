"""kvfs.warm: the RAM tier between the device window and the SSD volume.

Owns ``.kvmap`` shard files under a RAM-backed directory (default ``/dev/shm/kvfs-warm-<uid>``,
one sub-directory per volume, one per process): per session and layer a byte "file"
(token-major KV bytes; callers convert), the session's ``meta.json`` content and one
float32 summary vector per round. It is a write-behind cache of the cold tier -- the files
under ``cold_root/sessions/<sid>/`` (normally a mounted KVFS volume, reached through its
native channel when it serves one): a background
thread appends every byte there within ``writebehind_s`` and fsyncs it, ``sync`` is the
durable point, and a global LRU over sessions drops clean sessions (cold copy complete)
from RAM when usage passes the threshold, bringing them back on demand. A session removed
or replaced through the mount is never brought back from RAM (its incarnation id). One
process at a time has a session open (a flock per session).

Modules, lowest first: ``kvmap_format`` (the .kvmap byte format, one page), ``ids``
(session ids, shard numbers, errors), ``extent``, ``space`` (allocation inside a shard,
reservations on tmpfs), ``rootdir`` (checked, private directories), ``shard_index``
(in-memory index of a shard), ``owners`` (volume / process / session-lock layout, agents'
figures), ``shard``, ``shardload`` (one shard file), ``shards`` (``ShardStore``: the files
and their locks); ``cold`` (what the cold backends share), ``checked`` (checked opens),
``coldfiles`` (plain files), ``coldnative`` (the mount's native channel), ``coldopen``
(which one serves a root); ``policy`` (``EvictionPolicy``, LRU groups), ``health`` (the
back-off), ``budget`` (bytes and cap), ``dirty``, ``held`` (sessions held, lost);
``resident`` (``Resident``: the RAM copies, composed of the above); ``validate``,
``reader``, ``migrate`` (``Mover``, ``Evictor``), ``writeback`` (``WriteBehind``);
``warm_tier`` (``WarmTier``: builds the parts, the API); ``summary`` (round summaries). No
module imports one above it or touches a private name another file defines. The cold
tier's seam (``ColdBackend``) and which files a session has, in which order a round writes
them, are :mod:`kvfs.session`'s.

Safety: the root is 0700 and ours, files 0600, nothing is followed through a symlink;
every byte read back is checked against CRC32C checksums (a mismatch is served from the
cold copy when it has the bytes, else ``WarmCorrupt``); every range is reserved before it
is written through a mapping (a full tmpfs is a WarmError, never SIGBUS); every failure
is a ``WarmError`` naming the path and the reason.

Never imports torch; never touches engine internals (the cold tier is used through its
``ColdBackend``: ordinary file calls, or the mount's native channel).
"""

from kvfs.ops.agents import read as read_agent_stats

from .cold import mount_info
from .ids import WarmBusy, WarmCorrupt, WarmError, WarmFull, WarmLost, device_id, shard_of
from .summary import summarize_keys
from .warm_tier import WarmTier

__all__ = ["WarmBusy", "WarmCorrupt", "WarmError", "WarmFull", "WarmLost", "WarmTier",
           "device_id", "mount_info", "read_agent_stats", "shard_of", "summarize_keys"]

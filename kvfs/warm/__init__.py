"""kvfs.warm: the RAM tier between the device window and the SSD volume.

Owns ``.kvmap`` shard files under a RAM-backed directory (default ``/dev/shm/kvfs-warm``):
per session and layer a byte "file" (token-major KV bytes; callers convert), the
session's ``meta.json`` content and one float32 summary vector per round. A global LRU
over sessions moves the least recently used group to the cold tier -- plain files under
``cold_root/sessions/<sid>/`` (normally a mounted KVFS volume) -- when usage passes the
threshold, and brings sessions back on demand. Sessions are never lost to a crash: a
session leaves RAM only after its cold copy is complete and fsynced.

Modules: ``format`` (the .kvmap byte format, one page), ``ids`` (session ids, shard
numbers, errors), ``rootdir`` (the checked, private root and file calls relative to it),
``extent`` (extent checksums), ``records`` (in-memory index of a shard), ``shard``
(writing and checking one shard file), ``shardload`` (opening, validating and repairing
one), ``cold`` (checked file calls on the cold tier), ``tier`` (WarmTier: the API, locks,
LRU), ``migrate`` (moves between tiers, back-off, start-up reconciliation), ``summary``
(round summaries).

Safety: the root is 0700 and ours, files 0600, nothing is followed through a symlink;
every byte read back is checked against CRC32C checksums (a mismatch is served from the
cold copy when it has the bytes, else ``WarmCorrupt``); every failure is a ``WarmError``
naming the path and the reason.

Never imports torch; never touches engine internals (the cold tier is used through
ordinary file calls only: open, os.pread/preadv, os.write, os.fsync, os.ftruncate,
os.listdir).
"""

from .ids import WarmCorrupt, WarmError, device_id, shard_of
from .summary import summarize_keys
from .tier import WarmTier

__all__ = ["WarmCorrupt", "WarmError", "WarmTier", "device_id", "shard_of", "summarize_keys"]

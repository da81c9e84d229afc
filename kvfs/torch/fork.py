"""Copying a stored session to a new id, through the warm tier (``KVRouter.fork``).

Owns the order of a fork's copy: layer bytes, summaries and the block key centroids
first, meta.json last (it claims the bytes), so a crash mid-copy leaves no session that
claims bytes it lacks; a failed copy is deleted. The live state of a fork (device
tensors, rounds, recall) is the cache's ``copy_state_to``.
"""

from __future__ import annotations

import logging

from kvfs.torch.blocks import STREAM
from kvfs.torch.seams import WarmStore

log = logging.getLogger("kvfs.torch.router")  # fork messages are the router's

#: bytes read and appended at a time
CHUNK = 8 << 20


def copy_stored(w: WarmStore, src_id: str, new_id: str, meta: dict, chunk: int = CHUNK) -> None:
    """Layer bytes, summaries, centroids, then ``meta`` (last: it claims the bytes) of
    session ``src_id`` into the new session ``new_id``."""
    try:
        for layer in range(int(meta["num_layers"])):
            size = w.size(src_id, layer)
            for a in range(0, size, chunk):
                w.append(new_id, layer, w.read(src_id, layer, a, min(size, a + chunk), promote=False))
        for i, vec in enumerate(w.summaries(src_id)):
            w.put_summary(new_id, i, vec)
        size = w.side_size(src_id, STREAM)  # block key centroids (retrieval)
        for a in range(0, size, chunk):
            w.side_append(new_id, STREAM, w.side_read(src_id, STREAM, a, min(size, a + chunk)))
        w.put_meta(new_id, meta)
        w.flush(new_id)
    except BaseException:
        if w.where(new_id) is not None:
            w.delete(new_id)  # no half copy left behind
        raise
    log.info("forked session %r -> %r (%d tokens)", src_id, new_id, meta.get("tokens", 0))

"""The checkpoint: one copy-on-write commit of the index, then a superblock naming it.

A commit carries what changed since the last one (dirty sessions, purged ones, bitmap
chunks, usage records); once it and the ring entries it references are durable, the
superblock's ``ckpt_pos`` says replay starts at the head. An index that does not fit the
tree region (a volume filled before the index had a budget, ``quota``) is kept in the ring
only: the superblock then says ``NO_CKPT`` (every open scans the whole ring, which holds
every session), the changes stay in memory, and a later checkpoint tries the tree again
once the index shrank. The volume stays mountable, readable and deletable; nothing is
lost. Called by ``Store.checkpoint`` under the store's locks, on its ``StoreState``; never imports pyfuse3 or torch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from .btree import BTree, TreeFull, TreeRoot
from .format import NO_CKPT, Superblock

if TYPE_CHECKING:
    from .state import StoreState

log = logging.getLogger(__name__)


def checkpoint_due(store: StoreState) -> bool:
    """Whether there is something to checkpoint and it is time: the interval passed,
    replay would be long, or many sessions are pinned in memory."""
    due = (time.monotonic() - store.last_ckpt >= store.cfg.checkpoint_interval_s
           or (not store.ring_only and (store.ring.head - store.sb.ckpt_pos > store.ring.size // 4
                                        or len(store.idx.pinned) > 10 * store.cfg.hot_sessions)))
    return due and (store.idx.has_changes() or store.ring.head != store.sb.ckpt_pos)


def write_checkpoint(store: StoreState, clean: bool = False) -> None:
    store.ring.sync()  # everything the checkpoint references is durable first
    old_root = store.tree.root
    store.quota.bitmap_chunks = len(store.idx.chunks)
    est = store.quota.estimate()
    root: TreeRoot | None = None
    if store.full_at is None or est < store.full_at:
        changes = store.idx.changes()
        changes.update(store.quota.changes())
        try:
            root = store.tree.commit(changes)
        except TreeFull as e:
            store.full_at = est
            log.error("%s: the index (about %d bytes) does not fit the tree region (%s); "
                      "it is kept in the ring only, and every mount scans the whole ring, "
                      "until sessions are deleted", store.vol.path, est, e)
    # Once both slots say NO_CKPT no durable superblock needs the tree's previous half:
    # the next commit may compact into it (a commit refused only for that protection
    # would otherwise keep the index in the ring for good).
    lift = root is None and store.ring_only and store.tree.root.prev_half >= 0
    sb, mark = store.sb, store.fsck_mark.mark  # the mark before its flag: see FsckMark.set
    new = Superblock(sb.seq + 1, store.fsck_mark.flags(clean), sb.volume_size, sb.ring_offset,
                     sb.ring_size, sb.tree_offset, sb.tree_pages, store.ring.head,
                     store.ring.tail, store.ring.head if root is not None else NO_CKPT,
                     store.next_sno, time.time_ns(), sb.created_ns,
                     (root or old_root).pack(), sb.uuid)
    try:
        store.vol.sync()
        store.vol.write_superblock(new)
    except BaseException:
        # The durable superblock still names the old root: keep committing on top of it.
        store.idx.tree = BTree(store.vol, sb.tree_offset, sb.tree_pages, old_root)
        raise
    store.sb, store.fsck_mark.written = new, mark
    store.ring.durable_tail = store.ring.tail
    if store.published is not None:  # before the head may write behind the old tail
        store.published.set_tail(store.ring.durable_tail)
    if root is not None:
        if store.full_at is not None:
            log.warning("%s: the index fits the tree region again", store.vol.path)
        store.full_at = None
        store.idx.committed()
        store.quota.committed()
    elif lift:
        store.idx.tree.root = dataclasses.replace(store.tree.root, prev_half=-1)
        store.full_at = None
    store.last_ckpt = time.monotonic()
    store.counters["checkpoints"] += 1

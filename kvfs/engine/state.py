"""What the store's parts see of it: the ``StoreState`` protocol.

``Store`` (store.py) owns an open volume; its parts -- the checkpoint, recovery, reclaim,
the fail-safe guard, reporting -- each work on the state named here and import only this,
never ``store.py``: a part does not import its owner. ``Store`` satisfies the protocol
structurally (mypy checks it where ``store.py`` hands itself to a part). Never imports
pyfuse3 or torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .btree import BTree
    from .catalog import Catalog
    from .codec import Codec
    from .format import Superblock
    from .fsck_mark import FsckMark
    from .index import Index
    from .published import Published
    from .quota import Ledger
    from .ring import Ring, ScanReport
    from .types import FullRing, StoreConfig
    from .volume import VolumeFile


class StoreState(Protocol):
    """An open volume's state and the few store operations its parts call back."""

    vol: VolumeFile
    sb: Superblock
    cfg: StoreConfig
    clock: Callable[[], float]
    ring: Ring
    idx: Index
    quota: Ledger
    codec: Codec
    counters: dict[str, int]
    fsck_mark: FsckMark
    readonly: bool
    next_sno: int
    full_at: int | None  # index estimate when the tree last could not take it
    ring_full: FullRing | None  # the last reclaim that found nothing to free, while it holds
    last_ckpt: float
    open_report: ScanReport | None
    full_scan_why: str
    writer_lock: threading.RLock  # one change at a time, for its whole length
    state_lock: threading.RLock  # what readers look at: index, ring state, caches

    @property
    def tree(self) -> BTree: ...

    @property
    def ring_only(self) -> bool: ...

    @property
    def published(self) -> Published | None: ...

    @property
    def catalog(self) -> Catalog | None: ...

    @property
    def needs_fsck(self) -> bool: ...

    def checkpoint(self, clean: bool = False) -> None: ...

    def mark_needs_fsck(self, reason: str) -> None: ...

    def mark_cut(self, sno: int) -> None: ...

    def drop_caches(self) -> None: ...

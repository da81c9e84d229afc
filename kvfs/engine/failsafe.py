"""Fail-safe: the guard around every ``Store`` operation, and writing the needs-fsck mark.

When corruption or an internal error is seen while a volume is in use, the volume is
marked as needing fsck (S3QL's ``needs_fsck``): a flag bit in the superblock that survives
a remount, so the next writable open refuses until ``kvfs-fsck --repair`` clears it.
The mark may be set from any thread (the FUSE layer's error path); it reaches the disk on
the next engine call, under the store's writer lock. Never imports pyfuse3.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import Corrupt, IndexCorrupt, KVFSError
from .format import SB_CLEAN, Superblock
from .recovery import rebuild

if TYPE_CHECKING:
    from .state import StoreState

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def persist(store: StoreState) -> None:
    """Write a change of the mark not yet on disk: the durable superblock again with the new
    flag. Only flags and seq change, so it is safe whatever state an error left in memory.
    A failure is logged, not raised: it must not hide the error that set the mark."""
    m = store.fsck_mark
    if not m.pending() or store.readonly or store.vol.fd < 0:
        return
    mark, sb = m.mark, store.sb
    new = Superblock(**{**sb.__dict__, "seq": sb.seq + 1,
                        "flags": (sb.flags & SB_CLEAN) | m.flags(False)})
    try:
        store.vol.write_superblock(new)
    except Exception as e:  # noqa: BLE001
        log.error("%s: could not write the needs-fsck mark: %s", store.vol.path, e)
        return
    store.sb, m.written = new, mark


def _persist_locked(store: StoreState) -> None:
    m = store.fsck_mark
    if m.mark != m.written:  # pending(), inlined: this runs twice per call
        with store.writer_lock, store.state_lock:
            persist(store)


def guarded(fn: F, mode: str = "write") -> F:
    """Run a Store operation. If the checkpoint tree proves bad, rebuild the index from the
    ring and run it once more from the start: every operation looks up before it writes, so
    the first attempt left nothing half-done (what reclaim copied is in the ring). Data
    corruption and unexpected exceptions mark the volume as needing fsck; a pending mark is
    written before and after the call.

    ``mode`` says which of the store's locks the call holds: "write" both (one change at a
    time, readers wait), "writer" only the writer lock (the operation takes the state lock
    itself around what readers may see), "lookup" the state lock, "read" none (the
    operation takes the state lock for its lookups). The writer lock is always taken first.
    """
    def attempt(self: StoreState, a: tuple, kw: dict) -> Any:
        try:
            if mode == "lookup":
                with self.state_lock:
                    return fn(self, *a, **kw)
            return fn(self, *a, **kw)
        except IndexCorrupt as e:
            with self.writer_lock, self.state_lock:
                rebuild(self, e)
        if mode == "lookup":
            with self.state_lock:
                return fn(self, *a, **kw)
        return fn(self, *a, **kw)

    def run(self: StoreState, a: tuple, kw: dict) -> Any:
        _persist_locked(self)
        try:
            return attempt(self, a, kw)
        except Corrupt as e:
            self.mark_needs_fsck(f"{fn.__name__}: {e}")
            raise
        except KVFSError:
            raise
        except Exception as e:
            # a bad call (arguments) changed nothing, nor did a look that ran out of memory
            if not _at_the_call(e, attempt) and not (
                    isinstance(e, MemoryError) and mode in ("lookup", "read")):
                self.mark_needs_fsck(f"{fn.__name__}: unexpected {type(e).__name__}: {e}")
            raise
        finally:
            _persist_locked(self)

    @functools.wraps(fn)
    def wrapper(self: StoreState, *a: Any, **kw: Any) -> Any:
        if mode == "write":
            with self.writer_lock, self.state_lock:
                return run(self, a, kw)
        if mode == "writer":
            with self.writer_lock:
                return run(self, a, kw)
        return run(self, a, kw)

    return wrapper  # type: ignore[return-value]


def _at_the_call(e: Exception, caller: Callable[..., Any]) -> bool:
    """Whether ``e`` is a TypeError raised by calling the operation (its arguments did
    not bind), not from inside it."""
    if not isinstance(e, TypeError) or e.__traceback__ is None:
        return False
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code is caller.__code__

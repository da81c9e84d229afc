"""The needs-fsck mark of an open volume (S3QL's ``needs_fsck``), in memory.

Whether the volume needs fsck, why, and whether the superblock says so yet: set from any
thread (the FUSE layer's error path), written by the next engine call (``failsafe``).
Never imports pyfuse3 or torch.
"""

from __future__ import annotations

import itertools

from .format import SB_CLEAN, SB_NEEDS_FSCK


class FsckMark:
    """Whether the volume needs fsck, why, and whether the disk knows yet."""

    def __init__(self, flags: int) -> None:
        self.needed = bool(flags & SB_NEEDS_FSCK)
        self.reason = "marked in the superblock" if self.needed else ""
        self._seq = itertools.count(1)
        self.mark = self.written = 0  # bumped by every change / the change last on disk

    def set(self, reason: str) -> bool:
        """Mark; True when this is news. ``needed`` is set before ``mark`` moves, so a
        writer that reads ``mark`` first and ``flags`` after never loses it."""
        if self.needed:
            return False
        self.reason = reason
        self.needed = True
        self.mark = next(self._seq)
        return True

    def clear(self) -> None:
        self.needed, self.reason = False, ""
        self.mark = next(self._seq)

    def flags(self, clean: bool) -> int:
        return (SB_CLEAN if clean else 0) | (SB_NEEDS_FSCK if self.needed else 0)

    def pending(self) -> bool:
        return self.mark != self.written

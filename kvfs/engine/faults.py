"""Fault injection for tests and tools/torture.py: power cuts, torn writes, failed syncs.

``FaultyVolume`` journals every write since the last fsync with its pre-image, so a
simulated power cut can keep any prefix of those writes, tear the next one at any byte,
and undo the rest — what a disk with a volatile cache may do. ``inject()`` makes every
``Store.open``/``Store.create`` in its scope use it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .volume import VolumeFile


class PowerCut(Exception):
    """Raised by a failpoint: the process 'loses power' here."""


class FaultyVolume(VolumeFile):
    last: FaultyVolume | None = None  # the newest instance, for tests to reach

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.journal: list[tuple[int, bytes, bytes]] = []  # (offset, pre-image, data)
        self.fail_before_superblock = False
        self.fail_after_writes: int | None = None  # raise PowerCut once this many more writes ran
        FaultyVolume.last = self

    def pwrite(self, data: bytes | memoryview, off: int) -> None:
        if self.fail_after_writes is not None:
            if self.fail_after_writes <= 0:
                raise PowerCut(f"failpoint: write at {off}")
            self.fail_after_writes -= 1
        data = bytes(data)
        self.journal.append((off, os.pread(self.fd, len(data), off), data))
        super().pwrite(data, off)

    def pwritev(self, bufs: list[bytes | memoryview], off: int) -> None:
        self.pwrite(b"".join(bytes(b) for b in bufs), off)  # one journaled write

    def write_superblock(self, sb) -> None:  # noqa: ANN001
        if self.fail_before_superblock:
            raise PowerCut("failpoint: before superblock write")
        super().write_superblock(sb)

    def sync(self) -> None:
        super().sync()
        self.journal.clear()

    def unsynced(self) -> int:
        return len(self.journal)

    def power_cut(self, keep: int = 0, tear: int | None = None) -> None:
        """Keep the first ``keep`` unsynced writes, the next one's first ``tear`` bytes, undo the rest."""
        for i in range(len(self.journal) - 1, keep - 1, -1):
            off, pre, data = self.journal[i]
            os.pwrite(self.fd, pre, off)
            if i == keep and tear is not None:
                os.pwrite(self.fd, data[:tear], off)
        self.journal.clear()
        self.close()


@contextlib.contextmanager
def inject() -> Iterator[type[FaultyVolume]]:
    """Within the block, the engine opens volumes as FaultyVolume."""
    from . import store as engine

    saved = engine.VolumeFile
    engine.VolumeFile = FaultyVolume
    try:
        yield FaultyVolume
    finally:
        engine.VolumeFile = saved

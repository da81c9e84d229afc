"""Fault injection for tests and tools/torture.py: power cuts, torn writes, failed syncs.

``FaultyVolume`` journals every write since the last fsync with its pre-image, so a
simulated power cut can keep any prefix of those writes, tear the next one at any byte,
and undo the rest — what a disk with a volatile cache may do. The ring and the B+ tree
both write through the volume, so tree pages tear too. Pass it to the engine explicitly:
``Store.create(path, size, volume=FaultyVolume)`` / ``Store.open(path, volume=FaultyVolume)``.

Once a failpoint has fired the power is off: every later write or sync raises PowerCut
again, so nothing the engine does while unwinding can make unsynced writes durable.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .format import Superblock
from .volume import Buffer, VolumeFile, pwrite_all


class PowerCut(Exception):
    """Raised by a failpoint: the process 'loses power' here."""


class FaultyVolume(VolumeFile):
    last: FaultyVolume | None = None  # the newest instance, for a test whose open raised

    def __init__(self, *a, **kw) -> None:  # noqa: ANN002, ANN003
        super().__init__(*a, **kw)
        self.journal: list[tuple[int, bytes, bytes]] = []  # (offset, pre-image, data)
        self.fail_before_superblock = False
        self.fail_after_writes: int | None = None  # raise PowerCut once this many more writes ran
        self.fail_at_sync: int | None = None  # raise PowerCut at this sync (0: the next one)
        self.dead = False  # a failpoint fired: no write or sync may reach the disk any more
        self.syncs = 0  # fsyncs that reached the disk
        FaultyVolume.last = self

    def cut(self, where: str) -> PowerCut:
        """Power is gone from here on; returns the exception to raise."""
        self.dead = True
        return PowerCut(f"failpoint: {where}")

    def _alive(self, where: str) -> None:
        if self.dead:
            raise PowerCut(f"power is off: {where}")

    def pwrite(self, data: Buffer, off: int) -> None:
        self._alive(f"write at {off}")
        if self.fail_after_writes is not None:
            if self.fail_after_writes <= 0:
                raise self.cut(f"write at {off}")
            self.fail_after_writes -= 1
        raw = bytes(data)
        self.journal.append((off, os.pread(self.fd, len(raw), off), raw))
        super().pwrite(raw, off)

    def pwritev(self, bufs: Sequence[Buffer], off: int) -> None:
        self.pwrite(b"".join(bytes(b) for b in bufs), off)  # one journaled write

    def write_superblock(self, sb: Superblock) -> None:
        self._alive("superblock write")
        if self.fail_before_superblock:
            raise self.cut("before superblock write")
        super().write_superblock(sb)

    def sync(self) -> None:
        self._alive("sync")
        if self.fail_at_sync is not None:
            if self.fail_at_sync <= 0:
                raise self.cut("at sync")
            self.fail_at_sync -= 1
        super().sync()
        self.syncs += 1
        self.journal.clear()

    def unsynced_writes(self) -> int:
        """Writes since the last sync (``power_cut`` may keep some); the base class's
        ``unsynced`` counts their bytes."""
        return len(self.journal)

    def power_cut(self, keep: int = 0, tear: int | None = None) -> None:
        """Keep the first ``keep`` unsynced writes, the next one's first ``tear`` bytes, undo
        the rest; then close. Works after the engine closed its fd too."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            for i in range(len(self.journal) - 1, keep - 1, -1):
                off, pre, data = self.journal[i]
                pwrite_all(fd, pre, off)
                if i == keep and tear is not None:
                    pwrite_all(fd, data[:tear], off)
        finally:
            os.close(fd)
        self.journal.clear()
        self.dead = True
        self.close()

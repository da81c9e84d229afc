"""Public value types of the storage engine (what ``Store`` methods return).

Kept apart from the engine so the FUSE layer, tools and tests can import them cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Observer(Protocol):
    """Where the engine reports latencies and errors; the mount passes one backed by its
    metrics. Called on the calling thread, from several threads at once when reads run
    concurrently; must be cheap, thread-safe, and must not raise."""

    def cold_read(self, ms: float) -> None: ...

    def cold_write(self, ms: float) -> None: ...

    def cold_error(self) -> None: ...


class NullObserver:
    """The default ``Observer``: reports go nowhere."""

    def cold_read(self, ms: float) -> None:
        pass

    def cold_write(self, ms: float) -> None:
        pass

    def cold_error(self) -> None:
        pass


@dataclass(frozen=True)
class StoreConfig:
    """Tunables of an opened volume. Every value has a default; profiles override them."""

    hot_sessions: int = 100  # sessions kept decoded in the in-memory hot index (LRU)
    checkpoint_interval_s: float = 600.0  # B+ tree checkpoint period (driven by the caller)
    cleanup_threshold: float = 0.70  # ring usage that triggers retention cleanup
    retention_s: float = 7 * 24 * 3600.0  # sessions idle longer than this may be dropped
    evict_when_full: bool = False  # drop least recently used sessions whole instead of ENOSPC
    compression: str = "auto"  # "auto" (zstd when it pays), "zstd" (always try), "none"
    zstd_level: int = 1
    min_ratio: float = 1.25  # store a block raw unless compression shrinks it this much (fp16
    # KV gains 1.18x, not worth compressing every write and decoding every read; bf16 1.47x)
    plane_split: bool = True  # split 16-bit values into high/low byte planes before zstd
    compress_on_copy: bool = True  # appends stored raw, compressed when reclaim copies them
    # forward: the write path and reads of recent rounds never wait for zstd; what outlives
    # a lap of the ring is stored small
    write_buffer: int = 4 << 20  # bytes of entries gathered before one pwrite
    fadvise: bool = True  # POSIX_FADV_DONTNEED after cold reads
    writeback: int = 4 << 20  # bytes written in one run before their write-out to the disk
    # starts (an fsync then waits for the last run only); 0 leaves it to the kernel
    # Quotas per uid other than root (kvfs.engine.quota): 0 none, -1 decided by ``shared``
    # (none unless other users write the volume: a quarter of it each)
    quota_sessions: int = 0
    quota_bytes: int = 0
    quota_index_share: float = 0.0  # of the index budget; 0 or 1: none
    shared: bool = False  # other users write this volume (a mount with --allow-other)
    index_fill: float = 0.5  # share of a tree half the index may fill; the rest is
    # headroom for the copy-on-write commits after a compaction


@dataclass
class FileStat:
    name: str
    size: int  # raw bytes (st_size)
    stored: int  # bytes the file's live extents occupy on disk, headers included (st_blocks)
    mode: int
    uid: int
    gid: int
    ctime: float
    mtime: float
    atime: float
    ctime_ns: int | None = None  # the same times exactly (a float loses the nanoseconds)
    mtime_ns: int | None = None
    atime_ns: int | None = None


@dataclass
class SessionStat:
    name: str
    sno: int  # never-reused session number (slot in the live bitmap)
    mode: int
    uid: int
    gid: int
    ctime: float
    mtime: float
    atime: float
    files: int
    size: int  # raw bytes over all files
    stored: int
    ctime_ns: int | None = None  # the same times exactly (a float loses the nanoseconds)
    mtime_ns: int | None = None
    atime_ns: int | None = None


@dataclass
class Usage:
    capacity: int  # ring bytes
    used: int  # head - tail: bytes the ring holds, dead or alive
    sessions: int
    head: int
    tail: int
    checkpoint_pos: int
    checkpoint_age_s: float
    raw_bytes_written: int = 0
    stored_bytes_written: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class FullRing:
    """A reclaim trip round the ring that freed too little: nothing was droppable
    (``reclaim.reclaim`` refuses a write needing as much room while it holds)."""

    cuts: int  # ``counters["cuts"]`` when it ended
    need: int  # the room it was for (a smaller need gets a trip of its own: pads and
    # superseded metadata may free a little)
    until: float  # ``clock()`` when the least recently used live session met leaves retention
    why: str

"""The FUSE layer's own counts (``Counters``), shown under ``fs`` in ``/.kvfs/stats``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    """The FUSE layer's own counts, shown under ``fs`` in ``/.kvfs/stats``."""

    reads: int = 0
    read_bytes: int = 0
    writes: int = 0
    write_bytes: int = 0
    appends: int = 0  # engine appends, i.e. ring entries written by flushes
    refused_writes: int = 0  # writes that were not appends (EPERM)
    errors: int = 0  # unexpected exceptions answered with EIO
    corrupt_reads: int = 0
    readahead_hits: int = 0
    window_hits: int = 0  # small reads answered from a handle's window, no engine call
    read_req_max: int = 0  # largest read / write request the kernel sent (request sizing)
    write_req_max: int = 0

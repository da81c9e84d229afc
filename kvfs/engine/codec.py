"""Payload codec: zstd when it pays, with a byte-plane filter for 16-bit floats.

fp16/bf16 KV compresses badly as is (1.09x / 1.29x with zstd -1) because the low byte of
each value is noise. Splitting the high bytes into their own plane and compressing only
that plane gives 1.18x / 1.46x at twice the speed; the low plane is stored raw.

Stored layout with F_PLANES: u32 length of the compressed high plane, the compressed high
plane, then the raw low plane. With F_ZSTD alone: one zstd frame. Neither: raw bytes.
Never imports torch; never touches the volume.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

from .errors import Corrupt
from .format import F_PLANES, F_ZSTD

_local = threading.local()
MIN_COMPRESS = 1024  # below this a zstd frame's overhead eats the gain


def _cctx(level: int) -> zstandard.ZstdCompressor:
    key = f"c{level}"
    c = getattr(_local, key, None)
    if c is None:
        # The frame checksum makes a damaged frame fail to decode rather than decode to
        # other bytes of the right length (the entry CRC is checked first; this is depth).
        c = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
        setattr(_local, key, c)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


class Codec:
    """Chooses, per payload, raw / zstd / planes+zstd. ``auto`` backs off after misses."""

    def __init__(self, mode: str = "auto", level: int = 1, min_ratio: float = 1.03,
                 planes: bool = True) -> None:
        if mode not in ("auto", "zstd", "none"):
            raise ValueError(f"compression must be auto, zstd or none, not {mode!r}")
        self.mode, self.level, self.min_ratio, self.planes = mode, level, min_ratio, planes
        self._skip = 0  # auto: payloads left to store raw before trying again
        self._misses = 0

    def encode(self, raw: bytes | memoryview) -> tuple[int, bytes | memoryview]:
        """(flags, stored bytes) for ``raw``."""
        n = len(raw)
        if self.mode == "none" or n < MIN_COMPRESS:
            return 0, raw
        if self.mode == "auto" and self._skip:
            self._skip -= 1
            return 0, raw
        if self.planes and n % 2 == 0:
            flags, out = F_PLANES | F_ZSTD, _encode_planes(raw, self._cctx())
        else:
            flags, out = F_ZSTD, self._cctx().compress(raw)
        if len(out) * self.min_ratio <= n:
            self._misses = 0
            return flags, out
        # Incompressible (already compressed, random, fp32 noise): back off exponentially so
        # a stream of such writes costs one trial in many, not one per write.
        self._misses = min(self._misses + 1, 6)
        self._skip = (1 << self._misses) - 1
        return 0, raw

    def _cctx(self) -> zstandard.ZstdCompressor:
        return _cctx(self.level)


def _encode_planes(raw: bytes | memoryview, cctx: zstandard.ZstdCompressor) -> bytes:
    # Shifts on a uint16 view are 4-5x faster than strided byte copies.
    a = np.frombuffer(raw, dtype="<u2")
    hi = cctx.compress((a >> 8).astype(np.uint8))
    return b"".join((struct.pack("<I", len(hi)), hi, a.astype(np.uint8).tobytes()))


def _unzstd(frame: bytes | memoryview, n: int) -> bytes:
    """Exactly ``n`` bytes from one zstd frame. The frame's declared size is checked first:
    zstd allocates what a frame declares, so a damaged size must not reach it."""
    declared = zstandard.frame_content_size(frame)
    if declared != n:
        raise Corrupt(f"zstd frame declares {declared} bytes, header says {n}")
    return _dctx().decompress(frame, max_output_size=n)


def decode(flags: int, stored: bytes | memoryview, raw_len: int) -> bytes | memoryview:
    """Raw bytes of a payload; Corrupt if it does not decode to exactly ``raw_len`` bytes."""
    try:
        if flags & F_PLANES:
            (hlen,) = struct.unpack_from("<I", stored, 0)
            half = raw_len // 2
            if raw_len % 2 or 4 + hlen + half != len(stored):
                raise Corrupt("byte planes have the wrong length")
            hi = _unzstd(stored[4: 4 + hlen], half)
            out = np.frombuffer(hi, dtype=np.uint8).astype("<u2")
            out <<= 8
            out |= np.frombuffer(stored[4 + hlen:], dtype=np.uint8)
            return memoryview(out).cast("B")  # no copy: callers slice, then join
        out = _unzstd(stored, raw_len) if flags & F_ZSTD else stored
    except (zstandard.ZstdError, struct.error, ValueError) as e:
        raise Corrupt(f"payload does not decode: {e}") from e
    if len(out) != raw_len:
        raise Corrupt(f"payload decodes to {len(out)} bytes, header says {raw_len}")
    return out

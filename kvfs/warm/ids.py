"""Session ids and where a session lives: validation, shard number, shard file name."""

from __future__ import annotations

import hashlib
import re

import numpy as np

from kvfs.session.errors import SessionError

from .kvmap_format import KEY_DEVICE, KEY_SESSION


class WarmError(SessionError):
    """A refused warm-tier request: bad session id, no cold tier, incompatible or unsafe
    root, a cold tier that refuses writes, a full tier... The message names the path and
    the reason."""


class WarmBusy(WarmError):
    """Another node serves the session: its mount holds the session's lease in the shared
    tier (``owner``: that node's id, or None when the mount cannot say)."""

    def __init__(self, sid: str, owner: str | None) -> None:
        who = f"node {owner!r}" if owner else "another node"
        super().__init__(f"session {sid!r} is served by {who}, which holds its lease in the "
                         "shared tier: continue it there, or here once that node releases it "
                         "or stops (its lease then expires and this node takes it over)")
        self.sid, self.owner = sid, owner


class WarmLost(WarmError):
    """The RAM copy of a session this process serves was dropped because the mount's copy
    changed under it (another node or process wrote it, or it was cut or removed): what this
    process wrote since is not on the mount. Writes and syncs of the session fail until the
    agent lets it go (``release``) or resumes it from the mount's copy."""


class WarmFull(WarmError):
    """The RAM filesystem under the warm root has no room left for a write (nothing was
    changed: the tier evicts to the cold tier and retries, or reports the WarmError)."""


class WarmCorrupt(WarmError):
    """Stored warm bytes failed their checksum (and the cold tier has no copy of them)."""


_DEVICE_RE = re.compile(r"[0-9]{1,20}")
MAX_SID_BYTES = 255


def check_sid(sid: object) -> str:
    """Return ``sid`` if it can name a directory on the mount (one path component).

    Refused: non-strings, empty, '.', '..', '/' or NUL inside, more than 255 UTF-8 bytes
    (or not encodable). Checked before anything is touched, so a refusal changes nothing.
    """
    if not isinstance(sid, str) or not sid:
        raise WarmError(f"session id must be a non-empty string, got {sid!r}")
    if sid in (".", "..") or "/" in sid or "\0" in sid:
        raise WarmError(f"session id {sid!r} is not a valid file name")
    try:
        n = len(sid.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise WarmError(f"session id {sid!r} is not valid UTF-8") from e
    if n > MAX_SID_BYTES:
        raise WarmError(f"session id is {n} bytes, at most {MAX_SID_BYTES} allowed")
    return sid


def check_shards(shards: int, key: int) -> None:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or shards > 1 << 32:
        raise WarmError(f"shards must be an integer in 1..2**32, got {shards!r}")
    if key == KEY_SESSION and shards & (shards - 1):
        # md5 sharding takes the top log2(shards) bits of the digest
        raise WarmError(f"shards must be a power of two with shard_key='session', got {shards}")


def device_id(sid: str) -> int:
    """The device id of an iot session id: its leading run of ASCII decimal digits.

    ``"4711"``, ``"4711-cmd-9"`` and ``"4711.ping"`` all belong to device 4711; at most
    20 digits. A session id that does not start with a digit is refused (WarmError).
    """
    m = _DEVICE_RE.match(sid)
    if m is None or (m.end() < len(sid) and sid[m.end()].isdigit()):
        raise WarmError(
            f"session id {sid!r} does not start with a decimal device id (shard_key='device')"
        )
    return int(m.group())


def shard_of(sid: str, shards: int, key: int = KEY_SESSION) -> int:
    """Shard number of ``sid``.

    key=session: the top log2(shards) bits of md5(sid) -- at 65,536 shards exactly the
    first 4 hex digits of the digest, at 131,072 / 262,144 one / two bits more of the same
    hash. key=device: ``device_id(sid) % shards``.
    """
    if key == KEY_DEVICE:
        return device_id(sid) % shards
    bits = shards.bit_length() - 1
    if bits == 0:
        return 0
    top = int.from_bytes(hashlib.md5(sid.encode("utf-8")).digest()[:8], "big")
    return top >> (64 - bits)


def shard_file_name(shard: int, shards: int) -> str:
    """``sess_<hex>.kvmap``, as many hex digits as the largest shard number needs."""
    width = max(4, (max(shards - 1, 1).bit_length() + 3) // 4)
    return f"sess_{shard:0{width}x}.kvmap"


def as_u8(data: object) -> np.ndarray:
    """The bytes of ``data`` as a flat uint8 array, without a copy when contiguous."""
    if isinstance(data, np.ndarray):
        if data.dtype.hasobject:
            raise TypeError("object arrays cannot be stored")
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(memoryview(data).cast("B"), np.uint8)
    raise TypeError(f"append takes bytes, memoryview or numpy arrays, not {type(data).__name__}")


def check_layer(layer: object) -> int:
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < 1 << 31:
        raise ValueError(f"layer must be an integer in [0, 2**31), got {layer!r}")
    return int(layer)

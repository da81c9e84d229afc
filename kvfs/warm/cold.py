"""The cold tier as the warm tier sees it: one seam, ``ColdBackend``, two ways through it.

The cold copy of a session is ``sessions/<sid>/`` on a mounted kvfs volume (tests use any
directory of that layout): ``layer_<n>`` files of token-major KV bytes, ``summaries.f32``,
``meta.json`` and ``.incarnation``. Layer files and summaries are only appended to or cut
shorter (the mount refuses a write anywhere but at the end); small files are replaced by
a cut to zero and one write. Everything the warm tier, recall and resume do with the cold
tier goes through the ``ColdBackend`` protocol below; ``open_cold`` picks, once at
start-up, how:

- ``coldfiles.ColdStore``: plain file calls through any mount (open, preadv, write,
  fsync), each checked (a file or directory that is not ours, or that others may write,
  is refused);
- ``coldnative.NativeCold``: the mount's native channel (``kvfs.channel``) when the mount
  serves one this process may use -- reads straight from the volume with extents the
  mount hands out, a pass's changes of a session as one request, one durability point
  for all of them; names (make, list, remove a session) and the shared tier's hold still
  through the files. Anything else (another uid, a remote mount, ``--no-channel``, a
  shared mount) gets the plain files, without being told.

Writes come in ``Changes`` (one session's appends, replacements and truncations, applied
in order by ``write``, durable only after ``sync`` of what ``write`` returned), so a pass
over many sessions writes them all, then makes them durable together.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .ids import WarmBusy, WarmError

log = logging.getLogger("kvfs.warm")

LAYER_RE = re.compile(r"layer_(0|[1-9][0-9]{0,9})")
#: side streams: append-only byte files of a session beside its layers (the hot tier's
#: ``key_centroids``), kept exactly like a layer (checksummed extents, write-behind,
#: migration, promotion) under stream numbers above every layer number
SIDE_BASE = 1 << 31
SIDE_STREAMS = {"key_centroids": SIDE_BASE}
_SIDE_NAMES = {n: name for name, n in SIDE_STREAMS.items()}
SUMMARIES = "summaries.f32"
META = "meta.json"
# the session's incarnation id, 16 hex digits and a newline, written by the warm tier with
# the first bytes of a session: a copy removed (or made anew) through the mount has none
# (or another one), so a RAM copy of the old session is never written back over it
INCARNATION = ".incarnation"
HOLD_WAIT_S = 1.0  # a hold refused with EBUSY is retried this long: a clean hand-over ends in it
MAX_SMALL = 1 << 20  # meta.json and the like: far more than 100,000 rounds take

APPEND, REPLACE, TRUNCATE = 1, 2, 3  # kinds of a change (the channel's WRITE items too)


def layer_name(layer: int) -> str:
    """The cold file of a stream: ``layer_<n>``, or a side stream's own name."""
    return _SIDE_NAMES.get(layer) or f"layer_{layer}"


def stream_number(name: str) -> int | None:
    """The stream a cold file holds (a layer's number or a side stream's); None for others."""
    m = LAYER_RE.fullmatch(name)
    return int(m.group(1)) if m else SIDE_STREAMS.get(name)


def side_stream(name: object) -> int:
    """The stream number of side stream ``name`` (ValueError for any other name)."""
    if not isinstance(name, str) or name not in SIDE_STREAMS:
        raise ValueError(f"side stream must be one of {', '.join(SIDE_STREAMS)}, got {name!r}")
    return SIDE_STREAMS[name]


def incarnation_bytes(inc: int) -> bytes:
    return f"{inc:016x}\n".encode()


def parse_incarnation(raw: bytes | None) -> int | None:
    try:
        return int(raw, 16) if raw and len(raw) == 17 and raw.endswith(b"\n") else None
    except ValueError:
        return None


def mount_info(root: str | None) -> dict[str, Any] | None:
    """What a kvfs mount publishes in ``/.kvfs/stats`` (its profile, the volume's identity,
    its shared tier and native channel); None for a plain directory or no mount."""
    if root is None:
        return None
    try:
        with open(os.path.join(root, ".kvfs", "stats"), "rb") as f:
            stats = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise OSError(f"{root}: cannot read .kvfs/stats of the mount: {e}") from e
    return stats if isinstance(stats, dict) else None


def refusal(path: str, mode: int, uid: int, want_dir: bool, me: int) -> str | None:
    """Why a cold file or directory may not be used as ours (None: it may): not of the
    kind wanted (a symlink or other), another uid's, or writable by group or other."""
    kind = "directory" if want_dir else "file"
    if not (stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode)):
        return f"cold {path!r} is not a {kind} (a symlink or other): refused"
    if uid != me:
        return f"cold {kind} {path!r} is owned by uid {uid}, not by this process (uid {me}): refused"
    if mode & 0o022:
        return (f"cold {kind} {path!r} is writable by group/other (mode "
                f"{stat.S_IMODE(mode):04o}): refused")
    return None


def cold_errors(fn):  # noqa: ANN001, ANN201 - a decorator of both backends' methods
    """OSErrors of a cold call become WarmErrors naming the cold path (errno kept as the
    cause): the tier's callers see one kind of error; EBUSY is another node's lease."""
    @functools.wraps(fn)
    def run(self, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        try:
            return fn(self, *args, **kw)
        except OSError as e:
            if e.errno == errno.EBUSY and args and isinstance(args[0], str):
                raise WarmBusy(args[0], self.lease_owner(args[0])) from e  # another node's now
            where = self.dir
            if args and isinstance(args[0], str):
                where = self.path(args[0], args[1] if len(args) > 1 and isinstance(args[1], str) else None)
            raise WarmError(f"cold {where!r}: {e.strerror or e}") from e
    return run


@dataclass
class Change:
    kind: int
    name: str
    arg: int = 0  # APPEND: the file's size before; TRUNCATE: the new length
    pieces: list[Any] = field(default_factory=list)  # APPEND / REPLACE: bytes-like pieces


class Changes:
    """One session's changes to its cold copy, applied in order by ``ColdBackend.write``."""

    def __init__(self) -> None:
        self.items: list[Change] = []

    def __bool__(self) -> bool:
        return bool(self.items)

    def append(self, name: str, expect: int, pieces: Iterable[Any]) -> None:
        """Append ``pieces`` to ``name`` (made if missing), whose size must be ``expect``."""
        self.items.append(Change(APPEND, name, expect, list(pieces)))

    def replace(self, name: str, raw: bytes) -> None:
        """Replace a small file's bytes (made if missing): a cut to zero, then one write."""
        self.items.append(Change(REPLACE, name, 0, [raw]))

    def truncate(self, name: str, length: int) -> None:
        self.items.append(Change(TRUNCATE, name, length))

    def rewrite(self, name: str, new: bytes, old: bytes) -> bool:
        """Make an append-only file holding ``old`` hold ``new``: cut back to the common
        prefix, append the rest (usually just the new rounds). False when equal."""
        if new == old:
            return False
        limit = min(len(old), len(new))
        diff = np.nonzero(np.frombuffer(old, np.uint8, limit) != np.frombuffer(new, np.uint8, limit))[0]
        p = int(diff[0]) if len(diff) else limit
        if len(old) > p:
            self.truncate(name, p)
        if len(new) > p:
            self.append(name, p, [np.frombuffer(new, np.uint8)[p:]])
        return True


@dataclass
class Written:
    """What ``write`` did to one session: each file's size after it, the names to make
    durable (a caller may add names written by earlier passes), whether the session's
    directory was made, and descriptors a plain backend keeps for the fsyncs."""

    sid: str
    sizes: dict[str, int] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)
    made_dir: bool = False
    fds: dict[str, int] = field(default_factory=dict)
    error: BaseException | None = None  # set by ``sync`` when this session's part failed


class ColdBackend(Protocol):
    """The cold tier's seam (module doc). Every failure is a ``WarmError`` naming the path;
    ``WarmBusy`` when another node holds the session's lease."""

    root: str
    dir: str
    shared: bool  # a mount with a shared tier: sessions are held (``hold``)
    kind: str  # "files" or "channel"

    # the session's lease on a shared mount
    def hold(self, sid: str, wait_s: float = HOLD_WAIT_S) -> Any: ...
    def unhold(self, h: Any) -> None: ...
    def lease_owner(self, sid: str) -> str | None: ...

    # names
    def path(self, sid: str, name: str | None = None) -> str: ...
    def reachable(self) -> None: ...
    def exists(self, sid: str) -> bool: ...
    def list(self) -> list[str]: ...
    def ensure_dir(self, sid: str) -> bool: ...
    def delete(self, sid: str) -> bool: ...

    # sizes and reads
    def state(self, sid: str) -> tuple[dict[int, int], int | None] | None: ...
    def layer_sizes(self, sid: str) -> dict[int, int] | None: ...
    def size(self, sid: str, layer: int) -> int: ...
    def read_into(self, sid: str, layer: int, off: int, out: np.ndarray,
                  missing_is_empty: bool = False) -> None: ...
    def read_ranges(self, sid: str, ranges: list[tuple[int, int, np.ndarray]],
                    missing_is_empty: bool = False) -> None: ...
    def read_small(self, sid: str, name: str) -> bytes | None: ...
    def read_meta(self, sid: str) -> dict | None: ...
    def read_incarnation(self, sid: str) -> int | None: ...
    def prefetch(self, sid: str, layers: Iterable[int], start: int, end: int) -> int: ...

    # writes: none durable until ``sync`` (but ``truncate``, durable at once)
    def write(self, sid: str, changes: Changes) -> Written: ...
    def sync(self, written: list[Written]) -> None: ...
    def forget(self, written: Written) -> None: ...
    def truncate(self, sid: str, name: str, length: int) -> None: ...
    def write_meta(self, sid: str, raw: bytes, sync: bool = True, old: bytes | None = None,
                   name: str = META) -> bool: ...
    def close(self) -> None: ...


def parse_meta(raw: bytes | None, sid: str) -> dict | None:
    if not raw:
        return None
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        log.warning("cold %s/meta.json is not JSON; ignored", sid)
        return None
    return meta if isinstance(meta, dict) else None


def open_cold(root: str, native: bool | None = None) -> ColdBackend:
    """The cold tier at ``root``: through the mount's native channel when it serves one
    this process may use (``native`` None: when available; False: never; True: required,
    else WarmError), else plain files."""
    from .coldfiles import ColdStore  # noqa: PLC0415 - the implementations import this module

    files = ColdStore(root)
    if native is False:
        return files
    from .coldnative import NativeCold  # noqa: PLC0415

    cold = NativeCold.open(files)
    if cold is None:
        if native:
            raise WarmError(f"cold tier {root!r}: no native channel this process may use")
        return files
    return cold


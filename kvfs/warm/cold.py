"""The cold tier as the warm tier sees it: plain files under ``cold_root/sessions/<sid>/``.

``cold_root`` is normally a mounted KVFS volume; tests use any directory with the same
layout. Only ordinary file calls are used (open, os.pread/preadv, os.write, os.fsync,
os.ftruncate, os.listdir, os.stat), never engine internals, and the mount's rules are
kept everywhere: layer files and summaries.f32 are only appended to (a write at an offset
other than the current size fails with EPERM on the mount) or cut shorter; meta.json is
replaced by truncate(0) + one write.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from collections.abc import Iterable

import numpy as np

from .ids import WarmError

log = logging.getLogger("kvfs.warm")

_LAYER_RE = re.compile(r"layer_(0|[1-9][0-9]{0,9})")
SUMMARIES = "summaries.f32"
META = "meta.json"
_CHUNK = 8 << 20  # bytes per os.write: bounded kernel/FUSE requests, no big copies


def layer_name(layer: int) -> str:
    return f"layer_{layer}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # some FUSE filesystems do not implement fsyncdir
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


class ColdStore:
    """File-level access to ``cold_root/sessions``. Stateless apart from the path."""

    def __init__(self, root: str) -> None:
        # A mounted volume always has sessions/; an empty mountpoint (volume not mounted)
        # does not, and writing into it would silently put "cold" data on the root disk.
        self.root = root
        self.dir = os.path.join(root, "sessions")
        if not os.path.isdir(self.dir):
            raise WarmError(f"cold tier {root!r} has no sessions/ directory: is the volume mounted?")

    def path(self, sid: str, name: str | None = None) -> str:
        d = os.path.join(self.dir, sid)
        return d if name is None else os.path.join(d, name)

    def exists(self, sid: str) -> bool:
        return os.path.isdir(self.path(sid))

    def list(self) -> list[str]:
        try:
            return os.listdir(self.dir)
        except FileNotFoundError:
            return []

    def layer_sizes(self, sid: str) -> dict[int, int] | None:
        """{layer: size} of the cold copy, None when there is no cold copy."""
        try:
            names = os.listdir(self.path(sid))
        except (FileNotFoundError, NotADirectoryError):
            return None
        out = {}
        for n in names:
            m = _LAYER_RE.fullmatch(n)
            if m:
                out[int(m.group(1))] = os.stat(self.path(sid, n)).st_size
        return out

    def size(self, sid: str, layer: int) -> int:
        try:
            return os.stat(self.path(sid, layer_name(layer))).st_size
        except (FileNotFoundError, NotADirectoryError):
            return 0

    def read_into(self, sid: str, layer: int, off: int, out: np.ndarray) -> None:
        """Fill ``out`` (uint8, contiguous) from layer bytes at ``off``; WarmError if short."""
        try:
            fd = os.open(self.path(sid, layer_name(layer)), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise WarmError(f"cold {sid}/layer_{layer} is missing") from e
        try:
            view = memoryview(out).cast("B")
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], off + done)
                if n <= 0:
                    raise WarmError(f"cold {sid}/layer_{layer}: short read at {off + done}")
                done += n
        finally:
            os.close(fd)

    def ensure_dir(self, sid: str) -> bool:
        """mkdir the session directory; True when made (then ``sync_sessions_dir``)."""
        d = self.path(sid)
        if os.path.isdir(d):
            return False
        os.mkdir(d)
        return True

    def sync_sessions_dir(self) -> None:
        _fsync_dir(self.dir)

    def fsync_file(self, sid: str, name: str) -> None:
        """fsync a file written earlier through another descriptor (the data is the
        inode's, not the descriptor's; on the mount, close flushed it and fsync syncs)."""
        fd = os.open(self.path(sid, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def append(self, sid: str, name: str, expect: int, pieces: Iterable[np.ndarray],
               sync: bool = True) -> int:
        """Append ``pieces`` to file ``name`` whose size must be ``expect`` (fsync unless
        ``sync`` is False: the caller then calls ``fsync_file``). Writes go at the current
        end (the mount's append-only rule); returns the new size."""
        fd = os.open(self.path(sid, name), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            pos = os.lseek(fd, 0, os.SEEK_END)
            if pos != expect:
                raise WarmError(f"cold {sid}/{name}: size {pos}, expected {expect}")
            for piece in pieces:
                view = memoryview(piece).cast("B")
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:done + _CHUNK])
                pos += len(view)
            if sync:
                os.fsync(fd)
            return pos
        finally:
            os.close(fd)

    def truncate(self, sid: str, name: str, length: int) -> None:
        """Cut a file shorter (allowed on the mount) and make it durable."""
        fd = os.open(self.path(sid, name), os.O_WRONLY)
        try:
            os.ftruncate(fd, length)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_small(self, sid: str, name: str) -> bytes | None:
        try:
            with open(self.path(sid, name), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def sync_summaries(self, sid: str, data: bytes, sync: bool = True) -> bool:
        """Make summaries.f32 equal ``data`` by cutting back to the common prefix and
        appending the rest (usually: append the new rounds only). True if it changed."""
        old = self.read_small(sid, SUMMARIES)
        if old == data:
            return False
        old = old or b""
        limit = min(len(old), len(data))
        diff = np.nonzero(np.frombuffer(old, np.uint8, limit) != np.frombuffer(data, np.uint8, limit))[0]
        p = int(diff[0]) if len(diff) else limit
        if old:
            self.truncate(sid, SUMMARIES, p)
        self.append(sid, SUMMARIES, p, [np.frombuffer(data[p:], np.uint8)], sync)
        return True

    def read_meta(self, sid: str) -> dict | None:
        raw = self.read_small(sid, META)
        if not raw:
            return None
        try:
            meta = json.loads(raw)
        except ValueError:
            log.warning("cold %s/meta.json is not JSON; ignored", sid)
            return None
        return meta if isinstance(meta, dict) else None

    def write_meta(self, sid: str, raw: bytes, sync: bool = True) -> bool:
        """Replace meta.json: truncate(0) + one write (+ fsync), the mount's rule for it.
        True if it changed."""
        if self.read_small(sid, META) == raw:
            return False
        fd = os.open(self.path(sid, META), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 0)
            view = memoryview(raw)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def sync_dir(self, sid: str) -> None:
        _fsync_dir(self.path(sid))

    def delete(self, sid: str) -> bool:
        d = self.path(sid)
        try:
            names = os.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            return False
        for n in names:
            os.unlink(os.path.join(d, n))
        os.rmdir(d)
        _fsync_dir(self.dir)
        return True
